"""Fixtures of the runtime tests.  Ray-using modules start their own local Ray (module scope)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # problems.py / inspect_messages.py helpers
