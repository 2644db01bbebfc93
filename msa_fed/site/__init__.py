"""What a site does, in one place, below the runtime and the control plane.

- :mod:`msa_fed.site.worker`: :class:`~msa_fed.site.worker.SiteWorker`, the site itself: its
  labelled data behind its privacy policy (:mod:`msa_fed.privacy`), the sums it answers;
- :mod:`msa_fed.site.published`: the published half (the unlabelled sample and the classifier
  shard trained on it), served by the site, by its stand-in in the federated topology
  (:class:`~msa_fed.site.published.PublishedSample`) and by its helper workers
  (:class:`~msa_fed.site.published.ShardWorker`); :mod:`msa_fed.site.shards`, the row blocks;
- :mod:`msa_fed.site.policy`: the policy the site's host hands in (the site's own process, or
  a Ray actor that reads its node's policy file);
- :mod:`msa_fed.site.data`: the site's private data on its own node;
  :mod:`msa_fed.site.deployed`: a cluster site (data and predictors from its node and the
  registry's ONNX artifacts);
- :mod:`msa_fed.site.job_book`: the jobs a site process was asked to serve;
- :mod:`msa_fed.site.chain`: the site process's one request chain (open the seal, the
  allowlist, admission, the gate, the body, the audit record, the sealed answer), with
  :mod:`msa_fed.site.admission` (the rules of joining a job) and :mod:`msa_fed.site.methods`
  (what a site answers to each host, through its one entry point ``handle``).

The site process's transport loop (the relay's stream) is :mod:`msa_fed.federation.agent`;
docs/SITE_REVIEW.md is the reviewer's guide to all of it.
"""
