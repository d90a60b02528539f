"""The trained policy out as a Hugging Face folder that ``transformers`` loads without this package.

Three ways in:

- ``module.save_pretrained("out/")`` on a :class:`~polopt_lightning.PolicyOptimizationModule` (drop-in users);
- ``polopt-train`` writes ``<run_dir>/model/`` at the end of every run;
- ``polopt-export CKPT OUT`` (or ``python -m polopt_lightning.export CKPT OUT``) turns any of this project's
  Lightning checkpoints (``last.ckpt``, ``best.ckpt``, ``on_exception.ckpt``; a run directory means its newest, as
  ``polopt-train ckpt_path=<run>`` does) into such a folder. Checkpoints carry
  the model's ``transformers`` config, its adapter's peft config and its tokenizer's files for this, so no other
  file is needed.

The folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` and the tokenizer's files:
``AutoModelForCausalLM.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)`` load it.

A policy with a LoRA adapter is written either merged (the default: the adapter folded into its base, a quantized
base dequantized first, so the folder is an ordinary full-precision model as above) or as the adapter alone
(``merge=False``, ``polopt-export --adapter-only``): ``adapter_model.safetensors`` and ``adapter_config.json``,
which ``peft.PeftModel.from_pretrained(base, OUT)`` loads over the base named in ``base_model_name_or_path``.

Every export also writes ``polopt_export.json`` (:data:`EXPORT_MARKER`): the files it wrote. An export never deletes
what it did not write: a target that holds the checkpoint being exported (its folder, or any folder above it) is
refused, and ``overwrite`` replaces only an empty folder or a previous export, one that holds nothing but the files its
marker lists and Hugging Face model, adapter and tokenizer files (:func:`foreign_entries`); a subfolder or any other
file (``checkpoints/``, ``results.json``, your notes) makes it refuse, naming them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoints import checkpoint_folder, checkpoints_in, resume_point
from .models import has_adapter

log = logging.getLogger(__name__)

# where PolicyOptimizationModule.on_save_checkpoint puts what an export needs
CHECKPOINT_KEY = "polopt"
POLICY_PREFIX = "policy."
# written into every folder an export makes: which files it wrote, so that `overwrite` knows a previous export
EXPORT_MARKER = "polopt_export.json"
# the files of a Hugging Face model, adapter (peft's README.md model card too) or tokenizer folder: with the marker's
# files, all that a folder replaced by `overwrite` may hold (a previous export, one made before the marker too)
HF_FILES = re.compile(
    r"(config|generation_config|adapter_config|tokenizer_config|tokenizer|special_tokens_map|added_tokens|vocab"
    r"|chat_template)\.json|(model|adapter_model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)"
    r"|(model\.safetensors|pytorch_model\.bin)\.index\.json|vocab\.txt|merges\.txt|tokenizer\.model|spiece\.model"
    r"|sentencepiece\.bpe\.model|chat_template\.jinja|README\.md")


def hf_metadata(model: nn.Module, tokenizer: Any) -> dict[str, Any]:
    """What a checkpoint needs to be turned into a Hugging Face folder: the model's config and the tokenizer's files,
    and for a peft model its adapter's config (``adapter``).

    ``{}`` when ``model`` is not a ``transformers`` model (it has no config to rebuild it from).
    """
    adapter = None
    if has_adapter(model):
        adapter = _json_safe(model.peft_config["default"].to_dict())
        model = model.get_base_model()
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return {}
    files: dict[str, bytes] = {}
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
    generation = getattr(model, "generation_config", None)
    meta = {"config": _json_safe(config.to_dict()), "tokenizer_files": files,
            "generation_config": generation.to_dict() if generation is not None else None}
    if adapter is not None:
        meta["adapter"] = adapter
    return meta


def _json_safe(value: dict[str, Any]) -> dict[str, Any]:
    """Plain JSON types only (sets as sorted lists, enums as their values): checkpoints are read back with
    ``torch.load(weights_only=True)``, which refuses other classes (a quantized config holds an enum)."""
    return json.loads(json.dumps(value, default=lambda o: sorted(o) if isinstance(o, set) else getattr(o, "value",
                                                                                                         str(o))))


def save_policy(model: nn.Module, tokenizer: Any, out_dir: str | Path, merge: bool = True,
                overwrite: bool = False) -> Path:
    """Save a ``transformers`` policy and its tokenizer into ``out_dir`` with ``save_pretrained`` (safetensors).

    A peft policy is saved merged into a full-precision copy of its base (``merge``) or as the adapter alone.
    Raises a TypeError naming the model's class when it has no ``save_pretrained`` (not a ``transformers`` model),
    and a FileExistsError when ``out_dir`` holds files and ``overwrite`` is False, or holds anything but a previous
    export (see :func:`check_target`).
    """
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"cannot save {type(model).__name__} in Hugging Face format: it has no save_pretrained "
                        "(a transformers PreTrainedModel has)")
    check_target(out_dir, overwrite)
    if has_adapter(model) and merge:
        model = rebuild_policy(model.state_dict(), hf_metadata(model, None)).merge_and_unload()

    def write(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    out = write_folder(out_dir, write, overwrite)
    log.info("saved the policy in Hugging Face format to %s", out)
    return out


def _shown(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def foreign_entries(folder: str | Path) -> list[str]:
    """What in ``folder`` no export wrote (sorted; a subfolder with a trailing ``/``): every entry but the files its
    :data:`EXPORT_MARKER` lists and the marker itself; in a folder without a marker (an export made before it), every
    entry but Hugging Face model, adapter and tokenizer files (:data:`HF_FILES`). ``[]``: ``folder`` is empty or a
    previous export, which ``overwrite`` may replace."""
    folder = Path(folder)
    try:
        listed = json.loads((folder / EXPORT_MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):  # no marker, or not one this project wrote
        listed = None
    # a marked export: exactly the files it wrote (a README.md or vocab.txt put there since is the user's); an export
    # from before the marker: Hugging Face's file names
    ours = {name for name in listed if isinstance(name, str)} | {EXPORT_MARKER} if isinstance(listed, list) else None
    out = []
    for entry in sorted(folder.iterdir()):
        if not entry.is_file():  # a folder (checkpoints/, a run's csv/), a broken link, ...
            out.append(entry.name + "/" if entry.is_dir() else entry.name)
        elif entry.name not in ours if ours is not None else not HF_FILES.fullmatch(entry.name):
            out.append(entry.name)
    return out


def check_outside(out_dir: str | Path, source: str | Path) -> None:
    """Raise a ValueError naming both paths when ``out_dir`` is the checkpoint ``source`` or a folder that holds it
    (its own folder or any folder above it): an export there would put the checkpoint it reads at risk."""
    out, src = Path(out_dir).resolve(), Path(source).resolve()
    if out == src:
        raise ValueError(f"polopt-export: the output folder {out_dir} is the checkpoint being exported: give another "
                         "folder (nothing was written)")
    if out in src.parents:
        raise ValueError(f"polopt-export: the output folder {out_dir} holds the checkpoint being exported ({source}): "
                         "give a folder outside it, e.g. a new one beside the run (nothing was written)")


def check_target(out_dir: str | Path, overwrite: bool, source: str | Path | None = None) -> None:
    """Refuse ``out_dir`` unless an export may write there: a FileExistsError when it is a file, when it holds files
    and ``overwrite`` is False, or when it holds anything that no export wrote (:func:`foreign_entries`: ``overwrite``
    replaces only an empty folder or a previous export); a ValueError when it holds the checkpoint ``source``
    (:func:`check_outside`). Every message names the folder and what is in the way."""
    out = Path(out_dir)
    if source is not None:
        check_outside(out, source)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file, not a folder: give another output folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        names = sorted(p.name for p in out.iterdir())
        raise FileExistsError(f"{out} is not empty ({_shown(names)}): give an empty or new folder, or overwrite=True "
                              "(polopt-export --overwrite) to replace a previous export")
    foreign = foreign_entries(out)
    if foreign:
        raise FileExistsError(
            f"{out} is not a previous export: it holds {_shown(foreign)}, which no export wrote. overwrite "
            f"(polopt-export --overwrite) replaces only an empty folder or one holding an export (Hugging Face "
            f"model, adapter and tokenizer files, {EXPORT_MARKER}); give another folder (nothing was deleted)")


def write_folder(out_dir: str | Path, write: Callable[[Path], None], overwrite: bool = False,
                 source: str | Path | None = None) -> Path:
    """Run ``write(folder)`` into a new folder beside ``out_dir``, add :data:`EXPORT_MARKER` (the files written),
    then put that folder in ``out_dir``'s place.

    ``out_dir`` must pass :func:`check_target`: a folder that holds files is refused unless ``overwrite``, and then
    only a previous export is replaced, whole: no file of it (an old shard, a stale ``model.safetensors.index.json``)
    stays beside the new ones. A folder holding anything else, or the checkpoint ``source`` the export reads, is
    refused. A failure while writing leaves ``out_dir`` as it was.
    """
    from . import __version__

    out = Path(out_dir)
    check_target(out, overwrite, source)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".new"))
    try:
        write(new)
        files = sorted(p.name for p in new.iterdir() if p.name != EXPORT_MARKER)
        marker = {"written_by": f"polopt-lightning {__version__}", "source": str(source) if source else None,
                  "files": files}
        (new / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        check_target(out, overwrite, source)  # again: something may have been put there while this one wrote
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    old = None
    if out.is_dir():
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
        os.replace(out, old / out.name)
    os.replace(new, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


def _policy_state(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len(POLICY_PREFIX):]: v for k, v in state_dict.items() if k.startswith(POLICY_PREFIX)}


#: a 4-bit weight's quantization state, in a (saved or pushed) state dict: ``<weight>.quant_state.bitsandbytes__nf4``
QUANT_STATE = ".quant_state.bitsandbytes__"


def dequantized_state(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` with every bitsandbytes-quantized weight (4-bit with its quant-state entries, int8 with its ``SCB``
    row scales) replaced by its floating-point value in ``dtype``: the weights the quantized layers compute with."""
    out = dict(state)
    for key in [k for k in state if QUANT_STATE in k]:  # one per 4-bit weight
        from bitsandbytes.functional import QuantState, dequantize_4bit

        prefix = key[: key.index(".quant_state.")]  # "...base_layer.weight"
        parts = {k[len(prefix) + 1:]: out.pop(k) for k in list(out) if k.startswith(prefix + ".")}
        quant_state = QuantState.from_dict(parts, device=torch.device("cpu"))
        out[prefix] = dequantize_4bit(out[prefix].cpu(), quant_state).to(dtype)
    for key in [k for k in state if k.endswith("SCB")]:  # int8: weight ~ round(W * 127 / absmax) per row
        prefix = key[: -len("SCB")]
        scale = out.pop(key).float()
        out.pop(prefix + "weight_format", None)
        out[prefix + "weight"] = (out[prefix + "weight"].float() * (scale[:, None] / 127)).to(dtype)
    return out


