"""The job's side of the federated topology: the sites of a job whose sites run their own process.

:func:`relayed_sites` is called by :func:`msa_fed.jobs.run.run_job` for ``[run] topology =
"federated"``: it downloads every site's published unlabelled sample from the registry (pinned to
the sha256 the registry recorded) and opens the relay client with the job's admin token (and its
sealer, when the job is sealed); :func:`msa_fed.runtime.topology.make_backend` makes the backend
of them.
"""

from __future__ import annotations

import numpy as np

from msa_fed.errors import ConfigError
from msa_fed.federation.relay_client import RelayClient
from msa_fed.runtime.topology import RelayedSites


def relayed_sites(
    config, admin_token: str, client, names, records, predictor_sha256, classes, log=print
) -> RelayedSites:
    """The sites of a federated job (see the module docstring).

    config : the job's validated :class:`msa_fed.jobs.config.JobConfig` (registry, its TLS options,
        name, job_key, approval_wait_s), its sealing checked by ``run_job``.
    client : a :class:`msa_fed.control.registry.client.RegistryClient` with the admin token.
    records : {site name: SiteRecord} as listed by the registry.
    """
    samples = []
    for name in names:
        rec = records[name].sample
        if rec is None:
            raise ConfigError(
                f"site {name!r} has not published an unlabelled sample (msa-fed site publish "
                "--unlabeled ...); the federated topology trains the domain classifier on it"
            )
        X, _ = client.download_sample(name, expected_sha256=rec.sha256)
        samples.append(np.asarray(X, dtype=np.float64))
        log(f"  {name}: published unlabelled sample {X.shape[0]} x {X.shape[1]} (sha256 {rec.sha256[:12]}...)")
    loss = config.fit.loss
    sealer = job_sealer(config, names, records, predictor_sha256, loss, log=log) if config.job_key else None
    relay = RelayClient(config.registry, admin_token, sealer=sealer, **config.client_tls())
    return RelayedSites(
        list(names),
        relay,
        samples,
        job_id=config.name,
        predictor_sha256=list(predictor_sha256),
        classes=classes,
        approval_wait_s=float(config.approval_wait_s),
        echo=log,
    )


def job_sealer(config, names, records, predictor_sha256, loss: str, log=print):
    """The job's :class:`msa_fed.crypto.sealing.JobSealer`: its content (the sites with their
    pinned key fingerprints, published-sample and predictor digests, the model's options and the
    planned number of queries) signed by the consortium's job key; each site's public key as the
    registry lists it, accepted only with the fingerprint the job file pins."""
    from msa_fed.crypto.sealing import SEAL_KEY_LABEL, JobKey, JobSealer, SitePublicKey, job_content

    pins = config.seal_pins
    unpinned = [n for n in names if n not in pins]
    if unpinned:
        raise ConfigError(
            f'the job pins no sealing key for site(s) {", ".join(unpinned)}: add "NAME=SHA256" for each to '
            "[sealing] sites (the fingerprint the site's operator gives out: msa-fed site keygen / site "
            "register --seal-key), or leave the site out of [run] sites"
        )
    keys = {}
    for name in names:
        text = records[name].labels.get(SEAL_KEY_LABEL)
        if text:
            keys[name] = SitePublicKey.parse(text, f"the sealing key the registry lists for site {name!r}")
    fit = config.fit
    content = job_content(
        config.name,
        [
            dict(
                name=n,
                key_fingerprint=pins[n],
                sample_sha256=records[n].sample.sha256 if records[n].sample is not None else "",
                predictor_sha256=sha,
            )
            for n, sha in zip(names, predictor_sha256)
        ],
        task=fit.task,
        loss=loss,
        features=fit.features if isinstance(fit.features, (str, type(None))) else repr(fit.features),
        mu=fit.classifier.mu,
        objective=fit.solver.objective,
        planned_queries=config.planned_queries,
        min_points=fit.min_points,
    )
    key = JobKey.load(config.job_key)
    sealer = JobSealer(key, content, keys)
    log(f"  sealed end to end: job key {key.fingerprint[:16]}..., content digest {sealer.certificate.content_digest}")
    return sealer
