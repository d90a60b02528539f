"""Collectives over the default process group that are no-ops in a single process.

The module calls these itself (not through Lightning's ``sync_dist``) because its metrics need exact reductions:
sums of count-weighted terms, maxima, and whole-batch statistics from gathered rows, not means of per-process means.
Every process must call each function in the same order (they are collectives).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .data.sampling import process_rank


def world_size() -> int:
    return process_rank()[0]


def all_reduce(tensor: Tensor, op: str = "sum") -> Tensor:
    """``tensor`` reduced over every process (``"sum"``, ``"max"``, ``"min"``), as a new tensor."""
    if world_size() == 1:
        return tensor
    ops = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX,
           "min": torch.distributed.ReduceOp.MIN}
    out = tensor.detach().clone()
    torch.distributed.all_reduce(out, op=ops[op])
    return out


def reduce_metrics(sums: dict[str, Tensor], counts: dict[str, Tensor]) -> dict[str, Tensor]:
    """Metrics over every process: a key ending in ``_max`` the largest value; a key in ``counts`` a mean, its value
    there the sum of a mean times how many tokens or sequences it averages, divided by every process's count; any
    other key summed."""
    out = {key: all_reduce(value, "max" if key.endswith("_max") else "sum") for key, value in sums.items()}
    for key, count in counts.items():
        out[key] = out[key] / all_reduce(count).clamp(min=1)
    return out


def all_gather_rows(tensor: Tensor) -> Tensor:
    """Every process's ``tensor`` (same shape on each) joined along the first dimension, in rank order."""
    if world_size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world_size())]
    torch.distributed.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every process's picklable ``obj``, in rank order (``[obj]`` in a single process)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def close_process_group() -> None:
    """Every process of a distributed run waits for the others (the first one writes the model and results after the
    rest are done), then closes the process group; nothing in a single process. A process that exits with its Gloo
    group open can abort while its communication threads are torn down ("terminate called without an active
    exception", exit -6; pytorch/pytorch#190489): call this before a script's processes end."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
