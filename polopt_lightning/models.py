"""Policy and reference loading: a hub id or local path through ``from_pretrained``, or a tiny model built from a
``transformers`` config with a character-level tokenizer built locally (the defaults and tests: no downloads)."""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from . import accel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, key: str = "model.dtype", auto: bool = True) -> torch.dtype | None:
    """``None``, a torch dtype, or one of :data:`DTYPES` (``"auto"`` too when ``auto``); errors name ``key``."""
    if dtype is None or isinstance(dtype, torch.dtype) or (auto and dtype == "auto"):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"{key} must be one of {sorted(DTYPES)}{' or auto' if auto else ''}, got {dtype!r}")
    return DTYPES[dtype]


def char_tokenizer(extra_chars: str = "", chat_template: str | None = None):
    """A character-level fast tokenizer over printable ASCII and newline, with ``<pad>``, ``<eos>``, ``<unk>``.

    Left padding (what batched generation needs). Saved and reloaded with ``save_pretrained``/``AutoTokenizer``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in [chr(i) for i in range(32, 127)] + ["\n"] + list(extra_chars):
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


ARCHITECTURES = ("qwen2", "llama")


def build_tiny_model(
    architecture: str = "qwen2",
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    dropout: float = 0.0,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Build a small randomly initialised causal LM from a ``transformers`` config, with a char tokenizer.

    Args:
        architecture: ``"qwen2"`` or ``"llama"`` (config class of that family).
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: model shape
            (``intermediate_size`` defaults to ``4 * hidden_size``; ``num_kv_heads`` to ``num_heads``).
        vocab_size: defaults to the tokenizer's size (a larger one simulates a big vocabulary).
        dropout: attention dropout.
        seed: initialisation seed.
        tokenizer: defaults to :func:`char_tokenizer`.
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"model.architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    if hidden_size % num_heads:
        raise ValueError(f"model.hidden_size={hidden_size} is not divisible by model.num_heads={num_heads}")
    tokenizer = char_tokenizer() if tokenizer is None else tokenizer
    vocab_size = vocab_size or len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ValueError(f"model.vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        intermediate_size=intermediate_size or 4 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        attention_dropout=dropout,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    config = AutoConfig.for_model(architecture, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def load_pretrained(
    name_or_path: str,
    dtype: str | torch.dtype | None = "auto",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    tokenizer_name_or_path: str | None = None,
    quantization: Quantization | str | Mapping[str, Any] | None = None,
    quantization_config: Any = None,
    **model_kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a policy and its tokenizer from a hub id or a local folder with ``from_pretrained``.

    ``trust_remote_code`` is off by default: a repository's own Python code runs only when you say so.
    A tokenizer without a pad token gets its EOS token as pad (logged), and left padding for generation.
    ``quantization`` (a :class:`Quantization`, a mode name such as ``"nf4"``, or its fields) quantizes the linear
    layers while loading, so the full-precision weights are never held; ``quantization_config`` takes a ready
    ``transformers`` quantization config instead.
    """
    quantization = as_quantization(quantization)
    if quantization.enabled and quantization_config is not None:
        raise ValueError(f"give either quantization={quantization.mode!r} or quantization_config, not both")
    quantization_config = quantization_config if quantization_config is not None else quantization.bnb_config()
    check_source(name_or_path, "model.name_or_path", "config.json", MODEL_FILES_HINT)
    tokenizer_source = tokenizer_name_or_path or name_or_path
    check_source(tokenizer_source, "model.tokenizer_name_or_path" if tokenizer_name_or_path else "model.name_or_path",
                 TOKENIZER_FILES, "a tokenizer (save it beside the model with tokenizer.save_pretrained, or set "
                 "model.tokenizer_name_or_path to another folder or hub id)")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path,
            dtype=resolve_dtype(dtype),
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            revision=revision,
            quantization_config=quantization_config,
            **model_kwargs,
        )
    except OSError as exc:  # a hub id that is neither cached nor reachable, or a repository without weights
        raise OSError(f"model.name_or_path={name_or_path!r}: no local folder of that name, and the hub id could not "
                      f"be loaded (offline and not in the cache, or not a model repository): {exc}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, trust_remote_code=trust_remote_code,
                                                  revision=revision)
    except OSError as exc:
        raise OSError(f"tokenizer {tokenizer_source!r}: could not be loaded (looked for {', '.join(TOKENIZER_FILES)}; "
                      f"set model.tokenizer_name_or_path to a folder or hub id that has one): {exc}") from exc
    prepare_tokenizer(tokenizer)
    if is_quantized(model):
        prepare_quantized(model)
    accel.loaded(model)
    return model, tokenizer


