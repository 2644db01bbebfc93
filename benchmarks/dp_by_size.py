"""DP accuracy against the number of labelled points per site (docs/RESULTS.md, "Differential
privacy at the sizes of real hospitals").

The synthetic problem of ``msa_fed.experiments.privacy.synthetic_seed`` at 30, 50, 100, 300 and
1000 labelled points per site, epsilon 1, 4 and DP off, 5 seeds.  The concentration refusals
are lifted (they refuse honest fits at 30 points per site, a separate matter from DP); every
other rule is the site's default.

    python benchmarks/dp_by_size.py TAG [--loss-clip 5] [--seeds 5]
        writes benchmarks/results/dp_by_size_TAG.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np

SIZES = (30, 50, 100, 300, 1000)
EPSILONS = (1.0, 4.0, float("inf"))
LIMITS = "[limits]\nmin_effective_points = 1e-9\nmax_point_share = 1.0\n"


def main(argv=None):
    import msa_fed.experiments.privacy as P
    from msa_fed.privacy.policy import POLICY_ENV

    ap = argparse.ArgumentParser()
    ap.add_argument("tag")
    ap.add_argument("--loss-clip", type=float, default=P.LOSS_CLIP)
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")

    @contextmanager
    def site_policy(eps, loss_clip, ratio_clip):
        with tempfile.TemporaryDirectory() as tmp:
            f = Path(tmp) / "policy.toml"
            body = LIMITS
            if np.isfinite(eps):
                body += (
                    f"[dp]\nenabled = true\nepsilon_per_job = {eps!r}\nepsilon_lifetime = 1e9\n"
                    f"delta = {P.DELTA!r}\ndc_evaluations = {P.DP_EVALUATIONS}\n"
                    f"loss_clip = {loss_clip!r}\nratio_clip = {ratio_clip!r}\n"
                )
            f.write_text(body)
            old = os.environ.get(POLICY_ENV)
            os.environ[POLICY_ENV] = str(f)
            try:
                yield
            finally:
                if old is None:
                    os.environ.pop(POLICY_ENV, None)
                else:
                    os.environ[POLICY_ENV] = old

    P.site_policy = site_policy
    P.LOSS_CLIP = args.loss_clip
    out: dict = {}
    path = Path(__file__).parent / "results" / f"dp_by_size_{args.tag}.json"
    for n in SIZES:
        rows = []
        for s in range(args.seeds):
            t = time.time()
            rows.append(P.synthetic_seed(s, n, 2000, epsilons=EPSILONS))
            print(n, s, rows[-1], round(time.time() - t, 1), flush=True)
        out[n] = rows
        path.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
