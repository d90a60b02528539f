"""The rollout interface: sampling settings, the batch a rollout returns, the backend's contract, and the sampling
helpers every backend shares (filtering, drawing a token)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class SamplingConfig:
    """How completions are sampled.

    Attributes:
        max_new_tokens: completion length cap (tokens).
        min_new_tokens: EOS is forbidden before this many tokens (benchmarks force full length with it).
        temperature: softmax temperature; 0 means greedy.
        top_p: nucleus sampling mass (1.0 disables).
        top_k: keep the k most likely tokens (0 disables).
    """

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"generation.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"generation.min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"generation.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"generation.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"generation.top_k must be >= 0, got {self.top_k}")

    @classmethod
    def of(cls, value: SamplingConfig | Mapping[str, Any] | None, **defaults: Any) -> SamplingConfig:
        """``value`` itself, or the settings a dict gives over ``defaults``."""
        if isinstance(value, cls):
            return value
        return cls(**{**defaults, **dict(value or {})})

    @property
    def logprob_temperature(self) -> float:
        """Temperature at which the returned log-probs are computed (1 for greedy decoding)."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class Completions:
    """``N`` rows of prompts and their sampled completions, laid out group by group: what a rollout returns and what
    the update's experience (:class:`~polopt_lightning.step.experience.Experience`) carries on.

    Attributes:
        prompt_ids, prompt_mask: ``[N, Lp]`` left-padded prompts (each prompt repeated for its G completions).
        completion_ids: ``[N, T]`` sampled tokens (pad after EOS).
        completion_mask: ``[N, T]`` 1 on completion tokens, EOS included, 0 after.
        sampling_logprobs: ``[N, T]`` log-probs of the sampled tokens under the tempered, unfiltered distribution
            (what a fresh forward pass at the same temperature gives).
        finished: ``[N]`` True when the completion ended with EOS, False when it hit ``max_new_tokens``.
        context_mask: ``[N, T]`` 1 on every token of the completion's context, the policy's and an environment's
            (a multi-turn rollout's tool results, :mod:`~polopt_lightning.rollout.multi_turn`), which the forward
            passes attend to; ``completion_mask`` is then 1 on the policy's own tokens only, the ones the loss, the
            importance ratios and the sampling log-probs cover. ``None``: the completion mask (one turn).
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    sampling_logprobs: Tensor
    finished: Tensor
    context_mask: Tensor | None = field(default=None, kw_only=True)

    @property
    def completion_lengths(self) -> Tensor:
        return self.completion_mask.sum(-1)

    @property
    def attention_mask(self) -> Tensor:
        """The completion tokens the forward passes attend to: the context mask, or the completion mask (one turn).
        Always contiguous from the first position, so its row sums are the completions' widths."""
        return self.completion_mask if self.context_mask is None else self.context_mask


@dataclass
class RolloutBatch(Completions):
    """Completions for ``P`` prompts times ``G`` generations, ``N = P * G`` rows (:class:`Completions`' fields) and
    ``group_size``, ``G``. A multi-turn rollout also gives each row's ``conversations`` (its turns as messages,
    TRL's conversational completion) and ``extras`` (per-row columns for the reward functions: ``env_reward``,
    ``turn_rewards``, ``tool_calls``)."""

    group_size: int
    conversations: list[list[dict[str, str]]] | None = field(default=None, kw_only=True)
    extras: dict[str, list[Any]] | None = field(default=None, kw_only=True)


