"""One site request's path through the policy: the budget read in one call, the counts written
before the answer leaves (a site killed right after answering has counted every answer), the
audit record's content and the hash of its line."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from msa_fed.boundary import messages as m
from msa_fed.errors import PrivacyError
from msa_fed.privacy.audit import _SHA256, GENESIS, AuditLog, _json_default, line_hash, verify_log
from msa_fed.privacy.guard import SiteGuard
from msa_fed.privacy.ledger import HOUR_S, Ledger, MemoryLedger
from msa_fed.privacy.policy import SitePolicy
from tests.privacy import attacks as A

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
def test_used_is_the_job_count_and_the_rolling_day_count(tmp_path, kind):
    ledger = Ledger(str(tmp_path / "l.sqlite")) if kind == "sqlite" else Ledger("")
    assert isinstance(ledger, MemoryLedger) == (kind == "memory")
    now = 1000 * HOUR_S + 10.0
    assert ledger.used("j1", "dc_evaluation", now) == (0, 0)
    ledger.commit("j1", [("dc_evaluation", 3)], t=now)
    ledger.commit("j2", [("dc_evaluation", 2), ("domain_model", 1)], t=now - 5 * HOUR_S)
    ledger.commit("j1", [("dc_evaluation", 7)], t=now - 24 * HOUR_S)  # the oldest hour still in the window
    ledger.commit("j1", [("dc_evaluation", 100)], t=now - 25 * HOUR_S)  # out of the window
    for job in ("j1", "j2", "j3"):
        for k in ("dc_evaluation", "domain_model"):
            assert ledger.used(job, k, now) == (ledger.job_count(job, k), ledger.day_count(k, now))
    assert ledger.used("j1", "dc_evaluation", now) == (110, 12)
    assert ledger.used("j2", "domain_model", now) == (1, 1)


def test_every_answer_is_counted_before_it_leaves_even_if_the_site_is_killed(tmp_path):
    """The site answers 3 DC requests and is killed (SIGKILL, nothing closed or flushed by
    Python): its ledger holds all 3 and the set_qhat query, the audit log and the anchor agree,
    and the restarted site refuses the request beyond the job's budget of 5."""
    ledger, log = tmp_path / "ledger.sqlite", tmp_path / "audit.jsonl"
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        import numpy as np
        from msa_fed.privacy.policy import SitePolicy
        from msa_fed.boundary import messages as m
        from tests.privacy import attacks as A
        from tests.privacy.test_policy import _honest_spec
        pol = SitePolicy(ledger={str(ledger)!r}, audit_log={str(log)!r}, dc_evaluations_per_job=5)
        w, X, _ = A.victim(1, policy=pol, job_id="job-1")
        w.set_domain_model(_honest_spec(X))
        w.set_qhat(m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.01))
        for _ in range(3):
            w.dc_evaluate(m.DCRequest(z=np.array([0.5, 0.5]), eta=0.01, what=("L",)))
        sys.stdout.write("answered\\n"); sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout == "answered\n", proc.stderr
    assert proc.returncode == -9
    check = Ledger(str(ledger))
    assert check.job_count("job-1", "dc_evaluation") == 4  # set_qhat and the 3 DC answers
    summary = verify_log(log, anchor=check.anchor(os.path.abspath(log)))
    assert summary["lines"] == 5 and summary["requests"] == {"set_domain_model": 1, "set_qhat": 1, "dc_evaluate": 3}
    check.close()
    pol = SitePolicy(ledger=str(ledger), audit_log=str(log), dc_evaluations_per_job=5)
    w, X, _ = A.victim(1, policy=pol, job_id="job-1")
    from tests.privacy.test_policy import _honest_spec

    w.set_domain_model(_honest_spec(X))
    w.set_qhat(m.QhatBroadcast(qhat=np.array([0.5, 0.5]), eta=0.01))  # the 5th query of the job
    with pytest.raises(PrivacyError, match="dc_evaluations_per_job"):
        w.dc_evaluate(m.DCRequest(z=np.array([0.5, 0.5]), eta=0.01, what=("L",)))
    assert w.guard.ledger.job_count("job-1", "dc_evaluation") == 6  # the refusal is counted too


def _record_lines(guard: SiteGuard) -> list[dict]:
    return [json.loads(x) for x in guard.audit.lines]


