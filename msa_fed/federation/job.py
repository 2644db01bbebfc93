"""The job's side of the federated topology: the backend of a job whose sites run their own process.

:func:`federated_backend` is called by :func:`msa_fed.jobs.run.run_job` for ``[run] topology =
"federated"``: it downloads every site's published unlabelled sample from the registry (pinned to
the sha256 the registry recorded), and returns a :class:`msa_fed.runtime.federated.FederatedSites`
talking to the sites through the registry's relay with the job's admin token.
"""

from __future__ import annotations

import time

import numpy as np

from msa_fed.control.relay import JOB_ID_PATTERN
from msa_fed.errors import ConfigError, PrivacyError
from msa_fed.federation.relay_client import RelayClient
from msa_fed.runtime.federated import FederatedSites

#: how often a job waiting for a site's approval asks again (seconds)
APPROVAL_POLL_S = 2.0


class _JobSites(FederatedSites):
    """:class:`FederatedSites` that waits up to ``approval_wait_s`` for the sites in approve mode
    to admit the job, and closes its relay connection when the job ends."""

    approval_wait_s = 0.0
    log = staticmethod(print)

    def start(self, recorder=None, setup_log=None):
        deadline = time.monotonic() + self.approval_wait_s
        told: set[str] = set()
        while True:
            try:
                return super().start(recorder, setup_log)
            except PrivacyError as exc:
                if exc.rule != "accept_jobs":
                    raise
                site = exc.site or "?"
                command = f"msa-fed site approve {self.job_id} --config site.toml"
                if time.monotonic() + APPROVAL_POLL_S > deadline:
                    raise PrivacyError(  # one argument: the line is the message as written
                        f"site {site} serves only the jobs its operator approves, and job {self.job_id} was not "
                        f"approved within {self.approval_wait_s:g} s ([run] approval_wait_s). On that site's "
                        f"machine run: {command}; then rerun the job",
                    ) from None
                if site not in told:
                    told.add(site)
                    self.log(
                        f"site {site}: waits for its operator to approve job {self.job_id} (up to "
                        f"{self.approval_wait_s:g} s); on that site's machine run: {command}"
                    )
                time.sleep(APPROVAL_POLL_S)

    def transcript(self) -> dict | None:
        """The sites' signed answers of a sealed job (:meth:`JobSealer.record`), else None."""
        sealer = getattr(self.relay, "sealer", None)
        return None if sealer is None else sealer.record()

    def shutdown(self):
        try:
            super().shutdown()
        finally:
            self.relay.close()


def check_job_name(name: str) -> None:
    """A federated job's name is its id at the registry's relay: a ConfigError unless it is one."""
    if not JOB_ID_PATTERN.match(name):
        raise ConfigError(
            f"job name {name!r} is the job's id at the registry's relay (sites approve jobs by "
            "it): use 1-128 letters, digits, '_', '.', ':' or '-'"
        )


def federated_backend(
    config, admin_token: str, client, names, records, predictor_sha256, classes, loss: str, log=print
) -> FederatedSites:
    """The backend of a federated job (see the module docstring).

    config : the job's :class:`msa_fed.jobs.config.JobConfig` (registry, tls_ca, insecure, name, and
        of its fit: task, min_points, site_timeout_s and the Ray options of the stand-in actors).
    client : a :class:`msa_fed.control.client.RegistryClient` with the admin token.
    records : {site name: SiteRecord} as listed by the registry.
    """
    check_job_name(config.name)
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
    config.check_sealed()
    sealer = job_sealer(config, names, records, predictor_sha256, loss, log=log) if config.job_key else None
    relay = RelayClient(config.registry, admin_token, sealer=sealer, **config.client_tls())
    fit = config.fit
    sites = _JobSites(
        names,
        relay,
        samples,
        job_id=config.name,
        predictor_sha256=list(predictor_sha256),
        task=fit.task,
        loss=loss,
        classes=classes,
        min_points=fit.min_points,
        site_timeout_s=fit.site_timeout_s,
        address=fit.ray.address,
        data_channel=fit.ray.data_channel,
        workers_per_site=fit.ray.workers_per_site,
        num_cpus=fit.ray.num_cpus,
        init_kwargs=dict(fit.ray.init_kwargs),
        max_restarts=fit.ray.max_restarts,
    )
    sites.approval_wait_s, sites.log = float(config.approval_wait_s), log
    return sites


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
