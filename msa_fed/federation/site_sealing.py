"""The site process's side of sealed jobs: its opener, and the checks of a job's signed content.

A site serves sealed jobs only: ``seal_key`` and ``job_keys`` in site.toml
(:mod:`msa_fed.federation.config`), or else ``allow_unsealed = true``, the operator's explicit
choice to let the registry read (and so forge) the job's traffic.  A site with ``seal_key``:
every request must be sealed for it by a job whose certificate is signed by a job key it pins
(``job_keys``), and the job's joining request must agree with the content the certificate
signs (its sites, their key fingerprints, this site's published sample and predictor).  What the
site approves (``msa-fed site approve``) is that content's digest.
"""

from __future__ import annotations

from msa_fed.crypto.sealing import SiteKey, SiteOpener
from msa_fed.errors import ConfigError

#: what a site without a sealing key is told to do (one line, with the keys to set)
NO_SEAL_KEY = (
    "site {name!r} holds no sealing key, and a site serves sealed jobs only: create one with "
    "'msa-fed site keygen --out site.key', register its public half ('msa-fed site register ... "
    "--seal-key site.key.pub'), and set seal_key and job_keys in site.toml; or set "
    "allow_unsealed = true there to serve unsealed jobs, which the registry can read and forge"
)


def sealing_opener(config, book=None, ledger=None) -> SiteOpener | None:
    """The site's :class:`SiteOpener`, or None when site.toml says ``allow_unsealed = true``
    (ConfigError when it names neither a ``seal_key`` nor that).  The last request each sealed
    job sent is on disk before the site answers it (a restarted site process refuses it and every
    earlier one): with a ``ledger`` file (:class:`msa_fed.privacy.ledger.Ledger`) there, in the
    same commit as the request's audit record (and read back together with what ``book``, the
    site's :class:`msa_fed.site.job_book.JobBook`, kept before); else in ``book``, a commit of its own."""
    if not getattr(config, "seal_key", None):
        if not getattr(config, "allow_unsealed", False):
            raise ConfigError("site config: " + NO_SEAL_KEY.format(name=config.name))
        return None
    key = SiteKey.load(config.seal_key)
    if ledger is not None and getattr(ledger, "path", "") not in ("", ":memory:"):
        mine = f"{config.name}:"  # a ledger file may be another site's too: its floors are per site

        def floor(digest: str) -> int:
            return max(ledger.seal_floor(mine + digest), book.seal_floor(digest) if book is not None else 0)

        return SiteOpener(
            config.name,
            key,
            config.job_keys,
            floor=floor,
            remember=lambda digest, seq: ledger.keep_floor(mine + digest, seq),
            settle=lambda digest, seq: ledger.floor_kept(mine + digest, seq),
        )
    if book is None:
        return SiteOpener(config.name, key, config.job_keys)
    return SiteOpener(config.name, key, config.job_keys, floor=book.seal_floor, remember=book.set_seal_floor)
