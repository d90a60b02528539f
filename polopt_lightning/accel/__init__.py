"""Hardware-specific speed, kept apart from the generic paths: one plugin per kind of machine, registered here by name
(:data:`PLUGINS`) and imported only when first used. Generic code reaches a plugin through this module's functions,
never by importing it:

- :func:`training` the module's levers (``compute(model, device)``: the context a step computes in; ``prepare(models,
  device)``: before training; ``callbacks(present)``: the callbacks training needs), from the ``accel`` settings;
- :func:`decoding` the transformers backend's (``sampling_dtype``, ``context``, ``projections``), from its ``cpu``
  settings;
- :func:`loaded` what a model from ``from_pretrained`` needs once loaded;
- :func:`backward_product` the product an autograd function's backward makes with a weight, as the step's context
  would run it in the forward pass; :func:`recompute_contexts` the contexts activation checkpointing recomputes in.

Each lever is opt-in or automatic with a stated fallback. The one plugin is ``cpu`` (:mod:`.cpu.plugin`: oneDNN
products, the few-row decoding kernel, host memory, weights out of mapped files); the lean decoding step it speeds up
(:mod:`.lean_step`) runs on any device.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

#: plugin name -> the module that provides ``training``, ``decoding`` and ``loaded``
PLUGINS = {"cpu": "polopt_lightning.accel.cpu.plugin"}
# the module of the CPU plugin's compute context: where it is not imported, no such context can be open
_CPU_CONTEXT = "polopt_lightning.accel.cpu.linear"


def plugin(name: str = "cpu") -> ModuleType:
    """The plugin registered as ``name``, imported on first use."""
    if name not in PLUGINS:
        raise ValueError(f"no accel plugin {name!r}; registered: {sorted(PLUGINS)}")
    return importlib.import_module(PLUGINS[name])


def training(settings: Any = None) -> Any:
    """The training levers from the ``accel`` settings (the plugin's settings object, a dict of them or ``None``)."""
    return plugin().training(settings)


def decoding(settings: Any = None) -> Any:
    """The decoding levers from the transformers backend's ``cpu`` settings (an object, a dict or ``None``)."""
    return plugin().decoding(settings)


def loaded(model: Any) -> None:
    """What a model needs once ``from_pretrained`` has loaded it (the CPU plugin: its weights out of the mapped files)."""
    plugin().loaded(model)


def backward_product(weight: Any) -> Any:
    """``(x, w) -> x @ w.T`` as the context a step computes in (:func:`training`'s ``compute``) runs products with
    ``weight``, for an autograd function's backward, where that context is not active (the CPU plugin: oneDNN's
    product inside its ``OneDNNLinear``); ``None``: ``F.linear``'s. Asked in the forward pass."""
    return None if _CPU_CONTEXT not in sys.modules else plugin().backward_product(weight)


def recompute_contexts() -> tuple[Any, Any]:
    """Activation checkpointing's ``context_fn`` (torch's non-reentrant checkpoint): a checkpointed layer's
    recomputation in the backward pass runs in the context its forward ran in (the CPU plugin: its oneDNN products),
    so both save the same tensors."""
    from contextlib import nullcontext

    if _CPU_CONTEXT not in sys.modules:
        return nullcontext(), nullcontext()
    return plugin().recompute_contexts()
