"""Conversion between registry records and ``msa_fed.v1`` protobuf messages (both directions)."""

from __future__ import annotations

import json

from msa_fed.boundary.proto import registry_pb2 as pb
from msa_fed.control.registry.records import (
    KIND_PREDICTOR,
    ArtifactRecord,
    CombinedModelRecord,
    SiteRecord,
)


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


def combined_to_pb(record: CombinedModelRecord) -> pb.CombinedModelInfo:
    return pb.CombinedModelInfo(
        version=record.version,
        upload_id=record.upload_id,
        sha256=record.sha256,
        size=record.size,
        manifest_json=record.manifest_json,
        created_at=record.created_at,
        created_by=record.created_by,
    )


def combined_from_pb(msg: pb.CombinedModelInfo) -> CombinedModelRecord:
    return CombinedModelRecord(
        msg.version, msg.upload_id, msg.sha256, msg.size, msg.manifest_json, msg.created_by, msg.created_at
    )
