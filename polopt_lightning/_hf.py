"""Small compatibility helpers for ``transformers`` model calls (shared by rollout and log-prob code)."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn


def cache_argument(model: nn.Module) -> str:
    """transformers 5 renamed ``past_key_values`` to ``cache``; the name this model's forward takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out: Any) -> Any:
    cache = out.get("cache")
    return out.get("past_key_values") if cache is None else cache
