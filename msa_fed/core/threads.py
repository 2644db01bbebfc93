"""How many BLAS threads numpy and scipy use: decided here, for the whole package.

On a loaded machine the workers of a second BLAS thread spin on a busy core, and the small
products of this package then run many times slower than on one thread (measured: 2.7 s
instead of 33 ms for one DC evaluation at n = 1e5, p = 32; in one profile at load 3.5 the
p = 16 fit was 1.6x slower in the median with the solver's SLSQP and the sites' inference
left on two threads, a gain not reproduced at load 15 to 29, BENCHMARKS.md).  So:

- the DC sums (:meth:`msa_fed.core.dc_terms.PointSet.evaluate`), the classifier's optimiser
  and the whole z solve (:func:`msa_fed.core.dc_solver.solve_dc`) run on one thread;
- inference (a predictor or the domain model on a batch, the combined model's predictions)
  runs on one thread when the batch is small (:data:`SMALL_WORK`), on the default otherwise.

torch's own thread pool is left alone.
"""

from __future__ import annotations

import contextlib
import sys
from contextlib import AbstractContextManager
from typing import Any

#: a product with fewer multiply-adds than this runs on one BLAS thread (a 1e5 x 40 matrix times
#: a vector is 4e6; set to 0 to leave every inference on the default, as a benchmark does)
SMALL_WORK = 1 << 24

#: threadpoolctl's controllers of the BLAS libraries loaded, keyed by which BLAS-carrying packages were loaded
_BLAS: dict[tuple[bool, ...], Any] = {}


def one_blas_thread() -> AbstractContextManager[object]:
    """Context manager: numpy's and scipy's BLAS on one thread inside (torch's pool untouched).

    The libraries' controllers are found once (a fresh ``threadpool_limits`` scans the loaded
    libraries, 3.6 ms) and again when scipy or torch, which bring their own libraries, have been
    imported since.  Nested uses are cheap and restore the outer setting.
    """
    key = tuple(name in sys.modules for name in ("scipy.linalg", "torch", "sklearn"))
    if key not in _BLAS:
        try:
            from threadpoolctl import ThreadpoolController

            _BLAS.clear()
            libs = [lib for lib in ThreadpoolController().lib_controllers if lib.user_api == "blas"]
            _BLAS[key] = tuple(libs)
        except Exception:  # pragma: no cover - threadpoolctl ships with scikit-learn
            _BLAS[key] = None
    libs = _BLAS[key]
    if libs is None:  # pragma: no cover
        return contextlib.nullcontext()
    return _OneThread(libs)


class _OneThread:
    """Each BLAS library on one thread inside, its own setting restored after.  Reads each
    library's setting and changes only one that is not 1 already (threadpoolctl's ``limit``
    gathers every library's full description first: 50-65 us per use with numpy's, scipy's
    and torch's libraries loaded, against a few us here; a nested use changes nothing)."""

    __slots__ = ("libs", "saved")

    def __init__(self, libs: tuple[Any, ...]):
        self.libs = libs
        self.saved: list[tuple[Any, int]] = []

    def __enter__(self) -> _OneThread:
        for lib in self.libs:
            n = lib.get_num_threads()
            if isinstance(n, int) and n != 1:  # (a library that cannot tell is left as it is)
                lib.set_num_threads(1)
                self.saved.append((lib, n))
        return self

    def __exit__(self, *exc: object) -> None:
        while self.saved:
            lib, n = self.saved.pop()
            lib.set_num_threads(n)


def blas_threads_for(work: int) -> AbstractContextManager[object]:
    """One BLAS thread for ``work`` multiply-adds below :data:`SMALL_WORK`, else the default."""
    return one_blas_thread() if work < SMALL_WORK else contextlib.nullcontext()
