"""What crosses a site's boundary, below the site, the runtime and the control plane: the
boundary messages (:mod:`~msa_fed.boundary.messages`), their one codec to and from protobuf
(:mod:`~msa_fed.boundary.wire`), the direct data channel that carries them between a
coordinator and a site actor (:mod:`~msa_fed.boundary.channel`), and all generated protobuf
and gRPC code (:mod:`msa_fed.boundary.proto`: the boundary schema and the registry,
operations and relay services)."""
