"""The paper's experiments, run through the public API (``fit_dmsa`` / ``fit_gmsa``).

Modules: ``data`` (loaders for the offline data sets), ``report`` (aggregation, tables,
JSON), ``synthetic``, ``adult``, ``sentiment``, ``digits`` (+ ``cnn``), and ``cli``
(``msa-fed experiment NAME``).  Results and commands are recorded in docs/RESULTS.md.
"""
