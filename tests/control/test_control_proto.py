"""The committed generated code equals what protos/generate.py produces now."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "msa_fed" / "boundary" / "proto"


def load_generator():
    spec = importlib.util.spec_from_file_location("msa_fed_proto_generate", REPO / "protos" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_up_to_date(tmp_path):
    written = load_generator().generate(tmp_path)
    names = sorted(p.name for p in written)
    assert names == [
        "boundary_pb2.py",
        "boundary_pb2.pyi",
        "operations_pb2.py",
        "operations_pb2.pyi",
        "operations_pb2_grpc.py",
        "registry_pb2.py",
        "registry_pb2.pyi",
        "registry_pb2_grpc.py",
        "relay_pb2.py",
        "relay_pb2.pyi",
        "relay_pb2_grpc.py",
    ]
    committed = sorted(p.name for p in COMMITTED.glob("*_pb2*"))
    assert committed == names, "generated files were added or removed; rerun protos/generate.py"
    for path in written:
        assert (COMMITTED / path.name).read_text() == path.read_text(), (
            f"{path.name} differs; rerun: python protos/generate.py"
        )


def test_generated_stub_imports_from_the_package():
    text = (COMMITTED / "registry_pb2_grpc.py").read_text()
    assert "from msa_fed.boundary.proto import registry_pb2" in text
    assert "\nimport registry_pb2" not in text
