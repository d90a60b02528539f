"""The algorithm's pieces around the objective, as loss terms the update runs in order (:class:`LossTerm`):

- :class:`SamplerCorrection` weights each token's (or sequence's) advantage by ``exp(old - sampler)``, capped or masked
  (truncated importance sampling for a sampler whose numerics are not the trainer's; ``update.is_*``);
- :class:`TopEntropyMask` keeps the policy-gradient term on the highest-entropy tokens only (``update.top_entropy_quantile``);
- :class:`EntropyBonus` subtracts ``coef x`` the policy's entropy, its coefficient fixed or adaptive (``update.entropy_*``);
- :class:`KLWatch` measures the policy's KL from the reference where the objective does not train on it (``track_kl``,
  a KL reward penalty);
- :class:`AnchorTerm` adds ``lambda x`` the NLL of the reference answers (the module's ``anchor``).

Each is registered by name in :data:`TERMS` (:func:`register_term`, as verl registers its policy losses) with a
:meth:`LossTerm.build` that reads the update's settings and returns the term, or ``None`` where the settings leave it
off; :func:`build_terms` gives an update's terms in registration order. :class:`~polopt_lightning.step.update.Updater`
only splits each mini-batch into micro-batches, runs the objective and these hooks on each, backward, and reduces the
metrics; ``Updater(terms=[...])`` runs a list of its own instead (the built-in ones from :func:`build_terms`, and more).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..distributed import all_reduce, reduce_metrics, world_size
from ..objectives.base import kl_estimate, masked_max, masked_mean
from .logprobs import completion_logprobs, group_rows

if TYPE_CHECKING:
    from .experience import Experience
    from .loop import TrainingLoop


@dataclass
class MiniBatch:
    """One optimizer step's completions: the rollout ``exp``, the rows ``rows`` of it, the objective, the processes
    ``world`` the strategy averages over, the policy and the loop that runs backward. ``keep``: the tokens ``[B, T]``
    (of the whole rollout) that carry the policy gradient, when a term masks some out; ``tokens``: the mini-batch's
    completion tokens over every process, known once the micro-batches are done (for :meth:`LossTerm.end`)."""

    exp: Experience
    rows: Tensor
    objective: Any
    world: int
    policy: nn.Module
    loop: TrainingLoop
    keep: Tensor | None = None
    tokens: Tensor | None = None


@dataclass
class Piece:
    """One micro-batch: its rows, its width (padding past its longest completion trimmed), the completion ``mask``,
    the policy's ``logprobs`` and ``entropy`` (with gradient), the ``old`` and reference (``ref``) log-probs, and its
    ``share`` of the mini-batch (its part of the objective's normaliser: the pieces' shares add up to 1 over every
    process). Terms add their per-piece metrics to ``metrics``: a mean with its count in ``counts`` (how many tokens or
    sequences it is over, as :class:`~polopt_lightning.objectives.ObjectiveOutput.counts`) is averaged over the
    pieces by those counts; one without a count is summed over the pieces weighted by ``share``."""

    rows: Tensor
    width: int
    mask: Tensor
    logprobs: Tensor
    entropy: Tensor
    old: Tensor
    ref: Tensor | None
    share: Tensor | float = 1.0
    metrics: dict[str, Tensor] = field(default_factory=dict)
    counts: dict[str, Tensor] = field(default_factory=dict)


class LossTerm:
    """A part of the update's loss or of its advantages. Every hook but :meth:`build` may be left as is (it does
    nothing); the inherited :meth:`build` puts the term into every update.

    An update built by the module takes the registered terms its settings ask for (:func:`build_terms`); a term added
    to a module already built goes into its list: ``module.updater.terms.append(MyTerm())``. Under data parallelism a
    term that averages over the mini-batch divides by a count over every process
    (:func:`~polopt_lightning.distributed.all_reduce`), as the built-in ones do.

    Attributes:
        name: its name in :data:`TERMS`.
        needs_entropies: the term reads the sampling policy's per-token entropies ``exp.entropies`` (the update
            computes them once a rollout, with the old log-probs where it computes those).
    """

    name = ""
    needs_entropies = False

    @classmethod
    def build(cls, updater: Any) -> LossTerm | None:
        """The term for this update (its ``config``, ``objective``, ``engine``, ``anchor``, ``entropy``,
        ``reference``), or ``None`` where its settings leave it off. Here: ``cls()``, in every update."""
        return cls()

    def __repr__(self) -> str:
        settings = {k: v for k, v in vars(self).items() if isinstance(v, (str, int, float, bool, type(None)))}
        return f"{type(self).__name__}({self.name!r}{''.join(f', {k}={v!r}' for k, v in settings.items())})"

    def begin(self, batch: MiniBatch) -> dict[str, Tensor]:
        """Before the micro-batches; returns metrics summed over the processes (a term's own backward goes here)."""
        return {}

    def advantages(self, batch: MiniBatch, piece: Piece, advantages: Tensor) -> Tensor:
        """The piece's advantages as the objective takes them (``[n]`` or, per token, ``[n, T]``)."""
        return advantages

    def loss(self, batch: MiniBatch, piece: Piece, out: Any) -> Tensor | None:
        """What to add to the piece's loss before its backward; ``out`` is the objective's output on the piece. The
        update backpropagates ``out.loss x piece.share x batch.world`` for the objective (the strategy then averages
        the gradients over the ``world`` processes): a term whose value is a mean over the whole mini-batch returns its
        piece's sum over the mini-batch's count (over every process) times ``batch.world``, so the pieces add up to
        it. ``train/loss`` logs the objective's loss alone; a term logs its own value (:meth:`end`)."""
        return None

    def end(self, batch: MiniBatch) -> dict[str, Tensor]:
        """After the micro-batches' backward: metrics of the whole mini-batch (already over every process)."""
        return {}


#: the registered loss terms by name, in the order an update runs them
TERMS: dict[str, type[LossTerm]] = {}


def register_term(name: str) -> Callable[[type[LossTerm]], type[LossTerm]]:
    """Register a :class:`LossTerm` under ``name``: every update built afterwards asks its :meth:`~LossTerm.build`
    (updates built before keep their terms). A class of the same module and name takes its place (a notebook cell run
    again); another class under a registered name is refused."""
    def register(cls: type[LossTerm]) -> type[LossTerm]:
        known = TERMS.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"a loss term is already registered as {name!r}: {TERMS[name].__qualname__}")
        cls.name = name
        TERMS[name] = cls
        return cls
    return register