def rebuild_policy(state: Mapping[str, torch.Tensor], meta: Mapping[str, Any], where: str = "the policy") -> nn.Module:
    """A full-precision ``transformers`` model (a peft model over it when ``meta`` has an adapter) holding ``state``.

    ``state`` is a policy's ``state_dict`` (a live one, or a checkpoint's without the ``policy.`` prefix), ``meta``
    what :func:`hf_metadata` stored beside it. A quantized base is dequantized into the dtype of its other weights.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_dict = {k: v for k, v in meta["config"].items() if k != "quantization_config"}
    model_type = config_dict.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"polopt-export: {where} stores a config of model_type {model_type!r}, which this "
                         "transformers version does not know")
    config = CONFIG_MAPPING[model_type].from_dict(config_dict)
    # the base's own dtype: not the adapter's, nor that of bitsandbytes' constants ("weight.absmax", "SCB", ...)
    dtype = next(v.dtype for k, v in state.items() if v.dtype.is_floating_point and "lora_" not in k
                 and ".weight." not in k and not k.endswith("SCB"))
    state = dequantized_state(state, dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if meta.get("generation_config"):
        model.generation_config = GenerationConfig.from_dict(meta["generation_config"])
    if meta.get("adapter"):
        from peft import PeftConfig, get_peft_model

        model = get_peft_model(model, PeftConfig.from_peft_type(**meta["adapter"]))
    missing, unexpected = model.load_state_dict(state, strict=False)
    base = model.get_base_model() if meta.get("adapter") else model
    tied = set(getattr(base, "_tied_weights_keys", None) or [])  # tied to the input embeddings
    missing = [k for k in missing if k.rsplit("base_model.model.", 1)[-1] not in tied
               and not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"polopt-export: {where}'s weights do not fit its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    base.tie_weights()
    return model


def consolidated_checkpoint(path: str | Path) -> Path:
    """A checkpoint file for ``path``: itself, or for a DeepSpeed checkpoint folder (one shard per process) the file
    ``<path>.consolidated`` that Lightning's converter writes beside it (made once)."""
    path = Path(path)
    if not path.is_dir():
        return path
    out = path.with_name(path.name + ".consolidated")
    if not out.is_file():
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        convert_zero_checkpoint_to_fp32_state_dict(str(path), str(out))
    return out


