"""The rules a site applies before it serves a job: the join's shape, the signed content, the
planned number of labelled-data queries, and the published samples it verifies models with.

Every function here refuses with one line naming the job (``ConfigError``, or ``PrivacyError``
under the rule it applies); :class:`msa_fed.site.chain.SiteApp` calls them in its chain's
``admit`` step.  The job's **content** (:func:`msa_fed.crypto.sealing.job_content`) is what the
consortium's job key signed for a sealed job, and what the site's operator approves (its digest).
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from msa_fed.boundary import messages as m
from msa_fed.crypto.sealing import job_content
from msa_fed.errors import ConfigError, PrivacyError
from msa_fed.privacy.memo import frozen_value
from msa_fed.privacy.policy import SitePolicy

#: the requests that spend the site's labelled-data queries a sealed job's content plans
PLANNED = ("dc_evaluate", "max_bound", "harm")
#: the largest published sample a site fetches to verify a domain model
MAX_SAMPLE_BYTES = 256 * 2**20


def sample_sha256(X: np.ndarray) -> str:
    """The sha256 of an unlabelled sample as the registry stores it (little-endian float32, C order);
    once per array for a frozen one (:func:`msa_fed.privacy.memo.frozen`: the job's samples as
    a host of several sites hands them to each)."""
    return frozen_value(np.asarray(X), "sample_sha256", _sample_sha256)


def _sample_sha256(X: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(X, dtype="<f4").data).hexdigest()


def job_key(job: str, digest: str) -> str:
    """``job@digest``: the job's id and (the start of) the digest of its content
    (:func:`msa_fed.crypto.sealing.job_content_digest`), the name the audit log and the ledger
    give one content of a job."""
    return f"{job}@{digest[:16]}"


def run_key(key: str) -> str:
    """The ledger's name for one run of a job (one join): per-job budgets count per run, so a
    monthly job starts each month with its per-job budgets, and the rolling-day budgets and the
    lifetime epsilon, counted over all runs, bound what repeated runs take."""
    return f"{key}#{os.urandom(4).hex()}"


def worker_policy_kwargs(policy: SitePolicy, job: m.JobSetup, job_id: str) -> dict:
    """Keyword arguments of :class:`msa_fed.site.worker.SiteWorker` that carry the site's policy
    for one job: the job's min_points can only tighten the policy's (the worker applies the
    stricter)."""
    return {"min_points": int(job.min_points), "policy": policy, "job_id": job_id, "sites": list(job.sites)}


def check_join(site: str, job: str, msg: m.JobSetup) -> None:
    """The join's own shape: this site at its index, one predictor per site, a known task."""
    sites = list(msg.sites)
    if not (0 <= msg.index < len(sites)) or sites[msg.index] != site:
        raise ConfigError(f"job {job!r} does not name site {site!r} at index {msg.index}")
    if len(msg.predictor_sha256) != len(sites) or len(set(sites)) != len(sites):
        raise ConfigError(f"job {job!r}: one predictor sha256 per site, each site once")
    if msg.task not in ("classification", "regression"):
        raise ConfigError(f"job {job!r}: unknown task {msg.task!r}")
    want_loss = "cross_entropy" if msg.task == "classification" else "squared"
    if msg.loss != want_loss:
        raise ConfigError(f"job {job!r}: loss {msg.loss!r} does not go with task {msg.task!r}")


def unsealed_content(job: str, msg: m.JobSetup) -> dict:
    """The content of an unsealed job, as far as its join says it (what an approval binds to)."""
    return job_content(
        job,
        [dict(name=n, predictor_sha256=sha) for n, sha in zip(msg.sites, msg.predictor_sha256)],
        task=msg.task,
        loss=msg.loss,
        min_points=msg.min_points,
    )


def check_join_content(site: str, own_sample_sha256: str, job: str, msg: m.JobSetup, content: dict) -> None:
    """ConfigError unless the join ``msg`` of a sealed job is the job its signed ``content`` says,
    and the content names this site with its own published sample (its key: checked when the seal
    was opened) and the predictors the join names."""
    sites = content.get("sites") or []
    names = [s.get("name") for s in sites]
    if names != list(msg.sites):
        raise ConfigError(f"job {job!r}: the join names sites {list(msg.sites)}, its signed content {names}")
    if [s.get("predictor_sha256") for s in sites] != list(msg.predictor_sha256):
        raise ConfigError(f"job {job!r}: the join's predictors are not those of its signed content")
    for key in ("task", "loss"):
        if content.get(key) != getattr(msg, key):
            raise ConfigError(f"job {job!r}: the join's {key} is not its signed content's")
    if content.get("min_points") is not None and int(content["min_points"]) != int(msg.min_points):
        raise ConfigError(f"job {job!r}: the join's min_points is not its signed content's")
    mine = sites[msg.index]
    if mine.get("sample_sha256") != own_sample_sha256:
        want = str(mine.get("sample_sha256"))[:16]
        raise ConfigError(
            f"job {job!r} expects site {site!r} to hold published sample {want}..., not {own_sample_sha256[:16]}..."
        )


