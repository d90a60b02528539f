"""Token-balanced data parallelism: whole groups move between processes after the rollout so that each process's share
of every optimizer step holds about as many tokens (verl's ``balance_batch``).

Each process samples its own prompts, so one that drew the long completions would run the longest passes while the
others wait for it at the gradient's reduction. :func:`balance` gathers every process's groups (their token counts
first, then the experience's tensors), splits each optimizer step's groups among the processes (as many groups on
each, the largest first to the least loaded: :func:`assign`) and gives each process its share. The optimizer steps
are unchanged: a step holds the same completions whichever process computes them (each group keeps its advantages,
its reference answer and its prompt), so the update is the unbalanced one within float tolerance.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import torch
from torch import Tensor, nn

from ..distributed import all_gather_objects, all_gather_rows, all_reduce, world_size
from .experience import ROLLOUT_FIELDS, Experience

#: the experience's tensors, by what their first dimension counts and the side their second is padded on
ROW_FIELDS = {**ROLLOUT_FIELDS, "group_index": None, "advantages": "right", "old_logprobs": "right",
              "ref_logprobs": "right", "entropies": "right", "values": "right", "returns": "right"}
GROUP_FIELDS = {"anchor_ids": "right", "anchor_mask": "right"}


def group_tokens(exp: Experience) -> Tensor:
    """``[P]`` the tokens (prompt and completion, padding left out) of each group's rows: the work the passes do."""
    per_row = exp.prompt_mask.sum(-1) + exp.attention_mask.sum(-1)
    groups = int(exp.group_index.max()) + 1
    return torch.zeros(groups, dtype=torch.long).index_add_(0, exp.group_index.cpu(), per_row.cpu().long())


def assign(costs: list[int], buckets: list[int], world: int, owners: list[int] | None = None) -> list[list[int]]:
    """Each process's groups (indices into ``costs``), bucket by bucket: every bucket's groups (an optimizer step's)
    split into ``world`` equal counts, each group in turn (the costliest first) to the least loaded process that has
    room (loads counted over all buckets). A bucket's count must divide by ``world``. ``owners``: the process that
    holds each group now; where dealing would not lower the largest load, each keeps its own (nothing moves)."""
    shares: list[list[int]] = [[] for _ in range(world)]
    loads = [0] * world
    for bucket in sorted(set(buckets)):
        members = sorted((g for g, b in enumerate(buckets) if b == bucket), key=lambda g: (-costs[g], g))
        if len(members) % world:
            raise ValueError(f"bucket {bucket} holds {len(members)} groups, not a multiple of the {world} processes")
        room = [len(members) // world] * world
        for g in members:
            p = min((p for p in range(world) if room[p]), key=lambda p: (loads[p], p))
            shares[p].append(g)
            loads[p] += costs[g]
            room[p] -= 1
    if owners is not None:
        own = [sorted((g for g in range(len(costs)) if owners[g] == p), key=lambda g: (buckets[g], g))
               for p in range(world)]
        if max(sum(costs[g] for g in s) for s in own) <= max(loads):
            return own
    return shares


def imbalance(loads: list[int]) -> float:
    """The largest process's tokens over the mean: 1 is even."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


def _buckets(group: Tensor, order: Tensor, size: int, uniform: bool, device: torch.device) -> tuple[list[int], bool]:
    """Each group's mini-batch in the first pass (``group``: each row's group, on the CPU; ``order`` split in pieces of
    ``size`` rows), and whether every group
    lies in one mini-batch and the groups are of one size (``uniform``) on every process (collective); where not, one
    bucket for the whole rollout."""
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel())
    step = position // size
    groups = int(group.max()) + 1
    first = torch.full((groups,), order.numel()).scatter_reduce(0, group, step, reduce="amin")
    last = torch.zeros(groups, dtype=torch.long).scatter_reduce(0, group, step, reduce="amax")
    here = int(uniform and bool((first == last).all()))
    whole = int(all_reduce(torch.tensor(here, device=device)).item()) == world_size()
    return (first.tolist() if whole else [0] * groups), whole


def _gather(value: Tensor, side: str | None, width: int, device: torch.device) -> Tensor:
    """Every process's ``value`` (``[n, ...]``, the same ``n`` on each) padded to ``width`` on ``side`` and joined."""
    if side is not None and value.dim() > 1 and value.shape[1] < width:
        extra = width - value.shape[1]
        value = nn.functional.pad(value, (extra, 0) if side == "left" else (0, extra))
    flag = value.dtype == torch.bool  # not every backend gathers booleans
    out = all_gather_rows((value.to(torch.uint8) if flag else value).to(device))
    return out.bool() if flag else out


def _trim(value: Tensor, mask: Tensor, side: str) -> Tensor:
    """``value`` without the columns that ``mask`` (its rows' padding mask) leaves empty on every row (at least one)."""
    used = torch.nonzero(mask.bool().any(0)).flatten()
    if side == "left":
        return value[:, int(used[0]) if used.numel() else mask.shape[1] - 1:]
    return value[:, :int(used[-1]) + 1 if used.numel() else 1]


