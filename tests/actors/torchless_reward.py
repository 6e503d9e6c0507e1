"""A reward for tests/actors/test_verifier.py that reports what its worker process imported: kept apart from
that file, which imports torch itself (a worker loading it would load torch whatever the pool does)."""

from __future__ import annotations

import sys
from typing import Any


def imports_torch(prompt: str, completion: str, **row: Any) -> float:
    """1.0 where the worker scoring it has torch or the actor runtime loaded, else 0.0."""
    return float(any(name in sys.modules for name in ("torch", "slipstream.runtime.host")))
