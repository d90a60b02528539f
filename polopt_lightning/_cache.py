"""Where the package keeps what it computes once and reuses across runs (warm starts, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$POLOPT_CACHE``, else ``~/.cache/polopt-lightning``."""
    return Path(os.environ.get("POLOPT_CACHE", Path.home() / ".cache" / "polopt-lightning"))
