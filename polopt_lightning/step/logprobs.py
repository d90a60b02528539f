"""Log-probabilities of chosen tokens without materialising a full-vocabulary log-softmax for the whole batch, and
the :class:`Scorer` that takes them for an experience's rows under the policy or the KL reference."""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import accel
from .._hf import cache_argument, last_positions, output_cache, peft_base, positions_from_mask
from ..models import evaluating, reference_context
from . import varlen

if TYPE_CHECKING:
    from .experience import Experience

# Elements of [rows, V] logits processed at once: temporaries stay at ~32 MiB in float32 whatever the batch and the
# vocabulary (55 rows of a 151,936-token vocabulary; every row of a small one).
CHUNK_ELEMENTS = 2**23
DEFAULT_CHUNK_ROWS = None  # rows per chunk: CHUNK_ELEMENTS // V


def _chunk_stats(chunk: Tensor, index: Tensor, temperature: float, with_entropy: bool
                 ) -> tuple[Tensor, Tensor, Tensor | None]:
    """A chunk of logits ``[r, V]`` (float32) -> its tempered log-normalisers, chosen logits and entropies ``[r]``."""
    if temperature != 1.0:
        chunk = chunk / temperature
    part = torch.logsumexp(chunk, dim=-1)
    chosen = chunk.gather(-1, index[:, None]).squeeze(-1)
    entropy = part - (torch.softmax(chunk, dim=-1) * chunk).sum(-1) if with_entropy else None
    return part, chosen, entropy


def _chunk_grad(chunk: Tensor, index: Tensor, lse: Tensor, entropy: Tensor, grad: Tensor,
                grad_entropy: Tensor | None, temperature: float, first_column: int | None = None) -> Tensor:
    """The gradient ``[r, c]`` of a chunk of logits (float32) from its rows' log-probs' ``grad`` and, when the entropy
    takes part in the loss, their entropies' ``grad_entropy``: ``g / t * (onehot(index) - softmax(x / t))`` and
    ``-gH / t * p * (log p + H)``. ``first_column``: the chunk holds the vocabulary's columns from there on (not all of
    them); a row's chosen entry counts only where it falls among them."""
    if temperature != 1.0:
        chunk = chunk / temperature
    g = grad[:, None]
    part = -g * (chunk - lse[:, None]).exp()  # the log-normaliser's share
    if first_column is None:
        part.scatter_add_(-1, index[:, None], g)  # the chosen entry's
    else:
        local = index - first_column
        inside = (local >= 0) & (local < part.shape[1])
        part.scatter_add_(-1, local.clamp(0, part.shape[1] - 1)[:, None], g * inside[:, None])
    if grad_entropy is not None:  # dH/dz = -p (log p + H)
        logp = chunk - lse[:, None]
        part = part - grad_entropy[:, None] * logp.exp() * (logp + entropy[:, None])
    return part / temperature if temperature != 1.0 else part


def _outputs(ctx, chosen: Tensor, lse: Tensor, entropy: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor]:
    """A log-softmax function's outputs, the log-probs and the entropies (empty without ``with_entropy``). An output
    the loss does not use gets no gradient tensor (None), not zeros: the entropy's term costs nothing unless an
    entropy bonus asks for it."""
    ctx.set_materialize_grads(False)
    if not with_entropy:
        ctx.mark_non_differentiable(entropy)
    return chosen - lse, entropy


class _ChosenLogProbs(torch.autograd.Function):
    """``log_softmax(x / t)[index]`` and (optionally) the entropy, chunk by chunk over the rows of ``x: [R, V]``.

    Forward keeps only the ``[R]`` log-normalisers (and entropies) besides the logits it was given; backward writes the
    logits' gradient, ``g / t * (onehot(index) - softmax(x / t))`` plus, when the entropy takes part in the loss,
    ``-gH / t * p * (log p + H)``, into one ``[R, V]`` tensor, chunk by chunk. Autograd through the same operations
    would allocate a full-size zero tensor per chunk for the gather's gradient and another for the slice's, plus the
    exponentials: at a 152k vocabulary several full-vocabulary temporaries per row. Without the entropy's gradient the
    operations are those autograd runs, in the same order, so the results are the same bits (tested)."""

    @staticmethod
    def forward(ctx, logits: Tensor, index: Tensor, temperature: float, rows: int, with_entropy: bool):
        R = logits.shape[0]
        lse = logits.new_empty(R, dtype=torch.float32)
        chosen = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if with_entropy else lse.new_empty(0)
        for start in range(0, R, rows):
            part, picked, h = _chunk_stats(logits[start : start + rows].float(), index[start : start + rows],
                                           temperature, with_entropy)
            lse[start : start + rows], chosen[start : start + rows] = part, picked
            if with_entropy:
                entropy[start : start + rows] = h
        ctx.save_for_backward(logits, index, lse, entropy)
        ctx.temperature, ctx.rows = temperature, rows
        return _outputs(ctx, chosen, lse, entropy, with_entropy)

    @staticmethod
    def backward(ctx, grad: Tensor | None, grad_entropy: Tensor | None):
        logits, index, lse, entropy = ctx.saved_tensors
        temperature, rows = ctx.temperature, ctx.rows
        if grad is None:
            grad = lse.new_zeros(lse.shape)
        out = torch.empty_like(logits)
        for start in range(0, logits.shape[0], rows):
            span = slice(start, start + rows)
            out[span] = _chunk_grad(logits[span].float(), index[span], lse[span], entropy[span], grad[span],
                                    None if grad_entropy is None else grad_entropy[span], temperature)
        return out, None, None, None, None