def test_request_writes_answered_refused_and_error_records_with_the_same_fields():
    guard = SiteGuard("s0", SitePolicy(dc_evaluations_per_job=1), job="name@digest#run")
    with guard.request("dc_evaluate", n_labeled=50, what=["L"]) as dec:
        dec.update(guard.charge("dc_evaluation"))
        dec["eta"] = 0.01
    with pytest.raises(PrivacyError) as err:
        with guard.request("dc_evaluate", n_labeled=50, what=["L"]) as dec:
            dec.update(guard.charge("dc_evaluation"))
    assert err.value.rule == "budget"
    with pytest.raises(PrivacyError):
        with guard.request("set_qhat", p=2):
            exc = PrivacyError("qhat", "s0", "the request: qhat")
            exc.measured = {"own_share": 0.25}  # type: ignore[attr-defined]
            raise exc
    with pytest.raises(ZeroDivisionError):
        with guard.request("max_bound", n_labeled=50):
            1 / 0  # noqa: B018
    with pytest.raises(KeyboardInterrupt):  # not an error of the request: nothing written
        with guard.request("max_bound", n_labeled=50):
            raise KeyboardInterrupt
    recs = _record_lines(guard)
    assert [list(r) for r in recs] == [
        ["time", "site", "job", "request", "sizes", "decisions", "outcome", "run", "charged", "prev"],
        ["time", "site", "job", "request", "sizes", "decisions", "outcome", "rule", "detail", "run", "charged", "prev"],
        ["time", "site", "job", "request", "sizes", "decisions", "outcome", "rule", "detail", "run", "prev"],
        ["time", "site", "job", "request", "sizes", "decisions", "outcome", "detail", "run", "prev"],
    ]
    assert recs[0]["decisions"] == {"dc_evaluations_job": 1, "eta": 0.01} and recs[0]["outcome"] == "answered"
    assert recs[0]["job"] == "name" and recs[0]["run"] == "name@digest#run"
    assert recs[0]["charged"] == {"dc_evaluation": 1}  # what the answer counts toward the rolling day
    assert recs[1]["outcome"] == "refused" and recs[1]["rule"] == "budget"
    assert recs[1]["decisions"] == {}  # refused before the counts were returned
    assert recs[1]["charged"] == {"dc_evaluation": 1}  # a refused query is counted too (no free probing)
    assert recs[2]["decisions"] == {"own_share": 0.25} and recs[2]["rule"] == "qhat"
    assert "0.25" not in str(err.value)
    assert recs[3]["outcome"] == "error" and recs[3]["detail"] == "ZeroDivisionError"
    # both budget requests counted (the refusal is an answer), nothing else
    assert guard.ledger.job_count("name@digest#run", "dc_evaluation") == 2
    for k, line in enumerate(guard.audit.lines):
        rec = json.loads(line)
        assert line == json.dumps(rec, separators=(",", ":"), default=_json_default, allow_nan=False).encode()
        assert rec["prev"] == (GENESIS if k == 0 else line_hash(guard.audit.lines[k - 1]))


def test_the_line_hash_is_sha256(tmp_path):
    rng = np.random.default_rng(0)
    for n in (0, 1, 55, 64, 1000, 100_000):
        data = rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()
        assert line_hash(data) == hashlib.sha256(data).hexdigest() == _SHA256(data).hexdigest()
    log = AuditLog(str(tmp_path / "a.jsonl"))
    head = log.append({"x": 1})
    assert head == hashlib.sha256((tmp_path / "a.jsonl").read_bytes()[:-1]).hexdigest()


def test_writers_chain_to_each_others_lines_in_any_order(tmp_path):
    """Two writers of one log file and ledger (two jobs' workers on one node): a writer appending
    again to the file as it left it chains to its own last line without reading the file back; a
    writer that finds lines of another since chains to those and to their count.  Every order of
    appends leaves one whole chain, its anchor the ledger's, its records in the order written."""
    path = str(tmp_path / "a.jsonl")
    ledger = Ledger(str(tmp_path / "l.sqlite"))
    writers = {"a": AuditLog(path, ledger=ledger), "b": AuditLog(path, ledger=Ledger(str(tmp_path / "l.sqlite")))}
    order = "aababbbaab"
    for k, who in enumerate(order):
        head = writers[who].append({"writer": who, "k": k}, [("dc_evaluation", 1)])
        lines = (tmp_path / "a.jsonl").read_bytes().splitlines()
        assert head == line_hash(lines[-1]) and len(lines) == k + 1
        assert ledger.anchor(os.path.abspath(path)) == (k + 1, head)
    summary = verify_log(path, ledger.anchor(os.path.abspath(path)))
    assert summary["lines"] == len(order)
    records = [json.loads(x) for x in (tmp_path / "a.jsonl").read_bytes().splitlines()]
    assert [r["writer"] for r in records] == list(order) and [r["k"] for r in records] == list(range(len(order)))
    assert ledger.job_count("", "dc_evaluation") == len(order)
    # a line written behind a writer's back (here: by a third writer opened after it) is chained to
    writers["c"] = AuditLog(path, ledger=ledger)
    writers["c"].append({"writer": "c"})
    writers["a"].append({"writer": "a"})
    summary = verify_log(path, ledger.anchor(os.path.abspath(path)))
    assert summary["lines"] == len(order) + 2
    for w in writers.values():
        w.close()
    # the log as the writers left it opens again (its chain and anchor checked) and grows
    again = AuditLog(path, ledger=ledger)
    again.append({"writer": "again"})
    assert verify_log(path, ledger.anchor(os.path.abspath(path)))["lines"] == len(order) + 3
    again.close()


