"""The requests a site answers, per host: the allowlists of its request chain.

Every host hands a request to the site through one entry point, ``site.handle(method, msg)``
(:meth:`msa_fed.site.published.ShardHost.handle`), which answers only the methods of the
site's own list for that host and refuses anything else in one line (rule ``methods``); the
site process adds its seal and admission around it (:class:`msa_fed.site.chain.SiteApp`).
Nothing here is taken from the job or the coordinator: the lists are the site's.
"""

from __future__ import annotations

from msa_fed.errors import PrivacyError

#: through the relay, to the site's own process (``msa-fed site serve``): aggregates over its
#: points and counts (:data:`msa_fed.site.chain.CHAIN`)
SITE_METHODS = frozenset(
    {"join_job", "info", "set_domain_model", "set_qhat", "dc_evaluate", "max_bound", "harm", "ping"}
)
#: what every holder of published rows answers (gradient sums over them, liveness, the data channel)
SHARD_METHODS = frozenset({"setup_shard", "classifier_loss_grad", "ping", "open_channel"})
#: the published half of a site: its unlabelled sample, whole or by rows, and the shard on it
PUBLISHED_METHODS = SHARD_METHODS | {"unlabeled_sample", "unlabeled_rows", "info"}
#: a site run by the job's own host (in-process, or an actor on the site's Ray node): the
#: labelled half's requests (the gate table's rows), the published half, and the host's
#: hand-over of the job's published samples (it joins no job: its host made it for one)
HOST_METHODS = (SITE_METHODS - {"join_job"}) | PUBLISHED_METHODS | {"set_published"}
#: a helper of a site's classifier shard (rows of the published sample sent by the site)
HELPER_METHODS = SHARD_METHODS | {"load_rows"}


def check(site: str, method: str, allowed: frozenset) -> None:
    """PrivacyError (rule ``methods``) unless ``allowed`` lists ``method``."""
    if method not in allowed:
        raise PrivacyError(
            "methods", site, f"{str(method)[:64]!r}: it does not answer it here (it answers {sorted(allowed)})"
        )


def answer(site, method: str, msg, allowed: frozenset):
    """``site``'s answer to ``method`` (its public method of that name), if ``allowed`` lists it;
    PrivacyError (rule ``methods``) otherwise."""
    check(str(getattr(site, "name", "?")), method, allowed)
    return getattr(site, method)(msg)
