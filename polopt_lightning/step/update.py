"""The update: its settings (:class:`UpdateConfig`), the order of a rollout's rows over mini-batches, the split of a
mini-batch into micro-batches (as many on every process), gradient accumulation without a reduction until the last
piece, the global gradient norm and clipping by it, and the learning-rate schedule; :class:`Updater` puts them together
over a :class:`~polopt_lightning.step.loop.TrainingLoop`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from ..distributed import all_reduce, reduce_metrics, world_size
from ..settings import Settings
from .balance import balance
from .entropy import EntropyControl
from .loop import TrainingLoop
from .terms import LossTerm, MiniBatch, Piece, SamplerCorrection, advantages_for, build_terms

if TYPE_CHECKING:
    from .experience import Experience

LR_SCHEDULES = ("constant", "linear", "cosine")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
ENTROPY_AGGREGATIONS = ("token-mean", "objective")


@dataclass
class UpdateConfig(Settings):
    """How each rollout becomes optimizer steps (the module's ``update`` argument, ``update.*`` in the CLI).

    Args:
        num_iterations: passes over each rollout (``mu``); > 1 makes the update off-policy.
        mini_batches: optimizer steps per pass; > 1 makes the update off-policy.
        lr_schedule: ``"constant"``, ``"linear"`` or ``"cosine"`` decay over ``trainer.max_steps``, after
            ``warmup_steps`` of linear warm-up; ``min_lr_ratio`` is the floor as a fraction of the optimizer's peak.
        max_grad_norm: gradient clipping by global norm (``None`` or 0 disables).
        micro_batch_tokens: bound on the tokens (prompt + completion) of one forward/backward; a mini-batch larger
            than this is split and its gradients accumulated (same gradient, bounded memory). ``None``: no split.
        gradient_checkpointing: recompute each decoder layer's activations in the backward pass instead of keeping
            them (the model's own activation checkpointing, non-reentrant): less memory for about one more forward
            pass. Checkpointed layers keep no cache, so the training pass then runs each completion with its own
            prompt (the passes without gradient still share it). TRL's ``GRPOConfig`` turns it on by default.
        share_prompt: run each prompt once per group in the training, reference and old-log-prob passes, the G
            completions attending to its keys/values (same result, fewer FLOPs); off for models whose cache cannot
            be gathered.
        pack_groups: with ``share_prompt``, run each group as one packed sequence (its prompt, then its
            completions, under a block mask: one product per layer over all its tokens; the same result within float
            tolerance). ``None``: for groups of at most ``logprobs.PACKED_MAX_TOKENS`` packed tokens, where it pays
            (docs/performance.md); ``True``: every group. Both need SDPA attention and no sliding-window layers, else
            the prompt's keys/values are shared as before.
        fused_head: run the output head inside the log-softmax, block by block over the vocabulary, in the training,
            reference and old-log-prob passes: the ``[tokens, vocabulary]`` logits (and their gradient) are never held
            whole, for one more head product in the backward pass (:func:`~polopt_lightning.step.logprobs.
            head_log_softmax`; the same log-probs, entropies and gradients within float tolerance). ``None``: where
            the logits would exceed one chunk (``logprobs.CHUNK_ELEMENTS``, 8M floats) and the model allows it
            (:func:`~polopt_lightning.step.logprobs.fusable_head`); ``True``: always (an error where the model does not
            allow it); ``False``: never. verl's ``use_fused_kernels``, TRL's Liger loss.
        padding_free: run the training, reference and old-log-prob passes on the rows' real tokens only, packed into one
            sequence with each group's prompt once (with ``share_prompt``, also under gradient checkpointing), attention
            segment by segment so that it never crosses sequences (:mod:`~polopt_lightning.step.varlen`): no pass
            computes padding, whatever the completions' lengths. The same log-probs within float tolerance. Needs the
            fused head's model types, SDPA attention, no sliding windows and the weights whole on each process (``True``:
            an error names what is missing). ``None``: a pass's rows pack on the CPU where their completions are at
            least 128 tokens wide with at most 80% of the padded positions real and the model allows it
            (:func:`~polopt_lightning.step.logprobs.pads_enough`; measured: docs/performance.md), else they run padded;
            ``False``: never.
        balance_tokens: under data parallelism, move whole groups between the processes after the rollout so that each
            process's share of every optimizer step holds about as many tokens (:mod:`~polopt_lightning.step.balance`,
            verl's ``balance_batch``): no process waits at the gradient's reduction for the one that drew the longest
            completions. The steps hold the same completions either way (the same update within float tolerance);
            logs ``token_imbalance`` (the largest process's tokens over the mean) and ``token_imbalance_before``.
            ``None``: where the passes' work follows the real tokens (``padding_free=True``, or ``micro_batch_tokens``'s
            pieces of similar lengths); a padded pass in one piece computes every row at its longest completion's
            width, and the process holding the longest group pays that whatever the split, so there it would only add
            padding (measured: docs/performance.md). ``True``: always; ``False``: never. Nothing in a single process.
        reuse_sampling_logprobs: off-policy updates take the sampler's log-probs as old log-probs instead of a
            second forward pass, where they match the training numerics (dropout off, the sampler in the policy's
            own precision); otherwise the pass runs, for every row but the first mini-batch's.
        disable_dropout: dropout off in the policy (the peers' default; keeps importance ratios exact).
        is_correction: correct for the sampler's numerics (:func:`sampler_weights`): each token's (or sequence's)
            advantage times ``exp(old - sampler)``, the trainer's log-prob at sampling time against the sampler's,
            truncated or masked at ``is_cap``. ``None``: where the rollout backend asks for it (vLLM's); the
            transformers backend samples with the trainer's numerics.
        is_mode: ``"token_truncate"``, ``"token_mask"``, ``"sequence_truncate"`` or ``"sequence_mask"`` (a
            sequence's weight is the product of its tokens'; ``mask`` drops what exceeds the cap instead of capping it).
            ``None``: ``token_truncate`` for objectives that take an advantage a token, ``sequence_truncate`` for those
            that take one a sequence (GSPO).
        is_cap: the largest weight kept.
        entropy_coef: an entropy bonus, ``loss - entropy_coef x H`` with ``H`` the policy's mean per-token entropy
            over the mini-batch (:mod:`~polopt_lightning.step.entropy`); with ``entropy_target`` it is the starting value
            of an adaptive coefficient. 0: none.
        entropy_aggregation: how the bonus's ``H`` averages the tokens' entropies: ``"token-mean"``, one mean over the
            mini-batch's tokens whatever the objective (TRL's); ``"objective"``, as the objective aggregates its loss
            (:meth:`~polopt_lightning.objectives.Objective.aggregate_tokens`: GRPO's each sequence's token mean, then
            over sequences), verl's ``entropy_coeff`` with its ``loss_agg_mode``. The adaptive coefficient and
            ``train/entropy`` read the token mean either way.
        entropy_target: the target entropy (nats per token) of the adaptive coefficient (Skywork-OR1, TRL's
            ``use_adaptive_entropy``): it rises by ``entropy_coef_delta`` after a step at or below the target, falls
            otherwise, within ``[entropy_coef_min, entropy_coef_max]``, and acts after steps at or below the target.
            ``None``: the coefficient is fixed.
        top_entropy_quantile: train the policy-gradient term only on this share of each mini-batch's tokens, those of
            highest entropy under the policy that sampled them (Wang et al. 2025; 0.2 in the paper); 1: every token.
            One extra forward pass per rollout (none off-policy, where the old log-probs' pass gives them).
    """

    num_iterations: int = 1
    mini_batches: int = 1
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    max_grad_norm: float | None = 1.0
    micro_batch_tokens: int | None = None
    gradient_checkpointing: bool = False
    share_prompt: bool = True
    pack_groups: bool | None = None
    fused_head: bool | None = None
    padding_free: bool | None = None
    balance_tokens: bool | None = None
    reuse_sampling_logprobs: bool = True
    disable_dropout: bool = True
    is_correction: bool | None = None
    is_mode: str | None = None
    is_cap: float = 2.0
    entropy_coef: float = 0.0
    entropy_aggregation: str = "token-mean"
    entropy_target: float | None = None
    entropy_coef_delta: float = 0.005
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    top_entropy_quantile: float = 1.0

    KEY = "update"
    RULES = {
        "num_iterations": (lambda v: v >= 1, ">= 1"),
        "mini_batches": (lambda v: v >= 1, ">= 1"),
        "lr_schedule": (lambda v: v in LR_SCHEDULES, f"one of {LR_SCHEDULES}"),
        "warmup_steps": (lambda v: v >= 0, ">= 0"),
        "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
        "max_grad_norm": (lambda v: v is None or v >= 0, ">= 0 or None"),
        "micro_batch_tokens": (lambda v: v is None or v >= 1, ">= 1 or None"),
        "is_mode": (lambda v: v is None or v in IS_MODES, f"one of {IS_MODES} or None"),
        "is_cap": (lambda v: v >= 1, ">= 1"),
        "entropy_aggregation": (lambda v: v in ENTROPY_AGGREGATIONS, f"one of {ENTROPY_AGGREGATIONS}"),
        "entropy_target": (lambda v: v is None or v >= 0, ">= 0 or None"),
        "entropy_coef_delta": (lambda v: v >= 0, ">= 0"),
        "entropy_coef_max": (lambda v: v >= 0, ">= 0"),
        "top_entropy_quantile": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.entropy_coef_min <= self.entropy_coef_max:
            raise ValueError(f"update.entropy_coef_min={self.entropy_coef_min} must be <= update.entropy_coef_max="
                             f"{self.entropy_coef_max}")

    @property
    def off_policy(self) -> bool:
        """Whether the policy moves between sampling and some update: then old log-probs are needed."""
        return self.num_iterations > 1 or self.mini_batches > 1


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
    lengths = exp.attention_mask[rows].sum(-1).clamp(min=1)
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


def _gradients(model: nn.Module | list[nn.Parameter]) -> list[Tensor]:
    """The gradients of ``model``'s parameters (or of a list of parameters) that have one."""
    params = model.parameters() if isinstance(model, nn.Module) else model
    return [p.grad for p in params if p.grad is not None]


def grad_norm(model: nn.Module | list[nn.Parameter]) -> Tensor:
    """The global L2 norm of the gradients of ``model`` (or of a list of parameters); for sharded (DTensor) gradients,
    of every process's shards together."""
    from torch.distributed.tensor import DTensor

    grads = [g.detach() for g in _gradients(model)]
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


def scale_gradients(model: nn.Module | list[nn.Parameter], max_norm: float, norm: Tensor) -> None:
    """Clip by global norm with the norm already measured, as ``torch.nn.utils.clip_grad_norm_`` does (the same
    factor ``max_norm / (norm + 1e-6)``, computed the same way, so the same bits), except that it skips the
    multiplication when the factor is 1 (a pass over every gradient that changes nothing)."""
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if float(factor) < 1.0:
        grads = _gradients(model)
        for device in dict.fromkeys(g.device for g in grads):
            torch._foreach_mul_([g for g in grads if g.device == device], factor.to(device))


class Updater:
    """A rollout's optimizer steps (:meth:`run`): the old log-probs off-policy updates need, the reference's, the
    mini-batches of every pass, each one's gradient accumulated over micro-batches (:meth:`accumulate`: the objective
    and the loss terms, backward, the metrics reduced), a non-finite step skipped, clipping, the optimizer and schedule
    steps.

    Its collaborators are explicit: the ``policy`` it trains, the ``objective``, the ``scorer`` (log-probs, entropies
    and the reference's log-probs), the rollout ``engine`` (told of every optimizer step; it says whether its
    log-probs match the policy's and whether its samples need the sampler correction), the ``config``, the supervised
    ``anchor`` (or ``None``) and the ``loop`` that runs it (:class:`~polopt_lightning.step.loop.TrainingLoop`: backward,
    clipping, the optimizer step, gradient synchronisation, the step counter). ``reference``: whether the update needs
    the reference's log-probs (the KL term or its tracking); ``reuse_sampling_logprobs``: the sampler's log-probs may
    stand for the old ones when the engine says they match; ``seed``: the mini-batch orders are drawn from it and the
    step counter; ``terms``: the loss terms (:mod:`~polopt_lightning.step.terms`) in the order they act, ``None``:
    those the settings ask for (:func:`~polopt_lightning.step.terms.build_terms`); ``critic``: PPO's value model, trained
    by its value loss in the same optimizer steps (a parameter group of the same optimizer), its gradient clipped by
    its own norm, alone during ``critic_config.warmup_steps`` (:class:`~polopt_lightning.step.critic.CriticConfig`).
    The module builds it with a
    :class:`~polopt_lightning.step.loop.LightningLoop`; without Lightning, :class:`~polopt_lightning.step.loop.TorchLoop`
    runs it.
    """

    def __init__(self, policy: nn.Module, objective: Any, scorer: Any, engine: Any, config: UpdateConfig,
                 loop: TrainingLoop, *, anchor: Any = None, reference: bool = False,
                 reuse_sampling_logprobs: bool = False, seed: int = 0, terms: list[LossTerm] | None = None,
                 critic: nn.Module | None = None, critic_config: Any = None) -> None:
        self.policy, self.objective, self.scorer, self.engine = policy, objective, scorer, engine
        #: PPO's value model and its settings (:mod:`~polopt_lightning.step.critic`), trained beside the policy
        self.critic, self.critic_config = critic, critic_config
        self.config, self.loop, self.anchor = config, loop, anchor
        self.reference, self.reuse_sampling_logprobs, self.seed = reference, reuse_sampling_logprobs, seed
        #: the entropy bonus's coefficient (and its adaptive state, saved in checkpoints) and the top-entropy mask's share
        self.entropy = EntropyControl.of(config)
        self.terms = build_terms(self) if terms is None else list(terms)

    def run(self, exp: Experience, optimizer: Any, scheduler: Any) -> dict[str, Tensor]:
        """Every optimizer step of one rollout; returns their metrics (means; ``skipped_updates`` summed)."""
        config, loop, policy, scorer = self.config, self.loop, self.policy, self.scorer
        n = exp.completion_ids.shape[0]
        if n < config.mini_batches:
            prompts = int(exp.group_index.max()) + 1
            raise ValueError(f"update.mini_batches={config.mini_batches} is more than the rollout's {n} completions "
                             f"({prompts} prompts x num_generations={n // prompts})")
        size = math.ceil(n / config.mini_batches)

        def order(i: int) -> Tensor:
            return mini_batch_order(exp.group_index.cpu(), self.seed + loop.global_step + i * config.mini_batches,
                                    config.share_prompt)

        first, balanced = order(0), {}
        if self.balances() and world_size() > 1:  # each process's share of every step: as many tokens
            exp, first, balanced = balance(exp, first, size, loop.device)
            first = order(0) if first is None else first
        # the mini-batch orders of every pass, drawn up front: the first mini-batch needs no old-log-prob pass
        orders = [first, *(order(i) for i in range(1, config.num_iterations))]
        needs_entropies = any(term.needs_entropies for term in self.terms)
        own_old = False  # whether the first update records its rows' old log-probs itself
        with torch.no_grad():
            if config.off_policy:  # on-policy, old == current log-probs detached: no pass needed
                if self.reuse_sampling_logprobs and self.engine.logprobs_match(policy):
                    exp.old_logprobs = exp.sampling_logprobs
                elif needs_entropies:  # the top-entropy mask needs every row's entropies: one pass gives both
                    exp.old_logprobs, exp.entropies = scorer.logprobs(policy, exp, slice(None), with_entropy=True)
                else:
                    later = orders[0][size:].to(loop.device)
                    exp.old_logprobs = torch.zeros_like(exp.sampling_logprobs)
                    if later.numel():  # none when one mini-batch holds the whole rollout (mu > 1)
                        exp.old_logprobs[later] = scorer.logprobs(policy, exp, later)[0]
                    own_old = True
            if needs_entropies and exp.entropies is None:  # the sampling policy's, for every pass of the rollout
                exp.entropies = scorer.logprobs(policy, exp, slice(None), with_entropy=True)[1]
            # only the KL term (or its tracking) needs the reference; a KL reward penalty has taken it already
            if exp.ref_logprobs is None and self.reference:
                exp.ref_logprobs = scorer.reference(exp)

        updates = [(i, start) for i in range(len(orders)) for start in range(0, n, size)]
        # Lightning stops between training steps only: a rollout's updates stop at trainer.max_steps themselves, so
        # max_steps=3 with 2 updates a rollout stops after the third update, not the fourth
        last = loop.max_steps
        if last is not None and loop.global_step + len(updates) > last:
            updates = updates[:max(last - loop.global_step, 1)]
            rank_zero_info(f"trainer.max_steps={last}: the last rollout makes {len(updates)} of its optimizer steps")
        step_metrics = [self.step(exp, orders[i][start:start + size].to(loop.device), optimizer, scheduler,
                                  record_old=own_old and i == 0 and start == 0) for i, start in updates]
        gap = {}
        if exp.old_logprobs is not None and exp.old_logprobs is not exp.sampling_logprobs and \
                not any(isinstance(term, SamplerCorrection) for term in self.terms):
            gap = SamplerCorrection.gap(self, exp)  # the sampler's numerics against the trainer's, corrected or not
        return {**{key: (torch.stack([m[key] for m in step_metrics]).sum() if key == "skipped_updates"
                         else torch.stack([m[key] for m in step_metrics]).mean()) for key in step_metrics[0]},
                **balanced, **gap}

    def balances(self) -> bool:
        """Whether groups are dealt between the processes by their tokens (``update.balance_tokens``; ``None``: where
        the passes' work follows the real tokens)."""
        config = self.config
        if config.balance_tokens is None:
            return bool(config.padding_free is True or config.micro_batch_tokens)  # the same on every process
        return config.balance_tokens

    def micro_batches(self, exp: Experience, rows: Tensor) -> list[Tensor]:
        """The mini-batch ``rows`` in pieces of at most ``micro_batch_tokens`` tokens (:func:`micro_batches`), as many
        on every process (:func:`even_pieces`)."""
        pieces = micro_batches(exp, rows, self.config.micro_batch_tokens, self.config.share_prompt)
        return even_pieces(pieces, self.policy, self.loop.device)

    def step(self, exp: Experience, rows: Tensor, optimizer: Any, scheduler: Any,
             record_old: bool = False) -> dict[str, Tensor]:
        """One optimizer step on the completions ``rows`` of the rollout (see :meth:`accumulate`)."""
        loop = self.loop
        optimizer.zero_grad(set_to_none=True)
        metrics = self.accumulate(exp, rows, record_old)
        critic_params = self.critic_params  # once a step (FSDP2 replaces them once it shards)
        critic_norm = self.critic_gradients(metrics, critic_params)
        # Under autocast (Lightning's *-mixed precisions wrap the whole training_step) the forward cached a low-precision
        # copy of every trainable weight, kept until the context exits and never refreshed: the next mini-batch's
        # forward, after this update, would run on the weights from before it (measured: the same output after an
        # in-place change). Dropping the cache once the backward is done also frees that copy before the optimizer step.
        torch.clear_autocast_cache()
        metrics["grad_norm"] = grad_norm(self.policy)
        # A non-finite loss or gradient never reaches the weights: the gradients are dropped, so the optimizer's step
        # leaves every parameter and its state as they are (it skips parameters without a gradient) while the step
        # still counts. `train/skipped_updates` says so, and the collapse monitor acts on it. The norm is the same on
        # every process (gradients are reduced first), so all of them skip together.
        finite = (bool(torch.isfinite(metrics["grad_norm"])) and bool(torch.isfinite(metrics["loss"]))
                  and bool(torch.isfinite(critic_norm)))
        metrics["skipped_updates"] = torch.tensor(0.0 if finite else 1.0, device=metrics["grad_norm"].device)
        limit = self.config.max_grad_norm
        if not finite:
            optimizer.zero_grad(set_to_none=True)
            rank_zero_warn(f"step {loop.global_step}: non-finite loss ({float(metrics['loss']):.4g}) or gradient norm "
                           f"({float(metrics['grad_norm']):.4g}); the update is skipped")
        elif limit:
            in_place = self.clips_in_place()
            if self.critic is not None:  # by its own norm, as verl's critic clips apart from its actor
                if in_place:
                    scale_gradients(critic_params, limit, critic_norm)
                else:  # sharded gradients: torch's clip, the critic's alone
                    torch.nn.utils.clip_grad_norm_(critic_params, limit)
            if in_place:  # the norm is known: one scaling pass, and none when it is within the limit
                scale_gradients(self.policy, limit, metrics["grad_norm"])
            elif self.critic is not None:  # the policy's alone (Lightning's clip would take the critic's with it)
                torch.nn.utils.clip_grad_norm_([p for p in self.policy.parameters() if p.grad is not None], limit)
            else:
                loop.clip_gradients(optimizer, limit)
        loop.optimizer_step(optimizer)
        self.engine.policy_updated(self.policy)
        # gradients are not needed past the step: freeing them leaves their memory to the next rollout (which holds
        # no activations but may hold a sampler copy or prepacked decoding weights)
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return metrics

    @property
    def critic_params(self) -> list[nn.Parameter]:
        """The critic's own parameters (a shared trunk's: the head's), whose gradient it clips by its own norm; taken
        when asked, since FSDP2 replaces the parameters it shards once the processes exist."""
        from .critic import own_parameters

        return [] if self.critic is None else own_parameters(self.critic, self.policy)

    def critic_gradients(self, metrics: dict[str, Tensor], params: list[nn.Parameter]) -> Tensor:
        """With a critic: the gradient norm of its own ``params`` (logged as ``critic/grad_norm``) and, during its warm-up, the policy's
        gradients dropped (the optimizer skips parameters without one: the policy and its optimizer state stay as they
        are). 0 without a critic."""
        if self.critic is None:
            return torch.zeros(())
        norm = metrics["critic/grad_norm"] = grad_norm(params)
        if self.loop.global_step < self.critic_config.warmup_steps:
            for p in self.policy.parameters():
                p.grad = None
            metrics["critic/warmup"] = torch.ones((), device=norm.device)
        else:
            metrics["critic/warmup"] = torch.zeros((), device=norm.device)
        return norm

    def clips_in_place(self) -> bool:
        """Whether the loop lets the update scale the gradients by the norm it measured (see
        :func:`~polopt_lightning.step.loop.clips_in_place`)."""
        return self.loop.clips_in_place(self.policy)

    def accumulate(self, exp: Experience, rows: Tensor, record_old: bool = False) -> dict[str, Tensor]:
        """Backward of the objective and the loss terms (:mod:`~polopt_lightning.step.terms`) on the completions
        ``rows``, in micro-batches; returns the step's metrics.

        ``record_old``: the policy has not moved since sampling, so these rows' old log-probs are their current
        ones; they are used as such and stored in ``exp.old_logprobs`` for later passes.
        """
        objective, device, policy, loop = self.objective, self.loop.device, self.policy, self.loop
        full_mask = exp.completion_mask[rows]
        # Under data parallelism each process holds its share of the mini-batch and the strategy averages the
        # gradients over the W processes: dividing by the normaliser of the whole mini-batch (summed over processes)
        # and multiplying by W gives exactly the gradient of one process holding every row. Token-level objectives
        # thereby divide by the global token count, not by a mean of per-process means.
        world = world_size()
        total_weight = all_reduce(objective.normaliser(full_mask))
        sums: dict[str, Tensor] = {}
        counts: dict[str, Tensor] = {}  # the tokens or sequences of each mean metric (ObjectiveOutput.counts)
        entropy_sum = torch.zeros((), device=device)
        pieces = self.micro_batches(exp, rows)
        batch = MiniBatch(exp, rows, objective, world, policy, loop)
        for term in self.terms:
            sums.update(term.begin(batch))
        for k, micro in enumerate(pieces):
            # trim padding past the longest completion of this piece (the objectives do not depend on the width)
            width = max(int(exp.attention_mask[micro].sum(-1).max()), 1)
            mask = exp.completion_mask[micro, :width]
            with loop.no_sync(policy, last=k == len(pieces) - 1):
                logprobs, entropy = self.scorer.logprobs(policy, exp, micro, width, with_entropy=True)
                if record_old:
                    exp.old_logprobs[micro, :width] = logprobs.detach()
                old = (logprobs.detach() if record_old or exp.old_logprobs is None
                       else exp.old_logprobs[micro, :width])
                ref = exp.ref_logprobs[micro, :width] if exp.ref_logprobs is not None else None
                # The loss is a sum over the mini-batch divided by the objective's normaliser: weighting each piece
                # by its share of that normaliser makes the accumulated gradient exactly the full mini-batch's.
                share = objective.normaliser(mask) / total_weight.clamp(min=1e-12)
                piece = Piece(micro, width, mask, logprobs, entropy, old, ref, share)
                advantages = advantages_for(self.terms, batch, piece)
                out = objective(logprobs=logprobs, old_logprobs=old, advantages=advantages, mask=mask,
                                ref_logprobs=ref)
                loss = out.loss * (share * world)
                for term in self.terms:
                    extra = term.loss(batch, piece, out)
                    if extra is not None:
                        loss = loss + extra
                out.metrics.update(piece.metrics)
                out.counts.update(piece.counts)
                loop.backward(loss)
            for key, value in {"loss": out.loss.detach(), **out.metrics}.items():
                if key.endswith("_max"):
                    sums[key] = torch.maximum(sums[key], value) if key in sums else value
                elif key in out.counts:  # a mean over tokens or sequences: weighted by how many it averages
                    count = out.counts[key].to(value.dtype)
                    sums[key] = sums.get(key, 0.0) + value * count
                    counts[key] = counts.get(key, 0.0) + count
                else:
                    sums[key] = sums.get(key, 0.0) + value * share
            entropy_sum = entropy_sum + (entropy.detach() * mask).sum()
        # every metric over the whole mini-batch: normaliser-weighted sums added up, means over every process's tokens
        # or sequences, maxima of maxima, and the entropy per token over every process's tokens
        metrics = reduce_metrics(sums, counts)
        batch.tokens = tokens = all_reduce(full_mask.sum().to(entropy_sum))
        metrics["entropy"] = all_reduce(entropy_sum.detach()) / tokens.clamp(min=1)
        for term in self.terms:
            metrics.update(term.end(batch))
        return metrics
