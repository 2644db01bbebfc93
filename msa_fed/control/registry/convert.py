"""Conversion between registry records and ``msa_fed.v1`` protobuf messages (both directions)."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, TypeVar

from msa_fed.boundary.proto import registry_pb2 as pb
from msa_fed.control.registry.records import (
    KIND_PREDICTOR,
    ArtifactRecord,
    CombinedModelRecord,
    SiteRecord,
)

M = TypeVar("M")
R = TypeVar("R")


def artifact_to_pb(record: ArtifactRecord) -> pb.ArtifactInfo:
    msg = pb.ArtifactInfo(
        site=record.site,
        upload_id=record.upload_id,
        kind=record.kind,
        sha256=record.sha256,
        size=record.size,
        created_at=record.created_at,
    )
    if record.kind == KIND_PREDICTOR:
        classes = record.meta.get("classes")
        msg.predictor.CopyFrom(
            pb.PredictorMeta(
                output_kind=record.meta["output_kind"],
                n_features=record.meta["n_features"],
                classes_json=json.dumps(classes) if classes is not None else "",
            )
        )
    else:
        msg.sample.CopyFrom(
            pb.SampleMeta(rows=record.meta["rows"], cols=record.meta["cols"], dtype=record.meta["dtype"])
        )
    return msg


def artifact_from_pb(msg: pb.ArtifactInfo) -> ArtifactRecord:
    if msg.WhichOneof("meta") == "predictor":
        p = msg.predictor
        meta = {
            "output_kind": p.output_kind,
            "n_features": p.n_features,
            "classes": json.loads(p.classes_json) if p.classes_json else None,
        }
    else:
        s = msg.sample
        meta = {"rows": s.rows, "cols": s.cols, "dtype": s.dtype}
    return ArtifactRecord(msg.site, msg.upload_id, msg.kind, msg.sha256, msg.size, meta, msg.created_at)


def site_to_pb(site: SiteRecord) -> pb.SiteInfo:
    msg = pb.SiteInfo(
        name=site.name,
        registered_at=site.registered_at,
        last_heartbeat=site.last_heartbeat or 0.0,
        labels=site.labels,
    )
    if site.predictor is not None:
        msg.predictor.CopyFrom(artifact_to_pb(site.predictor))
    if site.sample is not None:
        msg.sample.CopyFrom(artifact_to_pb(site.sample))
    return msg


def site_from_pb(msg: pb.SiteInfo) -> SiteRecord:
    return SiteRecord(
        name=msg.name,
        registered_at=msg.registered_at,
        last_heartbeat=msg.last_heartbeat or None,
        labels=dict(msg.labels),
        predictor=artifact_from_pb(msg.predictor) if msg.HasField("predictor") else None,
        sample=artifact_from_pb(msg.sample) if msg.HasField("sample") else None,
    )


def record_to_pb(message: type[M], record) -> M:
    """A ``message`` of the record's fields of the same names (None: the field's zero value)."""
    names = message.DESCRIPTOR.fields_by_name  # type: ignore[attr-defined]
    values = {f.name: getattr(record, f.name) for f in fields(record) if f.name in names}
    return message(**{k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if v is not None})


def record_from_pb(record: type[R], msg, **given: Any) -> R:
    """A ``record`` of the message's fields of the same names (a tuple field: the repeated field's
    items; the zero value of an optional field: None), and ``given``."""
    values = dict(given)
    for f in fields(record):  # type: ignore[arg-type]
        if f.name not in values:
            value = getattr(msg, f.name)
            value = tuple(value) if str(f.type).startswith("tuple") else value
            values[f.name] = None if not value and "None" in str(f.type) else value
    return record(**values)


def combined_to_pb(record: CombinedModelRecord) -> pb.CombinedModelInfo:
    return record_to_pb(pb.CombinedModelInfo, record)


def combined_from_pb(msg: pb.CombinedModelInfo) -> CombinedModelRecord:
    return record_from_pb(CombinedModelRecord, msg)