def balance(exp: Experience, order: Tensor, size: int, device: torch.device) -> tuple[Experience, Tensor | None,
                                                                                     dict[str, Tensor]]:
    """This process's share of every process's groups (collective; see the module's docstring).

    ``order`` and ``size``: the first pass's mini-batches (each process's ``order`` split in pieces of ``size`` rows).
    Where every group lies in one mini-batch, each mini-batch's groups are balanced among the processes and the new
    rows come mini-batch by mini-batch (the first pass's order is then returned: the rows in turn); otherwise the whole
    rollout's groups are, and the first pass's order is ``None`` (to be drawn again). The metrics are the largest
    process's share of the tokens over the mean, before (``token_imbalance_before``) and after
    (``token_imbalance``)."""
    world, rank = world_size(), torch.distributed.get_rank()
    costs = group_tokens(exp)
    group = exp.group_index.cpu()
    rows_of = [torch.nonzero(group == g).flatten() for g in range(costs.numel())]
    # groups of one size whose rows share a mini-batch keep their optimizer steps; otherwise the whole rollout is one
    buckets, whole = _buckets(group, order, size, uniform=len({len(r) for r in rows_of}) == 1, device=device)
    widths = {f.name: getattr(exp, f.name).shape[1] for f in fields(exp)
              if isinstance(getattr(exp, f.name), Tensor) and getattr(exp, f.name).dim() > 1}
    unknown = {f.name for f in fields(exp) if getattr(exp, f.name) is not None} - set(ROW_FIELDS) - set(GROUP_FIELDS)
    if unknown:
        raise TypeError(f"update.balance_tokens cannot move the experience's fields {sorted(unknown)}")
    mine = {"costs": costs.tolist(), "buckets": buckets, "rows": exp.num_rows, "sizes": [len(r) for r in rows_of],
            "widths": widths}
    every = all_gather_objects(mine)
    if len({(p["rows"], tuple(p["sizes"])) for p in every}) > 1:  # equal batches of whole groups make them equal
        raise RuntimeError("update.balance_tokens: the processes' rollouts differ in rows or group sizes "
                           f"({[(p['rows'], p['sizes']) for p in every]}); set update.balance_tokens=false")
    all_costs = [c for p in every for c in p["costs"]]
    all_buckets = [b for p in every for b in p["buckets"]]
    owners = [r for r, p in enumerate(every) for _ in p["costs"]]
    shares = assign(all_costs, all_buckets, world, owners)
    before = [sum(p["costs"]) for p in every]
    after = [sum(all_costs[g] for g in share) for share in shares]
    metrics = {"token_imbalance_before": torch.tensor(imbalance(before), device=device),
               "token_imbalance": torch.tensor(imbalance(after), device=device)}
    if all(owners[g] == r for r, share in enumerate(shares) for g in share):  # dealing would not help: nothing moves
        return exp, order, metrics
    # the rows of each of this process's new groups, as indices into every process's rows (each process's laid out
    # group by group) joined in rank order; every process holds as many groups, of the same sizes (checked above)
    sizes = every[0]["sizes"]
    starts = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    picked, counts = [], []
    for g in shares[rank]:
        r, local = divmod(g, len(sizes))
        picked.append(torch.arange(starts[local], starts[local + 1]) + r * exp.num_rows)
        counts.append(sizes[local])
    rows = torch.cat(picked)
    by_group = torch.cat(rows_of)
    new: dict[str, Any] = {}
    for name, side in {**ROW_FIELDS, **GROUP_FIELDS}.items():
        value = getattr(exp, name, None)
        if value is None:
            continue
        width = max(p["widths"].get(name, 0) for p in every)
        if name in ROW_FIELDS:
            gathered = _gather(value[by_group.to(value.device)], side, width, device)
            new[name] = gathered[rows.to(gathered.device)].to(value.device)
        else:
            gathered = _gather(value, side, width, device)
            new[name] = gathered[torch.tensor(shares[rank], device=gathered.device)].to(value.device)
    new["group_index"] = torch.arange(len(counts)).repeat_interleave(torch.tensor(counts)).to(exp.group_index.device)
    new["prompt_ids"] = _trim(new["prompt_ids"], new["prompt_mask"], "left")
    new["prompt_mask"] = _trim(new["prompt_mask"], new["prompt_mask"], "left")
    attention = new["context_mask"] if new.get("context_mask") is not None else new["completion_mask"]
    for name, side in ROW_FIELDS.items():
        if side == "right" and new.get(name) is not None and new[name].dim() > 1:
            new[name] = _trim(new[name], attention, "right")
    if "anchor_mask" in new:
        new["anchor_ids"] = _trim(new["anchor_ids"], new["anchor_mask"], "right")
        new["anchor_mask"] = _trim(new["anchor_mask"], new["anchor_mask"], "right")
    first = torch.arange(exp.num_rows) if whole else None
    return replace(exp, **new), first, metrics