def build_terms(updater: Any) -> list[LossTerm]:
    """The terms the update's settings ask for, in registration order."""
    return [term for cls in TERMS.values() if (term := cls.build(updater)) is not None]


def advantages_for(terms: list[LossTerm], batch: MiniBatch, piece: Piece) -> Tensor:
    """What the objective takes as the piece's advantages: the rollout's, through each term's ``advantages`` in order."""
    advantages = batch.exp.advantages[piece.rows]
    if advantages.dim() == 2:  # per token (GAE): the piece's width
        advantages = advantages[:, :piece.width]
    for term in terms:
        advantages = term.advantages(batch, piece, advantages)
    return advantages


def token_level(objective: Any) -> bool:
    return bool(getattr(objective, "accepts_token_advantages", False))


def per_token(advantages: Tensor) -> Tensor:
    """``[n]`` advantages as ``[n, 1]`` (broadcast over tokens); ``[n, T]`` as they are."""
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def sampler_weights(old: Tensor, sampler: Tensor, mask: Tensor, mode: str, cap: float,
                    ) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights of sampled tokens for a sampler whose numerics differ from the trainer's (truncated IS).

    ``old`` are the trainer's log-probs of the tokens at sampling time, ``sampler`` the sampler's, ``mask`` the
    completion tokens (``[B, T]`` each). The weight is ``exp(old - sampler)`` per token (``token_*``) or its product
    over a sequence (``sequence_*``: ``[B, 1]``); ``*_truncate`` caps it at ``cap``, ``*_mask`` sets it to 0 above
    ``cap``. Returns the weights (detached) and their metrics: ``is_weight_mean`` / ``is_weight_max`` (before the cap),
    ``is_capped_frac`` (the share of tokens or sequences beyond it) and ``sampler_kl`` (k3 per token, the sampler's
    distance from the trainer on its own tokens).
    """
    valid = mask.bool()
    token_log_w = torch.where(valid, (old - sampler).detach(), 0.0)
    sequence = mode.startswith("sequence")
    units = valid.any(-1, keepdim=True) if sequence else valid
    log_w = token_log_w.sum(-1, keepdim=True) if sequence else token_log_w
    w = torch.exp(log_w.clamp(max=20.0))
    beyond = (w > cap) & units
    weights = w.clamp(max=cap) if mode.endswith("truncate") else torch.where(beyond, 0.0, w)
    metrics = {"is_weight_mean": masked_mean(w, units), "is_weight_max": masked_max(w, units),
               "is_capped_frac": masked_mean(beyond.float(), units),
               "sampler_kl": masked_mean(torch.exp(token_log_w.clamp(max=20.0)) - 1 - token_log_w, valid)}
    return weights, metrics


def sampler_counts(mask: Tensor, mode: str) -> dict[str, Tensor]:
    """How many tokens or sequences each mean of :func:`sampler_weights`' metrics is over (``ObjectiveOutput.counts``)."""
    tokens = mask.bool().sum()
    units = mask.bool().any(-1).sum() if mode.startswith("sequence") else tokens
    return {"is_weight_mean": units, "is_capped_frac": units, "sampler_kl": tokens}


