"""Combined models as the registry stores them: a model directory packed as a tar, unpacked safely.

The stored form (what ``Registry.UploadCombinedModel`` receives and ``DownloadCombinedModel``
returns) is an uncompressed POSIX tar with one top folder ``model/`` holding exactly the files
of the directory :meth:`msa_fed.CombinedModel.save` writes:

    model/manifest.json         the model's manifest (JSON)
    model/arrays.npz            numeric state (read with allow_pickle=False)
    model/predictors/<k>.onnx   the frozen predictors, k = 0 .. p-1

:func:`unpack_model` writes those files into a directory that :func:`msa_fed.load_model`
opens.  It trusts nothing in the archive: only the names above, only regular files and those
two folders (no links, devices or other types), no member twice, bounded member count and
sizes; the files are written by this code (never ``extractall``) into a fresh directory that is
renamed into place only after every member was checked.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from msa_fed.control.registry.client import RegistryClient
from msa_fed.control.registry.records import CombinedModelRecord
from msa_fed.errors import ArtifactError, ConfigError, RegistryError

TOP = "model"
_FILE_NAME = re.compile(r"^model/(manifest\.json|arrays\.npz|predictors/(0|[1-9][0-9]{0,3})\.onnx)$")
_DIRS = {"model", "model/predictors"}
MAX_MEMBERS = 1 + 1 + 2 + 4096
MAX_TOTAL_BYTES = 512 * 2**20  # the registry's max_combined_bytes
MAX_MANIFEST_BYTES = 2**20
RETRYABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")


def model_files(path) -> list[tuple[str, Path]]:
    """(archive name, file) of every file of the model directory ``path``, checked and sorted."""
    path = Path(path)
    if not (path / "manifest.json").is_file():
        raise ConfigError(f"{str(path)!r} is not a model directory: manifest.json is missing")
    files = [("model/manifest.json", path / "manifest.json"), ("model/arrays.npz", path / "arrays.npz")]
    pred_dir = path / "predictors"
    if pred_dir.is_dir():
        onnx = sorted(pred_dir.glob("*.onnx"), key=lambda p: (len(p.name), p.name))
        files += [(f"model/predictors/{p.name}", p) for p in onnx]
    for name, file in files:
        if file.is_symlink() or not file.is_file():
            raise ConfigError(f"{str(file)!r} must be a regular file (not a link) in a model directory")
        if not _FILE_NAME.match(name):
            raise ConfigError(f"{str(file)!r} is not a file name a model directory holds")
    return files


def pack_model(path) -> bytes:
    """The model directory ``path`` as the stored tar (deterministic: fixed order, times and owners)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(_DIRS):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, file in model_files(path):
            data = file.read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def unpack_model(data: bytes, out, *, max_total_bytes: int = MAX_TOTAL_BYTES) -> Path:
    """Write the stored tar ``data`` as a model directory at ``out`` (must not exist, or be empty)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {str(out)!r} already exists and is not an empty directory")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {str(out)!r}: folder {str(out.parent)!r} does not exist")
    if len(data) > max_total_bytes + 2**20:
        raise ArtifactError(f"combined model archive of {len(data)} bytes exceeds the limit of {max_total_bytes}")
    files: dict[str, bytes] = {}
    total = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for n, member in enumerate(tar):
                if n >= MAX_MEMBERS:
                    raise ArtifactError(f"combined model archive has more than {MAX_MEMBERS} members")
                name = member.name
                if member.isdir():
                    if name.rstrip("/") not in _DIRS:
                        raise ArtifactError(f"combined model archive: unexpected folder {name[:100]!r}")
                    continue
                if not member.isreg():
                    raise ArtifactError(
                        f"combined model archive: {name[:100]!r} is not a regular file (links and "
                        "special files are refused)"
                    )
                if not _FILE_NAME.match(name):
                    raise ArtifactError(f"combined model archive: unexpected member {name[:100]!r}")
                if name in files:
                    raise ArtifactError(f"combined model archive: {name!r} appears twice")
                total += member.size
                if total > max_total_bytes:
                    raise ArtifactError(f"combined model archive unpacks to more than {max_total_bytes} bytes")
                if name.endswith(".json") and member.size > MAX_MANIFEST_BYTES:
                    raise ArtifactError(f"combined model archive: {name!r} exceeds {MAX_MANIFEST_BYTES} bytes")
                fh = tar.extractfile(member)
                content = fh.read(member.size + 1) if fh is not None else b""
                if len(content) != member.size:
                    raise ArtifactError(f"combined model archive: {name!r} is truncated")
                files[name] = content
    except tarfile.TarError as exc:
        raise ArtifactError(f"combined model archive is not a readable tar: {exc}") from None
    for required in ("model/manifest.json", "model/arrays.npz"):
        if required not in files:
            raise ArtifactError(f"combined model archive lacks {required!r}")
    staging = Path(tempfile.mkdtemp(prefix=".msa-fed-unpack-", dir=out.parent))
    try:
        for name, content in files.items():
            target = staging / name[len(TOP) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def read_manifest(path) -> dict:
    path = Path(path) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{str(path)!r} is not a readable JSON manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "msa_fed.combined_model":
        raise ConfigError(f"{str(path)!r} is not the manifest of a msa_fed combined model")
    return manifest


def registry_manifest(model_manifest: dict) -> dict:
    """What the registry stores next to the bytes: the model's manifest plus the job fields it carries."""
    manifest = dict(model_manifest)
    job = (manifest.get("info") or {}).get("job") or {}
    if isinstance(job, dict):
        for key in ("job", "job_id", "output_version", "predictor_sha256"):
            if key in job:
                manifest[key] = job[key]
    return manifest


def upload_with_retry(
    connect: Callable[[], RegistryClient],
    data: bytes,
    manifest: dict,
    *,
    retry_for: float = 300.0,
    upload_id: str | None = None,
    log: Callable[[str], None] | None = None,
    sleep=time.sleep,
) -> CombinedModelRecord:
    """Upload a packed model, retrying transient failures with exponential backoff for ``retry_for`` seconds.

    Every attempt reuses one ``upload_id`` (the registry stores a retried upload once) and takes
    its connection from ``with connect() as client`` (a fresh one, or a job's SharedClient that
    reconnects once the registry was found away).  Raises the last
    :class:`RegistryError` when time runs out or the failure is not transient."""
    upload_id = upload_id or uuid.uuid4().hex
    deadline = time.monotonic() + max(0.0, retry_for)
    delay, attempt = 0.5, 0
    while True:
        attempt += 1
        try:
            with connect() as client:
                return client.upload_combined_model(data, manifest, upload_id=upload_id)
        except RegistryError as exc:
            left = deadline - time.monotonic()
            if exc.code not in RETRYABLE or left <= 0:
                exc.attempts = attempt  # type: ignore[attr-defined]
                raise
            wait = min(delay, left)
            if log is not None:
                log(
                    f"storing the model failed ({exc.code}); attempt {attempt + 1} in {wait:.1f} s "
                    f"({left:.0f} s of retries left)"
                )
            sleep(wait)
            delay = min(delay * 2, 15.0)
