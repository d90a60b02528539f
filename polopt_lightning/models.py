"""Policy and reference loading: a hub id or local path through ``from_pretrained``, or a tiny model built from a
``transformers`` config with a character-level tokenizer built locally (the defaults and tests: no downloads)."""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

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
    quantization_config: Any = None,
    **model_kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a policy and its tokenizer from a hub id or a local folder with ``from_pretrained``.

    ``trust_remote_code`` is off by default: a repository's own Python code runs only when you say so.
    A tokenizer without a pad token gets its EOS token as pad (logged), and left padding for generation.
    """
    _check_source(name_or_path, "model.name_or_path", "config.json", MODEL_FILES_HINT)
    tokenizer_source = tokenizer_name_or_path or name_or_path
    _check_source(tokenizer_source, "model.tokenizer_name_or_path" if tokenizer_name_or_path else "model.name_or_path",
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
    return model, tokenizer


# what AutoTokenizer reads from a folder: any one of these makes a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
MODEL_FILES_HINT = "a model's config.json (what save_pretrained writes beside the weights)"
# a hub id: "name" or "owner/name", letters, digits, '-', '_', '.'; no '--' or '..' (the hub's own rule)
_HUB_ID = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def _check_source(name_or_path: str, key: str, wanted: str | Sequence[str], what: str) -> None:
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
    """A frozen deep copy in eval mode (the reference policy for the KL term), its weights cast to ``dtype``."""
    ref = copy.deepcopy(model)
    ref.eval()
    ref.requires_grad_(False)
    if dtype is not None:
        cast_weights(ref, dtype, key)
    return ref


@contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """Eval mode for the duration of a block, then every submodule's own mode back (as Lightning's loops do)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
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
    for name, p in model.named_parameters():
        if not p.dtype.is_floating_point:
            raise ValueError(f"{key}={dtype} needs floating-point weights; {name} is {p.dtype} "
                             f"(a quantized model computes in its own precision: leave {key} unset)")
    for p in model.parameters():
        p.data = p.data.to(dtype)


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