@register_term("sampler_correction")
class SamplerCorrection(LossTerm):
    """Each token's (or sequence's) advantage times its importance weight (:func:`sampler_weights`): a surrogate linear
    in the advantage, so the same as weighting the policy-gradient term. On with ``update.is_correction``; where that
    is ``None``, where the rollout backend asks for it (``corrects_sampler``: vLLM's). ``update.is_mode=None``: a weight
    a token where the objective takes an advantage a token, else one a sequence."""

    def __init__(self, mode: str, cap: float, objective: Any) -> None:
        self.mode, self.cap = mode, cap
        if not mode.startswith("sequence") and not token_level(objective):
            raise ValueError(f"update.is_mode={mode}: {type(objective).__name__} takes one advantage a sequence; use "
                             "update.is_mode=sequence_truncate or sequence_mask")

    @staticmethod
    def wanted(config: Any, engine: Any) -> bool:
        """Whether the update weights the sampler's tokens (``is_correction``; ``None``: as the backend asks)."""
        on = config.is_correction
        return bool(getattr(engine, "corrects_sampler", False)) if on is None else on

    @staticmethod
    def mode_of(config: Any, objective: Any) -> str:
        """``update.is_mode``, or where it is ``None`` a weight a token for token-level objectives, else a sequence."""
        return config.is_mode or ("token_truncate" if token_level(objective) else "sequence_truncate")

    @classmethod
    def build(cls, updater: Any) -> LossTerm | None:
        config, objective = updater.config, updater.objective
        if not cls.wanted(config, updater.engine):
            return None
        return cls(cls.mode_of(config, objective), config.is_cap, objective)

    @classmethod
    def gap(cls, updater: Any, exp: Any) -> dict[str, Tensor]:
        """The sampler's distance from the trainer where the correction is off but the trainer computed the old
        log-probs itself (a sampler of other numerics: ``rollout.dtype``, a mixed ``trainer.precision``): the metrics
        the correction would log (:func:`sampler_weights` with its mode and ``update.is_cap``), weighting nothing.
        ``is_capped_frac`` is then the share of tokens (or sequences) the correction would cap. Over every process's
        rows: means weighted by their tokens or sequences, the largest weight of all."""
        mode = cls.mode_of(updater.config, updater.objective)
        _, metrics = sampler_weights(exp.old_logprobs, exp.sampling_logprobs, exp.completion_mask, mode,
                                     updater.config.is_cap)
        counts = {key: count.to(metrics[key]) for key, count in sampler_counts(exp.completion_mask, mode).items()
                  if key in metrics and not key.endswith("_max")}
        return reduce_metrics({key: value * counts[key] if key in counts else value for key, value in metrics.items()},
                              counts)

    def advantages(self, batch: MiniBatch, piece: Piece, advantages: Tensor) -> Tensor:
        mask = piece.mask
        weights, metrics = sampler_weights(piece.old, batch.exp.sampling_logprobs[piece.rows, :mask.shape[1]], mask,
                                           self.mode, self.cap)
        piece.metrics.update(metrics)
        piece.counts.update(sampler_counts(mask, self.mode))
        if weights.shape[-1] == 1:  # one weight a sequence
            return advantages * weights.squeeze(-1) if advantages.dim() == 1 else advantages * weights
        return per_token(advantages) * weights


