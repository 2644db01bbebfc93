"""Generated protobuf code of ``protos/msa_fed/v1/boundary.proto`` (the site boundary).

Do not edit ``boundary_pb2*``: they are written by ``protos/generate.py``.
"""
