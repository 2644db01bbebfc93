"""Generated protobuf and gRPC code for the ``msa_fed.v1`` control-plane protocol.

Do not edit the ``registry_pb2*`` modules: they are written by
``protos/generate.py`` from ``protos/msa_fed/v1/registry.proto``.
"""
from msa_fed.control.proto import registry_pb2, registry_pb2_grpc

SERVICE_NAME = registry_pb2.DESCRIPTOR.services_by_name["Registry"].full_name

__all__ = ["registry_pb2", "registry_pb2_grpc", "SERVICE_NAME"]
