"""`msa-fed consortium init / add-site`: the kit's files, their modes, no party holding another's
secret; and the whole flow from the kit alone (a registry, three sites, a sealed mutual-TLS job),
every command a real process, no hand-made certificate."""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ops_helpers import REPO, Lines, cli, env

from msa_fed.jobs.consortium import Kit

SITES = ("north", "east", "west")
#: the commands of the kit's walkthrough in docs/OPERATIONS.md, in order (the slow test runs them)
KIT_COMMANDS = [
    "consortium init",
    "registry serve",
    "site register",
    "site publish",
    "site serve",
    "run",
    "model show",
    "job log",
    "job cancel",
    "job list",
]


def _doc_commands() -> list[str]:
    doc = (REPO / "docs" / "OPERATIONS.md").read_text()
    block = doc.split("<!-- kit-walkthrough -->", 1)[1].split("<!-- /kit-walkthrough -->", 1)[0]
    out = []
    for line in block.splitlines():
        words = line.strip().split()
        if words[:1] == ["msa-fed"]:
            out.append("run" if words[1] == "run" else " ".join(words[1:3]))
    return out


def test_the_kit_walkthrough_in_the_doc_is_what_the_flow_test_runs():
    assert _doc_commands() == KIT_COMMANDS


def _init(root: Path, *extra, registry: str = "127.0.0.1:38811", sites: str = "north,east,west"):
    rc, out, err = cli("consortium", "init", root, "--registry", registry, "--sites", sites, *extra)
    assert rc == 0, (out, err)
    return out


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _secrets(root: Path) -> dict[str, list[bytes]]:
    """Per party folder: the secrets it holds (private keys and tokens, as written)."""
    out: dict[str, list[bytes]] = {}
    for party in ["consortium", "registry", "coordinator", *(f"sites/{s}" for s in SITES)]:
        folder = root / party
        found = []
        for path in _files(folder):
            if path.name.endswith((".key", "token.txt", "admin_token")):
                data = path.read_bytes()
                found.append(data.strip())
                # each PEM block's base64 body too, and a token's secret part alone
                found += [b.split(b"-----", 1)[0].strip() for b in data.split(b"KEY-----")[1::2]]
                if data.startswith(b"mft1."):
                    found.append(data.strip().rsplit(b".", 1)[1])
        out[party] = [s for s in found if len(s) > 20]
    return out


