"""Artifacts that cross a process or institution boundary.

- :mod:`msa_fed.artifacts.predictors`: frozen predictors as ONNX (export, and the safe loader
  that checks an untrusted model in a sandboxed process before it is ever run here).
- :mod:`msa_fed.artifacts.model`: the combined model (manifest + arrays + ONNX), saved and
  loaded without pickle.

Names are imported on first use, so that the sandbox child (``msa_fed.artifacts.sandbox``)
sets its limits before numpy or onnxruntime are loaded.
"""

_LAZY = {
    name: "msa_fed.artifacts.predictors"
    for name in (
        "KIND_PROBABILITIES",
        "KIND_REGRESSION",
        "OnnxPredictor",
        "SANDBOX_MEMORY_BYTES",
        "SandboxLimits",
        "export_sklearn",
        "export_torch",
        "load_predictor",
        "load_predictor_file",
        "sha256_hex",
        "to_onnx",
    )
}
__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'msa_fed.artifacts' has no attribute {name!r}")