def test_a_sealed_request_whose_answer_left_is_refused_after_a_kill_between_the_writes(tmp_path):
    """A site process with a ledger file commits each sealed request's sequence number with the
    request's audit record (one commit).  It answers 3 sealed requests, takes a 4th and is
    killed (SIGKILL) between that request's two writes: its audit line is in the log, the
    commit of its counts, anchor and sequence number is not, and no answer left.  The restarted
    site opens the log (the anchor counts 3 of its 4 lines), refuses the 3 answered requests as
    replayed and answers the 4th, whose answer never left before; every answer the job got
    verifies."""
    from types import SimpleNamespace

    from msa_fed.crypto.sealing import JobKey, JobSealer, SiteKey, TamperedError, job_content
    from msa_fed.federation.site_sealing import sealing_opener

    site_key, job_key = SiteKey.generate(), JobKey.generate()
    key_path = site_key.save(tmp_path / "north.key")
    content = job_content(
        "job-1",
        [
            dict(
                name="north",
                key_fingerprint=site_key.public.fingerprint,
                sample_sha256="ab" * 32,
                predictor_sha256="cd" * 32,
            )
        ],
        task="classification",
        loss="cross_entropy",
        mu=1e-3,
        objective="minmax",
        planned_queries=50,
    )
    sealer = JobSealer(job_key, content, {"north": site_key.public})
    sent = [sealer.seal("north", f"r{k}".encode()) for k in range(4)]
    for k, (frame, _) in enumerate(sent):
        (tmp_path / f"frame{k}").write_bytes(frame)
    ledger, log = tmp_path / "ledger.sqlite", tmp_path / "audit.jsonl"
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        from types import SimpleNamespace
        from msa_fed.federation.site_sealing import sealing_opener
        from msa_fed.privacy.audit import AuditLog
        from msa_fed.privacy.ledger import Ledger
        config = SimpleNamespace(name="north", seal_key={str(key_path)!r}, job_keys={{{job_key.fingerprint!r}}},
                                 allow_unsealed=False)
        ledger = Ledger({str(ledger)!r})
        audit = AuditLog({str(log)!r}, ledger=ledger)
        opener = sealing_opener(config, None, ledger)
        for k in range(4):
            frame = open(os.path.join({str(tmp_path)!r}, f"frame{{k}}"), "rb").read()
            ctx, plain = opener.open("job-1", frame)
            if k == 3:  # killed after the record's line is written, before its commit
                def killed(*args, **kwargs):
                    sys.stdout.write("line written\\n"); sys.stdout.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                ledger.commit = killed
            audit.append({{"site": "north", "job": "job-1", "request": "dc_evaluate"}}, [("dc_evaluation", 1)])
            sys.stdout.write(opener.seal(ctx, b"answer " + plain).hex() + "\\n"); sys.stdout.flush()
        """
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 4 and lines[3] == "line written", proc.stdout
    for k, hexed in enumerate(lines[:3]):
        frame, seq = sent[k]
        assert (
            sealer.open("north", seq, bytes.fromhex(hexed), f"r{k}".encode(), "dc_evaluate") == f"answer r{k}".encode()
        )
    check = Ledger(str(ledger))
    audit = AuditLog(str(log), ledger=check)  # the anchor (3 lines) below the log's 4: not a truncation
    assert audit.count == 4 and check.anchor(os.path.abspath(log))[0] == 3
    config = SimpleNamespace(name="north", seal_key=str(key_path), job_keys={job_key.fingerprint}, allow_unsealed=False)
    restarted = sealing_opener(config, None, check)
    for frame, _ in sent[:3]:
        with pytest.raises(TamperedError, match="replayed"):
            restarted.open("job-1", frame)
    ctx, plain = restarted.open("job-1", sent[3][0])
    assert plain == b"r3"
    back = restarted.seal(ctx, b"answer r3")
    assert sealer.open("north", sent[3][1], back, b"r3", "dc_evaluate") == b"answer r3"
    assert len(sealer.transcript) == 4  # each request answered once, every signature checked
    audit.close()
    check.close()
