"""Client of the ``msa_fed.v1.Operations`` service, over a :class:`RegistryClient`'s connection.

    with RegistryClient(address, admin_token, tls_ca="ca.pem") as client:
        ops = OpsClient(client)
        ops.list_models(); ops.promote(3, reason="v4 is poisoned"); ops.list_jobs()

Errors are :class:`msa_fed.errors.RegistryError` like the registry client's.
"""

from __future__ import annotations

from msa_fed.boundary.proto import operations_pb2 as ops_pb
from msa_fed.boundary.proto import operations_pb2_grpc as ops_grpc
from msa_fed.control.ops.convert import (
    job_from_pb,
    model_status_from_pb,
    site_status_from_pb,
)
from msa_fed.control.registry.client import RegistryClient
from msa_fed.control.registry.ops_records import JobRecord, SiteStatus


class OpsClient:
    def __init__(self, client: RegistryClient):
        self.client = client
        self._stub = ops_grpc.OperationsStub(client._channel)

    def _unary(self, method: str, request, retry: bool = True):
        return self.client._unary(getattr(self._stub, method), request, retry=retry)

    # models
    def list_models(self) -> tuple[list[dict], int]:
        """([{"record", "current", "promotions"}...] oldest first, the current version (0: none))."""
        resp = self._unary("ListModels", ops_pb.ListModelsRequest())
        return [model_status_from_pb(m) for m in resp.models], resp.current_version

    def get_model(self, version: int = 0) -> dict:
        return model_status_from_pb(self._unary("GetModel", ops_pb.GetModelRequest(version=version)))

    def promote(self, version: int, reason: str = "") -> dict:
        request = ops_pb.PromoteModelRequest(version=version, reason=reason)
        return model_status_from_pb(self._unary("PromoteModel", request))

    # sites
    def site_statuses(self) -> list[SiteStatus]:
        return [site_status_from_pb(s) for s in self._unary("ListSiteStatus", ops_pb.ListSiteStatusRequest()).sites]

    def deregister(self, name: str, reason: str = "") -> SiteStatus:
        request = ops_pb.OpsDeregisterSiteRequest(name=name, reason=reason)
        return site_status_from_pb(self._unary("DeregisterSite", request))

    # jobs
    def start_job(self, job_id: str, name: str, sites, topology: str) -> JobRecord:
        return job_from_pb(
            self._unary(
                "StartJob", ops_pb.StartJobRequest(job_id=job_id, name=name, sites=list(sites), topology=topology)
            )
        )

    def finish_job(self, job_id: str, status: str, model_version: int = 0, error: str = "") -> JobRecord:
        return job_from_pb(
            self._unary(
                "FinishJob",
                ops_pb.FinishJobRequest(job_id=job_id, status=status, model_version=model_version or 0, error=error),
            )
        )

    def list_jobs(self, limit: int = 0) -> list[JobRecord]:
        return [job_from_pb(j) for j in self._unary("ListJobs", ops_pb.ListJobsRequest(limit=limit)).jobs]

    def get_job(self, job_id: str) -> JobRecord:
        return job_from_pb(self._unary("GetJob", ops_pb.GetJobRequest(job_id=job_id)))

    def append_job_log(self, job_id: str, lines: list[str]) -> tuple[int, int]:
        """Store progress lines of a recorded job; (lines stored, lines dropped past the limit)."""
        got = self._unary("AppendJobLog", ops_pb.AppendJobLogRequest(job_id=job_id, lines=lines), retry=False)
        return int(got.total), int(got.dropped)

    def job_log(self, job_id: str, after: int = 0, limit: int = 0) -> tuple[list[tuple[int, float, str]], int, int]:
        """(lines (seq, time, text) with seq > ``after``, lines stored, lines dropped)."""
        got = self._unary("GetJobLog", ops_pb.GetJobLogRequest(job_id=job_id, after=after, limit=limit))
        return [(int(x.seq), float(x.time), x.text) for x in got.lines], int(got.total), int(got.dropped)