@register_term("top_entropy_mask")
class TopEntropyMask(LossTerm):
    """The policy-gradient term on the share ``update.top_entropy_quantile`` of each mini-batch's tokens, those of
    highest entropy under the policy that sampled them (:meth:`~polopt_lightning.step.entropy.EntropyControl.top_mask`):
    the others' advantages are 0. Every objective's per-token policy term is ``A`` times a factor, so a zero advantage
    removes exactly that term (as TRL's ``per_token_loss * entropy_mask``) and leaves the KL term and the normaliser.
    Logs ``top_entropy_frac``."""

    needs_entropies = True

    def __init__(self, control: Any, objective: Any) -> None:
        self.control = control
        if not token_level(objective):
            raise ValueError(f"update.top_entropy_quantile={control.top_quantile} masks tokens out of the policy "
                             f"gradient: {type(objective).__name__} takes one advantage a sequence; use a token-"
                             "level objective (grpo, dapo, cispo, sapo, gspo_token) or top_entropy_quantile=1")

    @classmethod
    def build(cls, updater: Any) -> LossTerm | None:
        return cls(updater.entropy, updater.objective) if updater.entropy.masks else None

    def begin(self, batch: MiniBatch) -> dict[str, Tensor]:
        exp, rows = batch.exp, batch.rows
        batch.keep = torch.zeros_like(exp.completion_mask, dtype=torch.bool)
        batch.keep[rows] = self.control.top_mask(exp.entropies[rows], exp.completion_mask[rows])
        return {}

    def advantages(self, batch: MiniBatch, piece: Piece, advantages: Tensor) -> Tensor:
        return per_token(advantages) * batch.keep[piece.rows, :piece.width].to(advantages.dtype)

    def end(self, batch: MiniBatch) -> dict[str, Tensor]:
        return {"top_entropy_frac": all_reduce(batch.keep[batch.rows].sum().float()) / batch.tokens.clamp(min=1)}


@register_term("entropy_bonus")
class EntropyBonus(LossTerm):
    """``- coef x H``, ``H`` the policy's entropy over the mini-batch's tokens (those the top-entropy mask keeps, where
    one acts) on every process: their token mean (``update.entropy_aggregation="token-mean"``) or the objective's
    aggregate (``"objective"``). Its coefficient is the :class:`~polopt_lightning.step.entropy.EntropyControl`'s, which
    each step's entropy then moves (when adaptive). Logs ``entropy_coef``, the coefficient the step used."""

    def __init__(self, control: Any, config: Any) -> None:
        self.control, self.config = control, config  # the aggregation is read at each step, as the update's settings

    @classmethod
    def build(cls, updater: Any) -> LossTerm | None:
        return cls(updater.entropy, updater.config) if updater.entropy.bonus else None

    def begin(self, batch: MiniBatch) -> dict[str, Tensor]:
        rows = batch.rows
        self.coef = self.control.applied()
        self.mask = batch.keep if batch.keep is not None else batch.exp.completion_mask.bool()
        self.tokens = all_reduce(self.mask[rows].sum().float())
        # with the objective's aggregation: its normaliser of the bonus tokens over every process
        by_objective = self.config.entropy_aggregation == "objective"
        self.weight = all_reduce(batch.objective.normaliser(self.mask[rows])) if by_objective else None
        self.sum = torch.zeros((), device=batch.loop.device)
        return {}

    def loss(self, batch: MiniBatch, piece: Piece, out: Any) -> Tensor | None:
        coef, objective, world = self.coef, batch.objective, batch.world
        piece_mask = self.mask[piece.rows, :piece.width]
        piece_entropy = (piece.entropy * piece_mask).sum()
        self.sum = self.sum + piece_entropy.detach()
        if coef and self.weight is not None:  # the objective's aggregate, weighted as its loss is
            piece_share = objective.normaliser(piece_mask) / self.weight.clamp(min=1e-12)
            return -(coef * world * objective.aggregate_tokens(piece.entropy, piece_mask) * piece_share)
        if coef:  # the mean entropy over every process's bonus tokens
            return -(coef * world * piece_entropy / self.tokens.clamp(min=1))
        return None

    def end(self, batch: MiniBatch) -> dict[str, Tensor]:
        """The coefficient this step used; an adaptive one then moves for the next."""
        self.control.observe(float(all_reduce(self.sum) / self.tokens.clamp(min=1)))
        return {"entropy_coef": torch.tensor(self.coef, device=batch.loop.device)}


