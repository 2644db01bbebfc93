"""Static checks of the deployment files in ``cluster/`` and ``deploy/``.

What is checked, with the real tools where one exists on this machine:

- the cluster-launcher YAMLs pass Ray's own config preparation and validation,
  the code ``ray up`` runs (``commands._bootstrap_config`` for the local
  provider; ``prepare_config`` + ``validate_config`` for AWS, whose provider
  bootstrap needs AWS credentials);
- their start commands, composed and run the way Ray's node updater runs them
  over SSH (``with_head_node_ip``, ``_with_environment_variables``,
  ``_with_interactive``) with a stand-in ``ray`` that records its arguments,
  give ``ray start`` options that Ray's own ``ray start`` parser accepts, with
  the right ``site:<name>`` resource and token authentication on;
- KubeRay manifests, compose file and systemd units carry the site resource,
  token authentication and mounted (never inline) secrets; the units pass
  ``systemd-analyze verify``;
- the commands of ``deploy/secrets/README.md`` make TLS material that serves a
  real TLS handshake; no private key or token file is in the tree.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import ssl
import subprocess
import threading
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

import ray
from ray._private.resource_and_label_spec import ResourceAndLabelSpec
from ray._private.utils import parse_resources_json
from ray.autoscaler._private.cli_logger import cf, cli_logger
from ray.autoscaler._private.command_runner import (
    _with_environment_variables,
    _with_interactive,
)
from ray.autoscaler._private.commands import _bootstrap_config
from ray.autoscaler._private.util import prepare_config, validate_config, with_head_node_ip
from ray.scripts.scripts import start as ray_start_command

ROOT = Path(__file__).resolve().parents[1]
SITES = ("site-a", "site-b", "site-c")
HEAD_IP = "10.20.0.10"
TORCH_VERSION = "2.13.0"
RECORDED_ENV = ("RAY_AUTH_MODE", "RAY_OVERRIDE_RESOURCES", "MSA_FED_SITE", "MSA_FED_SITE_DATA")


def _load_yaml(rel: str):
    with open(ROOT / rel) as f:
        return yaml.safe_load(f)


def _parse_ray_start(args: list[str]) -> dict:
    """Parse ``ray start`` arguments with Ray's own click command (raises on an unknown option)."""
    return ray_start_command.make_context("start", list(args)).params


def _resources(params: dict) -> dict:
    return parse_resources_json(params["resources"], cli_logger, cf)