def export_checkpoint(ckpt_path: str | Path, out_dir: str | Path, merge: bool = True, overwrite: bool = False) -> Path:
    """Turn a :class:`PolicyOptimizationModule` Lightning checkpoint into a Hugging Face folder at ``out_dir``.

    The policy's weights come from the checkpoint's ``state_dict`` (the reference, optimizer and the rest are left
    out); its architecture, adapter and tokenizer from what the module stored beside them. A policy with an
    adapter is written merged (``merge``) or as the adapter alone. A non-empty ``out_dir`` is refused unless
    ``overwrite``, and then only a previous export is replaced, whole; a folder that holds ``ckpt_path`` never
    (:func:`check_target`, :func:`write_folder`).
    """
    path = Path(ckpt_path)
    folder = checkpoint_folder(path)
    if folder is not None:  # a run directory or its checkpoints/: its newest checkpoint, as ckpt_path=<run> resumes
        point = resume_point(folder)
        if point is None:
            found = ", ".join(p.name for p, _ in checkpoints_in(folder))
            raise FileNotFoundError(f"polopt-export: {path} is a folder, and {folder} holds "
                                    f"{'no checkpoint' if not found else found + ', none past step 0'}; give a "
                                    "checkpoint file (or a run directory, for its newest checkpoint)")
        path = ckpt_path = point[0]
        log.warning("polopt-export: %s (step %s), the newest checkpoint in %s; name another file to export it "
                    "instead", path.name, "?" if point[1] is None else point[1], folder)
    check_target(out_dir, overwrite, source=ckpt_path)  # before the checkpoint is read
    if path.is_dir():  # a DeepSpeed checkpoint: one shard per process
        path = consolidated_checkpoint(path)
    if not path.is_file():
        found = sorted(p.name for p in path.parent.glob("*.ckpt")) if path.parent.is_dir() else None
        held = "does not exist" if found is None else f"holds {', '.join(found) or 'no checkpoint'}"
        why = " (best.ckpt is written by a run that validates: a task with a validation split)" if (
            path.name == "best.ckpt" and found) else ""
        raise FileNotFoundError(f"polopt-export: no checkpoint file at {path}; {path.parent} {held}{why}")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    meta = (checkpoint.get(CHECKPOINT_KEY) or {}).get("hf")
    if not meta:
        raise ValueError(f"polopt-export: {path} holds no model config: it was not written by a "
                         "PolicyOptimizationModule of this version with a transformers policy")
    state = _policy_state(checkpoint.get("state_dict", {}))
    if not state:
        raise ValueError(f"polopt-export: {path} has no '{POLICY_PREFIX}*' weights in its state_dict")
    if not merge and not meta.get("adapter"):
        raise ValueError(f"polopt-export --adapter-only: {path} holds a policy without an adapter (full fine-tuning); "
                         "export it whole")
    model = rebuild_policy(state, meta, where=str(path))
    if meta.get("adapter") and merge:
        model = model.merge_and_unload()

    def write(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        for name, data in (meta.get("tokenizer_files") or {}).items():
            (folder / name).write_bytes(data)

    return write_folder(out_dir, write, overwrite, source=ckpt_path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="polopt-export",
        description="Turn a polopt-lightning checkpoint into a Hugging Face folder "
                    "(AutoModelForCausalLM/AutoTokenizer.from_pretrained load it).")
    parser.add_argument("checkpoint", help="a Lightning checkpoint written by polopt-train or PolicyOptimizationModule, "
                                           "or a run directory (its checkpoints/ folder) for its newest checkpoint")
    parser.add_argument("out", help="output folder: new or empty (created), or a previous export with --overwrite; "
                                    "never the checkpoint's own folder or one above it")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a previous export (Hugging Face model, adapter and tokenizer files only): it "
                             "goes whole, none of its files stay; a folder holding anything else is refused")
    parser.add_argument("--adapter-only", action="store_true",
                        help="a LoRA policy: write the adapter alone (adapter_model.safetensors, loadable with peft "
                             "over its base) instead of merging it into a full-precision copy of the base")
    args = parser.parse_args(argv)
    from .console import configure_console

    configure_console()  # polopt-train's quiet console: no "Writing model shards" bar, no dependency warnings
    try:
        out = export_checkpoint(args.checkpoint, args.out, merge=not args.adapter_only, overwrite=args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        parser.exit(2, f"{exc}\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
