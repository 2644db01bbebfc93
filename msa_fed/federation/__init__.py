"""The federated topology: the site agent (``msa-fed site serve``) and the job's relay client.

A site runs :class:`msa_fed.federation.agent.SiteAgent` on its own machine: it holds the site's
labelled data, opens no listening socket, dials out to the registry and answers the job's
requests relayed on that connection (:mod:`msa_fed.control.relay`).  The job reaches the sites
through :class:`msa_fed.federation.relay_client.RelayClient`.
"""
