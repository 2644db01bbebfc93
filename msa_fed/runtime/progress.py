"""Progress reporting for long steps, for people and for log files.

On a terminal (stderr is a TTY) a step is a tqdm bar redrawn in place.  Anywhere else (a file,
``ray job logs``, a systemd journal) a bar would become hundreds of carriage-return fragments,
so each step writes one plain line per iteration instead::

    DC solver: iteration 3, max_k L_k=0.4127
    DC solver: done after 7 iterations, max_k L_k=0.4102

Silent when not verbose.  ``MSA_FED_PROGRESS=bars|lines`` forces one style.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from tqdm.auto import tqdm

STYLE_ENV = "MSA_FED_PROGRESS"


class _Null:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


class LineBar:
    """The tqdm calls the coordinator uses, written as one line per iteration to ``stream``.

    ``update`` then ``set_postfix_str`` is one iteration; its line is written once its postfix is
    known (or at the next update/close when none comes)."""

    def __init__(self, desc: str, unit: str = "it", total=None, stream=None):
        self.desc, self.unit, self.total = desc, unit, total
        self.stream = stream if stream is not None else sys.stderr
        self.n = 0
        self.postfix = ""
        self._pending = False
        self._t0 = time.perf_counter()
        self._closed = False

    def _word(self) -> str:
        return {"it": "iteration", "epoch": "epoch"}.get(self.unit, self.unit)

    def _emit(self, text: str) -> None:
        print(f"{self.desc}: {text}", file=self.stream, flush=True)

    def _flush_pending(self) -> None:
        if self._pending:
            of = f"/{self.total}" if self.total else ""
            self._emit(f"{self._word()} {self.n}{of}" + (f", {self.postfix}" if self.postfix else ""))
            self._pending = False

    def update(self, n=1):
        self._flush_pending()
        self.n += n
        self._pending = True

    def set_postfix_str(self, s):
        self.postfix = str(s)
        self._flush_pending()

    def close(self):
        if self._closed:
            return
        self._closed = True
        self._flush_pending()
        plural = "s" if self.n != 1 else ""
        self._emit(
            f"done after {self.n} {self._word()}{plural} in {time.perf_counter() - self._t0:.1f} s"
            + (f", {self.postfix}" if self.postfix else "")
        )


def use_bars(stream=None) -> bool:
    """Bars on a terminal, lines elsewhere (``MSA_FED_PROGRESS`` overrides)."""
    forced = os.environ.get(STYLE_ENV, "").strip().lower()
    if forced in ("bars", "lines"):
        return forced == "bars"
    stream = stream if stream is not None else sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    def __init__(self, verbose: bool):
        self.verbose = verbose

    def bar(self, desc: str, unit: str = "it", total=None):
        if not self.verbose:
            return _Null()
        if use_bars():
            return tqdm(desc=desc, unit=unit, total=total, file=sys.stderr, leave=True, dynamic_ncols=True)
        return LineBar(desc, unit, total)

    def note(self, text: str):
        if self.verbose:
            if use_bars():
                tqdm.write(text, file=sys.stderr)
            else:
                print(text, file=sys.stderr, flush=True)


class RunBars:
    """The progress of a solver that restarts: one bar (or run of lines) per run.

    A solver with several starts (the min-max solve: the uniform point, then random ones; the
    Gamma solve: its phases and restarts) numbers the iterations of each run from 1, and keeps
    its best run.  ``step(it, postfix)`` opens a new bar when ``it`` does not follow the last
    one, so a line's iteration is an iteration of one run, never a running total::

        DC solver: iteration 8, max_k L_k=0.1586
        DC solver: done after 8 iterations in 0.1 s, max_k L_k=0.1586
        DC solver (run 2): iteration 1, max_k L_k=0.1742
    """

    def __init__(self, progress: Progress, desc: str, unit: str = "it"):
        self.progress, self.desc, self.unit = progress, desc, unit
        self.runs = 0
        self._last = 0
        self._bar: Any = None

    def step(self, iteration: int, postfix: str) -> None:
        if self._bar is None or iteration <= self._last:
            self.close()
            self.runs += 1
            desc = self.desc if self.runs == 1 else f"{self.desc} (run {self.runs})"
            self._bar = self.progress.bar(desc, unit=self.unit)
        self._last = iteration
        self._bar.update(1)
        self._bar.set_postfix_str(postfix)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


#: what each solver objective is, in words, for the line that ends a solve and the job summary
OBJECTIVE_WORDS = {
    "minmax": "max_k L_k(z), the worst site's loss",
    "gamma": "Gamma(z), the worst site's loss minus the z-weighted average of the sites' losses",
    "regret": "max_k (L_k(z) - b_k), the worst site's loss above the best loss b_k it can get",
}


def solver_summary(res, objective: str, runs: int) -> str:
    """The line that ends a z solve: the value minimised, said in words, the iterations of the
    best run, and the loss evaluations (each one round trip to every site) counted apart."""
    if objective == "regret":  # the history holds the objective's values
        value = res.history[-1] if res.history else res.max_loss
    else:
        value = res.max_loss if objective == "minmax" else res.gamma
    best = f"after {res.n_iter} iterations" + (f" (best of {runs} runs)" if runs > 1 else "")
    state = "converged" if res.converged else "not converged"
    return (
        f"DC solver ({res.method}): minimised {OBJECTIVE_WORDS[objective]}, to {value:.4g} {best}; "
        f"{res.n_evaluations} loss evaluations at the sites; {state}"
    )
