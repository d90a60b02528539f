"""PolicyOptimizationModule: the LightningModule that turns prompts into policy updates.

It orchestrates; the algorithms are the pure pieces it calls: rollout -> rewards -> advantages -> objective.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torchmetrics import MeanMetric

from . import accel as accelerators
from ._hf import stop_token_ids
from .data.datamodule import ExtraPrompts, batch_rows
from .distributed import all_reduce, world_size
from .models import cast_weights, enable_gradient_checkpointing, evaluating, prepare_tokenizer, prepare_trainable
from .models import disable_dropout as _disable_dropout
from .objectives import Objective, SupervisedAnchor, as_objective
from .optim import optimizer_and_schedule, optimizer_factory
from .resume import load_weights, restore_state, save_state, settings_record
from .rewards import MixtureRewards, RewardComposer, RewardOutput, TrainerState, build_rewards
from .rewards.composer import check_reward_rows
from .rng import restore_rng
from .rollout import RolloutBatch, RolloutEngine, SamplingConfig, build_engine
from .settings import MOVED_ARGUMENTS, settings_of, with_moved
from .step.critic import SHARED_UNDER_FSDP, CriticConfig, build_critic, needs_critic, own_parameters, token_values
from .step.experience import Experience, ExperienceConfig, ExperienceMaker
from .step.logprobs import Scorer
from .step.loop import LightningLoop
from .step.pipeline import RolloutPipeline
from .step.reference import ReferenceConfig, build_reference
from .step.update import UpdateConfig, Updater
from .strategies import WholeParameters

# Lightning's own pytree helper calls a torch API deprecated in torch 2.9 at every fit: nothing a user of this module
# (or of Lightning) can act on. Only that message, only from that Lightning module, is silenced.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                        module=r"lightning\.pytorch\.utilities\._pytree")


class PolicyOptimizationModule(L.LightningModule):
    """RL post-training of a causal LM with a group-relative objective (GRPO, GSPO, DAPO, Dr. GRPO, ...).

    Each training batch holds ``P`` prompts. One ``training_step`` samples ``G = experience.num_generations``
    completions per prompt, scores them, computes group-relative advantages, then runs ``update.num_iterations``
    passes over the rollout split into ``update.mini_batches`` optimizer steps each (``trainer.max_steps`` counts
    optimizer steps, as Lightning does).

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
        accuracy_reward: name of the reward function whose mean is ``val/accuracy`` (default: the first).
        generation: sampling settings (:class:`SamplingConfig` fields) for training rollouts.
        val_generation: settings for validation (greedy by default).
        experience: group size, advantage scale and DAPO's dynamic sampling and overlong filtering
            (:class:`~polopt_lightning.step.experience.ExperienceConfig`, or a dict of its fields).
        update: passes, mini-batches, schedule, clipping and the training pass's memory and speed settings
            (:class:`~polopt_lightning.step.update.UpdateConfig`, or a dict of its fields).
        optimizer: a factory ``params -> Optimizer`` called on the trainable parameters (e.g.
            ``functools.partial(torch.optim.AdamW, lr=1e-5)``), or a dict of
            :func:`~polopt_lightning.optim.build_optimizer`'s settings (``{"name": "adamw_8bit", "lr": 1e-5}``);
            default torch's AdamW at lr 1e-5, fused where allowed.
        reference: the KL reference's dtype, quantization and ``track_kl``
            (:class:`~polopt_lightning.step.reference.ReferenceConfig`, or a dict of its fields).
        ref_model: the reference policy itself, when it is not the starting policy (frozen in place: its parameters'
            ``requires_grad`` off; cast to ``reference.dtype``).
        rollout_engine: the rollout backend (:mod:`polopt_lightning.rollout`): a
            :class:`~polopt_lightning.rollout.RolloutEngine`, a backend's name, or a dict of its arguments with
            ``name`` (e.g. ``{"name": "hf", "dtype": "bfloat16"}``); default the transformers backend.
        accel: the CPU fast path's training settings (:class:`~polopt_lightning.accel.cpu.fast_path.CPUFastPath`, or
            a dict of them); each is on where it applies, and nothing acts on other devices.
        anchor: a :class:`~polopt_lightning.objectives.SupervisedAnchor` (or its fields as a dict): ``lambda`` x the
            negative log-likelihood of each prompt's reference answer (a dataset column) added to the objective's
            loss at every optimizer step; its schedule is run by an :class:`~polopt_lightning.callbacks.
            AnchorScheduler` that this module adds to the trainer.
        seed: seeds the sampling generator (offset by the global rank).
        critic: PPO's critic settings (:class:`~polopt_lightning.step.critic.CriticConfig`, or a dict of its fields),
            used where the advantage estimator is ``gae`` (``objective="ppo"``): the module then holds a value model
            (``critic_model``, else ``critic.name_or_path``'s: a copy of the policy's trunk with a value head) and trains it
            in the same optimizer steps, its learning rate ``critic.lr``; it is saved in checkpoints.
        critic_model: the value model itself (a :class:`~polopt_lightning.step.critic.ValueModel`, or any module mapping
            ``(input_ids, attention_mask, position_ids)`` to ``[B, L]`` values).

    The keyword arguments of earlier releases (``num_generations=``, ``mini_batches=``, ``ref_dtype=``, ``lr=``, ...:
    :data:`~polopt_lightning.settings.MOVED_ARGUMENTS`) still work, with a FutureWarning naming their new place.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        objective: Objective | str | Mapping[str, Any] = "grpo",
        reward_fns: Sequence[Callable] | RewardComposer | None = None,
        reward_weights: Sequence[float] | Mapping[str, float] | None = None,
        reward_on_error: str = "raise",
        accuracy_reward: str | None = None,
        generation: SamplingConfig | Mapping[str, Any] | None = None,
        val_generation: SamplingConfig | Mapping[str, Any] | None = None,
        experience: ExperienceConfig | Mapping[str, Any] | None = None,
        update: UpdateConfig | Mapping[str, Any] | None = None,
        optimizer: Callable[..., torch.optim.Optimizer] | Mapping[str, Any] | None = None,
        reference: ReferenceConfig | Mapping[str, Any] | None = None,
        ref_model: nn.Module | None = None,
        rollout_engine: RolloutEngine | str | Mapping[str, Any] | None = None,
        accel: Any = None,
        anchor: SupervisedAnchor | Mapping[str, Any] | None = None,
        seed: int = 0,
        critic: CriticConfig | Mapping[str, Any] | None = None,
        critic_model: nn.Module | None = None,
        **moved: Any,
    ) -> None:
        super().__init__()
        concerns = with_moved({"experience": experience, "update": update, "optimizer": optimizer,
                               "reference": reference}, moved, MOVED_ARGUMENTS, type(self).__name__)
        self.experience_config = ExperienceConfig.of(concerns["experience"])
        self.update_config = config = UpdateConfig.of(concerns["update"])
        if self.experience_config.max_staleness > 0:  # stale samples: never the current policy's log-probs, corrected
            config = self.update_config = replace(config, reuse_sampling_logprobs=False,
                                                  is_correction=True if config.is_correction is None
                                                  else config.is_correction)
        self.reference_config = ReferenceConfig.of(concerns["reference"])
        self.optimizer_factory = optimizer_factory(concerns["optimizer"])
        self.automatic_optimization = False
        prepare_trainable(model)

        self.policy = model
        # `from_pretrained` returns a model in eval mode, and Lightning keeps each module's mode through fit: without
        # this, a loaded policy trained with gradient checkpointing off (transformers applies it only in training
        # mode) and dropout off even when asked for, and Lightning warned about its modules at every fit. The
        # sampler and validation put it in eval mode for their own passes.
        model.train()
        self.tokenizer = prepare_tokenizer(tokenizer)
        self.objective = objective = as_objective(objective)
        self.rewards, self.accuracy_reward = build_rewards(reward_fns, reward_weights, reward_on_error, accuracy_reward)
        # a mixture's tasks: each has its own accuracy function, reward and signal metrics
        self.tasks = list(self.rewards.tasks) if isinstance(self.rewards, MixtureRewards) else []
        self.anchor = anchor = None if anchor is None else settings_of(SupervisedAnchor, anchor, "anchor")
        self.sampling = SamplingConfig.of(generation)
        self.val_sampling = SamplingConfig.of(val_generation, max_new_tokens=self.sampling.max_new_tokens,
                                              temperature=0.0)
        self.accel = accelerators.training(accel)
        # PPO's critic, where the advantages come from a value per token (experience.advantage_estimator gae)
        self.critic_config = CriticConfig.of(critic)
        self.critic: nn.Module | None = None
        if needs_critic(objective, self.experience_config):
            self.critic = critic_model if critic_model is not None else build_critic(model, self.critic_config)
            self.critic.train()
        elif critic_model is not None:
            estimator = self.experience_config.estimator(getattr(objective, "advantage_estimator", None))
            raise ValueError(f"critic_model is given, but experience.advantage_estimator={estimator} uses no critic "
                             "(gae does; objective=ppo picks it)")
        # rollout, rewards, dynamic sampling, advantages and the anchor's targets: one step's experience
        self.experience = ExperienceMaker(self.tokenizer, self.rewards, self.experience_config, anchor,
                                          objective.advantage_scale, self.reference_config,
                                          getattr(objective, "advantage_estimator", None),
                                          self.critic_config if self.critic is not None else None)
        self.engine = build_engine(rollout_engine)
        staleness = self.experience_config.max_staleness
        self.pipeline = RolloutPipeline(staleness) if staleness > 0 else None
        if self.pipeline is not None and not self.engine.samples_apart:
            rank_zero_warn(f"experience.max_staleness={staleness}: the {type(self.engine).__name__} backend samples in "
                           "the training process, so its rollouts do not overlap training (rollout=server does): the "
                           "pipeline only makes them older")
        self._pending_pipeline: list[Any] | None = None
        if getattr(self.engine, "tokenizer", False) is None:  # a multi-turn engine renders turns with the policy's
            self.engine.set_tokenizer(self.tokenizer)
        if config.gradient_checkpointing:
            enable_gradient_checkpointing(model, "update.gradient_checkpointing")
            if self.critic is not None and not self.critic_config.share_trunk and hasattr(self.critic, "backbone"):
                enable_gradient_checkpointing(self.critic.backbone, "update.gradient_checkpointing")
        # sampler log-probs equal a training forward only when dropout cannot make them differ
        self.reuse_sampling_logprobs = config.reuse_sampling_logprobs and config.disable_dropout
        self.seed = seed
        if config.disable_dropout:
            _disable_dropout(self.policy)
            if self.critic is not None:
                _disable_dropout(self.critic)
        # the reference exists when the KL term or the reward penalty needs it, or when the KL is watched (track_kl)
        self.ref_model, self.shared_reference, ref_quant = build_reference(
            model, self.reference_config.needed(objective.beta), ref_model, self.reference_config)
        # a float32 copy made here with reference.dtype unset follows bf16-mixed (configure_model)
        self._reference_follows_autocast = (self.ref_model is not None and ref_model is None and not self.shared_reference
                                            and not ref_quant.enabled and self.reference_config.dtype is None)
        if self.ref_model is not None:
            # Lightning asks every submodule to be in training mode when fit starts (and warns about each one that is
            # not); the reference only ever runs inside `evaluating`, which puts it in eval mode for its pass.
            self.ref_model.train()
        self.scorer = Scorer(model, self.ref_model, self.shared_reference, config, self.sampling.logprob_temperature)
        self.updater = Updater(model, objective, self.scorer, self.engine, config, LightningLoop(self), anchor=anchor,
                               reference=self.reference_config.needed(objective.beta), seed=seed,
                               reuse_sampling_logprobs=self.reuse_sampling_logprobs, critic=self.critic,
                               critic_config=self.critic_config)
        self.val_metrics = nn.ModuleDict({k: MeanMetric(nan_strategy="ignore")
                                          for k in ("accuracy", "reward", *(f"{t}/accuracy" for t in self.tasks))})
        self._generator: torch.Generator | None = None
        self.extra_prompts = ExtraPrompts()  # dynamic sampling's draws: their position survives a resume
        self._hf_metadata: dict[str, Any] | None = None
        self._pending_rng: list[dict[str, Any]] | None = None
        # the sharded policy gathered whole for sampling, once per step (make_experience) or validation batch (rollout)
        self.whole_parameters = WholeParameters(model)
        self.save_hyperparameters(ignore=["model", "tokenizer", "objective", "reward_fns", "ref_model", "moved",
                                          "rollout_engine", "accel", "optimizer", "anchor", "experience", "update",
                                          "reference", "critic", "critic_model"])
        self.hparams.update(settings_record(self, ref_quant.mode))

    # ------------------------------------------------------------------------------------------------------------
    @property
    def off_policy(self) -> bool:
        """Whether the policy moves between sampling and some update: then old log-probs are needed."""
        return self.update_config.off_policy

    def configure_optimizers(self):
        params: list[Any] = [p for p in self.policy.parameters() if p.requires_grad]
        adjust = None
        if self.critic is not None:  # a group of its own, at its own learning rate
            params = [{"params": params}, {"params": own_parameters(self.critic, self.policy)}]
            adjust = self.critic_config.set_lr
        return optimizer_and_schedule(params, self.optimizer_factory, self.update_config, self._trainer,
                                      self.updater.clips_in_place, adjust)

    def _sampling_generator(self) -> torch.Generator:
        if self._generator is None or self._generator.device != self.device:
            self._generator = torch.Generator(device=self.device)
            self._generator.manual_seed(self.seed + 1000003 * self.global_rank)
        return self._generator

    # ------------------------------------------------------------------------------------------------------------
    def rollout(self, batch: Mapping[str, Any], sampling: SamplingConfig, num_generations: int) -> RolloutBatch:
        return self._sample(self.engine.generate, batch, sampling, num_generations)

    def submit_rollout(self, batch: Mapping[str, Any]) -> Future[RolloutBatch]:
        """A training rollout of ``batch`` submitted to the backend (the asynchronous pipeline): sampled from the
        policy as it is now, returned as a future (:meth:`~polopt_lightning.rollout.RolloutEngine.submit`)."""
        return self._sample(self.engine.submit, batch, self.sampling, self.experience.num_generations)

    def _sample(self, method: Callable[..., Any], batch: Mapping[str, Any], sampling: SamplingConfig,
                num_generations: int) -> Any:
        # a multi-turn engine starts each completion's environment from its dataset row
        rows = {"rows": batch_rows(batch)} if getattr(self.engine, "takes_rows", False) else {}
        with self.whole_parameters(getattr(self._trainer, "strategy", None)):
            return method(self.policy, batch["prompt_ids"], batch["prompt_mask"], num_generations, sampling,
                          stop_token_ids(self.tokenizer, self.policy), self.tokenizer.pad_token_id,
                          generator=self._sampling_generator(), **rows)

    def configure_model(self) -> None:
        """Under ``strategy=fsdp`` (FSDP2), shard the policy and the reference copy over the processes: each decoder
        layer, then the rest of the model (Lightning calls this hook once the processes exist). Otherwise the CPU fast
        path prepares the weights (:meth:`~polopt_lightning.accel.cpu.fast_path.CPUFastPath.prepare`; nothing on other
        devices)."""
        self._reference_in_autocast_dtype()
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
        if self.critic is not None:
            if self.critic_config.share_trunk:
                raise ValueError(SHARED_UNDER_FSDP)
            shard_fully(self.critic, mesh["data_parallel"], reshard)

    def _reference_in_autocast_dtype(self) -> None:
        """Under ``bf16-mixed``, the frozen float32 reference copy made here (``reference.dtype`` unset) holds bfloat16
        weights: its products run in bf16 under autocast anyway, and the copy then takes half the memory and its pass
        no longer casts every weight again (docs/performance.md). ``reference.dtype=float32`` keeps it float32."""
        if (not self._reference_follows_autocast or self._trainer is None
                or str(self.trainer.precision) != "bf16-mixed"):
            return
        if any(p.dtype == torch.float32 for p in self.ref_model.parameters()):
            cast_weights(self.ref_model, torch.bfloat16, "reference.dtype")

    def score(self, batch: Mapping[str, Any], rollout: RolloutBatch) -> RewardOutput:
        """Decode completions and run the reward functions (:meth:`ExperienceMaker.score`)."""
        return self.experience.score(batch, rollout, self.trainer_state())

    def trainer_state(self) -> TrainerState:
        """Where training stands, as TRL's reward functions read it from their ``trainer_state`` argument."""
        return TrainerState.of(self._trainer)

    def make_experience(self, batch: Mapping[str, Any], rollout: Future[RolloutBatch] | None = None
                        ) -> tuple[Experience, dict[str, Tensor]]:
        """Rollout, rewards and advantages for one training batch (:meth:`ExperienceMaker.make`, with DAPO dynamic
        sampling if enabled). ``rollout``: the batch's rollout, submitted earlier (the asynchronous pipeline); dynamic
        sampling's further draws are sampled now.

        Under a sharded strategy the policy is gathered once for all the step's draws: gathering is collective, and
        dynamic sampling may draw more often on one process than on another.
        """
        G = self.experience.num_generations
        submitted = [] if rollout is None else [rollout]

        def sample(prompts: Mapping[str, Any]) -> RolloutBatch:
            return submitted.pop().result() if submitted else self.rollout(prompts, self.sampling, G)

        greedy = replace(self.sampling, temperature=0.0)
        with self.whole_parameters(getattr(self._trainer, "strategy", None)):
            return self.experience.make(batch, sample, lambda: self.extra_prompts.next(self.trainer, self.device),
                                        self.device, self.trainer_state(), reference=self.scorer.reference,
                                        greedy=lambda prompts: self.rollout(prompts, greedy, 1),
                                        values=self.critic_values if self.critic is not None else None)

    def critic_values(self, exp: Experience) -> Tensor:
        """The critic's values ``[N, T]`` at the rollout's completion tokens at sampling time (GAE's), without
        gradient, in pieces of ``update.micro_batch_tokens``."""
        from .step.update import even_pieces, micro_batches

        out = torch.zeros(exp.completion_ids.shape, dtype=torch.float32, device=exp.completion_ids.device)
        rows = torch.arange(exp.completion_ids.shape[0], device=exp.completion_ids.device)
        # eval mode for the pass, as the log-probs' (a shared trunk is the policy's own); the quantized layers keep the
        # kernels the update's forward uses
        trunk = getattr(self.critic, "backbone", self.critic)
        with torch.no_grad(), evaluating(self.critic, keep_quantized=True), evaluating(trunk, keep_quantized=True):
            # as many pieces on every process: each forward of a sharded critic gathers its weights collectively
            for piece in even_pieces(micro_batches(exp, rows, self.update_config.micro_batch_tokens, False),
                                     self.critic, self.device):
                width = max(int(exp.attention_mask[piece].sum(-1).max()), 1)
                out[piece, :width] = token_values(self.critic, exp, piece, width)
        return out

    def reference_logprobs(self, exp: Experience) -> Tensor:
        """Log-probs ``[N, T]`` of the rollout's completions under the KL reference: :meth:`.logprobs.Scorer.reference`,
        which the step itself calls (the KL reward penalty and the update)."""
        return self.scorer.reference(exp)

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        with self.accel.compute(self.policy, self.device):
            self._training_step(batch)

    def _training_step(self, batch: Mapping[str, Any]) -> None:
        if self.pipeline is None:
            exp, metrics = self.make_experience(batch)
        else:  # this batch's rollout submitted; the one due trained on (none while the pipeline fills)
            self.pipeline.put(batch, self.submit_rollout(batch))
            if not self.pipeline.ready():
                return
            due, staleness = self.pipeline.take()
            try:
                if due.rollout is None:  # lost with a failure before a resume: sampled again, now
                    due.rollout, staleness = self.submit_rollout(due.batch), 0
                self._train(due.batch, *self.make_experience(due.batch, due.rollout), staleness)
            except BaseException:  # the pipeline as before this step: an exception checkpoint resumes from it
                self.pipeline.undo(due)
                raise
            self.pipeline.trained()
            return
        self._train(batch, exp, metrics)

    def _train(self, batch: Mapping[str, Any], exp: Experience, metrics: dict[str, Tensor],
               staleness: int | None = None) -> None:
        if staleness is not None:
            metrics["train/staleness"] = torch.tensor(float(staleness))
        lengths = exp.completion_mask.sum(-1).float()
        # every process holds as many completions (whole groups of equal batches): means of means are exact
        metrics["train/completion_len"] = all_reduce(lengths.mean()) / world_size()
        metrics["train/completion_len_max"] = all_reduce(lengths.max(), "max")
        metrics["train/truncated_frac"] = all_reduce((~exp.finished).float().mean()) / world_size()
        optimizer = self.optimizers()
        metrics.update({f"train/{k}": v for k, v in self.updater.run(exp, optimizer, self.lr_schedulers()).items()})
        metrics["train/lr"] = torch.tensor(optimizer.param_groups[0]["lr"])
        self.log_dict({k: v.float() for k, v in metrics.items()}, on_step=True, on_epoch=False,
                      batch_size=batch["prompt_ids"].shape[0])
        self.log("reward", metrics["train/reward"].float(), prog_bar=True, on_step=True, logger=False)

    def policy_replaced(self) -> None:
        """The policy's weights were set outside an optimizer step (the collapse monitor's rollback): a backend that
        samples from weights of its own gets them again before its next rollout, and the pipeline's rollouts in
        flight, sampled by the weights replaced, are dropped (the next batches fill it again)."""
        self.engine.policy_updated(self.policy)
        if self.pipeline is not None:
            self.pipeline.queue.clear()

    def accumulate_gradients(self, exp: Experience, rows: Tensor, record_old: bool = False) -> dict[str, Tensor]:
        """Backward of the objective (and the anchor) on the completions ``rows``, in micro-batches; returns the
        step's metrics (:meth:`.update.Updater.accumulate`)."""
        return self.updater.accumulate(exp, rows, record_old)

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
        that holds files is refused; with ``overwrite`` a previous export is replaced whole, anything else still
        refused (:func:`~polopt_lightning.export.check_target`).
        """
        from .export import save_policy

        return save_policy(self.policy, self.tokenizer, out_dir, merge=merge, overwrite=overwrite)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        save_state(self, checkpoint)  # the training state beyond the weights (resume.py)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, except that the frozen part of a quantized base is checked against the base
        this module holds instead of loaded (:func:`~polopt_lightning.resume.load_weights`)."""
        return load_weights(self, super().load_state_dict, state_dict, strict, assign)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        restore_state(self, checkpoint)

    def configure_callbacks(self) -> list[L.Callback]:
        """The anchor's scheduler, when this module has an anchor and the trainer has none of its own; the CPU fast
        path's (:meth:`~polopt_lightning.accel.cpu.fast_path.CPUFastPath.callbacks`)."""
        from .callbacks import AnchorScheduler

        own = []
        if self.anchor is not None and not any(isinstance(c, AnchorScheduler) for c in self.trainer.callbacks):
            own.append(AnchorScheduler())
        return own + self.accel.callbacks(self.trainer.callbacks)

    def on_fit_start(self) -> None:
        self.rewards.place(self.device)  # a reward model follows the policy to its device
        check_reward_rows(self.rewards, self.trainer.datamodule)  # a row without its answer: now, not when drawn
        if self.anchor is not None:
            self.anchor.check_rows(getattr(self.trainer.datamodule, "train_rows", None))

    def on_validation_start(self) -> None:
        self.rewards.place(self.device)

    def on_train_start(self) -> None:
        # restored here, not at loading: the generator lives on the training device, known only once fit has started
        pending, self._pending_rng = self._pending_rng, None
        if pending is not None:
            restore_rng(pending, self.global_rank, world_size(), self._sampling_generator())
        pipeline, self._pending_pipeline = self._pending_pipeline, None
        if pipeline is not None:  # this process's rollouts in flight at the checkpoint
            saved = pipeline[0].get("max_staleness")
            if self.pipeline is None or len(pipeline) != world_size() or saved != self.pipeline.max_staleness:
                raise ValueError(f"ckpt_path: the checkpoint holds the asynchronous pipeline of {len(pipeline)} "
                                 f"process(es) with experience.max_staleness={saved}; resume with the same "
                                 f"experience.max_staleness and processes (this run: "
                                 f"{0 if self.pipeline is None else self.pipeline.max_staleness}, {world_size()})")
            self.pipeline.load_state_dict(pipeline[self.global_rank], self.device)

