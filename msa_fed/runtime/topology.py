"""One way to choose a topology: :func:`make_backend` returns the coordinator's backend for each.

============ ====================================================== =====================================
topology     the sites                                              backend
============ ====================================================== =====================================
``local``    :class:`~msa_fed.site.worker.SiteWorker` objects in    :class:`~msa_fed.runtime.local.LocalSites`
             this process (the API's ``runtime="local"``)
``ray``      SiteWorker actors, one per site (``runtime="ray"``)    :class:`~msa_fed.runtime.ray_sites.RaySites`
``cluster``  :class:`~msa_fed.site.deployed.DeployedSite` actors    RaySites of DeployedSite
             on each site's own node (a job's ``topology =
             "cluster"``)
``federated`` the sites' own processes through the registry's       :class:`~msa_fed.runtime.federated.FederatedSites`
             relay, their published samples on Ray stand-ins
             (a job's ``topology = "federated"``)
============ ====================================================== =====================================

The API (:func:`msa_fed.api.make_backend`) and the job (:func:`msa_fed.jobs.run.run_job`) both
call :func:`make_backend`; they differ only in how they describe their sites: keyword arguments
of each site's worker (local, ray, cluster) or :class:`RelayedSites` (federated).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from msa_fed.errors import ConfigError
from msa_fed.runtime.config import FitConfig

TOPOLOGIES = ("local", "ray", "cluster", "federated")


@dataclass(frozen=True)
class RelayedSites:
    """The sites of the federated topology, as the job found them in the registry.

    names : the job's sites, in order.
    relay : the relay client (``open_job``, ``call``, ``close_job``, ``close``); the backend
        owns it and closes it when it shuts down.
    samples : each site's published unlabelled sample, pinned to the sha256 the registry recorded.
    job_id : the job's id at the relay (the sites see it, and may have to approve it).
    predictor_sha256 : the sha256 of each site's published predictor, in site order.
    classes : the union of the predictors' classes (classification), else None.
    approval_wait_s : how long the job waits for the sites in approve mode to admit it.
    echo : where the lines for the job's operator go.
    """

    names: list[str]
    relay: Any
    samples: list
    job_id: str
    predictor_sha256: list[str]
    classes: Any = None
    approval_wait_s: float = 0.0
    echo: Callable[[str], None] = field(default=print, compare=False)


def make_backend(topology: str, fit: FitConfig, sites: list[dict] | RelayedSites):
    """The coordinator's backend for ``topology`` (see the module docstring).

    sites : local, ray: :class:`~msa_fed.site.worker.SiteWorker` keyword arguments per site;
        cluster: :class:`~msa_fed.site.deployed.DeployedSite` keyword arguments per site;
        federated: a :class:`RelayedSites`.
    """
    if topology not in TOPOLOGIES:
        raise ConfigError(f"topology must be one of {list(TOPOLOGIES)}; got {topology!r}")
    if (topology == "federated") != isinstance(sites, RelayedSites):
        want = "RelayedSites" if topology == "federated" else "a list of site keyword arguments"
        raise TypeError(f"the {topology} topology's sites are {want}; got {type(sites).__name__}")
    if isinstance(sites, RelayedSites):
        from msa_fed.runtime.federated import FederatedSites

        ray = fit.ray
        return FederatedSites(
            sites.names,
            sites.relay,
            sites.samples,
            job_id=sites.job_id,
            predictor_sha256=list(sites.predictor_sha256),
            task=fit.task,
            loss=fit.loss,
            classes=sites.classes,
            min_points=fit.min_points,
            site_timeout_s=fit.site_timeout_s,
            address=ray.address,
            data_channel=ray.data_channel,
            workers_per_site=ray.workers_per_site,
            num_cpus=ray.num_cpus,
            init_kwargs=dict(ray.init_kwargs),
            max_restarts=ray.max_restarts,
            approval_wait_s=sites.approval_wait_s,
            echo=sites.echo,
            owns_relay=True,
        )
    if topology == "local":
        from msa_fed.runtime.local import LocalSites

        return LocalSites(sites)
    from msa_fed.runtime.ray_sites import RaySites

    if topology == "ray":
        return RaySites(sites, fit.ray)
    from msa_fed.site.deployed import DeployedSite

    check_site_nodes([kw["name"] for kw in sites], fit)
    return RaySites(sites, fit.ray, worker_cls=DeployedSite)


def check_site_nodes(names: list[str], fit: FitConfig) -> None:
    """The cluster topology: every site's node carries the Ray resource ``site:<name>`` (a
    ConfigError naming the sites without one)."""
    from msa_fed.runtime.ray_actors import ensure_ray

    resources = ensure_ray(fit.ray.address, **fit.ray.init_kwargs).cluster_resources()
    absent = [n for n in names if f"site:{n}" not in resources]
    if absent:
        raise ConfigError(
            f"site(s) {', '.join(absent)} are registered but no Ray node carries the resource "
            + ", ".join(f"'site:{n}'" for n in absent)
            + "; start each site's node with "
            "ray start --resources='{\"site:<name>\": 1}'"
        )