class _HeadLogProbs(torch.autograd.Function):
    """:class:`_ChosenLogProbs` with the output head inside: ``log_softmax((h W^T + b) / t)[index]`` (and the entropy)
    from the hidden states ``h: [R, H]``, never holding more than ``columns`` of the ``[R, V]`` logits (and of their
    gradient) at once.

    Both passes go over the vocabulary in blocks of ``columns`` rows of the head's weight, so each product is
    ``[R, H] x [H, columns]``: the weight is read once a pass and its gradient written once, block by block (blocks of
    rows would each read the whole weight and add into the whole of its gradient). Forward runs the log-normaliser
    and the entropy online over the blocks (a running maximum, sum of exponentials and their logit-weighted sum) and
    picks each row's chosen logit from its block; it keeps the hidden states and the ``[R]`` log-normalisers (and
    entropies). Backward runs each block's product again, forms the block's logit gradient (:func:`_chunk_grad`),
    writes the weight's (and bias's) gradient for the block, where the head trains, and adds ``dz W`` to the hidden
    states' in float32. The products run in ``dtype`` (the autocast dtype under mixed precision, as the head's own
    ``F.linear`` would), the softmax in float32. One more head product than autograd through materialised logits
    runs, for ``[R, V]`` logits and as many of their gradient not held (at 1,024-token completions, groups of 8 and a
    152k vocabulary: 5 GiB each in float32)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, index: Tensor, temperature: float,
                columns: int, with_entropy: bool, dtype: torch.dtype, slot: _TiedGradient | None = None):
        R, V = hidden.shape[0], weight.shape[0]
        peak = hidden.new_full((R,), -torch.inf, dtype=torch.float32)
        total, weighted, chosen = torch.zeros_like(peak), torch.zeros_like(peak), torch.zeros_like(peak)
        h = hidden.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, V, columns):
                block = slice(start, start + columns)
                z = F.linear(h, weight[block].to(dtype), None if bias is None else bias[block].to(dtype)).float()
                if temperature != 1.0:
                    z = z / temperature
                new_peak = torch.maximum(peak, z.max(-1).values)
                rescale = (peak - new_peak).exp()
                e = (z - new_peak[:, None]).exp()
                total = total * rescale + e.sum(-1)
                if with_entropy:
                    weighted = weighted * rescale + (e * z).sum(-1)
                peak = new_peak
                local = index - start
                inside = (local >= 0) & (local < z.shape[1])
                chosen += z.gather(-1, local.clamp(0, z.shape[1] - 1)[:, None]).squeeze(-1) * inside
        lse = peak + total.log()
        entropy = lse - weighted / total if with_entropy else lse.new_empty(0)
        ctx.save_for_backward(hidden, weight, bias, index, lse, entropy)
        ctx.temperature, ctx.columns, ctx.dtype, ctx.slot = temperature, columns, dtype, slot
        # the forward's products went through oneDNN where the step's CPU mode is open: so do the backward's
        ctx.product = accel.backward_product(weight) if dtype == torch.float32 else None
        return _outputs(ctx, chosen, lse, entropy, with_entropy)

    @staticmethod
    def backward(ctx, grad: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, bias, index, lse, entropy = ctx.saved_tensors
        temperature, columns, dtype = ctx.temperature, ctx.columns, ctx.dtype
        product = ctx.product or F.linear  # (x, w) -> x @ w.T
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        if grad is None:
            grad = lse.new_zeros(lse.shape)
        h = hidden.to(dtype)
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_hidden else None
        grad_weight = torch.empty_like(weight) if want_weight else None
        grad_bias = torch.empty_like(bias) if want_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, weight.shape[0], columns):
                block = slice(start, start + columns)
                w = weight[block].to(dtype)
                z = F.linear(h, w, None if bias is None else bias[block].to(dtype)).float()
                dz = _chunk_grad(z, index, lse, entropy, grad, grad_entropy, temperature, first_column=start)
                if want_hidden:
                    grad_hidden += product(dz.to(dtype), w.t())  # dz @ w
                if want_weight:
                    grad_weight[block] = product(dz.t().to(dtype), h.t())  # dz^T @ h
                if want_bias:
                    grad_bias[block] = dz.sum(0)
        if ctx.slot is not None and grad_weight is not None:
            ctx.slot.gradient, grad_weight = grad_weight, None  # the tied embedding's lookup adds its rows and returns it
        return (None if grad_hidden is None else grad_hidden.to(hidden.dtype), grad_weight, grad_bias,
                None, None, None, None, None, None)


class _TiedGradient:
    """The gradient of a weight that the fused head (:class:`_HeadLogProbs`) and the embedding lookup of the same pass
    share (:class:`_TiedLookup`), between the two backward steps: the head writes it whole, the lookup adds its rows
    into it and hands it to autograd as the weight's one gradient."""

    gradient: Tensor | None = None


