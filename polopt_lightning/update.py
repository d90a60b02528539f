"""The update's pieces that need no module: the order of a rollout's rows over mini-batches, the split of a
mini-batch into micro-batches (as many on every process), gradient accumulation without a reduction until the last
piece, the global gradient norm and clipping by it, and the learning-rate schedule. The module's training step
(:meth:`~polopt_lightning.PolicyOptimizationModule.accumulate_gradients`) puts them together."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from .distributed import all_reduce, world_size

if TYPE_CHECKING:
    from .experience import Experience


def mini_batch_order(group_index: Tensor, seed: int, share_prompt: bool) -> Tensor:
    """A random order of the rollout's rows (drawn from ``seed``) for splitting into mini-batches.

    With ``share_prompt`` the order shuffles whole groups and the rows inside each group, so a mini-batch holds as
    few distinct prompts as possible and each prompt's forward pass is shared by more completions.
    """
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(group_index.numel(), generator=generator)
    if share_prompt:
        group_rank = torch.randperm(int(group_index.max()) + 1, generator=generator)[group_index[order]]
        order = order[torch.sort(group_rank, stable=True).indices]
    return order


def micro_batches(exp: Experience, rows: Tensor, budget: int | None, share_prompt: bool) -> list[Tensor]:
    """Split a mini-batch so each piece holds at most ``budget`` (prompt + completion) tokens (``None``: one piece).

    Rows go longest completion first (with ``share_prompt``, whole groups by their longest completion, so a group
    stays together) and each piece is filled up to the budget at the width of its own longest row: short completions
    are not padded to the longest of the mini-batch, and more of them fit in one piece. The accumulated gradient is
    the same whatever the split.
    """
    if not budget:
        return [rows]
    lengths = exp.completion_mask[rows].sum(-1).clamp(min=1)
    key = lengths
    if share_prompt:  # sort groups (not rows) by their longest completion; ties keep groups contiguous
        group = exp.group_index[rows]
        longest = torch.zeros(int(group.max()) + 1, dtype=lengths.dtype, device=lengths.device)
        longest = longest.scatter_reduce(0, group, lengths, reduce="amax")
        key = longest[group] * (int(group.max()) + 1) + group
    order = torch.sort(key, descending=True, stable=True).indices
    rows, lengths = rows[order], lengths[order].tolist()
    prompt_width = exp.prompt_ids.shape[1]
    pieces, current, width = [], [], 0
    for i, length in enumerate(lengths):  # fill each piece while its rows x (prompt + widest) fit the budget
        if current and (len(current) + 1) * (prompt_width + max(width, length)) > budget:
            pieces.append(rows[current])
            current, width = [], 0
        current.append(i)
        width = max(width, length)
    pieces.append(rows[current])
    return pieces


def even_pieces(pieces: list[Tensor], policy: nn.Module, device: torch.device) -> list[Tensor]:
    """As many pieces on every process: under FSDP2 each forward and backward gathers weights collectively, so a
    process with fewer pieces would leave the others waiting. The largest pieces are halved until the counts match
    (the accumulated gradient does not depend on the split). Collective under FSDP2; otherwise ``pieces``."""
    from torch.distributed.fsdp import FSDPModule

    if world_size() == 1 or not isinstance(policy, FSDPModule):
        return pieces
    target = int(all_reduce(torch.tensor(len(pieces), device=device), "max"))
    while len(pieces) < target:
        largest = max(range(len(pieces)), key=lambda i: pieces[i].numel())
        piece = pieces.pop(largest)
        if piece.numel() < 2:
            raise RuntimeError(f"cannot split the mini-batch into {target} pieces to match the other processes")
        half = piece.numel() // 2
        pieces[largest:largest] = [piece[:half], piece[half:]]
    return pieces


@contextmanager
def gradient_sync(wrapped: nn.Module | None, policy: nn.Module, last: bool) -> Iterator[None]:
    """No gradient reduction in the backward passes of a mini-batch's pieces but the last: they accumulate locally and
    the last one reduces the sum (DDP's ``no_sync`` on the strategy's ``wrapped`` model, FSDP2's
    ``set_requires_gradient_sync`` on the ``policy``)."""
    from torch.distributed.fsdp import FSDPModule

    if last:
        yield
    elif isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        with wrapped.no_sync():
            yield
    elif isinstance(policy, FSDPModule):
        policy.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            policy.set_requires_gradient_sync(True)
    else:
        yield


def lr_factor(step: int, schedule: str, warmup: int, total: int, floor: float) -> float:
    """The learning rate at ``step`` as a fraction of the peak: linear warm-up over ``warmup`` steps, then
    ``constant``, ``linear`` or ``cosine`` decay to ``floor`` at ``total``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def grad_norm(model: nn.Module) -> Tensor:
    """The global L2 norm of the gradients; for sharded (DTensor) gradients, of every process's shards together."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if not any(isinstance(g, DTensor) for g in grads):
        # what torch.nn.utils.clip_grad_norm_ computes, the same way (one multi-tensor pass per device and dtype), so
        # clipping with it (scale_gradients) gives the same bits
        groups: dict[tuple, list[Tensor]] = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
        norms = [n.to(grads[0].device) for group in groups.values() for n in torch._foreach_norm(group, 2)]
        return torch.linalg.vector_norm(torch.stack(norms).float())
    squares = sum((g.to_local() if isinstance(g, DTensor) else g).float().pow(2).sum() for g in grads)
    return all_reduce(squares).sqrt()


def scale_gradients(model: nn.Module, max_norm: float, norm: Tensor) -> None:
    """Clip by global norm with the norm already measured, as ``torch.nn.utils.clip_grad_norm_`` does (the same
    factor ``max_norm / (norm + 1e-6)``, computed the same way, so the same bits), except that it skips the
    multiplication when the factor is 1 (a pass over every gradient that changes nothing)."""
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if float(factor) < 1.0:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for device in dict.fromkeys(g.device for g in grads):
            torch._foreach_mul_([g for g in grads if g.device == device], factor.to(device))
