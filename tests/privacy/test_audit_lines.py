"""The audit line's serialisation: byte for byte the compact JSON of {"time", **record, "prev"}
(so every log written before verifies the same), and the hash chain over it still catches edits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from msa_fed.privacy.audit import AuditError, AuditLog, _json_default, _line, verify_log

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
