"""Conversion between operations records and ``msa_fed.v1`` Operations messages (both directions)."""

from __future__ import annotations

from msa_fed.boundary.proto import operations_pb2 as ops_pb
from msa_fed.control.registry.convert import combined_from_pb, combined_to_pb
from msa_fed.control.registry.ops_records import (
    DeregistrationRecord,
    JobRecord,
    PromotionRecord,
    SiteStatus,
)
from msa_fed.control.registry.records import CombinedModelRecord


def promotion_to_pb(rec: PromotionRecord) -> ops_pb.Promotion:
    return ops_pb.Promotion(
        version=rec.version, promoted_at=rec.promoted_at, promoted_by=rec.promoted_by, reason=rec.reason
    )


def model_status_to_pb(record: CombinedModelRecord, current: int | None, promotions) -> ops_pb.ModelStatus:
    return ops_pb.ModelStatus(
        model=combined_to_pb(record),
        current=record.version == current,
        promotions=[promotion_to_pb(p) for p in promotions if p.version == record.version],
    )


def model_status_from_pb(msg: ops_pb.ModelStatus) -> dict:
    """{"record": CombinedModelRecord, "current": bool, "promotions": [PromotionRecord]}."""
    return {
        "record": combined_from_pb(msg.model),
        "current": msg.current,
        "promotions": [PromotionRecord(p.version, 0, p.promoted_at, p.promoted_by, p.reason) for p in msg.promotions],
    }


def site_status_to_pb(s: SiteStatus) -> ops_pb.SiteStatus:
    msg = ops_pb.SiteStatus(
        name=s.name,
        token=s.token,
        token_revoked_at=s.token_revoked_at or 0.0,
        registered=s.registered,
        registered_at=s.registered_at or 0.0,
        last_heartbeat=s.last_heartbeat or 0.0,
        predictor_sha256=s.predictor_sha256 or "",
        sample_sha256=s.sample_sha256 or "",
    )
    if s.deregistration is not None:
        msg.deregistered_at = s.deregistration.deregistered_at
        msg.deregistered_by = s.deregistration.deregistered_by
        msg.deregistration_reason = s.deregistration.reason
    if s.connected is not None:
        msg.connected = s.connected
    return msg


def site_status_from_pb(msg: ops_pb.SiteStatus) -> SiteStatus:
    dereg = None
    if msg.deregistered_at:
        dereg = DeregistrationRecord(msg.name, msg.deregistered_at, msg.deregistered_by, msg.deregistration_reason)
    return SiteStatus(
        name=msg.name,
        token=msg.token,
        token_revoked_at=msg.token_revoked_at or None,
        registered_at=msg.registered_at if msg.registered else None,
        last_heartbeat=msg.last_heartbeat or None,
        deregistration=dereg,
        connected=msg.connected if msg.HasField("connected") else None,
        predictor_sha256=msg.predictor_sha256 or None,
        sample_sha256=msg.sample_sha256 or None,
    )


def job_to_pb(j: JobRecord) -> ops_pb.JobInfo:
    return ops_pb.JobInfo(
        job_id=j.job_id,
        name=j.name,
        sites=list(j.sites),
        topology=j.topology,
        status=j.status,
        started_at=j.started_at,
        ended_at=j.ended_at or 0.0,
        model_version=j.model_version or 0,
        error=j.error,
        started_by=j.started_by,
    )


def job_from_pb(m: ops_pb.JobInfo) -> JobRecord:
    return JobRecord(
        job_id=m.job_id,
        name=m.name,
        sites=tuple(m.sites),
        topology=m.topology,
        status=m.status,
        started_at=m.started_at,
        started_by=m.started_by,
        ended_at=m.ended_at or None,
        model_version=m.model_version or None,
        error=m.error,
    )