def check_planned(site: str, job: str, method: str, content: dict | None, done: int) -> int:
    """The number of planned queries spent after ``method`` (``done`` before it): a sealed job's
    content names the most labelled-data queries it sends, and one more is refused."""
    if method not in PLANNED or content is None or content.get("planned_queries") is None:
        return done
    if done >= int(content["planned_queries"]):
        raise PrivacyError(
            "planned_queries",
            site,
            f"job {job!r} planned {content['planned_queries']} labelled-data queries and sent one more",
        )
    return done + 1


def host_content(job: str, names, samples, predictor_sha256=None, *, task: str, loss: str, min_points=None) -> dict:
    """The content of a job whose sites are given to their workers by a host (in-process, Ray and
    cluster topologies): the sites in order with the sha256 of each one's published sample
    (:func:`sample_sha256`), the digests the sites check the samples they are handed against."""
    shas = list(predictor_sha256) if predictor_sha256 is not None else [""] * len(names)
    return job_content(
        job,
        [
            dict(name=n, sample_sha256=X if isinstance(X, str) else sample_sha256(X), predictor_sha256=sha)
            for n, X, sha in zip(names, samples, shas)
        ],
        task=task,
        loss=loss,
        min_points=min_points,
    )


def checked_host_samples(site: str, index: int, samples, own: np.ndarray, content: dict | None, sites=None) -> tuple:
    """The job's published samples as a host hands them to the site (in-process, Ray and cluster
    topologies), checked by the site that will verify domain models with them: its own, at
    ``index``, must be the sample it holds, and with the job's ``content`` every sample must have
    the sha256 the content pins for its site (a host that swaps a peer's sample is refused, the
    peer named).  Without a content only the site's own sample is pinned."""
    samples = tuple(np.asarray(X, dtype=np.float64) for X in samples)
    if not (0 <= index < len(samples)) or not np.array_equal(samples[index], np.asarray(own, dtype=np.float64)):
        raise ConfigError(f"site {site!r}: the published samples given to it do not hold its own sample at {index}")
    if content is None:
        return samples
    pinned = content.get("sites") or []
    names = [str(s.get("name")) for s in pinned]
    if len(pinned) != len(samples) or (sites is not None and names != list(sites)):
        raise ConfigError(
            f"site {site!r}: the job's content names sites {names}, the samples given are for {len(samples)} sites"
        )
    mine = str(pinned[index].get("sample_sha256") or "")
    if mine != sample_sha256(own):
        raise ConfigError(
            f"site {site!r}: the job's content pins published sample {mine[:16]}... for this site, "
            f"which holds {sample_sha256(own)[:16]}..."
        )
    for k, (X, pin) in enumerate(zip(samples, pinned)):
        want, got = str(pin.get("sample_sha256") or ""), sample_sha256(X)
        if got != want:
            raise ConfigError(
                f"site {site!r} refuses the published sample of site {names[k]!r} it was given "
                f"({got[:16]}...): the job's content pins {want[:16] or 'none'}..."
            )
    return samples


def checked_sample(
    site: str,
    peer: str,
    data: bytes,
    *,
    registry_sha256: str,
    rows: int,
    cols: int,
    signed_sha256: str | None,
    own_sha256: str,
) -> np.ndarray:
    """A peer's published sample as fetched through the relay, checked by the site that will
    verify a domain model with it: its bytes must have the sha256 the registry recorded, and, for
    a sealed job, the sha256 its signed content pins for ``peer`` (so neither the registry nor
    the relay can hand in another sample); this site's own sample must be the one it published."""
    if len(data) > MAX_SAMPLE_BYTES:
        raise ConfigError(f"the sample of site {peer!r} is larger than {MAX_SAMPLE_BYTES >> 20} MiB")
    got = hashlib.sha256(data).hexdigest()
    if got != registry_sha256:
        raise ConfigError(f"the sample of site {peer!r} does not match its published sha256")
    if signed_sha256 is not None and got != signed_sha256:
        raise ConfigError(
            f"the sample of site {peer!r} ({got[:16]}...) is not the one the job's signed content pins "
            f"({str(signed_sha256)[:16]}...)"
        )
    if peer == site and got != own_sha256:
        raise ConfigError(f"the registry's sample of site {peer!r} is not the one this site published")
    if rows < 0 or cols < 0 or rows * cols * 4 != len(data):
        raise ConfigError(f"the sample of site {peer!r}: {len(data)} bytes do not make ({rows}, {cols})")
    return np.frombuffer(data, dtype="<f4").reshape(rows, cols).astype(np.float64)
