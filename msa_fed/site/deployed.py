"""A site of the cluster topology: a Ray actor on the site's own node, started by the job."""

from __future__ import annotations

from msa_fed.artifacts.isolated import isolate
from msa_fed.artifacts.model import predictor_kind
from msa_fed.artifacts.predictors import load_predictor
from msa_fed.core.config import MIN_POINTS
from msa_fed.site.worker import SiteWorker


class DeployedSite(SiteWorker):
    """A site in a real deployment: reads its private data from its own node's disk
    (``data_path``; a relative path is under ``$MSA_FED_SITE_DATA`` on that node) and loads the
    published predictors from ONNX bytes through the safe loader (never unpickles).  Its host
    is the job's Ray cluster (``host="ray"``): the node's policy file is the policy."""

    def __init__(
        self,
        name: str,
        index: int,
        data_path: str,
        predictor_artifacts: list,
        task: str,
        loss: str,
        classes=None,
        min_points: int = MIN_POINTS,
        predictor_owners=None,
        sites=None,
        host: str = "ray",
        content: dict | None = None,
    ):
        predictors = [
            load_predictor(data, expected_sha256=sha, kind=predictor_kind(task)) for data, sha in predictor_artifacts
        ]
        if predictor_owners is not None:  # the peers' predictors: every call in a limited worker process
            predictors = [h if k == index else isolate(h, predictor_owners[k]) for k, h in enumerate(predictors)]
        super().__init__(
            name,
            index,
            predictors=predictors,
            task=task,
            loss=loss,
            classes=classes,
            min_points=min_points,
            data_path=data_path,
            sites=sites,
            host=host,
            content=content,
        )
