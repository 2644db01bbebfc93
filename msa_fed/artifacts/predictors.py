"""Frozen predictors as ONNX artifacts: export, and a loader that never runs author code.

A site publishes its predictor h_k as ONNX bytes (DESIGN.md section 6).  The pieces:

- :mod:`msa_fed.artifacts.export`: ``export_sklearn``, ``export_torch``, ``to_onnx``;
- :mod:`msa_fed.artifacts.structure`: the declaration (``msa_fed.kind``,
  ``msa_fed.n_features``, ``msa_fed.classes`` in ``metadata_props``) and the checks that need
  no onnxruntime (external data, operator domains, probe outputs), with the fixed public
  reasons of every refusal;
- :mod:`msa_fed.artifacts.sandbox`: the first load and the probe in a limited child process;
- :mod:`msa_fed.artifacts.loader`: ``load_predictor`` and the predictor objects.

This module keeps the names importable from one place.
"""

from msa_fed.artifacts.export import export_sklearn, export_torch, to_onnx  # noqa: F401
from msa_fed.artifacts.loader import (  # noqa: F401
    DEFAULT_MAX_BYTES,
    PROBE_CACHE,
    OnnxClassifier,
    OnnxPredictor,
    OnnxRegressor,
    load_predictor,
    load_predictor_file,
    load_predictors,
    sha256_hex,
)
from msa_fed.artifacts.sandbox import (  # noqa: F401
    SANDBOX_CPU_SECONDS,
    SANDBOX_MEMORY_BYTES,
    SANDBOX_TIMEOUT_S,
    SandboxLimits,
)
from msa_fed.artifacts.structure import (  # noqa: F401
    ALLOWED_DOMAINS,
    DEFAULT_MAX_FEATURES,
    KIND_PROBABILITIES,
    KIND_REGRESSION,
    KINDS,
    META_CLASSES,
    META_KIND,
    META_N_FEATURES,
    PROBA_ATOL,
)
