"""The random states a training step draws from, as a checkpoint keeps them: the sampler's generator, torch's (CPU
and CUDA), Python's and NumPy's, one set per process, in tensors and plain numbers only (checkpoints load with
``torch.load(weights_only=True)``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn


def rng_state(generator: torch.Generator) -> dict[str, Any]:
    """Every random state a step draws from: the sampler's ``generator``, torch's (CPU and CUDA), Python's, NumPy's."""
    import random

    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"sampling_generator": generator.get_state(), "torch": torch.get_rng_state(),
             "python": random.getstate(),
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any], generator: torch.Generator) -> None:
    """Put back what :func:`rng_state` took (``generator``: the sampler's, on the training device)."""
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    generator.set_state(state["sampling_generator"])


def restore_rng(saved: Sequence[Mapping[str, Any]], rank: int, world: int, generator: torch.Generator) -> None:
    """Process ``rank`` of ``world`` continues from the states a checkpoint saved (one set per process, in rank
    order); with another number of processes each takes the set of its rank modulo theirs, and a warning says the
    samples will differ. Checkpoints of version 0.1.0 hold only the sampler's and torch's states."""
    if len(saved) != world:
        rank_zero_warn(f"the checkpoint holds the random states of {len(saved)} process(es) and this run has "
                       f"{world}: each process continues from the states of process (its rank modulo "
                       f"{len(saved)}); the data order continues, the samples will differ from the "
                       "uninterrupted run's")
    state = saved[rank % len(saved)]
    if "python" in state:
        set_rng_state(state, generator)
    else:
        torch.set_rng_state(state["torch"])
        generator.set_state(state["sampling_generator"])
