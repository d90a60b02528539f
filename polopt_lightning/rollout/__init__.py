"""Rollout backends behind one interface (:class:`RolloutEngine`): prompts in, G completions per prompt with their
sampling log-probs out. ``"hf"`` (:class:`HFRolloutEngine`, transformers) is the default, ``"vllm"``
(:class:`~polopt_lightning.rollout.vllm.VLLMRolloutEngine`) needs vLLM; :data:`ENGINES` names every backend, and
:func:`build_engine` makes one from a name, a dict or an engine."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from .base import Completions, RolloutBatch, RolloutEngine, SamplingConfig, filter_logits, sample_tokens
from .hf import HFRolloutEngine

# name: "module:class", imported when chosen (a backend may need a package only its users install)
ENGINES: dict[str, str] = {"hf": "polopt_lightning.rollout.hf:HFRolloutEngine",
                           "vllm": "polopt_lightning.rollout.vllm:VLLMRolloutEngine",
                           "server": "polopt_lightning.rollout.server:ServerRolloutEngine"}


def build_engine(spec: RolloutEngine | str | Mapping[str, Any] | None = None, key: str = "rollout_engine",
                 ) -> RolloutEngine:
    """A rollout backend: ``spec`` itself when it is one; ``None``: the default (``"hf"``); a name from
    :data:`ENGINES`; or a dict with ``name`` (default ``"hf"``) and the backend's arguments. An unknown name or a
    wrong type raises a ValueError naming ``key``."""
    if isinstance(spec, RolloutEngine):
        return spec
    if spec is None or isinstance(spec, str):
        name, kwargs = spec or "hf", {}
    elif isinstance(spec, Mapping):
        kwargs = dict(spec)
        name = kwargs.pop("name", "hf")
    else:
        raise ValueError(f"{key} must be a RolloutEngine, a backend name ({sorted(ENGINES)}) or a dict of its "
                         f"arguments with 'name', got {type(spec).__name__}")
    if name not in ENGINES:
        raise ValueError(f"{key}: unknown rollout backend {name!r}; known: {sorted(ENGINES)}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)


__all__ = ["ENGINES", "Completions", "HFRolloutEngine", "RolloutBatch", "RolloutEngine", "SamplingConfig", "build_engine",
           "filter_logits", "sample_tokens"]
