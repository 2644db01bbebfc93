"""Answer a recorded job's requests as a site process does, in a Python without the coordinator's
packages (tests/site/test_slim_site.py runs it under tests/slim.py's import blocker, and from a
venv made by ``pip install .`` alone).

    python slim_replay.py JOB_DIR

JOB_DIR/job.json: the site (name, index, task, loss, classes), the requests (method and
``SiteRequest`` bytes, base64) in the order the coordinator sent them; JOB_DIR/data.npz: the
site's labelled data, its unlabelled sample and the job's published samples
(``published_<k>``); JOB_DIR/predictor_<k>.onnx: the job's predictors.  As ``site serve`` does,
the site loads its own predictor and runs every peer's in the sandbox (a limited worker process),
and every request goes through the site's one entry point (``handle``).
Writes JOB_DIR/answers.json: the ``SiteResponse`` bytes (base64) of every request, and the
modules of the coordinator extra this process holds at the end.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np

from msa_fed.artifacts.isolated import isolate
from msa_fed.artifacts.predictors import load_predictor
from msa_fed.boundary import messages as m
from msa_fed.boundary import wire
from msa_fed.boundary.proto import boundary_pb2 as pb
from msa_fed.errors import COORDINATOR_PACKAGES, MsaFedError
from msa_fed.site.worker import SiteWorker


def main(folder: Path) -> None:
    job = json.loads((folder / "job.json").read_text())
    data = np.load(folder / "data.npz")
    p = int(job["n_sources"])
    kind = "regression" if job["task"] == "regression" else "probabilities"
    predictors = []
    for k in range(p):
        loaded = load_predictor((folder / f"predictor_{k}.onnx").read_bytes(), kind=kind)
        predictors.append(loaded if k == job["index"] else isolate(loaded, f"site{k}"))
    worker = SiteWorker(
        job["name"],
        job["index"],
        data["X_labeled"],
        data["y_labeled"],
        data["X_unlabeled"],
        predictors=predictors,
        task=job["task"],
        loss=job["loss"],
        classes=None if job["classes"] is None else np.asarray(job["classes"]),
        min_points=job["min_points"],
    )
    worker.set_published(m.PublishedSamples(tuple(data[f"published_{k}"] for k in range(p))))
    answers = []
    for method, request in job["requests"]:
        got, msg = wire.from_proto(pb.SiteRequest.FromString(base64.b64decode(request)), wire.REQUESTS)
        assert got == method, (got, method)
        try:
            response = wire.to_proto(method, worker.handle(method, msg), wire.RESPONSES)
        except MsaFedError as exc:
            response = wire.failure_proto(exc)
        answers.append(base64.b64encode(response.SerializeToString()).decode())
    held = sorted({name.split(".")[0] for name in sys.modules} & COORDINATOR_PACKAGES)
    (folder / "answers.json").write_text(json.dumps({"answers": answers, "coordinator_modules": held}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
