"""The stored model format: a real model packed and unpacked, and hostile archives refused."""

from __future__ import annotations

import importlib.util
import io
import tarfile

import numpy as np
import pytest
from ops_helpers import REPO

import msa_fed
from msa_fed.control.ops.models import pack_model, unpack_model
from msa_fed.errors import ArtifactError, ConfigError


@pytest.fixture
def model_dir(demo_model_dir):
    """The suite's shared fitted model (tests/conftest.py)."""
    return demo_model_dir


def test_round_trip_opens_with_load_model(model_dir, tmp_path):
    path, X = model_dir
    data = pack_model(path)
    assert data == pack_model(path)  # deterministic: the same model gives the same sha256
    out = unpack_model(data, tmp_path / "copy")
    np.testing.assert_array_equal(msa_fed.load_model(out).predict_proba(X), msa_fed.load_model(path).predict_proba(X))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = tar.getnames()
    assert names[:2] == ["model", "model/predictors"] and "model/manifest.json" in names
    assert sorted(n for n in names if n.endswith(".onnx")) == [f"model/predictors/{k}.onnx" for k in range(3)]


def test_existing_output_is_never_overwritten(model_dir, tmp_path):
    data = pack_model(model_dir[0])
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError):
        unpack_model(data, tmp_path / "busy")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"


def _archive(members) -> bytes:
    """A tar made of (TarInfo, bytes or None) pairs, crafted by the attacker."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, content in members:
            if content is not None:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
            else:
                tar.addfile(info)
    return buf.getvalue()


def _file(name, content=b"{}"):
    return tarfile.TarInfo(name), content


def _link(name, target, kind):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def _special(name, kind):
    info = tarfile.TarInfo(name)
    info.type = kind
    return info, None


ATTACKS = {
    "parent traversal": [_file("model/manifest.json"), _file("model/../../evil.json")],
    "absolute path": [_file("/tmp/evil.json")],
    "symlink": [_link("model/manifest.json", "/etc/passwd", tarfile.SYMTYPE), _file("model/arrays.npz")],
    "hard link": [_file("model/arrays.npz"), _link("model/manifest.json", "/etc/passwd", tarfile.LNKTYPE)],
    "device": [_special("model/manifest.json", tarfile.CHRTYPE)],
    "fifo": [_special("model/arrays.npz", tarfile.FIFOTYPE)],
    "unexpected file": [_file("model/manifest.json"), _file("model/arrays.npz"), _file("model/run.sh", b"rm -rf /")],
    "unexpected folder": [_special("model/hooks", tarfile.DIRTYPE)],
    "duplicate member": [_file("model/manifest.json"), _file("model/manifest.json", b"[]")],
    "missing manifest": [_file("model/arrays.npz")],
    "oversized manifest": [_file("model/manifest.json", b" " * (2**20 + 1)), _file("model/arrays.npz")],
    "not a tar": None,
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_hostile_archives_are_refused_and_leave_nothing(attack, tmp_path):
    data = b"\x00garbage" * 100 if ATTACKS[attack] is None else _archive(ATTACKS[attack])
    with pytest.raises(ArtifactError):
        unpack_model(data, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no partial directory, nothing outside
    assert not (tmp_path.parent / "evil.json").exists()


def test_total_size_and_member_count_are_bounded(tmp_path):
    big = _archive([_file("model/manifest.json"), _file("model/arrays.npz", b"\x00" * 5000)])
    with pytest.raises(ArtifactError, match="more than"):
        unpack_model(big, tmp_path / "out", max_total_bytes=4000)
    many = _archive(
        [_file("model/manifest.json"), _file("model/arrays.npz")]
        + [_file(f"model/predictors/{k}.onnx", b"") for k in range(5000)]
    )
    with pytest.raises(ArtifactError):
        unpack_model(many, tmp_path / "out")


def test_generated_operations_code_is_up_to_date(tmp_path):
    spec = importlib.util.spec_from_file_location("msa_fed_proto_generate_ops", REPO / "protos" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    for name in ("operations_pb2.py", "operations_pb2.pyi", "operations_pb2_grpc.py"):
        committed = (REPO / "msa_fed" / "boundary" / "proto" / name).read_text()
        assert committed == (tmp_path / name).read_text(), f"{name} differs; rerun: python protos/generate.py"
