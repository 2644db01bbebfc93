"""`msa-fed site serve | jobs | approve` and the job file's topology keys: clear one-line errors.

Run in-process through msa_fed.cli.main (what the `msa-fed` command calls)."""

from __future__ import annotations

import json

import pytest
from fedhelpers import write_site_files, write_site_toml

from msa_fed.cli import main
from msa_fed.errors import ConfigError
from msa_fed.federation.config import SiteConfig
from msa_fed.jobs.config import JobConfig


def _error(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"colour": "blue"}, "unknown key(s) ['colour']"),
        ({"registry": None}, "missing key(s) ['registry']"),
        ({"registry": "10.1.2.3:50051"}, "insecure = true is allowed only towards a loopback registry"),
        ({"accept_jobs": "anyone"}, "accept_jobs must be one of 'admin', 'approve'"),
        ({"insecure": "yes"}, "insecure must be true or false"),
        ({"tls_cert": "c.pem", "insecure": None}, "tls_cert and tls_key must be given together"),
        ({"name": "no spaces"}, "is not a valid site name"),
        ({"allow_unsealed": "yes"}, "allow_unsealed must be true or false"),
        (
            {"allow_unsealed": True, "seal_key": "site.key", "job_keys": ["ab" * 32]},
            "seal_key and allow_unsealed = true are mutually exclusive",
        ),
    ],
)
def test_bad_site_config_is_one_error_line(tmp_path, capsys, changes, match):
    err = _error(capsys, ["site", "serve", "--config", str(write_site_toml(tmp_path, **changes))])
    assert match in err


def test_missing_files_are_named(tmp_path, capsys):
    err = _error(capsys, ["site", "serve", "--config", str(tmp_path / "nope.toml")])
    assert "nope.toml" in err and "not found" in err
    err = _error(capsys, ["site", "serve", "--config", str(write_site_toml(tmp_path))])
    assert "token_file" in err and "not found" in err
    (tmp_path / "token.txt").write_text("mft1.site.east.secret\n")
    err = _error(capsys, ["site", "serve", "--config", str(write_site_toml(tmp_path))])
    assert "data.npz" in err


def test_a_bad_policy_file_is_one_error_line(tmp_path, capsys):
    """The site's policy is read by its own process before it connects: a key the policy does
    not know, or a missing file, is one error line naming the file."""
    write_site_files(tmp_path)
    (tmp_path / "policy.toml").write_text("[limits]\nmin_pointz = 50\n")
    err = _error(capsys, ["site", "serve", "--config", str(write_site_toml(tmp_path, policy="policy.toml"))])
    assert "policy.toml" in err and "min_pointz" in err
    err = _error(capsys, ["site", "serve", "--config", str(write_site_toml(tmp_path, policy="absent.toml"))])
    assert "absent.toml" in err and "not found" in err


def test_a_site_without_a_sealing_key_serves_only_once_it_opts_out(tmp_path, capsys):
    """Sealing is the default: `site serve` without seal_key stops with one line naming the
    command and the keys to set; allow_unsealed = true is the explicit opt-out."""
    from msa_fed.crypto.sealing import JobKey, SiteKey
    from msa_fed.federation.agent import SiteAgent

    write_site_files(tmp_path)
    err = _error(capsys, ["site", "serve", "--config", str(write_site_toml(tmp_path))])
    assert "holds no sealing key" in err and "msa-fed site keygen" in err, err
    assert "seal_key and job_keys" in err and "allow_unsealed = true" in err, err
    opted_out = SiteAgent(SiteConfig.from_toml(write_site_toml(tmp_path, allow_unsealed=True)), echo=lambda _: None)
    try:
        assert opted_out.opener is None  # it takes unsealed jobs, as its operator wrote
    finally:
        opted_out.close()
    SiteKey.generate().save(tmp_path / "site.key")
    sealed = write_site_toml(tmp_path, seal_key="site.key", job_keys=[JobKey.generate().fingerprint])
    agent = SiteAgent(SiteConfig.from_toml(sealed), echo=lambda _: None)
    try:
        assert agent.opener is not None
    finally:
        agent.close()


@pytest.mark.parametrize("kind", ["site", "job"])
def test_keygen_writes_a_private_key_file_and_prints_only_its_fingerprint(tmp_path, capsys, kind):
    """`msa-fed site keygen` / `job keygen`: the private key 0600 from creation, never printed,
    never overwritten; what it prints is the fingerprint the other parties pin."""
    import stat

    from msa_fed.crypto.sealing import JobKey, SiteKey

    path = tmp_path / "keys" / f"{kind}.key"
    assert main([kind, "keygen", "--out", str(path)]) == 0
    out = capsys.readouterr()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = SiteKey.load(path) if kind == "site" else JobKey.load(path)
    fp = key.public.fingerprint if kind == "site" else key.fingerprint
    assert f"fingerprint {fp}" in out.out
    secret = "".join(path.read_text().split("-----")[2::4]).split()  # the base64 lines of each PEM block
    assert secret and not any(line in out.out + out.err for line in secret)
    if kind == "site":
        assert f'seal_key = "{path}"' in out.out and "job_keys" in out.out
    before = path.read_bytes()
    err = _error(capsys, [kind, "keygen", "--out", str(path)])
    assert "never overwritten" in err and path.read_bytes() == before