class RolloutEngine(ABC):
    """A rollout backend: turns prompts into ``G`` completions each, with the sampled tokens' log-probs.

    The module calls :meth:`generate` for every rollout (training and validation), :meth:`logprobs_match` before an
    off-policy update, and :meth:`policy_updated` after every optimizer step. Backends: ``"hf"``
    (:class:`~polopt_lightning.rollout.hf.HFRolloutEngine`, the default); a new one is a subclass in a file of its own,
    registered in :data:`polopt_lightning.rollout.ENGINES` and given a ``conf/rollout/<name>.yaml``.
    """

    @abstractmethod
    def generate(
        self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, num_generations: int,
        sampling: SamplingConfig, eos_token_id: int | list[int], pad_token_id: int,
        generator: torch.Generator | None = None,
    ) -> RolloutBatch: ...

    # whether the update should correct for this backend's numerics by default (update.is_correction=null)
    corrects_sampler: bool = False
    # whether it samples apart from the trainer (another process): then a submitted rollout runs while training does
    samples_apart: bool = False

    def submit(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, num_generations: int,
               sampling: SamplingConfig, eos_token_id: int | list[int], pad_token_id: int,
               generator: torch.Generator | None = None, **kwargs: Any) -> Future[RolloutBatch]:
        """:meth:`generate`'s rollout as a future, sampled from ``model``'s weights as they are now, the random numbers
        drawn from ``generator`` now: the asynchronous pipeline (``experience.max_staleness``) submits the next
        rollouts before it trains on earlier ones. Default: sampled here, before returning; a backend that
        :attr:`samples_apart` returns at once and samples while the trainer trains."""
        future: Future[RolloutBatch] = Future()  # a failure raises here, at once
        future.set_result(self.generate(model, prompt_ids, prompt_mask, num_generations, sampling, eos_token_id,
                                        pad_token_id, generator=generator, **kwargs))
        return future

    def logprobs_match(self, model: nn.Module) -> bool:
        """Whether the sampling log-probs equal what a training forward of ``model`` computes (then an off-policy
        update may use them as old log-probs instead of a forward pass). Engines with other numerics return False."""
        return True

    def policy_updated(self, model: nn.Module) -> None:
        """``model``'s weights changed (an optimizer step): a backend that samples from weights of its own (another
        process, an inference engine) refreshes them before its next :meth:`generate`. Default: nothing (the
        backend samples ``model`` itself)."""
        return None

    def close(self) -> None:
        """Release what the backend holds beyond ``model`` (an inference engine, its process groups, files) before the
        process ends; the next :meth:`generate` starts it again. ``polopt-train`` calls it once training and the final
        validation are done. Default: nothing."""
        return None


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Top-k then nucleus filtering (sets removed logits to -inf)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        remove_sorted = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses top_p
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def kept_log_mass(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                  completion_mask: Tensor, sampling: SamplingConfig, max_elements: int = 1 << 25) -> Tensor:
    """``log S`` ``[N, T]``: the log of the probability mass that ``sampling``'s top-k/top-p filter keeps at each
    completion position, under ``model``'s tempered distribution (0 where nothing is filtered, and at padding).

    An engine whose log-probs are renormalised over the kept tokens (vLLM's processed log-probs) returns
    ``log p - log S``; adding this back gives the log-probs of the tempered, unfiltered distribution that
    :class:`RolloutBatch` promises, so the sampler correction's weight measures the engine's disagreement with the
    trainer and not the kept mass (huggingface/trl#6789). One forward pass, ``max_elements`` logits at a time.
    """
    from .._hf import last_positions, positions_from_mask
    from ..models import evaluating

    N, T = completion_ids.shape
    out = torch.zeros(N, T, device=completion_ids.device)
    if sampling.temperature <= 0 or (sampling.top_p >= 1.0 and not sampling.top_k) or T == 0:
        return out
    vocab = model.get_output_embeddings().weight.shape[0]
    step = max(1, max_elements // max(1, T * vocab))
    with torch.no_grad(), evaluating(model, keep_quantized=True):  # as the trainer's own log-prob passes run
        for start in range(0, N, step):
            rows = slice(start, start + step)
            ids = torch.cat([prompt_ids[rows], completion_ids[rows]], dim=1)
            mask = torch.cat([prompt_mask[rows], completion_mask[rows].to(prompt_mask.dtype)], dim=1)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask),
                           use_cache=False, logits_to_keep=last_positions(ids.shape[1], T + 1, ids.device),
                           ).logits[:, :-1].float() / sampling.temperature  # [n, T, V]
            kept = filter_logits(logits, sampling.top_k, sampling.top_p)
            out[rows] = torch.logsumexp(kept, -1) - torch.logsumexp(logits, -1)
    return out * completion_mask


INVERSE_CDF_VOCAB = 32768  # from this vocabulary size on, tokens are drawn by inverse CDF (see sample_tokens)


def sample_tokens(probs: Tensor, generator: torch.Generator | None = None, rows: Tensor | None = None,
                  total: int | None = None) -> Tensor:
    """One token per row ``[N]`` from the distributions ``probs`` ``[N, V]``.

    ``torch.multinomial`` draws one exponential variate per vocabulary entry and row (a race): at a 152k-token
    vocabulary that costs more per decoded token than the head's product on a CPU. From
    :data:`INVERSE_CDF_VOCAB` tokens on, each row instead draws one uniform number and takes the first token whose
    cumulative probability (float64) exceeds it: the same distribution from N random numbers instead of N x V. Smaller
    vocabularies keep ``torch.multinomial``, so their runs draw exactly the tokens they always did.

    ``rows`` (with ``total``): where ``probs``' rows sit in a batch of ``total`` rows of which the others are left out
    (finished completions). The inverse-CDF draw still takes ``total`` uniform numbers and uses these rows' own, so
    leaving rows out changes no other row's token; ``torch.multinomial`` draws for the given rows only.
    """
    if probs.shape[-1] < INVERSE_CDF_VOCAB:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if rows is not None and total is None:
        raise ValueError("sample_tokens: rows needs total, the number of rows they are taken from")
    cdf = probs.double().cumsum(-1)  # [N, V]
    u = torch.rand(probs.shape[0] if rows is None else total, 1, generator=generator, device=probs.device,
                   dtype=torch.float64)
    u = (u if rows is None else u[rows]) * cdf[:, -1:]
    # the first index whose cumulative mass exceeds u; a zero-probability token (a flat cdf step) is never chosen
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