@register_term("kl_watch")
class KLWatch(LossTerm):
    """The policy's KL from the reference (the objective's estimator), measured where the objective has the reference's
    log-probs but does not train on the KL (``track_kl``, a KL reward penalty): logged as ``kl``, nothing trained. In
    the updates that take the reference's log-probs (``reference``) and whose objective has no KL term."""

    @classmethod
    def build(cls, updater: Any) -> LossTerm | None:
        return cls() if updater.reference and not getattr(updater.objective, "beta", 0) > 0 else None

    def loss(self, batch: MiniBatch, piece: Piece, out: Any) -> Tensor | None:
        ref = piece.ref
        if ref is not None and "kl" not in out.metrics:
            valid = piece.mask.bool()  # padding may hold -inf/NaN log-probs: zeros there, as the objectives do
            kl = kl_estimate(torch.where(valid, piece.logprobs.detach(), 0.0), torch.where(valid, ref, 0.0),
                             batch.objective.kl_estimator)
            piece.metrics["kl"], piece.counts["kl"] = masked_mean(kl, valid), valid.sum()
        return None


@register_term("anchor")
class AnchorTerm(LossTerm):
    """``lambda x NLL`` of the reference answers of the prompts the mini-batch's completions answer (one forward over
    those prompts, before the micro-batches; its gradient accumulates with the objective's before they are reduced).
    The NLL is the token mean over every process's prompts: each process divides its sum by the global count, times
    the processes the strategy averages over. With ``lambda = 0`` the NLL is measured without a backward. Logs
    ``anchor_nll`` and ``anchor_coef``."""

    def __init__(self, anchor: Any, fused_head: bool | None = None) -> None:
        self.anchor, self.fused_head = anchor, fused_head

    @classmethod
    def build(cls, updater: Any) -> LossTerm | None:
        return None if updater.anchor is None else cls(updater.anchor, updater.config.fused_head)

    def begin(self, batch: MiniBatch) -> dict[str, Tensor]:
        anchor, policy, loop, exp = self.anchor, batch.policy, batch.loop, batch.exp
        groups = torch.unique(exp.group_index[batch.rows])
        first = group_rows(exp.group_index)[2][groups]  # each group's first row: its prompt (groups are 0 .. P-1)
        mask = exp.anchor_mask[groups]
        width = max(int(mask.sum(-1).max()), 1)
        mask, ids = mask[:, :width], exp.anchor_ids[groups, :width]
        tokens = all_reduce(mask.sum().float())
        with loop.no_sync(policy, last=False), torch.set_grad_enabled(anchor.value > 0):
            logprobs, _ = completion_logprobs(policy, exp.prompt_ids[first], exp.prompt_mask[first], ids, mask,
                                              fuse=self.fused_head)
            loss, nll = anchor.loss(logprobs, mask, tokens)
            if anchor.value > 0:
                loop.backward(loss * world_size())
        # summed over the processes by the update's reduction, like the objective's metrics: the global token mean
        return {"anchor_nll": nll, "anchor_coef": torch.tensor(anchor.value / world_size(), device=loop.device)}
