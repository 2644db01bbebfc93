"""``--runtime ray`` gives the same experiment numbers as ``--runtime local``."""
import json

import pytest

from msa_fed.cli import main


def test_synthetic_ray_matches_local(tmp_path):
    out = {}
    for runtime in ("local", "ray"):
        path = tmp_path / f"{runtime}.json"
        assert main(["experiment", "synthetic", "--quick", "--seeds", "1", "--runtime", runtime,
                     "--json", str(path)]) == 0
        out[runtime] = json.loads(path.read_text())

    def flat(res, prefix=""):
        for k, v in res.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}/")
            else:
                yield f"{prefix}{k}", v

    local, ray_ = dict(flat(out["local"])), dict(flat(out["ray"]))
    assert local.keys() == ray_.keys()
    for key, value in local.items():
        assert ray_[key] == pytest.approx(value, abs=1e-9), key
