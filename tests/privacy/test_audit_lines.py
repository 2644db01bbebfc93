"""The audit line's serialisation: byte for byte the compact JSON of {"time", **record, "prev"}
(so every log written before verifies the same), and the hash chain over it still catches edits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from msa_fed.privacy.audit import AuditError, AuditLog, _json_default, _line, line_hash, verify_log

RECORDS = [
    {},
    {
        "site": "s0",
        "job": "j1",
        "request": "dc_evaluate",
        "sizes": {"n_labeled": 50, "what": ["L", "dL"]},
        "decisions": {"dc_evaluations_job": 7},
        "outcome": "answered",
    },
    {
        "request": "set_qhat",
        "decisions": {"w_share": np.float64(0.125), "n": np.int64(3), "v": np.arange(2)},
        "outcome": "refused",
        "rule": "concentration",
        "detail": 'quote " and \\ and \n and é',
    },
    {"time": "overridden", "prev": "not the chain", "x": 1},  # a record naming the chain's own fields
]


@pytest.mark.parametrize("record", RECORDS)
def test_line_is_the_compact_json_of_the_record_between_time_and_prev(record):
    t, prev = 1795690845.833, "ab" * 32
    expected = json.dumps(
        {"time": t, **record, "prev": prev}, separators=(",", ":"), default=_json_default, allow_nan=False
    ).encode()
    assert _line(record, t, prev) == expected


def test_non_finite_numbers_are_refused():
    with pytest.raises(ValueError):
        _line({"decisions": {"x": float("nan")}}, 1.0, "00")


def test_chain_over_the_lines_detects_an_edit(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path))
    for k in range(5):
        log.append({**RECORDS[1], "decisions": {"dc_evaluations_job": k}})
    log.close()
    summary = verify_log(path)
    assert summary["lines"] == 5 and summary["requests"] == {"dc_evaluate": 5}
    lines = path.read_bytes().splitlines()
    assert all(json.loads(x)["prev"] != json.loads(y)["prev"] for x, y in zip(lines, lines[1:]))
    lines[2] = lines[2].replace(b'"dc_evaluations_job":2', b'"dc_evaluations_job":9')
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(AuditError, match="line 4 does not chain to line 3"):
        verify_log(path)


def test_an_in_memory_log_writes_its_lines_when_read_as_they_were_appended():
    """An in-memory log (no file: nothing outlives the process) encodes and chains its records
    when it is read, not on the request's path: the lines are those the file writer writes for
    the same records and times, chained in the order appended, whatever the reads in between;
    a record's dicts changed after the append do not change its line; a non-finite number is
    written as its name instead of failing the read."""
    log = AuditLog("")
    decisions = {"dc_evaluations_job": 1}
    log.append({**RECORDS[1], "decisions": decisions})
    decisions["dc_evaluations_job"] = 99  # after the request ended: not in its line
    assert log.count == 1
    first = log.lines
    assert len(first) == 1 and json.loads(first[0])["decisions"] == {"dc_evaluations_job": 1}
    log.append(RECORDS[2])
    log.append({"decisions": {"x": float("nan"), "v": np.array([1.0, np.inf])}})
    lines = log.lines
    assert lines[:1] == first and log.count == 3
    prev = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256 of b""
    for line in lines:
        rec = json.loads(line)
        assert rec["prev"] == prev
        assert line == _line({k: v for k, v in rec.items() if k not in ("time", "prev")}, rec["time"], prev)
        prev = line_hash(line)
    assert log.head == prev
    assert json.loads(lines[2])["decisions"] == {"x": "nan", "v": [1.0, "inf"]}
    assert [r["decisions"] for r in log.records()][1]["w_share"] == 0.125


def test_an_in_memory_log_writes_its_waiting_records_once_there_are_many(monkeypatch):
    import msa_fed.privacy.audit as audit

    monkeypatch.setattr(audit, "MAX_PENDING", 3)
    log = AuditLog("")
    for k in range(7):
        log.append({"k": k})
    assert len(log._memory.lines) == 6 and len(log._memory.pending) == 1  # written in two batches of 3
    assert [json.loads(x)["k"] for x in log.lines] == list(range(7)) and not log._memory.pending