# what AutoTokenizer reads from a folder: any one of these makes a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
MODEL_FILES_HINT = "a model's config.json (what save_pretrained writes beside the weights)"
# a hub id: "name" or "owner/name", letters, digits, '-', '_', '.'; no '--' or '..' (the hub's own rule)
_HUB_ID = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def check_source(name_or_path: str, key: str, wanted: str | Sequence[str], what: str) -> None:
    """Fail early, naming ``key`` and the path, when ``name_or_path`` is neither a usable folder nor a hub id.

    An existing folder must hold ``wanted`` (a file name, or any one of several); a string that is no folder must be
    a valid hub id (``owner/name``), else it was meant as a path that does not exist.
    """
    path = Path(str(name_or_path)).expanduser()
    names = (wanted,) if isinstance(wanted, str) else tuple(wanted)
    if path.is_dir():
        if not any((path / name).is_file() for name in names):
            raise FileNotFoundError(f"{key}={str(name_or_path)!r}: the folder {path.resolve()} has no "
                                    f"{' or '.join(names)}: it does not hold {what}")
        return
    if path.exists():
        raise NotADirectoryError(f"{key}={str(name_or_path)!r} is a file; give the folder that holds {what}")
    if not _HUB_ID.match(str(name_or_path)):
        raise FileNotFoundError(f"{key}={str(name_or_path)!r}: no such folder ({path.resolve()}), and it is not a "
                                "hub id of the form owner/name either")


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Left padding for batched generation; EOS as pad when the tokenizer has no pad token (said in the log)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token")
        log.warning("tokenizer has no pad token: using its EOS token %r as pad", tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def frozen_copy(model: nn.Module, dtype: torch.dtype | None = None, key: str = "dtype") -> nn.Module:
    """A frozen deep copy in eval mode (the reference policy for the KL term), its weights cast to ``dtype``.

    With ``dtype`` the weights are cast straight from ``model``'s (no full-precision copy first: at 0.5B that would
    be 2 GB held a moment, and kept by the process where freed memory is kept) into one block
    (:func:`cast_as_one_block`); shared weights stay shared. Raises as :func:`cast_weights` does.
    """
    params = list(model.parameters())
    if dtype is None or not _plain(params):  # distributed tensors (FSDP) are deep-copied, then cast, as they are
        ref = copy.deepcopy(model)
        if dtype is not None:
            cast_weights(ref, dtype, key)
    else:
        check_floating(model, dtype, key)
        with torch.no_grad():
            memo = {id(p): nn.Parameter(c, requires_grad=False)
                    for p, c in zip(params, cast_as_one_block(params, dtype))}
        ref = copy.deepcopy(model, memo)
    ref.eval()
    ref.requires_grad_(False)
    return ref


BLOCK_ALIGN = 64  # bytes: each tensor of cast_as_one_block starts on a cache line (vector loads, oneDNN)


def cast_as_one_block(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Copies of ``tensors`` in ``dtype``, as views of one allocation, each starting :data:`BLOCK_ALIGN` bytes
    apart, freed as one when the last view goes. On the CPU, where a training run keeps freed memory in the C
    library's heap for the next step's tensors (:mod:`~polopt_lightning.accel.cpu.host_memory`), a copy made and
    freed weight by weight at each rollout (the sampling copy) left holes the training pass's tensors fitted badly:
    at 0.5B that pass ran 1.5x slower and the peak rose 1.1 GiB; as one block it is reused whole
    (docs/performance.md, "Precision by the hardware"). A block mapped outside the heap measured worse: it adds to
    the heap's kept high-water mark instead of filling the gradients' freed space."""
    if not _plain(tensors):
        return [t.detach().to(dtype) for t in tensors]
    if not tensors:
        return []
    step = max(BLOCK_ALIGN // torch.empty(0, dtype=dtype).element_size(), 1)
    sizes = [-(-t.numel() // step) * step for t in tensors]
    block = torch.empty(sum(sizes), dtype=dtype, device=tensors[0].device)
    views, at = [], 0
    for t, size in zip(tensors, sizes):
        view = block[at:at + t.numel()].view(t.shape)
        view.copy_(t.detach())
        views.append(view)
        at += size
    return views


def _plain(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every one of ``tensors`` holds its data itself (not a distributed or other tensor subclass)."""
    return all(type(t.data) is torch.Tensor for t in tensors)


@contextmanager
def evaluating(model: nn.Module, keep_quantized: bool = False) -> Iterator[nn.Module]:
    """Eval mode for the duration of a block, then every submodule's own mode back (as Lightning's loops do).

    ``keep_quantized``: bitsandbytes' quantized layers keep their mode (its int8 layer computes with int8 activations
    in eval mode and with dequantized weights in training mode: a reference pass that must match the training
    forward keeps the training kernels).
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    if keep_quantized:
        for module, training in modes:
            if is_quantized_layer(module):
                module.training = training
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


def cast_weights(model: nn.Module, dtype: torch.dtype, key: str = "dtype") -> None:
    """Cast every parameter of ``model`` to ``dtype`` in place; buffers keep theirs (rotary frequencies stay exact).

    Raises a ValueError naming ``key`` and the parameter when a weight is not floating point (a quantized model
    computes in its own precision).
    """
    check_floating(model, dtype, key)
    for p in model.parameters():
        p.data = p.data.to(dtype)


def check_floating(model: nn.Module, dtype: torch.dtype, key: str) -> None:
    """Raise a ValueError naming ``key`` and the parameter where a weight of ``model`` is not floating point."""
    for name, p in model.named_parameters():
        if not p.dtype.is_floating_point:
            raise ValueError(f"{key}={dtype} needs floating-point weights; {name} is {p.dtype} "
                             f"(a quantized model computes in its own precision: leave {key} unset)")


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability to 0 (the peers' default during the RL update: ratios stay exact)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop", "dropout"):
        if config is not None and isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)


def count_parameters(model: nn.Module, non_embedding: bool = False) -> int:
    total = sum(p.numel() for p in model.parameters())
    if non_embedding:
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if emb is not None:
            total -= emb.weight.numel()
    return total


# ---------------------------------------------------------------------------------------------------------------
# Quantization (bitsandbytes through transformers) and adapters (peft)
#
# Lightning's `BitsandbytesPrecision` is not used: it is CUDA-only and replaces every Linear of the LightningModule,
# the reference's too, at `setup`; loading through `transformers.BitsAndBytesConfig` quantizes the policy's base
# alone, runs on the CPU (bitsandbytes >= 0.45 has CPU nf4/int8 kernels and the LoRA backward), and leaves the
# model a plain `transformers` model that `save_pretrained`, peft and the rollout understand.

QUANTIZATION_MODES = ("none", "int8", "nf4", "fp4")


@dataclass
class Quantization:
    """How the base model's linear layers are stored: the ``quantization`` config group.

    Attributes:
        mode: ``none``, ``int8`` (LLM.int8 weights), ``nf4`` or ``fp4`` (4-bit, QLoRA). A quantized base is frozen:
            it trains only through an adapter.
        double_quant: 4-bit only: quantize the quantization constants too (~0.4 bits per weight saved).
        compute_dtype: 4-bit only: dtype the dequantized weights compute in (``float32``, ``bfloat16``,
            ``float16``); bf16 halves the bandwidth on GPUs and bf16-capable CPUs.
        skip_modules: module names left unquantized (``None``: transformers' choice, the output head and tied
            embeddings).
        key: the config key errors name.
    """

    mode: str = "none"
    double_quant: bool = True
    compute_dtype: str = "float32"
    skip_modules: list[str] | None = None
    key: str = "quantization"

    def __post_init__(self) -> None:
        if self.mode not in QUANTIZATION_MODES:
            raise ValueError(f"{self.key}.mode must be one of {QUANTIZATION_MODES}, got {self.mode!r}")
        resolve_dtype(self.compute_dtype, f"{self.key}.compute_dtype", auto=False)

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def bnb_config(self) -> Any:
        """The ``transformers.BitsAndBytesConfig`` for ``from_pretrained`` (``None`` when ``mode`` is ``none``)."""
        if not self.enabled:
            return None
        from transformers import BitsAndBytesConfig

        skip = list(self.skip_modules) if self.skip_modules is not None else None
        if self.mode == "int8":
            return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=self.mode,
                                  bnb_4bit_use_double_quant=self.double_quant,
                                  bnb_4bit_compute_dtype=resolve_dtype(self.compute_dtype), llm_int8_skip_modules=skip)


def as_quantization(value: Quantization | str | Mapping[str, Any] | None, key: str = "quantization") -> Quantization:
    """``None``, a mode name, a mapping of :class:`Quantization` fields or one itself -> :class:`Quantization`."""
    return _as_spec(Quantization, "mode", value, key)


def _as_spec(cls: type, name_field: str, value: Any, key: str) -> Any:
    """An instance of the dataclass ``cls`` from itself, ``None`` or a name (its ``name_field``), or its fields."""
    if isinstance(value, cls):
        return value
    if value is None or isinstance(value, str):
        return cls(**{name_field: value or "none", "key": key})
    return cls(**{"key": key, **dict(value)})


# the projections of Llama-family blocks; peft's "all-linear" finds the same ones (and skips the output head)
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_KINDS = ("none", "lora")


@dataclass
class Adapter:
    """A trainable adapter over a frozen base: the ``adapter`` config group (peft LoRA).

    Attributes:
        kind: ``none`` (full fine-tuning) or ``lora``.
        r: LoRA rank.
        alpha: LoRA scaling numerator (the update is ``alpha / r * B @ A``, or ``alpha / sqrt(r)`` with ``rslora``).
        dropout: dropout on the adapter's input (0 keeps importance ratios exact, as the policy's dropout is off).
        target_modules: module names to adapt, or ``"all-linear"``; ``None``: the attention and MLP projections of
            Llama-family models (Llama, Qwen2, Mistral), ``all-linear`` for others.
        bias: ``none``, ``all`` or ``lora_only`` (peft's): which biases train.
        rslora: rank-stabilised scaling ``alpha / sqrt(r)``.
        key: the config key errors name.
    """

    kind: str = "none"
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] | str | None = None
    bias: str = "none"
    rslora: bool = False
    key: str = "adapter"

    def __post_init__(self) -> None:
        if self.kind not in ADAPTER_KINDS:
            raise ValueError(f"{self.key}.kind must be one of {ADAPTER_KINDS}, got {self.kind!r}")
        if self.r < 1:
            raise ValueError(f"{self.key}.r must be >= 1, got {self.r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"{self.key}.dropout must be in [0, 1), got {self.dropout}")
        if self.bias not in ("none", "all", "lora_only"):
            raise ValueError(f"{self.key}.bias must be none, all or lora_only, got {self.bias!r}")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            self.target_modules = [self.target_modules]

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def peft_config(self, model: nn.Module) -> Any:
        from peft import LoraConfig

        targets = self.target_modules
        if targets is None:
            names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
            targets = list(LLAMA_TARGETS) if set(LLAMA_TARGETS) <= names else "all-linear"
        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
                          bias=self.bias, use_rslora=self.rslora, task_type="CAUSAL_LM")


def as_adapter(value: Adapter | str | Mapping[str, Any] | None, key: str = "adapter") -> Adapter:
    """``None``, a kind name, a mapping of :class:`Adapter` fields or one itself -> :class:`Adapter`."""
    return _as_spec(Adapter, "kind", value, key)


def check_combination(quantization: Quantization, adapter: Adapter) -> None:
    """A quantized base has frozen integer weights: it trains only through an adapter."""
    if quantization.enabled and not adapter.enabled:
        raise ValueError(f"{quantization.key}={quantization.mode} needs an adapter: quantized weights cannot be "
                         f"trained, so full fine-tuning of a quantized base is impossible; set {adapter.key}=lora "
                         f"(QLoRA) or {quantization.key}=none")


def is_quantized_layer(module: nn.Module) -> bool:
    """Whether ``module`` is one of bitsandbytes' quantized linear layers (4-bit or int8)."""
    return any(cls.__name__ in ("Linear4bit", "Linear8bitLt") for cls in type(module).__mro__)


def is_quantized(model: nn.Module) -> bool:
    """Whether some linear layer of ``model`` is a bitsandbytes quantized one (or any weight is not floating point)."""
    return any(is_quantized_layer(m) for m in model.modules()) or any(
        not p.dtype.is_floating_point for p in model.parameters())


def has_adapter(model: nn.Module) -> bool:
    """Whether ``model`` is a peft model (adapters over a frozen base)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def reference_context(model: nn.Module) -> Any:
    """A context in which ``model`` computes as its own frozen base (peft: adapters disabled), or ``None`` when the
    model has no such mode. This is the shared KL reference: no second copy of the weights."""
    return model.disable_adapter() if has_adapter(model) else None


def quantized_copy(model: PreTrainedModel, quantization: Quantization, folder: str | Path | None = None
                   ) -> PreTrainedModel:
    """``model`` reloaded with its linear layers quantized (``from_pretrained`` with ``quantization.bnb_config()``).

    bitsandbytes quantizes at load time, so an in-memory model (a built or warm-started one) goes through a
    ``save_pretrained`` folder: ``folder`` keeps it (an adapter's exports point their base there), else a
    temporary one is removed after loading.
    """
    import tempfile

    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"{quantization.key}={quantization.mode}: {type(model).__name__} is not a transformers model "
                        "(it has no save_pretrained to reload it quantized from)")
    with tempfile.TemporaryDirectory(prefix="polopt_quantize_") as tmp:
        target = Path(folder) if folder is not None else Path(tmp)
        model.save_pretrained(target, safe_serialization=True)
        quantized = AutoModelForCausalLM.from_pretrained(target, quantization_config=quantization.bnb_config(),
                                                         dtype=float_dtype(model))
        accel.loaded(quantized)  # before the temporary folder goes
    quantized.generation_config = copy.deepcopy(model.generation_config)
    return prepare_quantized(quantized)


def prepare_trainable(model: nn.Module) -> None:
    """Check that ``model`` can be trained (a quantized base needs an adapter; some parameter needs gradients) and
    prepare a quantized one (:func:`prepare_quantized`); a ValueError says what is missing."""
    if is_quantized(model):
        if not has_adapter(model):
            raise ValueError(f"{type(model).__name__} has quantized weights and no adapter: they cannot be trained "
                             "(set adapter=lora with quantization=int8/nf4 in the CLI, or wrap the model with "
                             "peft.get_peft_model before passing it)")
        prepare_quantized(model)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no trainable parameter (requires_grad is False everywhere)")


def enable_gradient_checkpointing(model: nn.Module, key: str = "gradient_checkpointing") -> None:
    """The model's own activation checkpointing, non-reentrant; a model without it raises a ValueError naming
    ``key``."""
    if not getattr(model, "supports_gradient_checkpointing", False) and not hasattr(model, "base_model"):
        raise ValueError(f"{key}=True: {type(model).__name__} does not support it (a transformers model with "
                         "supports_gradient_checkpointing does)")
    # the recomputation runs where the forward ran: on the CPU, inside the step's oneDNN products
    kwargs = {"use_reentrant": False, "context_fn": accel.recompute_contexts}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the old name is deprecated)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def prepare_quantized(model: nn.Module) -> nn.Module:
    """Keep bitsandbytes' 4-bit layers trainable after they have run in eval mode.

    bitsandbytes 0.50 repacks a ``Linear4bit`` weight for an inference-only CPU kernel the first time the layer runs
    in eval mode without gradient on an AVX512-BF16 CPU, and nothing packs it back in training mode: every later
    training forward then takes the inference kernel, which fails in place on layers with a bias (``a view of a leaf
    Variable that requires grad is being used in an in-place operation``) and gives no input gradient on the others.
    The sampler, validation and the reference pass all run in eval mode, so the repacking is turned off here.
    """
    from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse

    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):  # Linear4bit and its subclasses
            module.support_avx512bf16_for_cpu = False
            weight = getattr(module, "weight", None)
            state = getattr(weight, "quant_state", None)
            if state is not None and getattr(state, "packing_format_for_cpu", False):  # already repacked: undo
                weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
    return model


def apply_adapter(model: nn.Module, adapter: Adapter) -> nn.Module:
    """``model`` wrapped with ``adapter`` (peft): only the adapter's parameters train, the base is frozen.

    Quantized layers get their non-quantized parameters (norms, biases, embeddings) frozen in their own dtype; no
    ``prepare_model_for_kbit_training``, which casts them to float32 and turns on reentrant checkpointing (the
    module's ``gradient_checkpointing`` turns on the non-reentrant kind when asked).
    """
    if not adapter.enabled:
        return model
    from peft import get_peft_model

    if has_adapter(model):
        raise ValueError(f"{adapter.key}={adapter.kind}: the model already has a peft adapter; pass it as is "
                         f"and leave {adapter.key}=none")
    return get_peft_model(model, adapter.peft_config(model))


def train_in_float32(model: nn.Module) -> torch.dtype | None:
    """Cast a half-precision model's weights (bfloat16, float16: what a hub checkpoint loads in with ``dtype="auto"``)
    to float32 in place, for full fine-tuning: the optimizer's state then follows in float32 too. In bfloat16 an AdamW
    step smaller than half a unit of a weight's last place is rounded away, which at RL's learning rates (1e-6 to
    1e-5) is most steps of most weights; mixed precision (``bf16-mixed``) expects float32 weights. Returns the dtype
    it cast from, ``None`` when the model was not in half precision."""
    half = float_dtype(model)
    if half not in (torch.bfloat16, torch.float16):
        return None
    cast_weights(model, torch.float32, "model.dtype")
    return half


def float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of ``model``'s first floating-point parameter (float32 when it has none)."""
    return next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)


def prepare_policy(model: nn.Module, quantization: Quantization, adapter: Adapter,
                   base_dir: str | Path | None = None) -> nn.Module:
    """The policy a run trains: ``model`` quantized (unless it was loaded so already) and wrapped with ``adapter``.

    ``base_dir``: save the base there (full precision) and name it as the adapter's base, for a model built or
    changed in memory (a tiny model, a warm start) that no folder or hub id holds; an adapter exported alone then
    points at a base that exists. Without it the base keeps the name it was loaded from.
    """
    check_combination(quantization, adapter)
    source = getattr(model, "name_or_path", "")
    if quantization.enabled and not is_quantized(model):
        model = quantized_copy(model, quantization, folder=base_dir)
    elif adapter.enabled and base_dir is not None:
        model.save_pretrained(base_dir, safe_serialization=True)
    if adapter.enabled:  # peft records the base's name from this attribute
        model.name_or_path = model.config._name_or_path = str(base_dir) if base_dir is not None else source
    return apply_adapter(model, adapter)


def frozen_quantized_state(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> set[str]:
    """The keys of ``state_dict`` that belong to ``model``'s bitsandbytes layers and do not train: quantized weights
    and their constants, frozen biases.

    bitsandbytes writes these into a state dict but refuses to load them back on the CPU (4-bit: its constants are
    unexpected keys; int8: "Loading a quantized checkpoint into non-quantized Linear8bitLt is not supported"). A
    resumed run rebuilds the same frozen base from its settings, so they are compared instead of loaded: a key that
    differs from the rebuilt base raises a ValueError naming it (the run was resumed with another base or
    quantization).
    """
    prefixes = tuple(f"{name}." for name, module in model.named_modules() if name and is_quantized_layer(module))
    if not prefixes:
        return set()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    frozen = {k for k in state_dict if k.startswith(prefixes) and k not in trainable}
    own = model.state_dict()
    for key in sorted(frozen):
        if key not in own or not torch.equal(own[key].cpu(), state_dict[key].cpu()):
            raise ValueError(f"the checkpoint's {key} differs from the quantized base this run built: resume with the "
                             "model, warm start and quantization settings the checkpoint was trained with")
    return frozen
