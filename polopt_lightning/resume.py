"""What a checkpoint holds beyond the weights, so that a resumed run goes on where it stopped: the task weights, every
process's random states, dynamic sampling's extra draws, the anchor's and the entropy bonus's adaptive state, and what
``polopt-export`` needs to rebuild a Hugging Face folder (the module's ``on_save_checkpoint`` / ``on_load_checkpoint``
and ``load_state_dict``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from .distributed import all_gather_objects
from .export import CHECKPOINT_KEY, hf_metadata
from .models import frozen_quantized_state
from .rng import rng_state


def settings_record(module: Any, ref_quantization: str) -> dict[str, Any]:
    """The module's settings as its saved hyperparameters hold them: the ``experience``, ``update``, ``reference``
    (with the quantization the reference got) and ``optimizer`` (a partial's keywords) dicts, and the ``anchor``'s
    (without its current value, which is training state)."""
    reference = {**asdict(module.reference_config), "quantization": ref_quantization}
    reference["dtype"] = str(module.reference_config.dtype) if module.reference_config.dtype else None
    keywords = getattr(module.optimizer_factory, "keywords", None) or {}
    anchor = module.anchor
    return {"experience": asdict(module.experience_config), "update": asdict(module.update_config),
            "reference": reference,
            "optimizer": {k: list(v) if isinstance(v, tuple) else v for k, v in keywords.items()
                          if isinstance(v, (bool, int, float, str, list, tuple))},
            "anchor": None if anchor is None else {k: v for k, v in vars(anchor).items() if k != "value"}}


def save_state(module: Any, checkpoint: dict[str, Any]) -> None:
    """Add the module's training state to ``checkpoint`` under ``CHECKPOINT_KEY`` (collective: every process's random
    states are gathered, in rank order)."""
    if module._hf_metadata is None:  # the config and tokenizer do not change during training: gathered once
        module._hf_metadata = hf_metadata(module.policy, module.tokenizer)
    checkpoint[CHECKPOINT_KEY] = {
        "reward_weights": module.rewards.weights.tolist(),
        # every process's random states, in rank order: each process samples with its own generator
        "rng": all_gather_objects(rng_state(module._sampling_generator())),
        "extra_draws": module.extra_prompts.draws,
        "anchor": module.anchor.state_dict() if module.anchor is not None else None,
        "entropy": module.updater.entropy.state_dict(),  # the adaptive entropy coefficient
        # what `polopt-export CKPT OUT` needs to rebuild a Hugging Face folder from this file alone
        "hf": module._hf_metadata,
        # what the steps computed in: a resumed trainer.precision=auto run keeps it
        "precision": str(module.trainer.precision) if module._trainer is not None else None,
        # the asynchronous pipeline's rollouts in flight (experience.max_staleness), every process's in rank order
        "pipeline": (all_gather_objects(module.pipeline.state_dict()) if module.pipeline is not None else None),
    }


def restore_state(module: Any, checkpoint: Mapping[str, Any]) -> None:
    """Put a checkpoint's training state back into the module (the random states wait for the training device, until
    fit starts: ``module._pending_rng``)."""
    state = checkpoint.get(CHECKPOINT_KEY)
    if not state:
        return
    module.rewards.set_weights(state["reward_weights"])
    module.extra_prompts.draws = int(state.get("extra_draws", 0))
    if module.anchor is not None and state.get("anchor"):
        module.anchor.load_state_dict(state["anchor"])
    if state.get("entropy"):
        module.updater.entropy.load_state_dict(state["entropy"])
    if state.get("pipeline") is not None:
        module._pending_pipeline = state["pipeline"]
    if "rng" in state:
        module._pending_rng = state["rng"]
    else:  # checkpoints of version 0.1.0: the sampler's generator and torch's state of rank 0
        module._pending_rng = [{"sampling_generator": state["sampling_generator"], "torch": state["torch_rng"]}]


def load_weights(module: Any, load: Callable[..., Any], state_dict: Mapping[str, Any], strict: bool, assign: bool):
    """``load`` (``nn.Module.load_state_dict``) of ``state_dict``, except that the frozen part of a quantized base is
    checked against the base the module holds instead of loaded (:func:`~polopt_lightning.models.frozen_quantized_
    state`)."""
    frozen = frozen_quantized_state(module, state_dict)
    if not frozen:
        return load(state_dict, strict=strict, assign=assign)
    result = load({k: v for k, v in state_dict.items() if k not in frozen}, strict=False, assign=assign)
    missing = [k for k in result.missing_keys if k not in frozen]
    if strict and (missing or result.unexpected_keys):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing[:5]}, "
                           f"unexpected keys {result.unexpected_keys[:5]}")
    return result