class _TiedLookup(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose backward adds the looked-up rows' gradient into the tied head's
    (:class:`_TiedGradient`, written by :class:`_HeadLogProbs`, which leaves the weight's gradient to this step) in
    place, and returns that as the weight's gradient.

    Autograd would take two ``[V, H]`` gradients for a weight used twice, the head's and the lookup's (zeros but for
    the looked-up rows), and sum them: at the end of the backward pass, where all other gradients are held, one
    ``[V, H]`` more (545 MiB at a 152k vocabulary and 896 features). The head's backward always runs first (the
    lookup's gradient is what the trunk passes back from it); where it wrote nothing, the rows go into zeros.

    It assumes one backward pass through the whole graph, as the update runs: a partial one that reaches the head and
    not the lookup (``torch.autograd.grad`` for some inner weights with ``retain_graph``) leaves the head's gradient
    in the slot, and a later pass through the lookup alone would add it again. On CUDA ``index_add_`` adds rows with
    atomics, so the weight's gradient may differ in its last bits between runs unless
    ``torch.use_deterministic_algorithms(True)``."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, padding_idx: int | None, slot: _TiedGradient):
        ctx.save_for_backward(ids)
        ctx.slot, ctx.padding_idx, ctx.shape = slot, padding_idx, weight.shape
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (ids,) = ctx.saved_tensors
        slot = ctx.slot
        out, slot.gradient = slot.gradient, None
        if out is None:
            out = grad.new_zeros(ctx.shape)
        ids, grad = ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(out.dtype)
        if ctx.padding_idx is not None:  # the padding row gets no gradient (as F.embedding's backward)
            real = ids != ctx.padding_idx
            ids, grad = ids[real], grad[real]
        return None, out.index_add_(0, ids, grad), None, None


def selective_log_softmax(logits: Tensor, index: Tensor, temperature: float = 1.0,
                          chunk_rows: int | None = DEFAULT_CHUNK_ROWS,
                          with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """``log_softmax(logits / temperature).gather(-1, index)`` chunk by chunk, in float32.

    Args:
        logits: ``[..., V]``.
        index: ``[...]`` chosen token ids.
        temperature: the sampling temperature the log-probs must match.
        chunk_rows: rows per chunk; ``None``: as many as keep a chunk at ``CHUNK_ELEMENTS``.
        with_entropy: also return the per-position entropy of the tempered distribution (with its gradient through
            ``logits``, computed only when a loss uses it).

    Returns:
        ``([...], [...] | None)`` log-probs (with gradient through ``logits``) and entropies.
    """
    shape = index.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    if flat_logits.shape[0] == 0:
        empty = flat_logits.new_zeros(shape, dtype=torch.float32)
        return empty, (empty.detach() if with_entropy else None)
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    logp, entropy = _ChosenLogProbs.apply(flat_logits, index.reshape(-1), float(temperature), rows, with_entropy)
    return logp.view(shape), (entropy.view(shape) if with_entropy else None)


def head_log_softmax(hidden: Tensor, head: nn.Linear, index: Tensor, temperature: float = 1.0,
                     with_entropy: bool = False, columns: int | None = None,
                     slot: _TiedGradient | None = None) -> tuple[Tensor, Tensor | None]:
    """``selective_log_softmax(head(hidden), index, ...)`` without the ``[..., V]`` logits: the head's product runs
    block by block over the vocabulary inside the log-softmax, forward and backward (:class:`_HeadLogProbs`).

    Args:
        hidden: ``[..., H]`` the hidden states that feed the head.
        head: the output head (a plain ``nn.Linear``: :func:`fusable_head`).
        index: ``[...]`` chosen token ids.
        columns: vocabulary entries per block; ``None``: as many as keep a block at ``CHUNK_ELEMENTS``.
        slot: where the head's weight is the embedding's too and the trunk looked the tokens up through
            :class:`_TiedLookup` with this slot: the weight's gradient goes there (:func:`_trunk`).

    Returns:
        ``([...], [...] | None)`` log-probs (with gradient through ``hidden`` and the head's weight) and entropies.
    """
    shape = index.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    if flat.shape[0] == 0:
        empty = flat.new_zeros(shape, dtype=torch.float32)
        return empty, (empty.detach() if with_entropy else None)
    device = flat.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    columns = columns or max(1, CHUNK_ELEMENTS // flat.shape[0])
    logp, entropy = _HeadLogProbs.apply(flat, head.weight, head.bias, index.reshape(-1), float(temperature), columns,
                                        with_entropy, dtype, slot)
    return logp.view(shape), (entropy.view(shape) if with_entropy else None)


# Model types whose causal-LM forward is ``lm_head(trunk(...).last_hidden_state)`` and nothing else: no logit scaling
# or soft-capping (Gemma 2/3, Cohere, Granite) that the fused head would skip.
FUSABLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3", "gemma",
                                 "olmo2", "smollm3"})


def _trunk_problem(base: nn.Module) -> str:
    """Why the trunk of ``base`` (a transformers model) cannot run without the model's own forward, its head then
    applied to its output, or ``""``: the model type must be one of :data:`FUSABLE_MODEL_TYPES` and the trunk a
    separate module (``base_model``)."""
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type not in FUSABLE_MODEL_TYPES:
        return f"model type {model_type!r} is not one whose head runs plainly ({sorted(FUSABLE_MODEL_TYPES)})"
    if base.base_model is base:
        return f"{type(base).__name__} has no separate trunk (base_model)"
    return ""


def fusable_head(model: nn.Module) -> tuple[nn.Linear | None, str]:
    """The output head the fused log-probs (:func:`head_log_softmax`) can stand in for, or ``None`` and why not.

    The model must be one of :data:`FUSABLE_MODEL_TYPES` (a PEFT wrapper around one too), its head a plain
    ``nn.Linear`` (not a LoRA layer or a quantized one), and the head's weight a whole tensor on this process (not an
    FSDP2 shard or a DeepSpeed ZeRO-3 partition, which only the model's own forward gathers)."""
    base = peft_base(model)
    problem = _trunk_problem(base)
    if problem:
        return None, problem
    head = base.get_output_embeddings()
    if type(head) is not nn.Linear:
        return None, f"the output head is a {type(head).__name__}, not a plain nn.Linear"
    weight = head.weight
    if type(weight.data) is not torch.Tensor or hasattr(weight, "ds_id") or weight.dim() != 2:
        return None, "the output head's weight is sharded (FSDP2 or DeepSpeed ZeRO-3)"
    return head, ""


def _head_choice(model: nn.Module, fuse: bool | None, rows: int) -> nn.Linear | None:
    """The head to fuse with the log-softmax for ``rows`` positions, or ``None`` (the model's own head). ``fuse``:
    ``None`` fuses where the logits would exceed one chunk (``CHUNK_ELEMENTS``) and the model allows it
    (:func:`fusable_head`); ``True`` fuses or raises; ``False`` never."""
    if fuse is False:
        return None
    head, why = fusable_head(model)
    if head is None and fuse:
        raise ValueError(f"update.fused_head=true: {why}; set it to null or false")
    if head is not None and not fuse and rows * head.weight.shape[0] <= CHUNK_ELEMENTS:
        return None  # one chunk holds the logits: the head's own product, once, is cheaper
    return head


class _Fused(NamedTuple):
    """The output head fused with the log-softmax for one pass, and the slot of its weight's gradient where the
    pass's embedding lookup shares that weight (:func:`_trunk`)."""

    linear: nn.Linear
    slot: _TiedGradient | None = None


def _forward(model: nn.Module, fuse: bool | None, keep: Tensor, **inputs: Any) -> tuple[Any, Tensor, _Fused | None]:
    """``model(**inputs)`` up to the head's input or output at positions ``keep``: ``(output, states, head)`` with
    ``states`` the hidden states ``[B, k, H]`` and ``head`` the head they feed (to :func:`head_log_softmax`) where the
    head is fused (:func:`_head_choice`), else the logits ``[B, k, V]`` and ``None``."""
    linear = _head_choice(model, fuse, inputs["input_ids"].shape[0] * keep.numel())
    if linear is None:
        out = model(**inputs, logits_to_keep=keep)
        return out, out.logits, None
    out, head = _trunk(peft_base(model), linear, **inputs)
    return out, out.last_hidden_state.index_select(1, keep), head


def _trunk(base: nn.Module, linear: nn.Linear | None, **inputs: Any) -> tuple[Any, _Fused | None]:
    """``base.base_model(**inputs)`` (the trunk) ahead of the fused head ``linear`` (or of the plain head: ``None``),
    and the fused head to apply to its output.

    Where the head's weight is the input embedding's too and trains (tied embeddings, full fine-tuning), the tokens
    are looked up through :class:`_TiedLookup`, which takes the head's gradient for the weight and adds its own rows
    into it: one ``[V, H]`` gradient at the end of the backward pass where autograd made the lookup's too and their
    sum. A plain ``nn.Embedding`` called as it is only (:func:`_plain_lookup`)."""
    emb, slot = base.get_input_embeddings(), None
    if (linear is not None and torch.is_grad_enabled() and _plain_lookup(emb) and emb.weight is linear.weight
            and emb.weight.requires_grad and "input_ids" in inputs):
        slot = _TiedGradient()
        inputs["inputs_embeds"] = _TiedLookup.apply(inputs.pop("input_ids"), emb.weight, emb.padding_idx, slot)
    return base.base_model(**inputs), (None if linear is None else _Fused(linear, slot))


def _plain_lookup(emb: nn.Module) -> bool:
    """Whether calling ``emb`` computes ``F.embedding`` on its weight and nothing else, so a lookup of its own
    (:class:`_TiedLookup`) may stand in for the call: a plain ``nn.Embedding`` (a scaled or adapted one computes more)
    without ``max_norm`` or gradients scaled by frequency, and no hook or replaced ``forward`` that the call would run
    (NEFTune's noise, accelerate's device hooks, a user's own). transformers' own hook under activation checkpointing
    (``enable_input_require_grads``: the output made to require grad) is no exception to stand aside for: the lookup's
    output requires grad already, the weight being trained."""
    from torch.nn.modules import module

    hooks = [h for h in emb._forward_hooks.values() if getattr(h, "__name__", "") != "make_inputs_require_grads"]
    return (type(emb) is nn.Embedding and emb.max_norm is None and not emb.scale_grad_by_freq
            and not (hooks or emb._forward_pre_hooks or "forward" in vars(emb) or hasattr(emb, "_hf_hook")
                     or module._global_forward_hooks or module._global_forward_pre_hooks))


def _chosen(states: Tensor, head: _Fused | None, index: Tensor, temperature: float, chunk_rows: int | None,
            with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """The log-probs (and entropies) of ``index`` from :func:`_forward`'s states."""
    if head is None:
        return selective_log_softmax(states, index, temperature, chunk_rows, with_entropy)
    return head_log_softmax(states, head.linear, index, temperature, with_entropy, slot=head.slot)


def completion_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    fuse: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs ``[N, T]`` of ``completion_ids`` given left-padded prompts, one forward pass.

    ``prompt_ids``/``prompt_mask`` are ``[N, Lp]`` (one row per completion) and the completion ``[N, T]``. Position
    ids follow the attention mask so left padding does not shift positions (what the sampler does too). The
    language-model head runs only on the ``T`` positions that predict completion tokens (``logits_to_keep``), fused
    with the log-softmax as ``fuse`` says (:func:`_forward`).
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1)
    position_ids = positions_from_mask(attention_mask)
    T = completion_ids.shape[1]
    _, states, head = _forward(model, fuse, last_positions(input_ids.shape[1], T + 1, input_ids.device),
                               input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False)
    # [N, T, V or H]: position t predicts completion token t
    return _chosen(states[:, :-1], head, completion_ids, temperature, chunk_rows, with_entropy)


def group_rows(group_index: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The groups of rows that share a prompt: per row its group (``0 .. U-1``, in the order of ``group_index``'s
    values) and its place inside the group (in row order); per group its first row and its number of rows."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    counts = torch.bincount(inverse)
    order = torch.argsort(inverse, stable=True)
    starts = counts.cumsum(0) - counts
    place = torch.empty_like(inverse)
    place[order] = torch.arange(inverse.numel(), device=inverse.device) - starts[inverse[order]]
    return inverse, place, order[starts], counts


def shared_prompt_completion_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    group_index: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    packed: bool = False,
    fuse: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Same result as :func:`completion_logprobs`, but each distinct prompt runs once.

    Rows with the same ``group_index`` share their prompt (the G completions of one group). The prompt's forward
    pass runs on one row per group with ``use_cache``; its keys/values, which carry gradient, are gathered to the
    completions, which then attend to them. The prompt costs one forward and one backward per group instead of G.
    ``packed``: instead, each group runs as one sequence, its prompt then its completions under a block mask
    (:func:`_packed_groups`; the model must take the mask: :func:`packing_supported`).
    """
    if packed and completion_ids.shape[1] > 0:
        return _packed_groups(model, prompt_ids, prompt_mask, completion_ids, group_index, temperature, with_entropy,
                              chunk_rows, fuse)
    inverse, _, first, _ = group_rows(group_index)
    p_ids, p_mask = prompt_ids[first], prompt_mask[first]
    p_pos = positions_from_mask(p_mask)
    out, states, head = _forward(model, fuse, last_positions(p_ids.shape[1], 1, p_ids.device), input_ids=p_ids,
                                 attention_mask=p_mask, position_ids=p_pos, use_cache=True)
    # [N, 1, V or H]: predicts completion token 0
    first = _chosen(states.index_select(0, inverse), head, completion_ids[:, :1], temperature, chunk_rows,
                    with_entropy)
    T = completion_ids.shape[1]
    if T == 1:
        return first
    cache = output_cache(out)
    _select_rows(cache, inverse)  # [U, ...] -> [N, ...], gradient flows back to the U prompt rows
    attention_mask = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1)
    positions = positions_from_mask(attention_mask)[:, prompt_ids.shape[1]:]
    _, states, head = _forward(model, fuse, torch.arange(T - 1, device=completion_ids.device),
                               input_ids=completion_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                               position_ids=positions[:, :-1], use_cache=True, **{cache_argument(model): cache})
    rest = _chosen(states, head, completion_ids[:, 1:], temperature, chunk_rows, with_entropy)
    # the [N, T] results are joined, not the [N, T, V] logits: no full-vocabulary copy (nor its gradient)
    return (torch.cat([first[0], rest[0]], dim=1),
            torch.cat([first[1], rest[1]], dim=1) if with_entropy else None)


# Longest packed group (a prompt and its completions as one sequence) that the module packs by default: up to here the
# fewer, larger products save more than attention over the whole group costs; from ~250 tokens on packing gained
# nothing, and at 1,144 it lost (measured on 0.5B, 25M and tiny models: docs/performance.md, "Levers kept and dropped").
PACKED_MAX_TOKENS = 192


def packing_supported(model: nn.Module) -> bool:
    """Whether ``model`` takes the block mask of :func:`shared_prompt_completion_logprobs` with ``packed``: PyTorch's
    SDPA attention (a boolean 4-D mask, used as given by transformers' mask code) and no sliding-window layers
    (:func:`~polopt_lightning.step.varlen.attention_problem`)."""
    return not varlen.attention_problem(model)


def packed_length(prompt_len: int, completion_len: int, group_index: Tensor) -> tuple[int, bool]:
    """The packed length of a group (its prompt, then each of its completions but the last token) and whether the
    groups are even enough to pack: every group padded to the largest one's count adds under a quarter of rows."""
    counts = group_rows(group_index)[3]
    slots = counts.numel() * int(counts.max())
    return prompt_len + int(counts.max()) * max(completion_len - 1, 0), slots * 4 <= group_index.numel() * 5


def _packed_groups(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                   group_index: Tensor, temperature: float, with_entropy: bool,
                   chunk_rows: int | None, fuse: bool | None = None) -> tuple[Tensor, Tensor | None]:
    """:func:`shared_prompt_completion_logprobs` with ``packed=True``: each group in one packed sequence.

    Each group (rows with the same ``group_index``) becomes one row: its left-padded prompt, then one slot of ``T - 1``
    positions per completion, under a boolean block mask in which a prompt position sees the prompt causally and a
    completion position the whole prompt and its own completion causally (each position also sees itself, so no
    padded row of the mask is empty). Position ids continue each completion after its prompt, as in the unpacked
    pass. Every linear layer then runs once over all of a group's tokens, one product instead of the shared prompt's
    two (:func:`shared_prompt_completion_logprobs`) with their smaller row counts, and the head once. Attention
    covers the whole packed group, so this pays for short groups (:data:`PACKED_MAX_TOKENS`). The completions' mask
    is not needed: their padding comes after their last real token, which cannot see it.
    """
    T = completion_ids.shape[1]
    Lp, device = prompt_ids.shape[1], prompt_ids.device
    inverse, slot, first, counts = group_rows(group_index)  # slot: a row's place inside its group
    U, G, S = counts.numel(), int(counts.max()), T - 1
    L = Lp + G * S
    p_mask = prompt_mask[first].bool()
    t = torch.arange(S, device=device)
    ids = completion_ids.new_zeros(U, L)  # slots of absent rows (uneven groups) hold token 0, seen by no real row
    ids[:, :Lp] = prompt_ids[first]
    ids[inverse[:, None], Lp + slot[:, None] * S + t] = completion_ids[:, :S]
    segment = torch.cat([torch.full((Lp,), -1, device=device), torch.arange(G, device=device).repeat_interleave(S)])
    where = torch.arange(L, device=device)
    causal = where[None, :] <= where[:, None]
    allowed = (segment[:, None] == segment[None, :]) & causal  # the prompt causally; a completion itself causally
    allowed |= (segment[:, None] >= 0) & (segment[None, :] == -1)  # a completion sees the whole prompt
    keys = torch.cat([p_mask, p_mask.new_ones(U, G * S)], dim=1)  # the prompt's left padding is seen by no one
    mask = (allowed[None] & keys[:, None, :]) | torch.eye(L, dtype=torch.bool, device=device)
    positions = torch.cat([positions_from_mask(p_mask.long()), p_mask.sum(1, keepdim=True) + t.repeat(G)], dim=1)
    # per slot: the prompt's last position (predicts completion token 0), then the slot's positions
    keep = torch.cat([torch.full((G, 1), Lp - 1, device=device),
                      Lp + torch.arange(G, device=device)[:, None] * S + t], dim=1).reshape(-1)
    _, states, head = _forward(model, fuse, keep, input_ids=ids, attention_mask=mask[:, None], position_ids=positions,
                               use_cache=False)  # [U, G * T, V or H]
    targets = completion_ids.new_zeros(U, G, T)
    targets[inverse, slot] = completion_ids
    logp, entropy = _chosen(states, head, targets.view(U, G * T), temperature, chunk_rows, with_entropy)
    logp = logp.view(U, G, T)[inverse, slot]
    return logp, (entropy.view(U, G, T)[inverse, slot] if with_entropy else None)


#: ``update.padding_free=None`` packs a pass's rows on the CPU where their completions are at least this wide and at most
#: ``PADDING_FREE_MAX_REAL`` of the padded width is real (docs/performance.md: the passes at 128-512 tokens)
PADDING_FREE_MIN_WIDTH = 128
PADDING_FREE_MAX_REAL = 0.8


def pads_enough(mask: Tensor, prompt_mask: Tensor | None = None) -> bool:
    """Whether rows of this completion ``mask`` (``[N, T]``, real tokens then padding) pack on their own under
    ``update.padding_free=None``: on the CPU, ``T >= PADDING_FREE_MIN_WIDTH`` and at most ``PADDING_FREE_MAX_REAL`` of
    the ``N x T`` positions real, every row without a hole, every prompt (``prompt_mask``) with a token."""
    N, T = mask.shape
    if mask.device.type != "cpu" or T < PADDING_FREE_MIN_WIDTH or N == 0:
        return False
    if prompt_mask is not None and not bool(prompt_mask.bool().any(-1).all()):
        return False
    lengths = mask.sum(-1)
    if int(lengths.sum()) > PADDING_FREE_MAX_REAL * N * T:
        return False
    return torch.equal(mask.bool(), torch.arange(T, device=mask.device)[None] < lengths[:, None])


def padding_free_supported(model: nn.Module) -> str:
    """Why ``model`` cannot run padding-free (:func:`padding_free_logprobs`), or ``""``: its head must run plainly
    (:func:`_trunk_problem`: the trunk runs without the model's own forward) and its trunk segment by segment
    (:func:`~polopt_lightning.step.varlen.supported`)."""
    return _trunk_problem(peft_base(model)) or varlen.supported(model)


def padding_free_logprobs(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                          completion_mask: Tensor, group_index: Tensor | None, temperature: float = 1.0,
                          with_entropy: bool = False, fuse: bool | None = None) -> tuple[Tensor, Tensor | None]:
    """Log-probs ``[N, T]`` (and entropies) of the completions as :func:`completion_logprobs` gives them, from one
    packed sequence without padding (0 at padded positions).

    Rows with the same ``group_index`` share their prompt, which runs once (``None``: each row its own prompt).
    ``completion_mask`` must be each row's real tokens followed by padding (what the rollouts make, multi-turn
    context included). The head runs on the real completion positions only, fused as ``fuse`` says
    (:func:`_head_choice`'s rule).
    """
    why = padding_free_supported(model)
    if why:
        raise ValueError(f"update.padding_free=true: {why}; set it to false")
    N, T = completion_ids.shape
    device = completion_ids.device
    lengths = completion_mask.sum(-1)
    if not torch.equal(completion_mask.bool(), torch.arange(T, device=device)[None] < lengths[:, None]):
        raise ValueError("update.padding_free=true: a completion's mask has a hole (real tokens after padding)")
    groups = torch.arange(N, device=device) if group_index is None else group_index
    inverse, _, first, counts = group_rows(groups)
    order = torch.argsort(inverse, stable=True)  # rows group by group
    p_lengths = prompt_mask.sum(-1)
    ids, positions, segments, keep, targets, back = [], [], [], [], [], []
    cursor = 0
    lengths_list, p_list = lengths.tolist(), p_lengths.tolist()
    o = 0
    for g, count in enumerate(counts.tolist()):
        row = int(first[g])
        p = int(p_list[row])
        if p == 0:
            raise ValueError(f"update.padding_free=true: row {row}'s prompt is empty")
        ids.append(prompt_ids[row, prompt_ids.shape[1] - p:])  # left padding: the real tokens are the last p
        positions.append(torch.arange(p, device=device))
        prompt_start = cursor
        segments.append((cursor, cursor + p, cursor, cursor))
        cursor += p
        for i in order[o:o + count].tolist():
            n = int(lengths_list[i])
            if n == 0:
                continue
            inputs = n - 1  # the last token predicts nothing that is scored
            if inputs:
                ids.append(completion_ids[i, :inputs])
                positions.append(torch.arange(p, p + inputs, device=device))
                segments.append((cursor, cursor + inputs, prompt_start, prompt_start + p))
            keep.append(torch.cat([torch.tensor([prompt_start + p - 1], device=device),
                                   torch.arange(cursor, cursor + inputs, device=device)]))
            targets.append(completion_ids[i, :n])
            back.append(torch.stack([torch.full((n,), i, device=device), torch.arange(n, device=device)]))
            cursor += inputs
        o += count
    logp = torch.zeros(N, T, device=device)
    entropy = torch.zeros(N, T, device=device) if with_entropy else None
    if not keep:
        return logp, entropy
    base = peft_base(model)
    varlen.register()
    plan = varlen.SegmentPlan([s for s in segments if s[1] > s[0]])
    # a 4-D mask is taken as given (transformers builds none, which over the packed sequence would be [S, S]); the
    # segments are the mask
    placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
    keep = torch.cat(keep)
    out, head = _trunk(base, _head_choice(base, fuse, keep.numel()), input_ids=torch.cat(ids)[None],
                       position_ids=torch.cat(positions)[None], attention_mask=placeholder, use_cache=False,
                       **{varlen.PLAN_KEY: plan})
    states = out.last_hidden_state[0].index_select(0, keep)  # [scored positions, H]
    if head is None:
        states = base.get_output_embeddings()(states)
    values, ent = _chosen(states, head, torch.cat(targets), temperature, None, with_entropy)
    rows, cols = torch.cat(back, dim=1)
    logp = logp.index_put((rows, cols), values)
    if with_entropy:
        entropy = entropy.index_put((rows, cols), ent)
    return logp, entropy


def _select_rows(cache, index: Tensor) -> None:
    """Each layer's keys/values ``[U, ...] -> [N, ...]`` by ``index_select``: its backward (``index_add_``) is several
    times faster on the CPU than that of the advanced indexing ``Cache.batch_select_indices`` uses, and it runs twice
    per layer per pass."""
    layers = getattr(cache, "layers", None)
    if layers is None or not all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers):
        cache.batch_select_indices(index)  # pragma: no cover - older transformers caches
        return
    for layer in layers:
        layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)


class Scorer:
    """The log-probs of an :class:`~polopt_lightning.step.experience.Experience`'s completions under the policy or the KL
    reference, as the update's settings say: each prompt once per group (``share_prompt``), groups packed
    (``pack_groups``), each completion with its own prompt under gradient checkpointing (checkpointed layers keep no
    cache) while gradients are on.

    Args:
        policy: the policy.
        ref_model: the reference copy, or ``None`` (none needed, or ``shared``).
        shared_reference: the policy's own base with its adapters disabled is the reference.
        config: the :class:`~polopt_lightning.step.update.UpdateConfig`.
        temperature: the sampling temperature the log-probs are taken at.
    """

    def __init__(self, policy: nn.Module, ref_model: nn.Module | None, shared_reference: bool, config: Any,
                 temperature: float) -> None:
        self.policy, self.ref_model, self.shared_reference = policy, ref_model, shared_reference
        self.config, self.temperature = config, temperature
        for model in (m for m in (policy, ref_model) if m is not None):
            why = fusable_head(model)[1] if config.fused_head else ""
            if why:
                raise ValueError(f"update.fused_head=true: {why}; set it to null or false")
            why = padding_free_supported(model) if config.padding_free else ""
            if why:
                raise ValueError(f"update.padding_free=true: {why}; set it to false")

    def logprobs(self, model: nn.Module, exp: Experience, rows: Tensor | slice, width: int | None = None,
                 with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """Log-probs ``[n, width]`` of the completions ``rows`` under ``model`` (and their entropies if asked)."""
        width = exp.completion_ids.shape[1] if width is None else width
        # the context (a multi-turn rollout's tool results too) is attended to; the objective masks what it trains on
        args = (model, exp.prompt_ids[rows], exp.prompt_mask[rows], exp.completion_ids[rows, :width],
                exp.attention_mask[rows, :width])
        # checkpointed layers drop the cache the shared prompt is passed through; without gradient they keep it
        checkpointed = self.config.gradient_checkpointing and model is self.policy and torch.is_grad_enabled()
        with evaluating(model, keep_quantized=True) if model is self.ref_model else nullcontext():
            if self.padding_free(model, args[4], args[2]):  # one packed sequence: the prompt shared under checkpointing
                groups = exp.group_index[rows] if self.config.share_prompt else None
                return padding_free_logprobs(*args, groups, self.temperature, with_entropy,
                                             fuse=self.config.fused_head)
            if self.config.share_prompt and not checkpointed:
                groups = exp.group_index[rows]
                return shared_prompt_completion_logprobs(*args, groups, self.temperature, with_entropy=with_entropy,
                                                         packed=self.packs(model, args[1].shape[1], width, groups),
                                                         fuse=self.config.fused_head)
            return completion_logprobs(*args, self.temperature, with_entropy=with_entropy,
                                       fuse=self.config.fused_head)

    def padding_free(self, model: nn.Module, mask: Tensor, prompt_mask: Tensor) -> bool:
        """Whether these rows (completion ``mask``, ``prompt_mask``) run padding-free: ``update.padding_free``, or where
        it is ``None`` on the CPU where they pad enough (:func:`pads_enough`), ``pack_groups`` is not asked for and the
        model allows it now (:func:`padding_free_supported`: not sharded, SDPA, the fused head's model types; ~16 us)."""
        if self.config.padding_free is not None:
            return self.config.padding_free
        return (self.config.pack_groups is not True and pads_enough(mask, prompt_mask)
                and not padding_free_supported(model))

    def packs(self, model: nn.Module, prompt_len: int, completion_len: int, groups: Tensor) -> bool:
        """Whether these rows' groups run as packed sequences (``pack_groups``)."""
        pack = self.config.pack_groups
        if pack is False or not packing_supported(model):
            return False
        length, even = packed_length(prompt_len, completion_len, groups)
        return bool(pack) or (even and length <= PACKED_MAX_TOKENS)

    def reference(self, exp: Experience) -> Tensor:
        """Log-probs ``[N, T]`` of every completion under the KL reference, without gradient (a target, never
        trained: with grad on, a KL reward penalty's pass would keep its activations for the whole rollout)."""
        with torch.no_grad():
            if not self.shared_reference:
                return self.logprobs(self.ref_model, exp, slice(None))[0]
            # the policy's frozen base, adapters disabled; eval mode as a reference copy's pass, except the quantized
            # layers, which keep the kernels the training forward uses (see `evaluating`)
            with evaluating(self.policy, keep_quantized=True), reference_context(self.policy):
                return self.logprobs(self.policy, exp, slice(None))[0]
