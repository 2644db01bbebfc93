"""Conversion between operations records and ``msa_fed.v1`` Operations messages (both directions)."""

from __future__ import annotations

from msa_fed.boundary.proto import operations_pb2 as ops_pb
from msa_fed.control.registry.convert import combined_from_pb, combined_to_pb, record_from_pb, record_to_pb
from msa_fed.control.registry.ops_records import (
    DeregistrationRecord,
    JobRecord,
    PromotionRecord,
    SiteStatus,
)
from msa_fed.control.registry.records import CombinedModelRecord


def promotion_to_pb(rec: PromotionRecord) -> ops_pb.Promotion:
    return record_to_pb(ops_pb.Promotion, rec)


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
        "promotions": [record_from_pb(PromotionRecord, p, after_version=0) for p in msg.promotions],
    }


def site_status_to_pb(s: SiteStatus) -> ops_pb.SiteStatus:
    msg = record_to_pb(ops_pb.SiteStatus, s)  # connected None: left unset
    msg.registered = s.registered
    if s.deregistration is not None:
        msg.deregistered_at = s.deregistration.deregistered_at
        msg.deregistered_by = s.deregistration.deregistered_by
        msg.deregistration_reason = s.deregistration.reason
    return msg


def site_status_from_pb(msg: ops_pb.SiteStatus) -> SiteStatus:
    dereg = None
    if msg.deregistered_at:
        dereg = DeregistrationRecord(msg.name, msg.deregistered_at, msg.deregistered_by, msg.deregistration_reason)
    return record_from_pb(
        SiteStatus,
        msg,
        registered_at=msg.registered_at if msg.registered else None,
        deregistration=dereg,
        connected=msg.connected if msg.HasField("connected") else None,
    )


def job_to_pb(j: JobRecord) -> ops_pb.JobInfo:
    return record_to_pb(ops_pb.JobInfo, j)


def job_from_pb(m: ops_pb.JobInfo) -> JobRecord:
    return record_from_pb(JobRecord, m)