# --------------------------------------------------------------- a stand-in node
class FakeNode:
    """A home directory where the launcher's venv would be, with a ``ray`` that records its calls."""

    def __init__(self, tmp_path: Path):
        self.home = tmp_path / "home"
        bindir = self.home / "msa-fed" / "venv" / "bin"
        bindir.mkdir(parents=True)
        self.log = tmp_path / "ray_calls"
        self.log.mkdir()
        # A shell script, not Python: it runs many times per test and must start fast.
        (bindir / "ray").write_text(
            "#!/bin/sh\n"
            f'n=$(ls "{self.log}" | grep -c argv)\n'
            f'env -0 > "{self.log}/$n.env"\n'
            f'printf \'%s\\0\' "$@" > "{self.log}/$n.argv"\n'
        )
        (bindir / "ray").chmod(0o755)
        # `python` records its calls the same way (the configs stop their own Ray with it)
        (bindir / "python").write_text((bindir / "ray").read_text())
        (bindir / "python").chmod(0o755)
        (self.home / ".bashrc").write_text("")

    def run(self, cmd: str, env_vars: dict | None = None, extra_env: dict | None = None):
        """Run one command as Ray's SSH command runner does: env exports, then ``bash --login -c -i``."""
        remote = " ".join(_with_interactive(_with_environment_variables(cmd, env_vars or {})))
        env = {"HOME": str(self.home), "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
        env.update(extra_env or {})
        return subprocess.run(
            ["bash", "-c", remote], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60
        )

    def calls(self) -> list[dict]:
        """Each call of ``ray``, in order: ``{"argv": [...], "env": {name: value or None}}``."""
        out = []
        for i in range(len(list(self.log.glob("*.argv")))):
            argv = self.log.joinpath(f"{i}.argv").read_bytes().decode().split("\0")[:-1]
            env = dict(
                item.split("=", 1) for item in self.log.joinpath(f"{i}.env").read_bytes().decode().split("\0")[:-1]
            )
            out.append({"argv": argv, "env": {k: env.get(k) for k in RECORDED_ENV}})
        return out


def _initialise(node: FakeNode, cfg: dict) -> None:
    for _ in range(2):  # the launcher may run them again on a restart: they must be idempotent
        for cmd in cfg["initialization_commands"]:
            assert node.run(cmd).returncode == 0, cmd
    bashrc = node.home.joinpath(".bashrc").read_text().splitlines()
    assert bashrc.count("export RAY_AUTH_MODE=token") == 1
    assert bashrc.count('export PATH="$HOME/msa-fed/venv/bin:$PATH"') == 1
    assert sum(line.startswith("ray() {") for line in bashrc) == 1
    # `ray down` runs `ray stop` in the login shell: it goes to msa_fed's own stop
    before = len(node.calls())
    assert node.run("ray stop").returncode == 0
    assert node.calls()[before:][0]["argv"] == [
        "-m",
        "msa_fed.runtime.ray_own",
        "stop",
        "--temp-dir",
        "/tmp/msa-fed-ray",
    ]
    for f in node.log.glob(f"{before}.*"):
        f.unlink()


def _site_env(tmp_path: Path, site: str, data: Path | None = None) -> Path:
    data = data or tmp_path / f"data-{site}"
    data.mkdir(exist_ok=True)
    path = tmp_path / "site.env"
    path.write_text(f"MSA_FED_SITE={site}\nMSA_FED_SITE_DATA={data}\n")
    return path


# ------------------------------------------------------------ cluster launcher
def test_onprem_config_passes_ray_up_validation():
    cfg = _load_yaml("cluster/onprem.yaml")
    resolved = _bootstrap_config(json.loads(json.dumps(cfg)), no_config_cache=True)
    validate_config(prepare_config(cfg))
    (node_type,) = resolved["available_node_types"].values()
    n_sites = len(cfg["provider"]["worker_ips"])
    assert n_sites == len(SITES)
    assert node_type["min_workers"] == node_type["max_workers"] == n_sites
    assert resolved["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


@pytest.mark.parametrize("rel", ["cluster/onprem.yaml", "cluster/aws-example.yaml"])
def test_ray_validation_rejects_a_misspelt_field(rel):
    cfg = _load_yaml(rel)
    cfg["worker_start_ray_command"] = cfg.pop("worker_start_ray_commands")
    with pytest.raises(jsonschema.ValidationError, match="worker_start_ray_command"):
        validate_config(prepare_config(cfg))


def test_aws_config_passes_ray_validation_with_one_node_type_per_site():
    cfg = _load_yaml("cluster/aws-example.yaml")
    prepared = prepare_config(cfg)
    validate_config(prepared)
    types = prepared["available_node_types"]
    head = types[prepared["head_node_type"]]
    assert not any(k.startswith("site:") for k in head["resources"])
    workers = {name: t for name, t in types.items() if name != prepared["head_node_type"]}
    assert sorted(workers) == sorted(SITES)
    for name, t in workers.items():
        assert t["resources"] == {f"site:{name}": 1}
        assert t["min_workers"] == t["max_workers"] == 1
    assert sum(t["max_workers"] for t in workers.values()) <= prepared["max_workers"]


@pytest.mark.parametrize("rel", ["cluster/onprem.yaml", "cluster/aws-example.yaml"])
def test_launcher_head_starts_with_token_auth_and_loopback_dashboard(rel, tmp_path):
    cfg = _load_yaml(rel)
    node = FakeNode(tmp_path)
    _initialise(node, cfg)
    for cmd in cfg["head_start_ray_commands"]:
        done = node.run(cmd)
        assert done.returncode == 0, done.stderr
    stop, start = node.calls()
    assert stop["argv"] == [
        "-m",
        "msa_fed.runtime.ray_own",
        "stop",
        "--temp-dir",
        "/tmp/msa-fed-ray",
    ]  # only its own Ray, never `ray stop`
    assert start["argv"][0] == "start" and start["env"]["RAY_AUTH_MODE"] == "token"
    params = _parse_ray_start(start["argv"][1:])
    assert params["head"] and params["port"] == 6379
    assert params["dashboard_host"] == "127.0.0.1"
    assert params["autoscaling_config"] == "~/ray_bootstrap_config.yaml"


@pytest.mark.parametrize("site", SITES)
def test_onprem_worker_joins_with_its_site_resource(site, tmp_path):
    cfg = _load_yaml("cluster/onprem.yaml")
    node = FakeNode(tmp_path)
    _initialise(node, cfg)
    env = {"MSA_FED_SITE_ENV": str(_site_env(tmp_path, site))}
    for cmd in cfg["worker_setup_commands"]:
        assert node.run(cmd, extra_env=env).returncode == 0
    for cmd in with_head_node_ip(cfg["worker_start_ray_commands"], HEAD_IP):
        done = node.run(cmd, extra_env=env)  # the local provider sets no resource override
        assert done.returncode == 0, done.stderr
    stop, start = node.calls()
    assert stop["argv"] == ["-m", "msa_fed.runtime.ray_own", "stop", "--temp-dir", "/tmp/msa-fed-ray"]
    params = _parse_ray_start(start["argv"][1:])
    assert params["address"] == f"{HEAD_IP}:6379"
    assert _resources(params) == {f"site:{site}": 1}
    assert start["env"]["RAY_AUTH_MODE"] == "token"
    assert start["env"]["MSA_FED_SITE"] == site
    assert start["env"]["MSA_FED_SITE_DATA"] == str(tmp_path / f"data-{site}")


def test_onprem_worker_refuses_a_misconfigured_machine(tmp_path):
    cfg = _load_yaml("cluster/onprem.yaml")
    node = FakeNode(tmp_path)
    _initialise(node, cfg)
    start_cmds = with_head_node_ip(cfg["worker_start_ray_commands"], HEAD_IP)

    missing = {"MSA_FED_SITE_ENV": str(tmp_path / "absent.env")}
    done = node.run(cfg["worker_setup_commands"][0], extra_env=missing)
    assert done.returncode != 0 and "absent.env is missing" in done.stderr

    env = {"MSA_FED_SITE_ENV": str(_site_env(tmp_path, "site-z"))}
    done = node.run(start_cmds[-1], extra_env=env)
    assert done.returncode != 0 and "MSA_FED_SITE='site-z' is not a site" in done.stderr

    env = {"MSA_FED_SITE_ENV": str(_site_env(tmp_path, "site-a", data=tmp_path / "d"))}
    shutil.rmtree(tmp_path / "d")
    done = node.run(start_cmds[-1], extra_env=env)
    assert done.returncode != 0 and "is not a directory" in done.stderr
    assert node.calls() == []  # ray never started


@pytest.mark.parametrize("site", SITES)
def test_aws_worker_joins_with_its_node_type_resource(site, tmp_path, monkeypatch):
    cfg = _load_yaml("cluster/aws-example.yaml")
    node_type = cfg["available_node_types"][site]
    # The boot script declares the same site as the node type; run its site.env line here.
    (line,) = [ln for ln in node_type["node_config"]["UserData"].splitlines() if ln.endswith("> /etc/msa-fed/site.env")]
    site_env = tmp_path / "site.env"
    subprocess.run(["bash", "-c", line.replace("/etc/msa-fed/site.env", str(site_env))], check=True)
    declared = dict(ln.split("=", 1) for ln in site_env.read_text().splitlines())
    assert declared["MSA_FED_SITE"] == site
    assert f"s3://msa-fed-{site}-private/ {declared['MSA_FED_SITE_DATA']}/" in node_type["node_config"]["UserData"]

    node = FakeNode(tmp_path)
    _initialise(node, cfg)
    # As the node updater does for a non-local provider: resources in RAY_OVERRIDE_RESOURCES.
    overrides = {"RAY_OVERRIDE_RESOURCES": node_type["resources"]}
    for cmd in with_head_node_ip(cfg["worker_start_ray_commands"], HEAD_IP):
        done = node.run(cmd, env_vars=overrides, extra_env={"MSA_FED_SITE_ENV": str(site_env)})
        assert done.returncode == 0, done.stderr
    _, start = node.calls()
    params = _parse_ray_start(start["argv"][1:])
    assert params["address"] == f"{HEAD_IP}:6379"
    assert start["env"]["RAY_AUTH_MODE"] == "token"
    assert start["env"]["MSA_FED_SITE"] == site
    monkeypatch.setenv("RAY_OVERRIDE_RESOURCES", start["env"]["RAY_OVERRIDE_RESOURCES"])
    assert ResourceAndLabelSpec._load_env_resources() == {f"site:{site}": 1}


def test_pinned_versions_agree_with_the_installed_ray():
    docker = (ROOT / "deploy/Dockerfile").read_text()
    assert f"ARG RAY_VERSION={ray.__version__}" in docker
    assert f"ARG TORCH_VERSION={TORCH_VERSION}" in docker
    for rel in ("cluster/onprem.yaml", "cluster/aws-example.yaml"):
        setup = " ".join(_load_yaml(rel)["setup_commands"])
        assert f'"ray[default]=={ray.__version__}"' in setup
        assert f'"torch=={TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu' in setup
    assert _load_yaml("deploy/kuberay/raycluster.yaml")["spec"]["rayVersion"] == ray.__version__


# ---------------------------------------------------------------------- KubeRay
def _kuberay_site_start(rparams: dict, tmp_path: Path) -> dict:
    """Build `ray start` as KubeRay does (``--key=value`` in a bash command line) and parse it."""
    fake = tmp_path / "bin" / "ray"
    fake.parent.mkdir(exist_ok=True)
    out = tmp_path / "argv"
    fake.write_text(f'#!/bin/sh\nprintf \'%s\\0\' "$@" > "{out}"\n')
    fake.chmod(0o755)
    flags = " ".join(f"--{k}={v}" for k, v in rparams.items())
    subprocess.run(
        ["bash", "-c", f"ulimit -n 65536 2>/dev/null; ray start --address=msa-fed-head-svc:6379 {flags} --block"],
        env={"PATH": f"{fake.parent}:/usr/bin:/bin"},
        check=True,
    )
    argv = out.read_bytes().decode().split("\0")[:-1]
    return _parse_ray_start(argv[1:])


def _mounts(pod_spec: dict) -> dict:
    """mountPath -> volume of the pod's first container."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in pod_spec["containers"][0].get("volumeMounts", [])}


def _assert_no_inline_secret(pod_spec: dict) -> None:
    for c in pod_spec["containers"]:
        for e in c.get("env", []):
            assert isinstance(e.get("value", ""), str), e
            if re.search(r"TOKEN|KEY|PASSWORD|SECRET", e["name"]):
                assert "value" not in e, f"{e['name']} is written inline"


def test_raycluster_manifest(tmp_path):
    rc = _load_yaml("deploy/kuberay/raycluster.yaml")
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster"
    assert rc["metadata"]["name"]
    spec = rc["spec"]
    assert spec["authOptions"]["mode"] == "token"
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())  # map[string]string
    head_pod = head["template"]["spec"]
    assert head_pod["containers"][0]["image"]
    _assert_no_inline_secret(head_pod)
    assert _mounts(head_pod)["/etc/msa-fed/registry"]["secret"]["secretName"]

    groups = spec["workerGroupSpecs"]
    assert sorted(g["groupName"] for g in groups) == sorted(SITES)
    for g in groups:
        site = g["groupName"]
        assert isinstance(g["replicas"], int) and g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert all(isinstance(v, str) for v in g["rayStartParams"].values())
        assert _resources(_kuberay_site_start(g["rayStartParams"], tmp_path)) == {f"site:{site}": 1}
        pod = g["template"]["spec"]
        assert pod["containers"][0]["image"] == head_pod["containers"][0]["image"]
        assert pod["nodeSelector"] == {"msa-fed.io/site": site}
        env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
        assert env["MSA_FED_SITE"] == site
        data = _mounts(pod)[env["MSA_FED_SITE_DATA"]]["persistentVolumeClaim"]
        assert data["readOnly"] is True and site in data["claimName"]
        _assert_no_inline_secret(pod)


def test_rayjob_manifest():
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy/kuberay/rayjob.yaml").read_text()) if d]
    (job,) = [d for d in docs if d["kind"] == "RayJob"]
    assert job["apiVersion"] == "ray.io/v1" and job["metadata"]["name"]
    spec = job["spec"]
    assert "rayClusterSpec" in spec or "clusterSelector" in spec
    cluster = _load_yaml("deploy/kuberay/raycluster.yaml")
    if "clusterSelector" in spec:
        assert spec["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[0] == "python" and argv[1].endswith("cluster/jobs/run_msa.py")
    opts = dict(zip(argv[2::2], argv[3::2]))
    # Every file the driver reads is mounted on the head, where the driver runs.
    mounts = _mounts(cluster["spec"]["headGroupSpec"]["template"]["spec"])
    job_dir, job_name = os.path.split(opts["--job"])
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert mounts[job_dir]["configMap"]["name"] == config_map["metadata"]["name"]
    assert job_name in config_map["data"]
    assert "secret" in mounts[os.path.dirname(opts["--admin-token-file"])]


# ---------------------------------------------------------------------- compose
def test_compose_file():
    compose = _load_yaml("deploy/compose.yaml")
    services = compose["services"]
    assert set(services) == {"registry", "ray-head", *SITES}
    declared = compose["secrets"]
    for name, secret in declared.items():
        rel = Path("deploy") / secret["file"]
        assert rel.parent == Path("deploy/secrets"), name
        ignored = subprocess.run(["git", "check-ignore", "-q", str(rel)], cwd=ROOT)
        assert ignored.returncode == 0, f"{rel} would be committed"
    for name, svc in services.items():
        assert set(svc.get("secrets", [])) <= set(declared)
        for key, value in svc.get("environment", {}).items():
            if re.search(r"TOKEN|KEY|PASSWORD|SECRET", key):
                assert str(value).startswith("/run/secrets/"), f"{name}: {key} is inline"

    registry = services["registry"]["command"]
    assert "--insecure" not in registry
    assert "--tls-cert=/run/secrets/registry_cert" in registry
    assert "--tls-key=/run/secrets/registry_key" in registry

    for name in ("ray-head", *SITES):
        svc = services[name]
        assert svc["entrypoint"] == ["ray"] and svc["command"][0] == "start"
        assert svc["environment"]["RAY_AUTH_MODE"] == "token"
        assert svc["environment"]["RAY_AUTH_TOKEN_PATH"] == "/run/secrets/ray_auth_token"
        assert "ray_auth_token" in svc["secrets"]
        params = _parse_ray_start(svc["command"][1:])
        if name == "ray-head":
            assert params["head"]
            assert all(p.startswith("127.0.0.1:") for p in svc["ports"])
        else:
            assert params["address"] == "ray-head:6379"
            assert _resources(params) == {f"site:{name}": 1}
            assert svc["environment"]["MSA_FED_SITE"] == name
            (data,) = [v for v in svc["volumes"] if v.split(":")[-2] == svc["environment"]["MSA_FED_SITE_DATA"]]
            assert data.endswith(":ro")

    # The job file the head mounts names secrets the head has.
    head = services["ray-head"]
    (mount,) = [v for v in head["volumes"] if v.startswith("./compose_job.toml:")]
    job = tomllib.loads((ROOT / "deploy/compose_job.toml").read_text())
    for path in (job["registry"]["tls_ca"], job["registry"]["admin_token_file"]):
        assert path.startswith("/run/secrets/") and path.rsplit("/", 1)[1] in head["secrets"]


# ---------------------------------------------------------------------- systemd
def test_systemd_units_pass_systemd_analyze(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is needed to check the units"
    units = [tmp_path / "msa-fed-site@site-a.service", tmp_path / "msa-fed-registry.service"]
    shutil.copy(ROOT / "deploy/systemd/msa-fed-site@.service", units[0])
    shutil.copy(ROOT / "deploy/systemd/msa-fed-registry.service", units[1])
    done = subprocess.run([analyze, "verify", "--man=no", *map(str, units)], capture_output=True, text=True, timeout=60)
    # The executables live in /opt/msa-fed/venv on a deployed host, not here; any other
    # finding (unknown key, bad specifier, unbalanced quoting) is a defect.
    expected = re.compile(r"^\S+: Command /opt/msa-fed/venv/bin/(ray|msa-fed) is not executable: .*$")
    findings = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    assert findings and all(expected.match(ln) for ln in findings), findings


def test_systemd_site_unit_starts_ray_with_its_site_resource():
    unit = (ROOT / "deploy/systemd/msa-fed-site@.service").read_text().replace("%i", "site-a")
    lines = dict(ln.split("=", 1) for ln in unit.splitlines() if re.match(r"^[A-Z]\w+=", ln))
    argv = shlex.split(lines["ExecStart"])
    assert argv[0] == "/opt/msa-fed/venv/bin/ray" and argv[1] == "start"
    params = _parse_ray_start(argv[2:])
    assert params["block"] and _resources(params) == {"site:site-a": 1}
    env = [v for k, v in re.findall(r"^(Environment)=(.*)$", unit, re.M)]
    assert "RAY_AUTH_MODE=token" in env and "RAY_AUTH_TOKEN_PATH=%d/ray_auth_token" in env
    assert "LoadCredential=ray_auth_token:/etc/msa-fed/ray_auth_token" in unit.splitlines()


# ------------------------------------------------------------------- Dockerfile
def _dockerfile() -> list[tuple[str, str]]:
    text = (ROOT / "deploy/Dockerfile").read_text()
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            logical.append(current.strip())
            current = ""
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in logical]


def test_dockerfile_structure():
    ins = _dockerfile()
    kinds = [k for k, _ in ins]
    assert json.loads([a for k, a in ins if k == "ENTRYPOINT"][-1]) == ["msa-fed"]
    users = [a for k, a in ins[: kinds.index("ENTRYPOINT")] if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    runs = [a for k, a in ins if k == "RUN"]
    torch = [i for i, a in enumerate(runs) if 'pip install "torch==${TORCH_VERSION}"' in a]
    project = [i for i, a in enumerate(runs) if "pip install" in a and "msa-fed-src" in a]
    assert torch and project and torch[0] < project[0]
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs[torch[0]]
    # Every COPY source exists and is let through by the Dockerfile's own ignore file.
    allowed = {
        ln[1:].rstrip("/")
        for ln in (ROOT / "deploy/Dockerfile.dockerignore").read_text().splitlines()
        if ln.startswith("!")
    }
    for k, a in ins:
        if k == "COPY" and not a.startswith("--from"):
            for src in a.split()[:-1]:
                if not src.startswith("--"):
                    assert (ROOT / src).exists() and src.rstrip("/") in allowed, src


# ---------------------------------------------------------------------- secrets
def _generate_block() -> str:
    text = (ROOT / "deploy/secrets/README.md").read_text()
    section = text.split("## Generate", 1)[1]
    return section.split("```sh\n", 1)[1].split("```", 1)[0]


def _tls_roundtrip(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, hostname: str) -> bytes:
    """One message through a real TLS connection on loopback; returns what the client read."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve():
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"msa-fed:" + tls.recv(16))
            except (ssl.SSLError, OSError):
                pass

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
                with client_ctx.wrap_socket(raw, server_hostname=hostname) as tls:
                    tls.sendall(b"ping")
                    return tls.recv(64)
        finally:
            thread.join(timeout=10)


def test_secrets_readme_generates_working_tls_material(tmp_path):
    from cryptography import x509

    subprocess.run(
        ["sh", "-c", _generate_block()],
        cwd=tmp_path,
        check=True,
        timeout=60,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin"},
        capture_output=True,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["admin_token", "ca.key", "ca.pem", "ray_auth_token", "registry.key", "registry.pem"]
    )
    assert re.fullmatch(r"[0-9a-f]{64}\n", (tmp_path / "ray_auth_token").read_text())
    assert (tmp_path / "admin_token").read_bytes() == b""  # filled later by the registry
    for name in ("ray_auth_token", "admin_token", "ca.pem", "registry.pem", "registry.key"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o640, name
    assert (tmp_path / "ca.key").stat().st_mode & 0o777 == 0o600

    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    cert = x509.load_pem_x509_certificate((tmp_path / "registry.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"registry", "localhost"} <= set(san.get_values_for_type(x509.DNSName))

    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "registry.pem", tmp_path / "registry.key")
    client = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    assert _tls_roundtrip(server, client, "localhost") == b"msa-fed:ping"
    with pytest.raises(ssl.SSLCertVerificationError):
        _tls_roundtrip(server, client, "registry.invalid")


def test_secrets_directory_is_ignored_except_its_readme():
    def ignored(rel):
        return subprocess.run(["git", "check-ignore", "-q", rel], cwd=ROOT).returncode == 0

    for name in ("ray_auth_token", "admin_token", "ca.key", "ca.pem", "registry.key", "registry.pem", "x"):
        assert ignored(f"deploy/secrets/{name}"), name
    assert not ignored("deploy/secrets/README.md") and not ignored("deploy/secrets/.gitignore")


def test_no_private_key_or_token_file_in_the_tree():
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    header = re.compile(rb"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----")
    secret_names = {"ray_auth_token", "auth_token", "admin_token"}
    secret_suffixes = {".key", ".p12", ".pfx", ".jks"}
    offenders = []
    for rel in filter(None, listed):
        path = ROOT / rel
        if not path.is_file() or path.is_symlink():
            continue
        if path.name in secret_names or path.suffix in secret_suffixes or header.search(path.read_bytes()):
            offenders.append(rel)
    assert len(listed) > 20  # the listing saw the tree
    assert offenders == []


# --------------------------------------------------------------------- job file
JOB_CHOICES = {
    "model.task": {"classification", "regression"},
    "model.method": {"dmsa", "gmsa"},
    "model.objective": {"minmax", "gamma"},
    "model.features": {"standard", "onehot", "threshold", "rff"},
    "run.data_channel": {"tls"},  # the examples keep the default, mutual TLS
    "run.topology": {"cluster"},
}  # the examples run on a Ray cluster


def _documented_job_keys() -> set[str]:
    """The job's own keys (cluster/README.md, "Job file") and the fit's (docs/OPTIONS.md)."""
    section = (ROOT / "cluster/README.md").read_text().split("## Job file", 1)[1]
    own = set(re.findall(r"^\| `([a-z_.]+)` \|", section, re.M))
    fit = re.findall(
        r"^\| `[a-z_.0-9]+` \| [^|]* \| `\[([a-z_]+)\] ([a-z_0-9]+)` \|", (ROOT / "docs/OPTIONS.md").read_text(), re.M
    )
    return own | {f"{table}.{key}" for table, key in fit}


def _flatten(table: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _job_files() -> dict[str, dict]:
    docs = yaml.safe_load_all((ROOT / "deploy/kuberay/rayjob.yaml").read_text())
    (config_map,) = [d for d in docs if d and d["kind"] == "ConfigMap"]
    return {
        "cluster/jobs/example_job.toml": tomllib.loads((ROOT / "cluster/jobs/example_job.toml").read_text()),
        "deploy/compose_job.toml": tomllib.loads((ROOT / "deploy/compose_job.toml").read_text()),
        "rayjob ConfigMap": tomllib.loads(config_map["data"]["job.toml"]),
    }


@pytest.mark.parametrize("name", ["cluster/jobs/example_job.toml", "deploy/compose_job.toml", "rayjob ConfigMap"])
def test_job_files_match_the_documented_schema(name):
    documented = _documented_job_keys()
    assert len(documented) >= 10
    job = _flatten(_job_files()[name])
    assert set(job) <= documented
    optional = {k for k in documented if k.split(".")[0] in ("classifier", "solver", "sealing")}
    optional |= {"run.site_timeout_s", "run.influence", "run.influence_margin", "run.approval_wait_s", "model.suspects"}
    optional |= {"registry.server_name", "registry.timeout"}
    assert documented - set(job) <= optional, documented - set(job)
    for key, choices in JOB_CHOICES.items():
        assert job[key] in choices, key
    assert re.fullmatch(r"[A-Za-z0-9.-]+:\d{1,5}", job["registry.address"])
    for key in ("registry.tls_ca", "registry.admin_token_file", "run.checkpoint_dir"):
        assert os.path.isabs(job[key]), key
    assert isinstance(job["model.mu"], float) and job["model.mu"] > 0
    assert isinstance(job["model.eta"], float) and job["model.eta"] >= 0
    assert isinstance(job["model.random_state"], int)
    assert isinstance(job["privacy.min_points"], int) and job["privacy.min_points"] >= 1
    assert set(job["run.sites"]) <= set(SITES)
    assert job["registry.insecure"] is False  # the examples use TLS
    assert "{site}" in job["run.site_data"] and not os.path.isabs(job["run.site_data"])
    assert re.fullmatch(r"[A-Za-z0-9.-]+:\d{1,5}", job["run.ray_address"])  # explicit, never "auto"
    assert re.fullmatch(r"[A-Za-z0-9._-]+", job["run.output_version"])
    assert re.fullmatch(r"[A-Za-z0-9._-]+", job["name"])


# ------------------------------------------------------- the msa-fed commands
def test_deployment_commands_parse_with_the_msa_fed_cli():
    from msa_fed.cli import build_parser

    parser = build_parser()
    # compose: the registry service
    args = parser.parse_args(_load_yaml("deploy/compose.yaml")["services"]["registry"]["command"])
    assert (args.command, args.registry_command) == ("registry", "serve") and not args.insecure
    assert args.tls_cert == "/run/secrets/registry_cert" and args.tls_key == "/run/secrets/registry_key"
    # systemd: the registry unit
    unit = (ROOT / "deploy/systemd/msa-fed-registry.service").read_text()
    (exec_start,) = re.findall(r"^ExecStart=(.*)$", unit, re.M)
    argv = shlex.split(exec_start)
    assert argv[0] == "/opt/msa-fed/venv/bin/msa-fed"
    args = parser.parse_args(argv[1:])
    assert args.registry_command == "serve" and args.tls_cert and args.tls_key and not args.insecure
    # KubeRay: run_msa.py hands its arguments to `msa-fed run`
    docs = yaml.safe_load_all((ROOT / "deploy/kuberay/rayjob.yaml").read_text())
    (job,) = [d for d in docs if d and d["kind"] == "RayJob"]
    entry = shlex.split(job["spec"]["entrypoint"])
    args = parser.parse_args(["run", *entry[2:]])
    assert args.command == "run" and args.admin_token is None and args.admin_token_file


# ------------------------------------------------------------ every recipe's Ray
#: every recipe that starts a Ray (scripts, launcher configs, the Makefile's targets run these)
RAY_RECIPES = sorted([p for p in (ROOT / "deploy").glob("*.sh")] + [p for p in (ROOT / "cluster").glob("*.yaml")])


def _code_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if not line.strip().startswith("#")]


@pytest.mark.parametrize("path", RAY_RECIPES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_recipe_runs_ray_with_its_token_check_and_never_a_bare_ray_stop(path):
    """Each `ray start` of a recipe runs with RAY_AUTH_MODE=token (exported before it, or on its
    own line), its token file is made readable by its owner only, and no recipe runs `ray stop`
    (it stops every Ray of the account): only a `ray()` wrapper that turns it into
    `python -m msa_fed.runtime.ray_own stop --temp-dir ...` may name it."""
    lines = _code_lines(path)
    text = "\n".join(lines)
    starts = [i for i, line in enumerate(lines) if re.search(r"(^|[\s\"'(])(\"?\$RAY\"?|ray) start\b", line)]
    assert starts, f"{path.name} starts no Ray"  # every script and launcher config here does
    for i in starts:
        before = "\n".join(lines[max(0, i - 40) : i + 1])
        assert "RAY_AUTH_MODE=token" in before, f"{path.name}: a ray start without the token check: {lines[i]}"
    # its token: generated under umask 077 and chmod 600, or copied and chmod 600 on the node
    if path.suffix == ".sh":
        made = r"\(umask 077 && .*token_hex\(32\).*> \"[^\"]*(auth_token|RAY_AUTH_TOKEN_PATH)\"\)"
        assert re.search(made, text), path.name
    assert re.search(r"chmod 600 [^\n]*(auth_token|RAY_AUTH_TOKEN_PATH)", text), path.name
    for line in lines:
        if re.search(r"(^|[;&|(]\s*|\s)ray stop\b", line) and "ray() {" not in line:
            pytest.fail(f"{path.name} runs a bare `ray stop`: {line.strip()}")
    stops = [line for line in lines if "ray() {" in line]
    for line in stops:
        assert "msa_fed.runtime.ray_own stop --temp-dir" in line and "command ray" in line


def test_ray_up_local_gives_its_login_a_private_token_and_a_safe_ray_stop():
    """deploy/ray-up-local.sh (root and sshd are needed to run it; its test is
    tests/ops/test_ops_ray_up.py): the login's ~/.ray/auth_token made 0600 under umask 077, its
    shell with RAY_AUTH_MODE=token and a `ray stop` that stops only this recipe's Ray, and
    `down` through ray_own (which also stops the Ray client server)."""
    text = (ROOT / "deploy" / "ray-up-local.sh").read_text()
    assert (
        '(umask 077 && "$PY" -c "import secrets; print(secrets.token_hex(32))" > "$FOLDER/home/.ray/auth_token")'
        in text
    )
    assert 'chmod 600 "$FOLDER/home/.ray/auth_token"' in text and 'chmod 700 "$FOLDER/home/.ray"' in text
    bashrc = text.split('cat > "$FOLDER/home/.bashrc" <<EOF\n', 1)[1].split("\nEOF\n", 1)[0]
    assert "export RAY_AUTH_MODE=token" in bashrc.splitlines()
    (wrapper,) = [line for line in bashrc.splitlines() if line.startswith("ray() {")]
    assert "msa_fed.runtime.ray_own stop --temp-dir $FOLDER/ray" in wrapper
    assert 'f"RAY_AUTH_MODE=token ray start --head --node-ip-address=127.0.0.1' in text
    down = text.split("down() {", 1)[1].split("\n}\n", 1)[0]
    assert 'msa_fed.runtime.ray_own stop --temp-dir "$FOLDER/ray"' in down and "ray stop" not in down.replace(
        "ray_own stop", ""
    )
