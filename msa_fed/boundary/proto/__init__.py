"""Generated protobuf and gRPC code of ``protos/msa_fed/v1/*.proto``: the site boundary
(``boundary_pb2``) and the registry, operations and relay services.

Do not edit the ``*_pb2*`` modules: they are written by ``protos/generate.py``.
"""

from msa_fed.boundary.proto import operations_pb2, operations_pb2_grpc, registry_pb2, registry_pb2_grpc

SERVICE_NAME = registry_pb2.DESCRIPTOR.services_by_name["Registry"].full_name
OPS_SERVICE_NAME = operations_pb2.DESCRIPTOR.services_by_name["Operations"].full_name

__all__ = [
    "operations_pb2",
    "operations_pb2_grpc",
    "registry_pb2",
    "registry_pb2_grpc",
    "OPS_SERVICE_NAME",
    "SERVICE_NAME",
]
