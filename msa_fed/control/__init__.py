"""The gRPC control plane: the site registry, the operations service, the job relay.

Bottom to top (tests/test_layers.py holds the order):

- :mod:`~msa_fed.control.transport`: addresses, the one channel builder and its TLS rules;
- :mod:`~msa_fed.control.registry`: sites, tokens, artifacts, samples and their store, the
  registry's gRPC servicer and its client (:class:`~msa_fed.control.registry.client.RegistryClient`);
- :mod:`~msa_fed.control.ops`: jobs, model versions and site status over the registry's store,
  its servicer, client and commands;
- the server side: :mod:`~msa_fed.control.auth` (every call authenticated), :mod:`~msa_fed.control.audit`,
  :mod:`~msa_fed.control.relay` (job traffic to the sites), :mod:`~msa_fed.control.server`, and the
  registry's commands (:mod:`~msa_fed.control.cli`).

See ``docs/CONTROL_PLANE.md`` for the CLI, authentication, TLS and storage.
"""
