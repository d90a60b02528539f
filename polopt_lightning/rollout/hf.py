"""The transformers rollout backend: a prefill per prompt and a KV-cached decoding loop on the policy itself (or a copy
in its sampling dtype), the CPU fast path's lean decoding step where the model allows it."""

from __future__ import annotations

import logging
import warnings
from contextlib import nullcontext
from dataclasses import fields, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from .. import accel
from .._hf import cache_argument, last_positions, output_cache, positions_from_mask, preallocated_cache
from ..accel.lean_step import decode_step, llama_like, shared_prompt_decode_step, static_decode_step
from ..models import cast_as_one_block, float_dtype, frozen_copy, is_quantized, resolve_dtype
from .base import RolloutBatch, RolloutEngine, filter_logits, sample_tokens

log = logging.getLogger(__name__)

DROP_FINISHED_MIN_TOKENS = 128  # from this max_new_tokens on, finished rows leave the decoding batch by default


def _copied_in(model: nn.Module, dtype: torch.dtype | None) -> bool:
    """Whether sampling in ``dtype`` (``None``: the model as it is) takes a copy of ``model``'s weights."""
    return dtype is not None and any(p.dtype != dtype for p in model.parameters())


class HFRolloutEngine(RolloutEngine):
    """Sampling loop on a ``transformers`` causal LM with its KV cache.

    Each prompt is prefilled once and its cache expanded to its G samples, so the prompt costs one forward pass per
    group instead of G. The cache is preallocated (no copy per token) and, for Llama-family models, each token runs
    through a lean decoding step instead of the full ``forward`` (``fast_decode=False`` turns that off). The model
    runs in eval mode without gradient and returns to its previous mode after.

    Args:
        fast_decode: the lean Llama-family decoding step (see :mod:`polopt_lightning.accel.lean_step`).
        dtype: sample with a copy of the policy's weights in this dtype (e.g. ``"bfloat16"``), refreshed from the
            policy at each call, with autocast off. ``None`` samples in the precision the training step computes
            in: with the policy itself, or, for an fp32 policy under autocast (a ``bf16-mixed`` / ``16-mixed``
            trainer), with a copy in the autocast dtype: autocast would cast every weight again at every token; the
            copy costs 2 bytes per parameter. On a CPU without native bf16 products where oneDNN computes the
            float32 ones (:meth:`~polopt_lightning.accel.cpu.decode.CPUDecoding.sampling_dtype`) the fp32 policy
            itself samples with autocast off instead (faster there than an emulated bf16 copy, without its memory).
            ``"float32"`` samples the fp32 weights with autocast off. Half-precision
            sampling halves the bytes each token reads (weights and KV cache) and uses bf16 matrix units (AMX
            CPUs, GPUs); log-probs sampled in another precision than training's are not reused as old log-probs.
        compile: run the decoding step through ``torch.compile`` with static shapes (the whole cache attended
            under a mask). Pays on small models where per-token Python and kernel-launch overhead dominates; the
            first call of each new batch shape compiles (tens of seconds on CPU).
        shared_prompt_kv: keep each prompt's keys/values once per group while decoding (the lean step only; the
            G samples' queries meet them in one product) instead of a copy per sample. ``None`` decides: on for an
            fp32 model on the CPU when the copies would make each token re-read at least 1 MiB per layer and
            finished rows are not dropped (``drop_finished``, which it cannot do; dropping measured faster); off
            otherwise (short prompts and bf16 CPU kernels measured slower with it).
        cpu: the CPU's decoding levers (:class:`~polopt_lightning.accel.cpu.decode.CPUDecoding`, or a dict of them:
            ``packed_weights``, ``decode_kernel``, ``fused_step``): the lean step's products on prepacked weights or
            on the few-row C kernel, the whole step in C. Each acts on the CPU only, on where it applies by default.
        inference_mode: sample under ``torch.inference_mode`` instead of ``no_grad`` (less bookkeeping per
            operation); the returned tensors are ordinary copies. ``None`` decides: on for a plain
            ``transformers`` model whose linear layers are ``nn.Linear`` itself, off for quantized layers
            (bitsandbytes builds state in its forward, which must not become inference tensors) and adapters
            (peft). Set ``False`` for a model whose modules keep tensors made during the forward.
        release_copy: free the sampling copy's weights (``dtype`` above, or the autocast copy) after each rollout
            and cast them afresh at the next, instead of keeping them through the training pass, where they would
            add to the step's peak (1 GB at 0.5B in bf16). ``None`` decides: on when the copy holds at least
            256 MiB and the step is not compiled (a small copy costs nothing to keep, a compiled step would
            recompile for new storage). The copy is cast into one block (:func:`~polopt_lightning.models.
            cast_as_one_block`), so what it frees the training pass reuses.
        drop_finished: take finished completions out of the decoding batch, so the steps after a completion's EOS
            no longer compute it (its keys/values, its products, its attention over a growing cache): with lengths
            spread below the cap most rows end early while the batch decodes on to the longest. ``None`` decides: on
            where ``max_new_tokens`` is at least :data:`DROP_FINISHED_MIN_TOKENS` and the step is not compiled
            (static shapes); never on the shared-prompt path (rows in whole groups), which ``shared_prompt_kv=None``
            then leaves off; nor with a cache other than the preallocated one. Where the batch shrinks to the
            few-row kernel's size (or by a row block of it) the CPU's products are built afresh for it. The same
            completions where sampling is greedy or the vocabulary draws by inverse CDF
            (:func:`~polopt_lightning.rollout.base.sample_tokens`), up to float32 rounding: where the products move
            to the kernel, a draw within rounding of a token's edge can take its neighbour (27 of 4,453 tokens
            measured at 0.5B); below that vocabulary size ``torch.multinomial`` draws for fewer rows, so a seed gives
            other (equally distributed) completions than without it.
    """

    def __init__(self, fast_decode: bool = True, dtype: torch.dtype | str | None = None, compile: bool = False,
                 shared_prompt_kv: bool | None = None, inference_mode: bool | None = None,
                 release_copy: bool | None = None, cpu: Any = None, drop_finished: bool | None = None) -> None:
        self.cpu = accel.decoding(cpu)
        self.drop_finished = drop_finished
        self.fast_decode = fast_decode
        self.release_copy = release_copy
        self._released = False
        self.inference_mode = inference_mode
        self.shared_prompt_kv = shared_prompt_kv
        self.dtype = resolve_dtype(dtype, "rollout.dtype", auto=False)
        self.compile = compile
        self._sampler: tuple[nn.Module, nn.Module] | None = None  # (policy, its copy)
        self._compiled = None
        self._said_quantized = False
        self._said_sampling = False

    @property
    def sampling_copy(self) -> nn.Module | None:
        """The copy of the policy this engine samples with (``dtype``, or the autocast dtype), once made; else
        ``None`` (it samples with the policy itself)."""
        return None if self._sampler is None else self._sampler[1]

    def sampling_dtype(self, model: nn.Module) -> torch.dtype | None:
        """The precision completions are sampled in with autocast off (``None``: ``model`` as it is called).

        A quantized model has no floating-point copy to sample with: it samples as it is, and an explicit ``dtype``
        is set aside with a warning, once.
        """
        if is_quantized(model):
            if self.dtype is not None and not self._said_quantized:
                warnings.warn(f"rollout.dtype={str(self.dtype).removeprefix('torch.')} is off: the policy is quantized "
                              "(bitsandbytes), so completions are sampled with its own quantized layers",
                              RuntimeWarning, stacklevel=2)
                self._said_quantized = True
            return None
        if self.dtype is not None:
            return self.dtype
        device_type = _device_type(model)
        if torch.is_autocast_enabled(device_type) and all(p.dtype == torch.float32 for p in model.parameters()):
            return self.cpu.sampling_dtype(model, device_type) or torch.get_autocast_dtype(device_type)
        return None

    def sampling_dtype_differs(self, model: nn.Module) -> bool:
        """Whether completions are sampled with a copy of ``model`` in another dtype than its weights'."""
        return _copied_in(model, self.sampling_dtype(model))

    def logprobs_match(self, model: nn.Module) -> bool:
        # under autocast the training forward computes in another precision than any sampler; bitsandbytes' int8
        # layers compute with int8 activations in eval mode (sampling) and dequantized weights in training mode
        return (not self.sampling_dtype_differs(model) and not torch.is_autocast_enabled(_device_type(model))
                and not any(type(m).__name__ == "Linear8bitLt" for m in model.modules()))

    def sampling_model(self, model: nn.Module) -> nn.Module:
        """The module that samples: ``model``, or its copy in the sampling dtype holding ``model``'s weights."""
        dtype = self.sampling_dtype(model)
        copied = _copied_in(model, dtype)
        self._say_sampling(model, dtype, copied)
        if not copied:
            return model
        # outside inference mode: a copy made under `trainer.validate` would otherwise hold inference tensors that
        # the refresh during `fit` cannot write
        with torch.inference_mode(False), torch.no_grad():
            if self._sampler is None or self._sampler[0] is not model or float_dtype(self._sampler[1]) != dtype:
                self._sampler, self._compiled, self._released = (model, frozen_copy(model, dtype, "rollout.dtype")), \
                    None, False
            elif self._released:  # its weights were freed after the last rollout: cast them afresh, as one block
                params = list(model.parameters())
                for kept, weight in zip(self._sampler[1].parameters(), cast_as_one_block(params, dtype)):
                    kept.data = weight
                self._released = False
            else:  # refresh every time: an in-place optimizer step leaves no trace to test for (fused AdamW keeps
                # tensor versions), and the copy costs one read of the weights, small next to sampling
                torch._foreach_copy_(list(self._sampler[1].parameters()), list(model.parameters()))
        return self._sampler[1]

    def _say_sampling(self, model: nn.Module, dtype: torch.dtype | None, copied: bool) -> None:
        """Log once what completions are sampled with (``dtype``: :meth:`sampling_dtype`; ``copied``: with a copy in
        it) where ``rollout.dtype`` asks for a copy or the training step computes under autocast."""
        if (self._said_sampling or dtype is None
                or not (copied or torch.is_autocast_enabled(_device_type(model)))):
            return
        self._said_sampling = True
        name = str(dtype).removeprefix("torch.")
        if copied:
            why = "rollout.dtype" if self.dtype is not None else "the training step's autocast dtype"
            log.info("rollout: sampling with a %s copy of the policy (%s), cast from its weights before each rollout",
                     name, why)
        else:
            log.info("rollout: sampling the %s policy itself with autocast off (%s)", name,
                     "rollout.dtype" if self.dtype is not None else
                     "no native bfloat16 products on this CPU; its float32 products run through oneDNN")

    def _release(self, sampler: nn.Module) -> None:
        """Free the sampling copy's weights after a rollout (``release_copy``); the modules stay for the next one."""
        if self._sampler is None or sampler is not self._sampler[1]:
            return
        params = list(sampler.parameters())
        release = self.release_copy
        if release is None:
            release = not self.compile and sum(p.numel() * p.element_size() for p in params) >= 2**28
        if release:
            for p in params:
                p.data = p.data.new_empty(0)
            self._released = True

    @torch.no_grad()
    def generate(self, model, prompt_ids, prompt_mask, num_generations, sampling, eos_token_id, pad_token_id,
                 generator=None) -> RolloutBatch:
        sampler = self.sampling_model(model)
        # a sampling dtype of its own computes without autocast; otherwise the caller's context stands (a quantized
        # model may rely on it)
        precision = (torch.autocast(_device_type(model), enabled=False) if self.sampling_dtype(model) is not None
                     else nullcontext())
        inference = _stateless(sampler) if self.inference_mode is None else self.inference_mode
        was_training = sampler.training
        sampler.eval()
        try:
            with (precision, torch.inference_mode() if inference else nullcontext(),
                  self.cpu.context()):
                batch = self._generate(sampler, prompt_ids, prompt_mask, num_generations, sampling, eos_token_id,
                                       pad_token_id, generator)
        finally:
            sampler.train(was_training)
            self._release(sampler)
        if inference:  # inference tensors cannot be saved for backward: the training pass gets ordinary copies
            batch = replace(batch, **{f.name: getattr(batch, f.name).clone() for f in fields(batch)
                                      if isinstance(getattr(batch, f.name), Tensor)})
        return batch

    def _share_prompt_kv(self, cache, N: int, Lp: int, drop: bool = False) -> bool:
        """``shared_prompt_kv``, or where it is ``None`` whether the measured rule says it pays (see the class);
        never where finished rows are to be dropped (``drop``), which it cannot do."""
        if self.shared_prompt_kv is not None:
            return self.shared_prompt_kv
        if drop:
            return False
        k = cache.layers[0]._k  # [P, kv_heads, capacity, D] after the prefill
        P = k.shape[0]
        reread = (N - P) * k.shape[1] * Lp * k.shape[3] * k.element_size() * 2  # bytes per layer and token
        return k.is_cpu and k.dtype == torch.float32 and reread >= 2**20

    def _drops_finished(self, max_new_tokens: int) -> bool:
        """``drop_finished``, or where it is ``None`` whether it applies (see the class); never compiled."""
        if self.compile:
            return False
        return self.drop_finished if self.drop_finished is not None else max_new_tokens >= DROP_FINISHED_MIN_TOKENS

    def _static_step(self, base: nn.Module):
        if self._compiled is None or self._compiled[0] is not base:
            self._compiled = (base, torch.compile(partial(static_decode_step, base)))
        return self._compiled[1]

    def _generate(self, model, prompt_ids, prompt_mask, G, sampling, eos_token_id, pad_token_id, generator):
        device = prompt_ids.device
        eos_ids = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)
        prompt_mask = prompt_mask.long()
        position_ids = positions_from_mask(prompt_mask)
        cache_arg = cache_argument(model)
        cache = preallocated_cache(model, prompt_ids.shape[1] + sampling.max_new_tokens)
        extra = {cache_arg: cache} if cache is not None else {}
        out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids, use_cache=True,
                    logits_to_keep=last_positions(prompt_ids.shape[1], 1, device), **extra)
        cache = output_cache(out)
        logits = out.logits[:, -1].float().repeat_interleave(G, dim=0)  # [N, V]
        attention_mask = prompt_mask.repeat_interleave(G, dim=0)  # [N, Lp]
        next_position = position_ids[:, -1:].repeat_interleave(G, dim=0) + 1  # [N, 1]
        N, Lp = attention_mask.shape
        fast = llama_like(model) if (self.fast_decode and extra) else None
        # rows drop from the preallocated cache only (other caches' layers may not select all they hold)
        drop = self._drops_finished(sampling.max_new_tokens) and all(
            hasattr(layer, "_reindex") for layer in getattr(cache, "layers", [None]))
        shared = fast is not None and not self.compile and self._share_prompt_kv(cache, N, Lp, drop)
        drop = drop and not shared  # the shared prompt's rows go in whole groups
        packed = self.cpu.projections(fast, N) if fast is not None and not self.compile else None
        if shared:  # the prompt's keys/values stay one per group; completions get a cache of their own
            prompt_kv = [(kv._k[:, :, :Lp], kv._v[:, :, :Lp]) for kv in cache.layers]  # [P, kv_heads, Lp, D]
            completion_kv = [(k.new_zeros(N, k.shape[1], sampling.max_new_tokens, k.shape[3]),
                              v.new_zeros(N, v.shape[1], sampling.max_new_tokens, v.shape[3])) for k, v in prompt_kv]
            prompt_bias = torch.zeros(prompt_mask.shape, device=device).masked_fill(
                prompt_mask == 0, torch.finfo(torch.float32).min)[:, None, None, :]
        elif G > 1:
            cache.batch_repeat_interleave(G)
        if fast is not None and not shared:
            # additive mask over every cache slot: prompt padding closed; the slot of each new token is opened as it is
            # written (the eager step only sees the slots written so far, the static step sees all of them)
            dtype = next(model.parameters()).dtype
            dtype = dtype if dtype.is_floating_point else torch.float32
            open_slots = torch.cat([attention_mask.bool(),
                                    torch.full((N, sampling.max_new_tokens), not self.compile, device=device)], dim=1)
            key_mask = torch.zeros(open_slots.shape, dtype=dtype, device=device).masked_fill(
                ~open_slots, torch.finfo(dtype).min)[:, None, None, :]
            if self.compile:
                step_fn = self._static_step(fast)
                buffers = ([kv._k for kv in cache.layers], [kv._v for kv in cache.layers])
        rows = torch.arange(N, device=device)  # each decoding row's index among the N completions
        tokens, logps = [], []
        done = torch.zeros(N, dtype=torch.bool, device=device)  # per decoding row
        finished = torch.zeros(N, dtype=torch.bool, device=device)  # per completion
        temperature = sampling.logprob_temperature
        for step in range(sampling.max_new_tokens):
            # log-probs of the unfiltered tempered distribution: what the training forward computes
            logprobs_all = torch.log_softmax(logits / temperature, dim=-1)  # [N, V]
            if step < sampling.min_new_tokens:  # EOS banned for sampling only
                logits[:, eos_ids] = float("-inf")
            if sampling.temperature == 0:
                token = logits.argmax(-1)
            else:
                filtered = filter_logits(logits / temperature, sampling.top_k, sampling.top_p)
                token = sample_tokens(torch.softmax(filtered, dim=-1), generator,
                                      *((rows, N) if rows.shape[0] < N else ()))
            token = torch.where(done, torch.full_like(token, pad_token_id), token)
            logp = torch.where(done, torch.zeros_like(logprobs_all[:, 0]),
                               logprobs_all.gather(-1, token[:, None]).squeeze(-1))
            is_eos = torch.isin(token, eos_ids) & ~done
            if rows.shape[0] < N:  # rows dropped: they hold padding from here on
                tokens.append(token.new_full((N,), pad_token_id).index_copy_(0, rows, token))
                logps.append(logp.new_zeros(N).index_copy_(0, rows, logp))
                finished[rows] |= is_eos
            else:
                tokens.append(token)
                logps.append(logp)
                finished |= is_eos
            done |= is_eos
            ended = int(done.sum())  # one read from the device a step: all done, or a quarter to drop
            if ended == done.shape[0] or step == sampling.max_new_tokens - 1:
                break
            if drop and 4 * ended >= done.shape[0]:  # a quarter of the rows done: the rest decode alone
                keep = (~done).nonzero().squeeze(-1)
                if fast is not None:
                    key_mask = key_mask[keep]
                    packed = self.cpu.fewer_rows(packed, fast, done.shape[0], keep.shape[0])
                rows, done, token, logits = rows[keep], done[keep], token[keep], logits[keep]
                next_position, attention_mask = next_position[keep], attention_mask[keep]
                cache.batch_select_indices(keep)
            if fast is not None and self.compile:
                slot = Lp + step
                key_mask[..., slot] = 0
                logits = step_fn(*buffers, torch.tensor([slot], device=device), token, next_position, key_mask).float()
            elif shared:
                logits = shared_prompt_decode_step(fast, prompt_kv, prompt_bias, completion_kv, step, token,
                                                   next_position, packed).float()
            elif fast is not None:
                logits = decode_step(fast, cache, token, next_position, key_mask[..., : Lp + step + 1],
                                     packed).float()
            else:
                attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
                out = model(input_ids=token[:, None], attention_mask=attention_mask, position_ids=next_position,
                            use_cache=True, **{cache_arg: cache})
                cache = output_cache(out)
                logits = out.logits[:, -1].float()
            next_position = next_position + 1
        completion_ids = torch.stack(tokens, dim=1)  # [N, T]
        # 1 up to and including the EOS: a token belongs to the completion if no EOS came strictly before it.
        eos_seen = torch.isin(completion_ids, eos_ids).long().cumsum(-1)
        completion_mask = ((eos_seen - torch.isin(completion_ids, eos_ids).long()) == 0).long()
        completion_ids = completion_ids.masked_fill(completion_mask == 0, pad_token_id)
        return RolloutBatch(
            prompt_ids=prompt_ids.repeat_interleave(G, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(G, dim=0),
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            sampling_logprobs=torch.stack(logps, dim=1) * completion_mask,
            finished=finished,
            group_size=G,
        )


def _stateless(model: nn.Module) -> bool:
    """Whether ``model`` may sample under ``torch.inference_mode``: a plain ``transformers`` model (no peft adapter)
    whose linear layers are all ``nn.Linear`` itself (quantized layers subclass or replace it)."""
    if hasattr(model, "peft_config") or not hasattr(model, "config"):
        return False
    return all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))


def _device_type(model: nn.Module) -> str:
    return next(model.parameters()).device.type
