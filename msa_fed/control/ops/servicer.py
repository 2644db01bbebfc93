"""The ``msa_fed.v1.Operations`` servicer: parse, call :class:`~msa_fed.control.ops.service.Operations`, serialise.

Errors map to status codes through the registry servicer's one mapping (``_unary``).
"""

from __future__ import annotations

from msa_fed.boundary.proto import operations_pb2 as ops_pb
from msa_fed.boundary.proto import operations_pb2_grpc as ops_grpc
from msa_fed.control.ops.convert import job_to_pb, model_status_to_pb, site_status_to_pb
from msa_fed.control.ops.service import Operations
from msa_fed.control.registry.servicer import _unary


class OperationsServicer(ops_grpc.OperationsServicer):
    """gRPC face of :class:`Operations`; ``context.principal`` comes from the auth interceptor."""

    def __init__(self, operations: Operations):
        self.ops = operations

    @_unary
    def ListModels(self, request, context):
        records, current, promotions = self.ops.list_models(context.principal)
        return ops_pb.ListModelsResponse(
            models=[model_status_to_pb(r, current, promotions) for r in records], current_version=current or 0
        )

    @_unary
    def GetModel(self, request, context):
        record, current, promotions = self.ops.get_model(context.principal, request.version)
        return model_status_to_pb(record, current, promotions)

    @_unary
    def PromoteModel(self, request, context):
        self.ops.promote(context.principal, request.version, request.reason)
        record, current, promotions = self.ops.get_model(context.principal, request.version)
        return model_status_to_pb(record, current, promotions)

    @_unary
    def ListSiteStatus(self, request, context):
        return ops_pb.ListSiteStatusResponse(
            sites=[site_status_to_pb(s) for s in self.ops.site_statuses(context.principal)]
        )

    @_unary
    def DeregisterSite(self, request, context):
        return site_status_to_pb(self.ops.deregister(context.principal, request.name, request.reason))

    @_unary
    def StartJob(self, request, context):
        return job_to_pb(
            self.ops.start_job(context.principal, request.job_id, request.name, list(request.sites), request.topology)
        )

    @_unary
    def FinishJob(self, request, context):
        return job_to_pb(
            self.ops.finish_job(context.principal, request.job_id, request.status, request.model_version, request.error)
        )

    @_unary
    def ListJobs(self, request, context):
        jobs = self.ops.list_jobs(context.principal, request.limit)
        return ops_pb.ListJobsResponse(jobs=[job_to_pb(j) for j in jobs])

    @_unary
    def GetJob(self, request, context):
        return job_to_pb(self.ops.get_job(context.principal, request.job_id))

    @_unary
    def AppendJobLog(self, request, context):
        total, dropped = self.ops.append_job_log(context.principal, request.job_id, request.lines)
        return ops_pb.JobLog(total=total, dropped=dropped)

    @_unary
    def GetJobLog(self, request, context):
        lines, total, dropped = self.ops.job_log(context.principal, request.job_id, request.after, request.limit)
        return ops_pb.JobLog(
            lines=[ops_pb.JobLogLine(seq=s, time=t, text=x) for s, t, x in lines], total=total, dropped=dropped
        )
