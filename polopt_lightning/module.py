"""PolicyOptimizationModule: the LightningModule that turns prompts into policy updates.

It orchestrates; the algorithms are the pure pieces it calls: rollout -> rewards -> advantages -> objective.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torchmetrics import MeanMetric

from .accel.cpu.fast_path import CPUFastPath
from .distributed import all_gather_objects, all_reduce, world_size
from .experience import Experience, ExperienceMaker
from .logprobs import (
    PACKED_MAX_TOKENS,
    completion_logprobs,
    packed_length,
    packing_supported,
    shared_prompt_completion_logprobs,
)
from .models import (
    Quantization,
    evaluating,
    frozen_quantized_state,
    has_adapter,
    is_quantized,
    prepare_quantized,
    prepare_tokenizer,
    reference_context,
)
from .models import disable_dropout as _disable_dropout
from .objectives import Objective, SupervisedAnchor, build_objective
from .objectives.base import k3_kl, masked_mean
from .optim import build_optimizer
from .reference import build_reference
from .rewards import MixtureRewards, RewardComposer, RewardOutput
from .rng import restore_rng, rng_state
from .rollout import RolloutBatch, RolloutEngine, SamplingConfig, build_engine
from .update import (
    even_pieces,
    grad_norm,
    gradient_sync,
    lr_factor,
    micro_batches,
    mini_batch_order,
    scale_gradients,
)

LR_SCHEDULES = ("constant", "linear", "cosine")

# Lightning's own pytree helper calls a torch API deprecated in torch 2.9 at every fit: nothing a user of this module
# (or of Lightning) can act on. Only that message, only from that Lightning module, is silenced.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                        module=r"lightning\.pytorch\.utilities\._pytree")


def check_settings(**settings: Any) -> None:
    """Raise a ValueError naming the first of the module's numeric settings (its arguments, by name) that is out of
    range. :class:`PolicyOptimizationModule` calls it first thing; ``polopt-train`` calls it on ``module.*`` before
    anything loads or trains, so a bad value fails in a second instead of after the warm start."""
    rules = {
        "num_generations": (lambda v: v >= 2, ">= 2 (a group of one has no relative advantage)"),
        "num_iterations": (lambda v: v >= 1, ">= 1"),
        "mini_batches": (lambda v: v >= 1, ">= 1"),
        "lr": (lambda v: v > 0, "> 0"),
        "weight_decay": (lambda v: v >= 0, ">= 0"),
        "betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
        "lr_schedule": (lambda v: v in LR_SCHEDULES, f"one of {LR_SCHEDULES}"),
        "warmup_steps": (lambda v: v >= 0, ">= 0"),
        "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
        "max_grad_norm": (lambda v: v is None or v >= 0, ">= 0 or None"),
        "max_extra_draws": (lambda v: v >= 0, ">= 0"),
        "micro_batch_tokens": (lambda v: v is None or v >= 1, ">= 1 or None"),
    }
    for name, value in settings.items():
        if name in rules and not rules[name][0](value):
            raise ValueError(f"{name} must be {rules[name][1]}, got {value!r}")


def _sampling(value: SamplingConfig | Mapping[str, Any] | None, **defaults: Any) -> SamplingConfig:
    if isinstance(value, SamplingConfig):
        return value
    return SamplingConfig(**{**defaults, **dict(value or {})})


class PolicyOptimizationModule(L.LightningModule):
    """RL post-training of a causal LM with a group-relative objective (GRPO, GSPO, DAPO, Dr. GRPO, ...).

    Each training batch holds ``P`` prompts. One ``training_step`` samples ``G = num_generations`` completions per
    prompt, scores them, computes group-relative advantages, then runs ``num_iterations`` passes over the rollout
    split into ``mini_batches`` optimizer steps each (``trainer.max_steps`` counts optimizer steps, as Lightning does).

    Args:
        model: the policy, a ``transformers`` causal LM (or anything with its forward signature).
        tokenizer: its tokenizer (EOS is used as pad when it has none, and said so in the log).
        objective: an :class:`~polopt_lightning.objectives.Objective`, a registry key (``"grpo"``, ``"gspo"``, ...)
            or a dict with ``name`` and arguments.
        reward_fns: TRL-style reward functions, a ready :class:`RewardComposer`, or for a task mixture a
            :class:`~polopt_lightning.rewards.MixtureRewards` (each row scored by its own task's functions; the module
            then logs ``train/<task>/reward``, ``train/<task>/frac_zero_std`` and ``val/<task>/accuracy``).
        reward_weights: one weight per function (or by name).
        reward_on_error: ``"raise"`` or ``"none"`` (see :class:`RewardComposer`).
        num_generations: completions per prompt (``G >= 2``: a group of one has no relative signal).
        num_iterations: passes over each rollout (``mu``); > 1 makes the update off-policy.
        mini_batches: optimizer steps per pass; > 1 makes the update off-policy.
        generation: sampling settings (:class:`SamplingConfig` fields) for training rollouts.
        val_generation: settings for validation (greedy by default).
        lr, weight_decay, betas: AdamW settings, used when ``optimizer`` is None.
        optimizer: a factory ``params -> Optimizer`` called on the trainable parameters (e.g.
            ``functools.partial(torch.optim.AdamW, lr=1e-5)``, or :func:`~polopt_lightning.optim.build_optimizer`
            with ``name="adamw_8bit"``); default torch's AdamW, fused where allowed.
        lr_schedule: ``"constant"``, ``"linear"`` or ``"cosine"`` decay over ``trainer.max_steps``, after
            ``warmup_steps`` of linear warm-up; ``min_lr_ratio`` is the floor as a fraction of the peak.
        max_grad_norm: gradient clipping by global norm (``None`` or 0 disables).
        accel: the CPU fast path's training settings (:class:`~polopt_lightning.accel.cpu.fast_path.CPUFastPath`, or a dict of
            them: ``onednn_linear``, ``keep_host_memory``); by default each is on where it applies, and nothing acts
            on other devices.
        ref_model: reference policy for the KL term, used only when the objective's ``beta > 0``. Default: for a
            policy with an adapter (peft), the policy itself with its adapters disabled (its frozen base: no second
            copy of the weights); otherwise a frozen copy of ``model`` taken at construction.
        ref_dtype: weights of the reference copy in this dtype (e.g. ``"bfloat16"``: half the memory and a faster
            pass on GPUs and AMX CPUs, at bf16 rounding of the KL term); a given ``ref_model`` is cast in place.
        ref_quantization: the reference copy quantized (``"int8"``, ``"nf4"``, or :class:`Quantization` fields):
            a quarter to an eighth of its memory, for full fine-tuning (it never needs gradients). A
            ``transformers`` policy only; not with an adapter, whose reference is its own base.
        advantage_scale: ``"group"``, ``"batch"`` or ``"none"``; default the objective's own (Dr. GRPO: none).
        dynamic_sampling: DAPO's dynamic sampling: drop groups whose rewards are all equal and draw more prompts
            until the batch is full again, at most ``max_extra_draws`` extra batches per step.
        mask_truncated_completions: DAPO's overlong filtering: completions cut by ``max_new_tokens`` do not count.
        disable_dropout: dropout off in the policy (the peers' default; keeps importance ratios exact).
        accuracy_reward: name of the reward function whose mean is ``val/accuracy`` (default: the first).
        rollout_engine: the rollout backend (:mod:`polopt_lightning.rollout`): a
            :class:`~polopt_lightning.rollout.RolloutEngine`, a backend's name, or a dict of its arguments with
            ``name`` (e.g. ``{"name": "hf", "dtype": "bfloat16"}``: sample with a bf16 copy of the policy);
            default the transformers backend, :class:`~polopt_lightning.rollout.HFRolloutEngine`.
        share_prompt: run each prompt once per group in the training, reference and old-log-prob passes, the G
            completions attending to its keys/values (same result, fewer FLOPs); off for models whose cache cannot
            be gathered.
        pack_groups: with ``share_prompt``, run each group as one packed sequence (its prompt, then its
            completions, under a block mask: one product per layer over all its tokens instead of the prompt's and
            the completions' two, the same result within float tolerance). ``None``: where it pays, for groups of at
            most ``PACKED_MAX_TOKENS`` (192) packed tokens (Qwen2.5-0.5B shape, 2 CPU threads: the training pass
            19% faster at 92 tokens, 25% slower at 1,144); ``True``: every group; both need SDPA attention and no
            sliding-window layers, else the prompt's keys/values are shared as before.
        micro_batch_tokens: bound on the tokens (prompt + completion) of one forward/backward; a mini-batch larger
            than this is split and its gradients accumulated (same gradient, bounded memory). ``None``: no split.
        gradient_checkpointing: recompute each decoder layer's activations in the backward pass instead of keeping
            them (the model's own activation checkpointing, non-reentrant): less memory for about one more
            forward pass. Layers under checkpointing keep no cache, so the training pass then runs each completion
            with its own prompt (the reference and old-log-prob passes, without gradient, still share it). TRL's
            ``GRPOConfig`` turns it on by default.
        reuse_sampling_logprobs: off-policy updates take the sampler's log-probs as old log-probs instead of a
            second forward pass (they match the training numerics when dropout is off and the sampler runs in the
            policy's own precision; otherwise the pass runs, for every row but the first mini-batch's, whose old
            log-probs are its own before the first step).
        track_kl: log ``train/kl`` (k3, per token, against the reference) even when the objective's ``beta`` is 0, for
            the collapse monitor: the reference is then made as for ``beta > 0`` (with an adapter, the base itself; otherwise
            a frozen copy of the starting policy and one more forward pass per rollout).
        anchor: a :class:`~polopt_lightning.objectives.SupervisedAnchor` (or its fields as a dict): ``lambda`` x the
            negative log-likelihood of each prompt's reference answer (a dataset column) added to the objective's
            loss at every optimizer step, over the prompts of that step's mini-batch. Its schedule is run by an
            :class:`~polopt_lightning.callbacks.AnchorScheduler` that this module adds to the trainer.
        seed: seeds the sampling generator (offset by the global rank).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        objective: Objective | str | Mapping[str, Any] = "grpo",
        reward_fns: Sequence[Callable] | RewardComposer | None = None,
        reward_weights: Sequence[float] | Mapping[str, float] | None = None,
        reward_on_error: str = "raise",
        num_generations: int = 8,
        num_iterations: int = 1,
        mini_batches: int = 1,
        generation: SamplingConfig | Mapping[str, Any] | None = None,
        val_generation: SamplingConfig | Mapping[str, Any] | None = None,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: Sequence[float] = (0.9, 0.999),
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        lr_schedule: str = "constant",
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.0,
        max_grad_norm: float | None = 1.0,
        accel: CPUFastPath | Mapping[str, Any] | None = None,
        ref_model: nn.Module | None = None,
        ref_dtype: str | torch.dtype | None = None,
        ref_quantization: Quantization | str | Mapping[str, Any] | None = None,
        advantage_scale: str | None = None,
        dynamic_sampling: bool = False,
        max_extra_draws: int = 4,
        mask_truncated_completions: bool = False,
        disable_dropout: bool = True,
        accuracy_reward: str | None = None,
        rollout_engine: RolloutEngine | str | Mapping[str, Any] | None = None,
        share_prompt: bool = True,
        pack_groups: bool | None = None,
        reuse_sampling_logprobs: bool = True,
        micro_batch_tokens: int | None = None,
        gradient_checkpointing: bool = False,
        track_kl: bool = False,
        anchor: SupervisedAnchor | Mapping[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_settings(num_generations=num_generations, num_iterations=num_iterations, mini_batches=mini_batches,
                       lr=lr, weight_decay=weight_decay, betas=betas, lr_schedule=lr_schedule,
                       warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio, max_grad_norm=max_grad_norm,
                       max_extra_draws=max_extra_draws, micro_batch_tokens=micro_batch_tokens)
        if reward_fns is None:
            raise ValueError("reward_fns is required: give at least one reward function")
        self.automatic_optimization = False
        if is_quantized(model):
            if not has_adapter(model):
                raise ValueError(f"{type(model).__name__} has quantized weights and no adapter: they cannot be trained "
                                 "(set adapter=lora with quantization=int8/nf4 in the CLI, or wrap the model with "
                                 "peft.get_peft_model before passing it)")
            prepare_quantized(model)
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(f"{type(model).__name__} has no trainable parameter (requires_grad is False everywhere)")

        self.policy = model
        # `from_pretrained` returns a model in eval mode, and Lightning keeps each module's mode through fit: without
        # this, a loaded policy trained with gradient checkpointing off (transformers applies it only in training
        # mode) and dropout off even when asked for, and Lightning warned about its modules at every fit. The
        # sampler and validation put it in eval mode for their own passes.
        model.train()
        self.tokenizer = prepare_tokenizer(tokenizer)
        if isinstance(objective, str):
            objective = build_objective(objective)
        elif isinstance(objective, Mapping):
            objective = build_objective(**objective)
        if not isinstance(objective, Objective):
            raise TypeError(f"objective must be an Objective, a registry key or a dict, got {type(objective).__name__}")
        self.objective = objective
        self.rewards = reward_fns if isinstance(reward_fns, (RewardComposer, MixtureRewards)) else RewardComposer(
            reward_fns, weights=reward_weights, on_error=reward_on_error)
        # a mixture's tasks: each has its own accuracy function, reward and signal metrics
        self.tasks = list(self.rewards.tasks) if isinstance(self.rewards, MixtureRewards) else []
        if self.tasks:
            if accuracy_reward is not None:
                raise ValueError("accuracy_reward is set for a task mixture, whose accuracy is each task's own "
                                 "(MixtureRewards(accuracy={task: function}))")
            if reward_weights is not None:
                raise ValueError("reward_weights is set beside a MixtureRewards: give each task's weights to its "
                                 "RewardComposer (or set them with MixtureRewards.set_weights)")
        elif accuracy_reward is not None and accuracy_reward not in self.rewards.names:
            raise ValueError(f"accuracy_reward={accuracy_reward!r} is not a reward function; known: {self.rewards.names}")
        self.accuracy_reward = None if self.tasks else accuracy_reward or self.rewards.names[0]
        if isinstance(anchor, Mapping):
            anchor = SupervisedAnchor(**anchor)
        if anchor is not None and not isinstance(anchor, SupervisedAnchor):
            raise TypeError(f"anchor must be a SupervisedAnchor, a dict of its fields or None, got {type(anchor).__name__}")
        self.anchor = anchor
        self.num_generations, self.num_iterations, self.mini_batches = num_generations, num_iterations, mini_batches
        self.sampling = _sampling(generation)
        self.val_sampling = _sampling(val_generation, max_new_tokens=self.sampling.max_new_tokens, temperature=0.0)
        self.lr, self.weight_decay, self.betas, self.optimizer_factory = lr, weight_decay, tuple(betas), optimizer
        self.lr_schedule, self.warmup_steps, self.min_lr_ratio = lr_schedule, warmup_steps, min_lr_ratio
        self.max_grad_norm = max_grad_norm
        self.accel = CPUFastPath.of(accel)
        # rollout, rewards, dynamic sampling, advantages and the anchor's targets: one step's experience
        self.experience = ExperienceMaker(self.tokenizer, self.rewards, num_generations,
                                          advantage_scale or objective.advantage_scale, dynamic_sampling,
                                          max_extra_draws, mask_truncated_completions, anchor)
        self.engine = build_engine(rollout_engine)
        self.share_prompt, self.pack_groups = share_prompt, pack_groups
        self.micro_batch_tokens = micro_batch_tokens
        self.gradient_checkpointing = gradient_checkpointing
        if gradient_checkpointing:
            if not getattr(model, "supports_gradient_checkpointing", False) and not hasattr(model, "base_model"):
                raise ValueError(f"gradient_checkpointing=True: {type(model).__name__} does not support it "
                                 "(a transformers model with supports_gradient_checkpointing does)")
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the old name is deprecated)
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        # sampler log-probs equal a training forward only when dropout cannot make them differ
        self.reuse_sampling_logprobs = reuse_sampling_logprobs and disable_dropout
        self.seed = seed
        if disable_dropout:
            _disable_dropout(self.policy)
        # the reference exists when the KL term needs it, or when the KL is to be watched (track_kl)
        self.track_kl = track_kl
        self.ref_model, self.shared_reference, ref_quant = build_reference(
            model, objective.beta > 0 or track_kl, ref_model, ref_dtype, ref_quantization)
        if self.ref_model is not None:
            # Lightning asks every submodule to be in training mode when fit starts (and warns about each one that is
            # not); the reference only ever runs inside `evaluating`, which puts it in eval mode for its pass.
            self.ref_model.train()
        self.val_metrics = nn.ModuleDict({k: MeanMetric(nan_strategy="ignore")
                                          for k in ("accuracy", "reward", *(f"{t}/accuracy" for t in self.tasks))})
        self._generator: torch.Generator | None = None
        self._prompt_iter: Iterator | None = None
        self._hf_metadata: dict[str, Any] | None = None
        self._pending_rng: list[dict[str, Any]] | None = None
        self._gathered = False  # the sharded policy is gathered whole (see _whole_parameters)
        self._extra_draws = 0  # prompt batches drawn by dynamic sampling so far: their position survives a resume
        self.save_hyperparameters(ignore=["model", "tokenizer", "objective", "reward_fns", "ref_model",
                                          "rollout_engine", "accel", "optimizer", "ref_quantization", "anchor"])
        self.hparams["ref_quantization"] = ref_quant.mode
        if optimizer is not None:  # the factory's settings (a partial's keywords), not the unused lr/betas defaults
            for key in ("lr", "weight_decay", "betas"):
                self.hparams.pop(key, None)
            keywords = getattr(optimizer, "keywords", None) or {}
            self.hparams["optimizer"] = {k: list(v) if isinstance(v, tuple) else v for k, v in keywords.items()
                                         if isinstance(v, (bool, int, float, str, list, tuple))}
        self.hparams["anchor"] = None if anchor is None else {k: v for k, v in vars(anchor).items() if k != "value"}

    # ------------------------------------------------------------------------------------------------------------
    @property
    def off_policy(self) -> bool:
        """Whether the policy moves between sampling and some update: then old log-probs are needed."""
        return self.num_iterations > 1 or self.mini_batches > 1

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        factory = self.optimizer_factory or partial(build_optimizer, name="adamw", lr=self.lr,
                                                    weight_decay=self.weight_decay, betas=self.betas)
        # Lightning's mixed-precision plugins refuse to clip the gradients of an optimizer that unscales them itself
        # (as torch's fused AdamW declares it does). Where the step clips through Lightning (a loss scaler, sharded
        # gradients: see _clips_in_place) this project's factory then builds the unfused kernel; under bf16-mixed
        # the step clips in place and keeps the fused one (several times faster at 0.5B: docs/performance.md).
        mixed = self.trainer is not None and isinstance(self.trainer.precision_plugin, MixedPrecision)
        ours = getattr(factory, "func", None) is build_optimizer
        if mixed and self.max_grad_norm and ours and not self._clips_in_place():
            factory = partial(factory, fused=False)
        optimizer = factory(params)
        total = self.trainer.max_steps if self.trainer is not None and self.trainer.max_steps > 0 else 0
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, partial(lr_factor, schedule=self.lr_schedule, warmup=self.warmup_steps, total=total,
                               floor=self.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _sampling_generator(self) -> torch.Generator:
        if self._generator is None or self._generator.device != self.device:
            self._generator = torch.Generator(device=self.device)
            self._generator.manual_seed(self.seed + 1000003 * self.global_rank)
        return self._generator

    # ------------------------------------------------------------------------------------------------------------
    def rollout(self, batch: Mapping[str, Any], sampling: SamplingConfig, num_generations: int) -> RolloutBatch:
        with self._whole_parameters():
            return self.engine.generate(
                self.policy, batch["prompt_ids"], batch["prompt_mask"], num_generations, sampling,
                self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, generator=self._sampling_generator(),
            )

    def configure_model(self) -> None:
        """Under ``strategy=fsdp`` (FSDP2), shard the policy and the reference copy over the processes: each decoder
        layer, then the rest of the model (Lightning calls this hook once the processes exist). Otherwise the CPU fast
        path prepares the weights (:meth:`~polopt_lightning.accel.cpu.fast_path.CPUFastPath.prepare`; nothing on other
        devices)."""
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None:
            if self._trainer is not None:
                self.accel.prepare((self.policy, self.ref_model), self.trainer.strategy.root_device)
            return
        from .strategies import shard_fully

        reshard = getattr(self.trainer.strategy, "reshard_after_forward", True)
        shard_fully(self.policy, mesh["data_parallel"], reshard)
        if self.ref_model is not None:
            shard_fully(self.ref_model, mesh["data_parallel"], reshard)

    @contextmanager
    def _whole_parameters(self) -> Iterator[None]:
        """The policy gathered whole for sampling under a sharded strategy (:func:`strategies.gathered_for_sampling`),
        once per step: entered by ``make_experience`` for all its draws, and by ``rollout`` for validation."""
        if self._gathered:
            yield
            return
        from .strategies import gathered_for_sampling

        with gathered_for_sampling(self.policy, self.trainer.strategy if self._trainer is not None else None):
            self._gathered = True
            try:
                yield
            finally:
                self._gathered = False

    def score(self, batch: Mapping[str, Any], rollout: RolloutBatch) -> RewardOutput:
        """Decode completions and run the reward functions (:meth:`ExperienceMaker.score`)."""
        return self.experience.score(batch, rollout)

    def _next_prompts(self) -> Mapping[str, Any]:
        """Another batch of prompts for dynamic sampling.

        From :meth:`PromptDataModule.extra_batch` when the data comes from one: the ``n``-th extra batch of this
        process, the same after a resume (the count is in the checkpoint) and another share on each process.
        Otherwise from a second pass over the training loader.
        """
        dm = getattr(self.trainer, "datamodule", None)
        if hasattr(dm, "extra_batch"):
            batch = dm.extra_batch(self._extra_draws)
            self._extra_draws += 1
        else:
            if self._prompt_iter is None:
                self._prompt_iter = iter(self.trainer.train_dataloader)
            try:
                batch = next(self._prompt_iter)
            except StopIteration:
                self._prompt_iter = None
                return self._next_prompts()
        return {k: (v.to(self.device) if isinstance(v, Tensor) else v) for k, v in batch.items()}

    def make_experience(self, batch: Mapping[str, Any]) -> tuple[Experience, dict[str, Tensor]]:
        """Rollout, rewards and advantages for one training batch (:meth:`ExperienceMaker.make`, with DAPO dynamic
        sampling if enabled).

        Under a sharded strategy the policy is gathered once for all the step's draws: gathering is collective, and
        dynamic sampling may draw more often on one process than on another.
        """
        with self._whole_parameters():
            return self.experience.make(batch, lambda prompts: self.rollout(prompts, self.sampling, self.num_generations),
                                        self._next_prompts, self.device)

    def sequence_logprobs(self, model: nn.Module, exp: Experience, rows: Tensor | slice, width: int | None = None,
                          with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """Log-probs ``[n, width]`` of the completions ``rows`` under ``model`` (prompt shared per group if set)."""
        width = exp.completion_ids.shape[1] if width is None else width
        args = (model, exp.prompt_ids[rows], exp.prompt_mask[rows], exp.completion_ids[rows, :width],
                exp.completion_mask[rows, :width])
        # checkpointed layers drop the cache the shared prompt is passed through; without gradient they keep it
        checkpointed = self.gradient_checkpointing and model is self.policy and torch.is_grad_enabled()
        with evaluating(model, keep_quantized=True) if model is self.ref_model else nullcontext():
            if self.share_prompt and not checkpointed:
                groups = exp.group_index[rows]
                return shared_prompt_completion_logprobs(*args, groups, self.sampling.logprob_temperature,
                                                         with_entropy=with_entropy,
                                                         packed=self.packs(model, args[1].shape[1], width, groups))
            return completion_logprobs(*args, self.sampling.logprob_temperature, with_entropy=with_entropy)

    def packs(self, model: nn.Module, prompt_len: int, completion_len: int, groups: Tensor) -> bool:
        """Whether these rows' groups run as packed sequences (see ``pack_groups``)."""
        if self.pack_groups is False or not packing_supported(model):
            return False
        length, even = packed_length(prompt_len, completion_len, groups)
        return bool(self.pack_groups) or (even and length <= PACKED_MAX_TOKENS)

    def reference_logprobs(self, exp: Experience) -> Tensor:
        """Log-probs ``[N, T]`` of the rollout's completions under the KL reference."""
        if not self.shared_reference:
            return self.sequence_logprobs(self.ref_model, exp, slice(None))[0]
        # the policy's frozen base, adapters disabled; eval mode as a reference copy's pass, except the quantized
        # layers, which keep the kernels the training forward uses (see `evaluating`)
        with evaluating(self.policy, keep_quantized=True), reference_context(self.policy):
            return self.sequence_logprobs(self.policy, exp, slice(None))[0]

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        with self.accel.compute(self.policy, self.device):
            self._training_step(batch)

    def _training_step(self, batch: Mapping[str, Any]) -> None:
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        exp, metrics = self.make_experience(batch)
        n = exp.completion_ids.shape[0]
        if n < self.mini_batches:
            raise ValueError(f"mini_batches={self.mini_batches} is more than the rollout's {n} completions "
                             f"(prompts per batch x num_generations={self.num_generations})")
        mask = exp.completion_mask
        lengths = mask.sum(-1).float()
        # every process holds as many completions (whole groups of equal batches): means of means are exact
        metrics["train/completion_len"] = all_reduce(lengths.mean()) / world_size()
        metrics["train/completion_len_max"] = all_reduce(lengths.max(), "max")
        metrics["train/truncated_frac"] = all_reduce((~exp.finished).float().mean()) / world_size()
        size = math.ceil(n / self.mini_batches)
        # the mini-batch orders of every pass, drawn up front: the first mini-batch needs no old-log-prob pass
        orders = [mini_batch_order(exp.group_index.cpu(), self.seed + self.global_step + i * self.mini_batches,
                                   self.share_prompt) for i in range(self.num_iterations)]
        own_old = False  # whether the first update records its rows' old log-probs itself
        with torch.no_grad():
            if self.off_policy:  # on-policy, old == current log-probs detached: no pass needed
                if self.reuse_sampling_logprobs and self.engine.logprobs_match(self.policy):
                    exp.old_logprobs = exp.sampling_logprobs
                else:
                    later = orders[0][size:].to(self.device)
                    exp.old_logprobs = torch.zeros_like(exp.sampling_logprobs)
                    if later.numel():  # none when one mini-batch holds the whole rollout (mu > 1)
                        exp.old_logprobs[later] = self.sequence_logprobs(self.policy, exp, later)[0]
                    own_old = True
            if self.objective.beta > 0 or self.track_kl:  # only the KL term (or its tracking) needs the reference
                exp.ref_logprobs = self.reference_logprobs(exp)

        step_metrics: list[dict[str, Tensor]] = []
        updates = [(i, start) for i in range(len(orders)) for start in range(0, n, size)]
        # Lightning stops between training steps only: a rollout's updates stop at trainer.max_steps themselves, so
        # max_steps=3 with 2 updates a rollout stops after the third update, not the fourth
        last = self._trainer.max_steps if self._trainer is not None and self.trainer.max_steps > 0 else None
        if last is not None and self.global_step + len(updates) > last:
            updates = updates[:max(last - self.global_step, 1)]
            rank_zero_info(f"trainer.max_steps={last}: the last rollout makes {len(updates)} of its optimizer steps")
        for i, start in updates:
            rows = orders[i][start:start + size].to(self.device)
            first = own_old and i == 0 and start == 0
            step_metrics.append(self._update(exp, rows, optimizer, scheduler, record_old=first))
        for key in step_metrics[0]:
            values = torch.stack([m[key] for m in step_metrics])
            metrics[f"train/{key}"] = values.sum() if key == "skipped_updates" else values.mean()
        metrics["train/lr"] = torch.tensor(optimizer.param_groups[0]["lr"])
        self.log_dict({k: v.float() for k, v in metrics.items()}, on_step=True, on_epoch=False,
                      batch_size=batch["prompt_ids"].shape[0])
        self.log("reward", metrics["train/reward"].float(), prog_bar=True, on_step=True, logger=False)

    def micro_batches(self, exp: Experience, rows: Tensor) -> list[Tensor]:
        """The mini-batch ``rows`` in pieces of at most ``micro_batch_tokens`` tokens (:func:`.update.micro_batches`),
        as many on every process (:func:`.update.even_pieces`)."""
        pieces = micro_batches(exp, rows, self.micro_batch_tokens, self.share_prompt)
        return even_pieces(pieces, self.policy, self.device)

    def _update(self, exp: Experience, rows: Tensor, optimizer, scheduler,
                record_old: bool = False) -> dict[str, Tensor]:
        """One optimizer step on the completions ``rows`` of the rollout (see :meth:`accumulate_gradients`)."""
        optimizer.zero_grad(set_to_none=True)
        metrics = self.accumulate_gradients(exp, rows, record_old)
        # Under autocast (Lightning's *-mixed precisions wrap the whole training_step) the forward cached a low-precision
        # copy of every trainable weight, kept until the context exits and never refreshed: the next mini-batch's
        # forward, after this update, would run on the weights from before it (measured: the same output after an
        # in-place change). Dropping the cache once the backward is done also frees that copy (1 GB at 0.5B in bf16)
        # before the optimizer step.
        torch.clear_autocast_cache()
        metrics["grad_norm"] = grad_norm(self.policy)
        # A non-finite loss or gradient never reaches the weights: the gradients are dropped, so the optimizer's step
        # leaves every parameter and its state as they are (it skips parameters without a gradient) while the step
        # still counts. `train/skipped_updates` says so, and the collapse monitor acts on it. The norm is the same on
        # every process (gradients are reduced first), so all of them skip together.
        finite = bool(torch.isfinite(metrics["grad_norm"])) and bool(torch.isfinite(metrics["loss"]))
        metrics["skipped_updates"] = torch.tensor(0.0 if finite else 1.0, device=metrics["grad_norm"].device)
        if not finite:
            optimizer.zero_grad(set_to_none=True)
            rank_zero_warn(f"step {self.global_step}: non-finite loss ({float(metrics['loss']):.4g}) or gradient norm "
                           f"({float(metrics['grad_norm']):.4g}); the update is skipped")
        elif self.max_grad_norm:
            if self._clips_in_place():  # the norm is known: one scaling pass, and none when it is within the limit
                scale_gradients(self.policy, self.max_grad_norm, metrics["grad_norm"])
            else:
                self.clip_gradients(optimizer, gradient_clip_val=self.max_grad_norm, gradient_clip_algorithm="norm")
        optimizer.step()
        self.engine.policy_updated(self.policy)
        # gradients are not needed past the step: freeing them leaves their memory to the next rollout (which holds
        # no activations but may hold a sampler copy or prepacked decoding weights)
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return metrics

    def _clips_in_place(self) -> bool:
        """Whether clipping can scale the gradients by the norm :func:`.update.grad_norm` measured, instead of Lightning's
        ``clip_gradients`` measuring it again: gradients that no loss scaler holds scaled (``16-mixed`` has one), that
        no DeepSpeed engine clips itself and that are whole on each process (FSDP2's are sharded DTensors, under a
        device mesh). The same rule picks :meth:`configure_optimizers`' kernel, before any gradient exists."""
        if self._trainer is None:
            return True
        if getattr(self.trainer.precision_plugin, "scaler", None) is not None:
            return False
        if "deepspeed" in type(getattr(self.trainer, "strategy", None)).__name__.lower():
            return False
        if getattr(self, "_device_mesh", None) is not None:
            return False
        from torch.distributed.tensor import DTensor

        return not any(isinstance(p, DTensor) or isinstance(p.grad, DTensor) for p in self.policy.parameters())

    def _strategy_model(self) -> nn.Module | None:
        """The model as the strategy wraps it (DDP's wrapper), or ``None`` without a Trainer."""
        return self.trainer.strategy.model if self._trainer is not None else None

    def accumulate_gradients(self, exp: Experience, rows: Tensor, record_old: bool = False) -> dict[str, Tensor]:
        """Backward of the objective on the completions ``rows``, in micro-batches; returns the step's metrics.

        ``record_old``: the policy has not moved since sampling, so these rows' old log-probs are their current
        ones; they are used as such and stored in ``exp.old_logprobs`` for later passes.
        """
        full_mask = exp.completion_mask[rows]
        # Under data parallelism each process holds its share of the mini-batch and the strategy averages the
        # gradients over the W processes: dividing by the normaliser of the whole mini-batch (summed over processes)
        # and multiplying by W gives exactly the gradient of one process holding every row. Token-level objectives
        # thereby divide by the global token count, not by a mean of per-process means.
        world = world_size()
        total_weight = all_reduce(self.objective.normaliser(full_mask))
        sums: dict[str, Tensor] = {}
        entropy_sum = torch.zeros((), device=self.device)
        pieces = self.micro_batches(exp, rows)
        if self.anchor is not None:
            sums.update(self._anchor_backward(exp, rows))
        for k, micro in enumerate(pieces):
            # trim padding past the longest completion of this piece (the objectives do not depend on the width)
            width = max(int(exp.completion_mask[micro].sum(-1).max()), 1)
            mask = exp.completion_mask[micro, :width]
            with gradient_sync(self._strategy_model(), self.policy, last=k == len(pieces) - 1):
                logprobs, entropy = self.sequence_logprobs(self.policy, exp, micro, width, with_entropy=True)
                if record_old:
                    exp.old_logprobs[micro, :width] = logprobs.detach()
                old = (logprobs.detach() if record_old or exp.old_logprobs is None
                       else exp.old_logprobs[micro, :width])
                ref = exp.ref_logprobs[micro, :width] if exp.ref_logprobs is not None else None
                out = self.objective(logprobs=logprobs, old_logprobs=old, advantages=exp.advantages[micro],
                                     mask=mask, ref_logprobs=ref)
                if ref is not None and "kl" not in out.metrics:  # track_kl: watched, not trained on
                    valid = mask.bool()  # padding may hold -inf/NaN log-probs: zeros there, as the objectives do
                    kl = k3_kl(torch.where(valid, logprobs.detach(), 0.0), torch.where(valid, ref, 0.0))
                    out.metrics["kl"] = masked_mean(kl, valid)
                # The loss is a sum over the mini-batch divided by the objective's normaliser: weighting each piece
                # by its share of that normaliser makes the accumulated gradient exactly the full mini-batch's.
                share = self.objective.normaliser(mask) / total_weight.clamp(min=1e-12)
                self.manual_backward(out.loss * (share * world))
            for key, value in {"loss": out.loss.detach(), **out.metrics}.items():
                if key.endswith("_max"):
                    sums[key] = torch.maximum(sums[key], value) if key in sums else value
                else:
                    sums[key] = sums.get(key, 0.0) + value * share
            entropy_sum = entropy_sum + (entropy * mask).sum()
        # every metric over the whole mini-batch: normaliser-weighted sums added up, maxima of maxima, and the
        # entropy per token over every process's tokens
        metrics = {key: all_reduce(value, "max" if key.endswith("_max") else "sum") for key, value in sums.items()}
        tokens = all_reduce(full_mask.sum().to(entropy_sum))
        metrics["entropy"] = all_reduce(entropy_sum.detach()) / tokens.clamp(min=1)
        return metrics

    def _anchor_backward(self, exp: Experience, rows: Tensor) -> dict[str, Tensor]:
        """Backward of ``lambda x NLL`` of the reference answers of the prompts that the completions ``rows`` answer
        (one forward over those prompts; gradients accumulate with the objective's before they are reduced). The NLL is
        the token mean over every process's prompts: each process divides its sum by the global count, times the
        processes the strategy averages over. With ``lambda = 0`` the NLL is measured without a backward."""
        groups = torch.unique(exp.group_index[rows])
        first = groups * self.num_generations  # the rows of each group are contiguous, from group x G on
        mask = exp.anchor_mask[groups]
        width = max(int(mask.sum(-1).max()), 1)
        mask, ids = mask[:, :width], exp.anchor_ids[groups, :width]
        tokens = all_reduce(mask.sum().float())
        with gradient_sync(self._strategy_model(), self.policy, last=False), torch.set_grad_enabled(self.anchor.value > 0):
            logprobs, _ = completion_logprobs(self.policy, exp.prompt_ids[first], exp.prompt_mask[first], ids,
                                              mask)
            loss, nll = self.anchor.loss(logprobs, mask, tokens)
            if self.anchor.value > 0:
                self.manual_backward(loss * world_size())
        # summed over the processes by the caller's reduction, like the objective's metrics: the global token mean
        return {"anchor_nll": nll, "anchor_coef": torch.tensor(self.anchor.value / world_size(), device=self.device)}

    # ------------------------------------------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        # fresh sums outside inference mode: a reset under `trainer.validate`'s inference mode would leave inference
        # tensors that the next validation inside `fit` (no-grad, not inference) cannot update in place
        with torch.inference_mode(False):
            for metric in self.val_metrics.values():
                metric.reset()

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        with self.accel.compute(self.policy, self.device):
            rollout = self.rollout(batch, self.val_sampling, 1)
        rewards = self.score(batch, rollout)
        columns = batch.get("columns", {})
        accuracy = self.rewards.accuracy(rewards.per_function, columns, self.accuracy_reward)
        entries = [("accuracy", accuracy), ("reward", rewards.total)]
        if self.tasks:  # each task's accuracy over its own rows
            ids = self.rewards.task_ids(columns, accuracy.numel())
            entries += [(f"{task}/accuracy", torch.where(ids == t, accuracy, torch.full_like(accuracy, float("nan"))))
                        for t, task in enumerate(self.tasks)]
        # Means over every validation sample whose reward exists (a None reward is NaN and left out), across batches
        # and ranks: torchmetrics keeps the sums and counts, Lightning computes and resets them at the epoch's end.
        for key, values in entries:
            if "padding" in batch:  # rows that even out the processes' shares (see data.sampling.ShardSampler)
                values = torch.where(batch["padding"].cpu(), torch.full_like(values, float("nan")), values)
            metric = self.val_metrics[key]
            metric.update(values.to(self.device))
            self.log(f"val/{key}", metric, on_step=False, on_epoch=True, prog_bar=key == "accuracy")

    # ------------------------------------------------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | Path, merge: bool = True, overwrite: bool = False) -> Path:
        """Save the policy and its tokenizer in Hugging Face format (``AutoModelForCausalLM.from_pretrained`` loads it).

        The one-liner after ``trainer.fit(module, ...)``: ``module.save_pretrained("my_model")``. A policy with an
        adapter is merged into a full-precision copy of its base (a quantized base dequantized); ``merge=False``
        writes the adapter alone (``adapter_model.safetensors``, for ``peft.PeftModel.from_pretrained``). A folder
        that holds files is refused unless ``overwrite``, and then replaced whole.
        """
        from .export import save_policy

        return save_policy(self.policy, self.tokenizer, out_dir, merge=merge, overwrite=overwrite)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        from .export import CHECKPOINT_KEY, hf_metadata

        if self._hf_metadata is None:  # the config and tokenizer do not change during training: gathered once
            self._hf_metadata = hf_metadata(self.policy, self.tokenizer)
        checkpoint[CHECKPOINT_KEY] = {
            "reward_weights": self.rewards.weights.tolist(),
            # every process's random states, in rank order: each process samples with its own generator
            "rng": all_gather_objects(rng_state(self._sampling_generator())),
            "extra_draws": self._extra_draws,
            "anchor": self.anchor.state_dict() if self.anchor is not None else None,
            # what `polopt-export CKPT OUT` needs to rebuild a Hugging Face folder from this file alone
            "hf": self._hf_metadata,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, except that the frozen part of a quantized base is checked against the base
        this module holds instead of loaded (see :func:`~polopt_lightning.models.frozen_quantized_state`)."""
        frozen = frozen_quantized_state(self, state_dict)
        if not frozen:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        result = super().load_state_dict({k: v for k, v in state_dict.items() if k not in frozen}, strict=False,
                                         assign=assign)
        missing = [k for k in result.missing_keys if k not in frozen]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}: missing keys {missing[:5]}, "
                               f"unexpected keys {result.unexpected_keys[:5]}")
        return result

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("polopt")
        if state:
            self.rewards.set_weights(state["reward_weights"])
            self._extra_draws = int(state.get("extra_draws", 0))
            if self.anchor is not None and state.get("anchor"):
                self.anchor.load_state_dict(state["anchor"])
            if "rng" in state:
                self._pending_rng = state["rng"]
            else:  # checkpoints of version 0.1.0: the sampler's generator and torch's state of rank 0
                self._pending_rng = [{"sampling_generator": state["sampling_generator"], "torch": state["torch_rng"]}]

    def configure_callbacks(self) -> list[L.Callback]:
        """The anchor's scheduler, when this module has an anchor and the trainer has none of its own; the CPU fast
        path's (:meth:`~polopt_lightning.accel.cpu.fast_path.CPUFastPath.callbacks`)."""
        from .callbacks import AnchorScheduler

        own = []
        if self.anchor is not None and not any(isinstance(c, AnchorScheduler) for c in self.trainer.callbacks):
            own.append(AnchorScheduler())
        return own + self.accel.callbacks(self.trainer.callbacks)

    def on_train_start(self) -> None:
        # restored here, not at loading: the generator lives on the training device, known only once fit has started
        pending, self._pending_rng = self._pending_rng, None
        if pending is not None:
            restore_rng(pending, self.global_rank, world_size(), self._sampling_generator())
