"""Generate the Python code for ``protos/msa_fed/v1/*.proto``.

Usage (from the repository root)::

    .venv/bin/python protos/generate.py            # writes msa_fed/boundary/proto/
    .venv/bin/python protos/generate.py --out DIR  # writes DIR/ (used by the check test)

The generated files are committed.  ``tests/control/test_control_proto.py``
regenerates them into a temporary folder and fails on any difference, so edit
the ``.proto`` and rerun this script; never edit the output by hand.

protoc names the modules after the proto path (``msa_fed/v1/registry_pb2.py``);
this script moves them into ``msa_fed.boundary.proto`` (one package for all of them,
below the site, the runtime and the control plane: ``boundary.proto``, the messages that
may cross a site's boundary, and the registry, operations and relay services, which import
it) and rewrites the cross-module imports accordingly.
"""

from __future__ import annotations

import argparse
import importlib.resources
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
DEFAULT_OUT = REPO_ROOT / "msa_fed" / "boundary" / "proto"
PROTO_PACKAGE_DIR = "msa_fed/v1"
TARGET_PACKAGE = "msa_fed.boundary.proto"
#: protos that declare no service: no gRPC stub module is written for them
NO_SERVICES = {"boundary"}
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """The ``.proto`` sources, sorted so the output does not depend on listing order."""
    return sorted((PROTO_ROOT / PROTO_PACKAGE_DIR).glob("*.proto"))


def generate(out_dir: Path = DEFAULT_OUT) -> list[Path]:
    """Compile every proto into ``out_dir``; return the files written."""
    from grpc_tools import protoc  # test-only dependency (grpcio-tools)

    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        sources = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
        argv = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *sources,
        ]
        rc = protoc.main(argv)
        if rc != 0:
            raise SystemExit(f"error: protoc failed with status {rc}")
        generated_pkg = Path(tmp) / PROTO_PACKAGE_DIR
        old_import = "from " + PROTO_PACKAGE_DIR.replace("/", ".") + " import "
        for path in sorted(generated_pkg.iterdir()):
            if not path.name.endswith(SUFFIXES):
                continue
            text = path.read_text()
            text = text.replace(old_import, f"from {TARGET_PACKAGE} import ")
            stem = path.name.split("_pb2")[0]
            if stem in NO_SERVICES and path.name.endswith("_pb2_grpc.py"):
                continue  # a schema without services: no stub module
            target = out_dir / path.name
            target.write_text(text)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
