"""Generate the Python code for ``protos/msa_fed/v1/*.proto``.

Usage (from the repository root)::

    .venv/bin/python protos/generate.py            # writes msa_fed/control/proto/ and msa_fed/runtime/proto/
    .venv/bin/python protos/generate.py --out DIR  # writes DIR/ and DIR/runtime_proto/ (used by the check test)

The generated files are committed.  ``tests/control/test_control_proto.py``
regenerates them into a temporary folder and fails on any difference, so edit
the ``.proto`` and rerun this script; never edit the output by hand.

protoc names the modules after the proto path (``msa_fed/v1/registry_pb2.py``);
this script moves them into their packages and rewrites the cross-module imports
accordingly: ``boundary.proto`` (the messages that may cross a site's boundary,
used by the runtime's codec) goes to ``msa_fed.runtime.proto``, the others (the
registry and its relay, which import it) to ``msa_fed.control.proto``.
"""

from __future__ import annotations

import argparse
import importlib.resources
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
DEFAULT_OUT = REPO_ROOT / "msa_fed" / "control" / "proto"
DEFAULT_RUNTIME_OUT = REPO_ROOT / "msa_fed" / "runtime" / "proto"
PROTO_PACKAGE_DIR = "msa_fed/v1"
TARGET_PACKAGE = "msa_fed.control.proto"
#: protos whose code goes to the runtime layer (below control: the runtime may not import control)
RUNTIME_PROTOS = {"boundary": "msa_fed.runtime.proto"}
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """The ``.proto`` sources, sorted so the output does not depend on listing order."""
    return sorted((PROTO_ROOT / PROTO_PACKAGE_DIR).glob("*.proto"))


def generate(out_dir: Path = DEFAULT_OUT, runtime_out: Path | None = None) -> list[Path]:
    """Compile every proto; return the files written.

    Control-plane modules go to ``out_dir``, those of :data:`RUNTIME_PROTOS` to ``runtime_out``
    (default: ``msa_fed/runtime/proto`` with the default ``out_dir``, else ``out_dir/runtime_proto``).
    """
    if runtime_out is None:
        runtime_out = DEFAULT_RUNTIME_OUT if Path(out_dir) == DEFAULT_OUT else Path(out_dir) / "runtime_proto"
    runtime_out.mkdir(parents=True, exist_ok=True)
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
            for stem, package in RUNTIME_PROTOS.items():
                text = text.replace(f"{old_import}{stem}_pb2", f"from {package} import {stem}_pb2")
            text = text.replace(old_import, f"from {TARGET_PACKAGE} import ")
            stem = path.name.split("_pb2")[0]
            if stem in RUNTIME_PROTOS and path.name.endswith("_pb2_grpc.py"):
                continue  # a schema without services: no stub module
            target = (runtime_out if stem in RUNTIME_PROTOS else out_dir) / path.name
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