def test_the_site_policy_carries_one_audit_log_and_a_ledger_next_to_it(tmp_path):
    """load_site_policy: the policy file's limits, site.toml's audit log, a ledger file next to it
    by default (budgets survive restarts); a policy naming another audit log is refused."""
    from msa_fed.boundary import messages as m
    from msa_fed.federation.agent import load_site_policy, worker_policy_kwargs

    (tmp_path / "policy.toml").write_text("[limits]\nmin_points = 40\n[budget]\ndc_evaluations_per_job = 7\n")
    config = SiteConfig.from_toml(write_site_toml(tmp_path, policy="policy.toml"))
    policy = load_site_policy(config)
    assert policy.min_points == 40 and policy.dc_evaluations_per_job == 7
    assert policy.audit_log == str(tmp_path / "audit.jsonl")
    assert policy.ledger == str(tmp_path / "audit.ledger.db")
    defaults = load_site_policy(SiteConfig.from_toml(write_site_toml(tmp_path)))
    assert defaults.min_points == 20 and defaults.ledger == str(tmp_path / "audit.ledger.db")
    job = m.JobSetup(
        job_id="j",
        sites=("east", "west"),
        index=0,
        predictor_sha256=("a", "b"),
        task="classification",
        loss="cross_entropy",
        classes=None,
        min_points=5,
    )
    assert worker_policy_kwargs(policy, job, "j") == {
        "min_points": 5,
        "policy": policy,
        "job_id": "j",
        "sites": list(job.sites),
    }
    (tmp_path / "other.toml").write_text(f'[budget]\naudit_log = "{tmp_path / "elsewhere.jsonl"}"\n')
    with pytest.raises(ConfigError, match="one audit log"):
        load_site_policy(SiteConfig.from_toml(write_site_toml(tmp_path, policy="other.toml")))


def test_jobs_and_approve_keep_the_sites_book(tmp_path, capsys):
    config = write_site_toml(tmp_path, accept_jobs="approve")
    assert main(["site", "jobs", "--config", str(config)]) == 0
    assert "no jobs yet (accepting: approve)" in capsys.readouterr().out
    # a bare name never approves a job that has not asked yet: its content is unknown
    assert main(["site", "approve", "job-7", "--config", str(config)]) == 1
    assert "has not asked" in capsys.readouterr().err
    digest = "0123456789abcdef" * 4
    assert main(["site", "approve", "job-7", "--digest", digest, "--config", str(config)]) == 0
    assert f"approved in advance, for content {digest}" in capsys.readouterr().out
    assert main(["site", "jobs", "--config", str(config), "--json"]) == 0
    (job,) = json.loads(capsys.readouterr().out)
    assert job["job_id"] == "job-7" and job["state"] == "approved" and job["digest"] == digest
    # relative paths are relative to the file's folder
    assert SiteConfig.from_toml(config).jobs_path == tmp_path / "audit.jobs.db"


def test_job_file_topology_keys(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(
        '[registry]\naddress = "127.0.0.1:1"\ninsecure = true\n[run]\ntopology = "federated"\nsite_timeout_s = 5\n'
    )
    job = JobConfig.from_toml(path)
    assert job.topology == "federated" and job.fit.site_timeout_s == 5
    assert JobConfig(registry="127.0.0.1:1").topology == "federated"  # the default
    for run, match in (
        ('topology = "mesh"', "topology must be"),
        ("site_timeout_s = 0", "site_timeout_s must be"),
        ('site_timeout_s = "60"', "site_timeout_s must be"),
    ):
        path.write_text(f'[registry]\naddress = "127.0.0.1:1"\n[run]\n{run}\n')
        with pytest.raises(ConfigError, match=match):
            JobConfig.from_toml(path)


@pytest.mark.parametrize("peers", [None, ["west", "north"]])
def test_a_site_that_admits_any_peer_says_so_at_start(tmp_path, capsys, peers):
    """`site serve` with the default roster (peers = "any") says so in one line at start, before
    it asks the registry anything (here: a real registry that does not know the site's token,
    which ends the start); a site that names its peers prints no such line."""
    from msa_fed.control.registry.service import Registry
    from msa_fed.control.registry.sqlite_store import SqliteStore
    from msa_fed.control.server import RegistryServer

    write_site_files(tmp_path)
    extra = {}
    if peers is not None:
        (tmp_path / "policy.toml").write_text(f"[limits]\npeers = {json.dumps(peers)}\n")
        extra["policy"] = "policy.toml"
    store = SqliteStore(tmp_path / "registry.db")
    with RegistryServer(Registry(store), "127.0.0.1:0", insecure=True) as server:
        toml = write_site_toml(tmp_path, registry=server.address, allow_unsealed=True, **extra)
        rc = main(["site", "serve", "--config", str(toml)])
    store.close()
    out, err = capsys.readouterr()
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err, err  # the unknown token
    lines = [line for line in out.splitlines() if "peers" in line]
    if peers is None:
        assert lines == [
            'site east: peers = "any": it joins jobs with whatever sites the registry lists; '
            "name its peers in its policy ([limits] peers = [...])"
        ]
    else:
        assert lines == []
