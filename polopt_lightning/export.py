"""The trained policy out as a Hugging Face folder that ``transformers`` loads without this package.

Three ways in:

- ``module.save_pretrained("out/")`` on a :class:`~polopt_lightning.PolicyOptimizationModule` (drop-in users);
- ``polopt-train`` writes ``<run_dir>/model/`` at the end of every run;
- ``polopt-export CKPT OUT`` (or ``python -m polopt_lightning.export CKPT OUT``) turns any of this project's
  Lightning checkpoints (``last.ckpt``, ``best.ckpt``, ``on_exception.ckpt``) into such a folder. Checkpoints carry
  the model's ``transformers`` config and its tokenizer's files for this, so no other file is needed.

The folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` and the tokenizer's files:
``AutoModelForCausalLM.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)`` load it.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

# where PolicyOptimizationModule.on_save_checkpoint puts what an export needs
CHECKPOINT_KEY = "polopt"
POLICY_PREFIX = "policy."


def hf_metadata(model: nn.Module, tokenizer: Any) -> dict[str, Any]:
    """What a checkpoint needs to be turned into a Hugging Face folder: the model's config and the tokenizer's files.

    ``{}`` when ``model`` is not a ``transformers`` model (it has no config to rebuild it from).
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return {}
    files: dict[str, bytes] = {}
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
    generation = getattr(model, "generation_config", None)
    return {"config": config.to_dict(), "tokenizer_files": files,
            "generation_config": generation.to_dict() if generation is not None else None}


def save_policy(model: nn.Module, tokenizer: Any, out_dir: str | Path) -> Path:
    """Save a ``transformers`` policy and its tokenizer into ``out_dir`` with ``save_pretrained`` (safetensors).

    Raises a TypeError naming the model's class when it has no ``save_pretrained`` (not a ``transformers`` model).
    """
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"cannot save {type(model).__name__} in Hugging Face format: it has no save_pretrained "
                        "(a transformers PreTrainedModel has)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    log.info("saved the policy in Hugging Face format to %s", out)
    return out


def _policy_state(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len(POLICY_PREFIX):]: v for k, v in state_dict.items() if k.startswith(POLICY_PREFIX)}


def export_checkpoint(ckpt_path: str | Path, out_dir: str | Path) -> Path:
    """Turn a :class:`PolicyOptimizationModule` Lightning checkpoint into a Hugging Face folder at ``out_dir``.

    The policy's weights come from the checkpoint's ``state_dict`` (the reference, optimizer and the rest are left
    out); its architecture and tokenizer from what the module stored beside them.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = Path(ckpt_path)
    if not path.is_file():
        raise FileNotFoundError(f"polopt-export: no checkpoint file at {path}")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    meta = (checkpoint.get(CHECKPOINT_KEY) or {}).get("hf")
    if not meta:
        raise ValueError(f"polopt-export: {path} holds no model config: it was not written by a "
                         "PolicyOptimizationModule of this version with a transformers policy")
    state = _policy_state(checkpoint.get("state_dict", {}))
    if not state:
        raise ValueError(f"polopt-export: {path} has no '{POLICY_PREFIX}*' weights in its state_dict")
    config_dict = dict(meta["config"])
    model_type = config_dict.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"polopt-export: {path} stores a config of model_type {model_type!r}, which this "
                         "transformers version does not know")
    config = CONFIG_MAPPING[model_type].from_dict(config_dict)
    dtype = next(iter(state.values())).dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"polopt-export: the checkpoint's policy weights do not fit its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.tie_weights()
    if meta.get("generation_config"):
        model.generation_config = GenerationConfig.from_dict(meta["generation_config"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name, data in (meta.get("tokenizer_files") or {}).items():
        (out / name).write_bytes(data)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="polopt-export",
        description="Turn a polopt-lightning checkpoint into a Hugging Face folder "
                    "(AutoModelForCausalLM/AutoTokenizer.from_pretrained load it).")
    parser.add_argument("checkpoint", help="a Lightning checkpoint written by polopt-train or PolicyOptimizationModule")
    parser.add_argument("out", help="output folder (created; files in it are overwritten)")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out)
    except (FileNotFoundError, ValueError) as exc:
        parser.exit(2, f"{exc}\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
