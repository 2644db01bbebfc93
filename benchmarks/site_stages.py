"""``msa-fed site serve`` with the thread CPU of each stage of a request's chain counted.

    python benchmarks/site_stages.py OUT.json -- PYTHON -m msa_fed.cli site serve --config site.toml

The launcher prefix of :func:`bench_relay_round.measure` with ``--stages``: runs the site command
that follows ``--`` in this process (its interpreter and ``-m msa_fed.cli`` dropped), with each
stage of the site's request chain wrapped in a timer of its thread's CPU (``time.thread_time``),
and at exit writes ``{stage: [calls, CPU seconds]}`` to ``OUT.json``, counted since the last SIGUSR1
(the bench sends one after its warm-up rounds).  The
stages nest (``answer`` holds ``open``, ``chain``, ``seal``; ``chain`` holds ``dc_evaluate``; ...;
``chain[METHOD]`` is the chain by request method);
what a request costs outside ``answer`` (gRPC's threads, the hand-offs between them) is the
process's CPU less the sum of ``answer``.
"""

from __future__ import annotations

import atexit
import json
import signal
import sys
import threading
import time

#: (module, class, method, stage name): the chain's stages, outermost first
STAGES = (
    ("msa_fed.federation.agent", "SiteAgent", "answer", "answer"),
    ("msa_fed.crypto.sealing", "SiteOpener", "open", "open"),
    ("msa_fed.site.job_book", "JobBook", "set_seal_floor", "open.seal_floor"),  # a site without a ledger file
    ("msa_fed.privacy.ledger", "Ledger", "keep_floor", "open.seal_floor"),  # noted; committed with the record
    ("msa_fed.site.chain", "SiteApp", "_answer", "chain"),
    ("msa_fed.site.worker", "SiteWorker", "dc_evaluate", "chain.dc_evaluate"),
    ("msa_fed.core.dc_terms", "PointSet", "evaluate", "chain.dc_evaluate.sums"),
    ("msa_fed.privacy.ledger", "Ledger", "hold", "chain.dc_evaluate.ledger_hold"),
    ("msa_fed.privacy.audit", "AuditLog", "append", "chain.audit_record"),
    ("msa_fed.privacy.ledger", "Ledger", "commit", "chain.audit_record.ledger_commit"),
    ("msa_fed.boundary.wire", None, "from_proto", "chain.decode"),
    ("msa_fed.boundary.wire", None, "to_proto", "chain.encode"),
    ("msa_fed.crypto.sealing", "SiteOpener", "seal", "seal"),
    ("msa_fed.privacy.ledger", "Ledger", "floor_kept", "seal.floor_kept"),
    # outside the requests: what a site gets ready in the background once it admitted a job
    ("msa_fed.federation.agent", "SiteAgent", "fetch_sample", "background.fetch_sample"),
    ("msa_fed.federation.agent", "SiteAgent", "fetch_predictor", "background.fetch_predictor"),
    ("msa_fed.site.worker", "SiteWorker", "_compute_outputs", "background.outputs"),
)


def timed(owner, name: str, stage: str, counts: dict, lock: threading.Lock, by=None) -> None:
    """``owner.name`` wrapped in a timer of its thread's CPU, counted in ``counts[stage]``
    (``[calls, CPU seconds]``) and, where ``by(args)`` names a sub-stage, in that key too."""
    orig = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.thread_time()
        try:
            return orig(*args, **kwargs)
        finally:
            took = time.thread_time() - t0
            sub = by(args) if by is not None else None
            with lock:
                for key in (stage, sub) if sub else (stage,):
                    c = counts.setdefault(key, [0, 0.0])
                    c[0] += 1
                    c[1] += took

    setattr(owner, name, wrapper)


def _chain_method(args) -> str | None:
    """The chain by request method (``SiteApp._answer(self, job, admin, request, content)``)."""
    method = getattr(args[3], "method", None) if len(args) > 3 else None
    return f"chain[{method}]" if method else None


def main() -> int:
    out, rest = sys.argv[1], sys.argv[sys.argv.index("--") + 1 :]
    if rest[1:3] != ["-m", "msa_fed.cli"]:
        raise SystemExit(f"site_stages: expected PYTHON -m msa_fed.cli ...; got {rest[:3]}")
    import importlib

    counts: dict[str, list] = {}
    lock = threading.Lock()
    for module, cls, name, stage in STAGES:
        mod = importlib.import_module(module)
        owner = getattr(mod, cls) if cls else mod
        if not hasattr(owner, name):  # a stage of another tree (a baseline checkout's own code)
            continue
        timed(owner, name, stage, counts, lock, _chain_method if stage == "chain" else None)

    def reset(*_) -> None:
        with lock:
            counts.clear()

    signal.signal(signal.SIGUSR1, reset)

    def write() -> None:
        with lock, open(out, "w") as fh:
            json.dump({"stages": counts}, fh)

    atexit.register(write)
    from msa_fed.cli import main as cli_main

    return cli_main(rest[3:])


if __name__ == "__main__":
    sys.exit(main())
