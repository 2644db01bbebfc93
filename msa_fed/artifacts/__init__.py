"""Artifacts that cross a process or institution boundary.

- :mod:`msa_fed.artifacts.predictors`: frozen predictors as ONNX (export, and the safe loader
  that checks an untrusted model before it is ever run).
- :mod:`msa_fed.artifacts.model`: the combined model (manifest + arrays + ONNX), saved and
  loaded without pickle.
"""
from msa_fed.artifacts.predictors import (  # noqa: F401  (re-exported public names)
    KIND_PROBABILITIES,
    KIND_REGRESSION,
    OnnxPredictor,
    export_sklearn,
    export_torch,
    load_predictor,
    load_predictor_file,
    sha256_hex,
    to_onnx,
)