def test_the_kit_gives_each_party_its_own_files_only(tmp_path):
    root = tmp_path / "kit"
    text = _init(root)
    assert "registry serve --config registry.toml" in text
    for party in ("registry", "coordinator", "consortium", *(f"sites/{s}" for s in SITES)):
        assert stat.S_IMODE((root / party).stat().st_mode) == 0o700, party
    for path in _files(root):
        mode = stat.S_IMODE(path.stat().st_mode)
        secret = path.suffix == ".key" or path.name in ("token.txt", "admin_token", "registry.db")
        assert mode == (0o600 if secret else 0o644), (path, oct(mode))
    # what each party gets
    assert {p.name for p in _files(root / "sites" / "east")} == {
        "site.toml",
        "policy.toml",
        "token.txt",
        "ca.pem",
        "client.pem",
        "client.key",
        "site.key",
        "site.key.pub",
    }
    assert {p.name for p in _files(root / "coordinator")} == {
        "job.toml",
        "admin_token",
        "job.key",
        "job.key.pub",
        "ca.pem",
        "client.pem",
        "client.key",
    }
    assert {p.name for p in _files(root / "registry")} == {
        "registry.toml",
        "registry.db",
        "ca.pem",
        "server.pem",
        "server.key",
    }
    # no party's folder holds another party's secret, in any file (the registry's database included)
    secrets = _secrets(root)
    assert all(secrets[f"sites/{s}"] for s in SITES) and secrets["coordinator"] and secrets["registry"]
    for party in secrets:
        blobs = [p.read_bytes() for p in _files(root / party)]
        for other, held in secrets.items():
            if other == party:
                continue
            for secret in held:
                assert not any(secret in blob for blob in blobs), f"{party} holds a secret of {other}"
    # the site's certificate names the site and chains to the CA; the registry's names the host
    from cryptography import x509

    ca = x509.load_pem_x509_certificate((root / "registry" / "ca.pem").read_bytes())
    for name in SITES:
        cert = x509.load_pem_x509_certificate((root / "sites" / name / "client.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == [name]
    server = x509.load_pem_x509_certificate((root / "registry" / "server.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    # the configurations read back: the site's peers are the other sites, the job pins every site
    from msa_fed.federation.config import SiteConfig
    from msa_fed.jobs.config import JobConfig
    from msa_fed.privacy.policy import load_policy

    kit = Kit.load(root)
    config = SiteConfig.from_toml(root / "sites" / "east" / "site.toml")
    assert config.tls_cert == str(root / "sites" / "east" / "client.pem") and config.job_keys == (
        kit.job_key_fingerprint,
    )
    assert load_policy(config.policy).peers == ("north", "west")
    job = JobConfig.from_toml(root / "coordinator" / "job.toml")
    assert job.seal_pins == kit.site_fingerprints and job.sites == SITES and not job.insecure
    job.check_sealed()


def test_add_site_extends_the_kit(tmp_path):
    from msa_fed.control.registry.service import Registry
    from msa_fed.control.registry.sqlite_store import SqliteStore
    from msa_fed.jobs.config import JobConfig
    from msa_fed.privacy.policy import load_policy

    root = tmp_path / "kit"
    _init(root)
    rc, out, err = cli("consortium", "add-site", root, "south")
    assert rc == 0, (out, err)
    assert "each of north, east, west adds 'south'" in out
    job = JobConfig.from_toml(root / "coordinator" / "job.toml")
    assert job.sites == (*SITES, "south") and set(job.seal_pins) == {*SITES, "south"}
    assert load_policy(str(root / "sites" / "north" / "policy.toml")).peers == ("east", "west", "south")
    token = (root / "sites" / "south" / "token.txt").read_text().strip()
    with SqliteStore(root / "registry" / "registry.db") as store:
        assert Registry(store).authenticate(token).name == "south"
    # the same name twice, or a kit that is not one: one line each
    rc, out, err = cli("consortium", "add-site", root, "south")
    assert rc == 1 and err.strip() == "error: site 'south' is in the kit already", err
    rc, out, err = cli("consortium", "add-site", tmp_path, "x")
    assert rc == 1 and "is not a consortium kit" in err and len(err.strip().splitlines()) == 1


def test_init_refuses_a_used_folder_and_bad_names(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "a").write_text("x")
    rc, _, err = cli("consortium", "init", tmp_path / "used", "--registry", "127.0.0.1:1", "--sites", "a,b")
    assert rc == 1 and "is not an empty folder" in err
    rc, _, err = cli("consortium", "init", tmp_path / "k", "--registry", "127.0.0.1:1", "--sites", "a,a")
    assert rc == 1 and "names a site twice" in err
    rc, _, err = cli("consortium", "init", tmp_path / "k", "--registry", "127.0.0.1:1", "--sites", "a/b")
    assert rc == 1 and "is not valid" in err
    rc, _, err = cli("consortium", "init", tmp_path / "k", "--registry", "nohost", "--sites", "a")
    assert rc == 1 and err.startswith("error: --registry")
    assert not (tmp_path / "k").exists()


# --------------------------------------------------------------------------- the whole flow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, cwd, extra_env=None) -> tuple[subprocess.Popen, Lines]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "msa_fed.cli", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**env(), **(extra_env or {})},
        cwd=cwd,
    )
    return proc, Lines(proc.stdout)


def _wait_count(lines: Lines, text: str, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while sum(text in line for line in list(lines.lines)) < count:
        assert time.monotonic() < deadline, f"fewer than {count} lines with {text!r}:\n" + lines.text()
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_sealed_mutual_tls_job_from_the_kit_alone(tmp_path):
    from proc_federation import demo_sites, write_site_files

    root = tmp_path / "kit"
    _init(root, registry=f"127.0.0.1:{free_port()}")
    procs: list[subprocess.Popen] = []
    try:
        registry, reg_out = start(["registry", "serve", "--config", "registry.toml"], root / "registry")
        procs.append(registry)
        reg_out.wait_for("registry listening on", timeout=120)
        assert "(mutual TLS)" in reg_out.text() or "mutual" in reg_out.text(), reg_out.text()
        outs = {}
        for name, files in demo_sites(SITES).items():
            folder = root / "sites" / name
            write_site_files(folder, files)
            for command in ("register", "publish"):
                rc, out, err = cli("site", command, "--config", "site.toml", cwd=folder)
                assert rc == 0, (command, out, err)
            site, outs[name] = start(["site", "serve", "--config", "site.toml"], folder)
            procs.append(site)
        for name in SITES:
            outs[name].wait_for("connected to the registry", timeout=300)
        job, job_out = start(
            ["run", "--job", root / "coordinator" / "job.toml"],
            tmp_path,
            {"MSA_FED_PROGRESS": "lines"},
        )
        procs.append(job)
        assert job.wait(900) == 0, job_out.text()
        text = job_out.text()
        assert "stored combined model version 1" in text, text
        admin = ["--registry", Kit.load(root).registry, "--admin-token-file", root / "coordinator" / "admin_token"]
        admin += ["--tls-ca", root / "coordinator" / "ca.pem", "--tls-cert", root / "coordinator" / "client.pem"]
        admin += ["--tls-key", root / "coordinator" / "client.key"]
        rc, out, err = cli("model", "show", "latest", *admin)
        assert rc == 0 and "consortium-job" in out, (out, err)
        # the job's progress, from the registry (any machine with the admin token and the kit's certificate)
        first_id = job_out.wait_for("recorded in the registry", timeout=5).split()[1]
        rc, out, err = cli("job", "log", first_id, *admin)
        assert rc == 0 and "DC solver: iteration 1," in out and "stored combined model version 1" in out, (out, err)
        assert out.splitlines()[0].startswith(f"job {first_id} recorded in the registry"), out
        for name in SITES:
            assert "joined job consortium-job" in outs[name].text(), outs[name].text()
        assert os.stat(root / "registry" / "audit.jsonl").st_mode & 0o077 == 0

        # two more jobs, longer (every start of the solve run to the end): the second is cancelled
        # by the admin, the third stopped with SIGTERM.  The third starts once the second is
        # solving (its local Ray up: two Rays starting at once time out on a loaded machine), so
        # its start-up overlaps the second's cancellation; the sites serve both
        long_job = tmp_path / "long.toml"
        long_job.write_text(
            (root / "coordinator" / "job.toml").read_text() + "\n[solver]\nall_starts = true\nn_restarts = 40\n"
        )
        job, job_out = start(["run", "--job", long_job], tmp_path, {"MSA_FED_PROGRESS": "lines"})
        procs.append(job)
        job_id = job_out.wait_for("recorded in the registry", timeout=300).split()[1]
        job_out.wait_for("DC solver: iteration 1,", timeout=600)
        third, third_out = start(["run", "--job", long_job], tmp_path, {"MSA_FED_PROGRESS": "lines"})
        procs.append(third)
        rc, out, err = cli("job", "cancel", job_id, "--reason", "wrong cohort", *admin)
        assert rc == 0 and f"job {job_id} (consortium-job) cancelled by admin at " in out, (out, err)
        assert job.wait(300) == 1, job_out.text()
        last = job_out.lines[-1]
        assert last.startswith(f"error: job consortium-job ({job_id}) was cancelled by admin at "), job_out.text()
        assert last.endswith(": wrong cohort") and "Traceback" not in job_out.text(), job_out.text()
        for name in SITES:  # the relay told each site the job ended (the first job's end was one line)
            _wait_count(outs[name], "job consortium-job ended", 2)
        # ... the cancelled job's end: the third job is still running (its end would be a line too)
        assert third.poll() is None, third_out.text()
        rc, out, err = cli("job", "list", *admin)
        assert rc == 0 and re.search(rf"{job_id}\s+consortium-job\s+cancelled", out), (out, err)

        # the third, stopped with SIGTERM: one line, recorded as interrupted, no stack frames
        job, job_out = third, third_out
        job_id = job_out.wait_for("recorded in the registry", timeout=300).split()[1]
        job_out.wait_for("DC solver: iteration 1,", timeout=600)
        job.send_signal(signal.SIGTERM)
        assert job.wait(300) == 130, job_out.text()
        text = job_out.text()
        assert job_out.lines[-1] == (
            f"error: job {job_id} interrupted (SIGTERM); recorded in the registry as interrupted"
        ), text
        for foreign in ("SIGTERM received", "Traceback", "SystemExit", "clock_nanosleep", "*** "):
            assert foreign not in text, (foreign, text)
        rc, out, err = cli("job", "show", job_id, *admin)
        assert rc == 0 and "status          interrupted" in out and "interrupted (SIGTERM)" in out, (out, err)
    finally:
        for proc in reversed(procs):
            stop(proc)
