"""Progress reporting for long steps: tqdm bars on stderr when verbose, silent otherwise."""
from __future__ import annotations

import sys

from tqdm.auto import tqdm


class _Null:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


class Progress:
    def __init__(self, verbose: bool):
        self.verbose = verbose

    def bar(self, desc: str, unit: str = "it", total=None):
        if not self.verbose:
            return _Null()
        return tqdm(desc=desc, unit=unit, total=total, file=sys.stderr, leave=True, dynamic_ncols=True)

    def note(self, text: str):
        if self.verbose:
            tqdm.write(text, file=sys.stderr)
