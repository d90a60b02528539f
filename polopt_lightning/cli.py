"""Hydra entry point ``polopt-train`` (also ``python -m polopt_lightning``).

``polopt-train`` with no arguments runs the embedded default: a tiny model, a cached supervised warm start on
the built-in arithmetic task, then RL with the default objective. Everything is a config group; for example
``polopt-train objective=gspo trainer.max_steps=50`` or ``polopt-train -m objective=grpo,gspo seed=0,1,2``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from .checkpoints import checkpoint_folder, checkpoint_step, checkpoints_in, resume_point  # noqa: F401 (the CLI's names)
from .confschema import code_default, config_dir, target_of
from .console import configure_console
from .settings import MOVED_ARGUMENTS

log = logging.getLogger("polopt_lightning")


def _run_dir(cfg: DictConfig) -> Path:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.get("output_dir") or ".").resolve()


def _instantiate_all(group: Any) -> list[Any]:
    """Instantiate every entry of a mapping of ``_target_`` configs (null entries are skipped)."""
    from hydra.utils import instantiate

    if not group:
        return []
    return [instantiate(v) for v in group.values() if v is not None]


def _container(cfg: DictConfig, key: str) -> dict[str, Any]:
    """``cfg[key]`` as a plain dict (``{}`` when absent)."""
    node = cfg.get(key)
    return OmegaConf.to_container(node, resolve=True) if node is not None else {}


def _rewards(cfg: DictConfig, task: Any, task_rewards: dict[str, Any]) -> dict[str, Any]:
    """The module's reward arguments: the ``reward`` group's functions; the task's own rewards with ``reward=task``;
    for a task mixture each task's own (its built-in pair, or ``task.rewards.<name>``), whatever the reward group.

    The functions go by the keys written under ``functions`` (a mapping), so ``weights``, ``accuracy`` and
    ``weights.rewards.fade`` may name a function by its key (or by its name, as it is logged)."""
    from hydra.utils import instantiate

    from .data import TaskMixture
    from .rewards import RewardComposer

    def composer(spec: Any, key: str) -> RewardComposer:
        functions = {str(k): instantiate(v) for k, v in (spec.get("functions") or {}).items() if v is not None}
        if not functions:
            raise ValueError(f"{key}.functions is empty: give at least one reward function")
        weights = spec.get("weights")
        weights = OmegaConf.to_container(weights, resolve=True) if OmegaConf.is_config(weights) else weights
        try:
            return RewardComposer(functions, weights=weights, on_error=spec.get("on_error", "raise"),
                                  aggregation=spec.get("aggregation", "sum"))
        except ValueError as err:
            if str(err).startswith("reward weights"):  # named by its key: reward.weights, task.rewards.<t>.weights
                raise ValueError(f"{key}.weights: {err}") from None
            raise

    if isinstance(task, TaskMixture):
        unknown = sorted(set(task_rewards) - set(task.names))
        if unknown:
            raise ValueError(f"task.rewards names unknown tasks {unknown}; the tasks: {task.names}")
        if cfg.reward.get("functions") and not cfg.reward.get("from_task"):
            log.info("task mixture: each task is scored by its own rewards (task.rewards.<task> or its built-in "
                     "ones); the reward group is not used")
        overrides = {name: composer(spec, f"task.rewards.{name}") for name, spec in task_rewards.items()}
        accuracy = {name: spec["accuracy"] for name, spec in task_rewards.items() if spec.get("accuracy")}
        return {"reward_fns": task.rewards(overrides, accuracy)}
    if task_rewards:
        raise ValueError("task.rewards is set, but the task is not a mixture: set the reward group instead")
    if cfg.reward.get("from_task"):
        if not hasattr(task, "rewards"):
            raise ValueError(f"reward=task: the task ({type(task).__name__}) has no built-in rewards; choose a "
                             "reward group (e.g. reward=exact_match)")
        return {"reward_fns": task.rewards()}
    rewards = composer(cfg.reward, "reward")
    accuracy = cfg.reward.get("accuracy")
    accuracy = rewards.resolve(accuracy, "reward.accuracy") if accuracy else None  # its key or name -> its name
    return {"reward_fns": rewards, "accuracy_reward": accuracy}


def _weight_schedulers(cfg: DictConfig, task: Any) -> list[Any]:
    """The ``weights`` group's callbacks: the task-weight schedule (a mixture only) and the reward-weight fades."""
    from hydra.utils import instantiate

    from .data import TaskMixture

    weights = cfg.get("weights") or {}
    out = []
    if isinstance(task, TaskMixture) and weights.get("tasks") is not None:
        scheduler = instantiate(weights.tasks)
        scheduler.check(task.names, task.weights)  # its floor against the number of tasks, before anything trains
        out.append(scheduler)
    rewards = weights.get("rewards")
    if rewards is not None and rewards.get("fade"):
        out.append(instantiate(rewards))
    return out


def _validate(trainer, module, datamodule) -> dict[str, float]:
    if not datamodule.val_rows:
        return {}
    results = trainer.validate(module, datamodule=datamodule, verbose=False)
    return {k: float(v) for k, v in (results[0] if results else {}).items()}


def _resumes_from_file(cfg: DictConfig) -> bool:
    """Whether the run resumes from a checkpoint file (``ckpt_path`` a path that exists; a run folder was resolved
    to its newest file by :func:`resume_overrides`; Lightning's keywords are not)."""
    ckpt = cfg.get("ckpt_path")
    return ckpt is not None and str(ckpt) not in _CKPT_KEYWORDS and Path(str(ckpt)).is_file()


def _skips_warm_start(cfg: DictConfig, adapted: bool) -> bool:
    """Whether the warm start is skipped: a resume from a checkpoint file, without an adapter or a quantized
    reference (see :func:`_warm_start`)."""
    from .models import as_quantization

    quantization = _container(cfg, "reference").get("quantization")
    reference_quantized = as_quantization(quantization, "reference.quantization").enabled
    return _resumes_from_file(cfg) and not adapted and not reference_quantized


def _warm_start(cfg: DictConfig, model: Any, tokenizer: Any, datamodule: Any, quantized: str,
                adapted: bool) -> dict[str, Any]:
    """The ``warm_start`` block run on ``model`` (cached), or nothing when it is off: what it did, with ``ran``.

    A run resumed from a checkpoint file skips it: the checkpoint holds every weight the warm start would shape
    (the policy, the reference copy, a critic's trunk) and replaces them all. It runs (from its cache if kept) with
    an adapter (the warm-started base is written to the run's ``base_model/`` before the checkpoint loads), with a
    quantized reference (a resume checks the checkpoint's quantized copy against the one built from the
    warm-started weights instead of loading it) and for Lightning's ``last``/``best`` keywords (a ``last`` that
    finds no checkpoint starts afresh)."""
    from .models import is_quantized
    from .warmstart import WarmStartConfig, default_cache_dir, supervised_warm_start

    settings = _container(cfg, "warm_start") or {"enabled": False}
    enabled = settings.pop("enabled", False)
    if enabled is None:  # a model built from a config knows nothing yet; a pretrained one is the user's to shape
        enabled = not getattr(model, "name_or_path", "")
        if not enabled:
            log.info("warm start: off for a pretrained model (warm_start.enabled=null: on only for a model built from "
                     "a config); warm_start.enabled=true runs it on the task's reference answers")
    if not enabled:
        return {"ran": False, "cached": False, "wall_s": 0.0}
    if is_quantized(model):
        raise ValueError(f"warm_start.enabled=true trains every weight, but the model was loaded quantized "
                         f"(quantization={quantized}); set warm_start.enabled=false")
    if _skips_warm_start(cfg, adapted):
        log.info("warm start: skipped, the run resumes from %s, whose weights replace the starting ones",
                 cfg.ckpt_path)
        return {"ran": False, "cached": False, "wall_s": 0.0, "skipped": True}
    settings["cache_dir"] = settings.get("cache_dir") or str(default_cache_dir())
    column = settings.get("prompt_column", "prompt")  # chat prompts rendered as the policy will read them
    rows = [{**r, column: datamodule.prompt_text(r[column])} if column in r else r for r in datamodule.train_rows]
    return {"ran": True, **supervised_warm_start(model, tokenizer, rows, WarmStartConfig(**settings))}


# train.yaml's own keys
_TOP_LEVEL_TYPES = {"seed": int, "num_threads": int | None, "validate_before": bool, "verbose": bool}


# keys a group holds that the CLI takes apart before it builds the group's object (a mixture's per-task rewards)
_TAKEN_APART = {("task", "rewards"), ("warm_start", "enabled")}


def check_config(cfg: DictConfig) -> None:
    """Every value before anything is built, each error naming the key as it is typed on the command line: a required
    value not given (``???``), and a value of the wrong type, by the type hints of what takes it (the callable a
    ``_target_`` names, or a plain block's settings class): ``objective.beta: expected a number, got 'abc'``.

    A factory that passes its keywords on by name (``build_objective``) names the real callable with a
    ``target_for(values)`` attribute."""
    from .settings import accepted_names, annotations_of, check_names, check_types

    missing = sorted(OmegaConf.missing_keys(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])))
    if missing:
        raise ValueError(f"{missing[0]}: no value given, and it has no default: give it on the command line "
                         f"({missing[0]}=...)" + (f"; also missing: {', '.join(missing[1:])}" if missing[1:] else ""))
    check_types({k: cfg.get(k) for k in _TOP_LEVEL_TYPES if k in cfg}, _TOP_LEVEL_TYPES, "")
    if OmegaConf.is_config(cfg.get("trainer")) and "precision" in cfg.trainer:
        from .accel.precision import check_precision

        check_precision(cfg.trainer.precision)

    def walk(node: Any, key: str) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{key}.{i}")
            return
        if not isinstance(node, dict):
            return
        try:
            target, registered = target_of(node, key)
        except Exception:  # an unknown target: instantiating it says so
            target, registered = None, False
        # a registry's factory takes the registered name beside the class's settings
        registry_key = {"name"} if registered else set()
        if target is not None:
            values = {k: v for k, v in node.items() if not str(k).startswith("_") and (key, k) not in _TAKEN_APART}
            accepted = accepted_names(target)
            check_names(values, accepted | registry_key if accepted is not None else None, key)
            check_types(values, annotations_of(target), key)
        for k, v in node.items():
            walk(v, f"{key}.{k}")

    for group in cfg:
        if group == "hydra" or not OmegaConf.is_config(cfg.get(group)):
            continue
        try:
            values = OmegaConf.to_container(cfg[group], resolve=True)
        except Exception:  # an interpolation that cannot resolve here: building it says what is wrong
            continue
        walk(values, str(group))


def _built_early(cfg: DictConfig, group: str) -> Any:
    """The group's object (``_target_``), or ``None`` where the group is empty; its error (Hydra wraps it) raised
    again as a ValueError that names the group."""
    from hydra.utils import instantiate

    if not cfg.get(group):
        return None
    try:
        return instantiate(cfg[group])
    except Exception as err:
        _raise_named(err, group)
        cause = err.__cause__ or err
        raise ValueError(f"{group}: {type(cause).__name__}: {cause}") from cause


def _raise_named(err: Exception, group: str) -> None:
    """Where Hydra's error ``err`` wraps a refusal that names its key in ``group`` (the settings' own check), that
    refusal alone as a ValueError; else nothing."""
    cause = err.__cause__ or err
    if str(cause).startswith(f"{group}."):
        raise ValueError(str(cause)) from None


def train(cfg: DictConfig) -> dict[str, Any]:
    """Build everything from ``cfg`` and run: warm start, validation before, RL, validation after.

    Returns the summary written to ``results.json`` in the run directory.
    """
    import lightning as L
    import torch
    from hydra.utils import instantiate

    from .accel.precision import auto_precision
    from .callbacks import AtomicCheckpointIO, ProgressLog, ValidationHistory, progress_bar
    from .data import PromptDataModule
    from .export import export_checkpoint
    from .loggers import close_loggers
    from .models import as_adapter, as_quantization, check_combination, prepare_policy, train_in_float32
    from .module import PolicyOptimizationModule
    from .optim import optimizer_factory
    from .rewards.composer import check_reward_rows
    from .step.critic import SHARED_UNDER_FSDP, check_critic_source, needs_critic
    from .step.loop import TorchLoop
    from .step.update import Updater
    from .strategies import SHARDED, check_strategy, strategy_kind

    start = time.perf_counter()
    configure_console(bool(cfg.get("verbose", False)))
    if "note" in _RESUME:  # what resume_overrides found
        log.info(_RESUME["note"])
    # every concern's settings before anything loads or trains: a bad value fails in a second, naming its key
    # (the rollout backend and the CPU fast path also check what they need installed)
    with _settings_refused():
        check_config(cfg)
        objective, experience, update, reference, engine, accel, critic = (
            _built_early(cfg, g) for g in ("objective", "experience", "update", "reference", "rollout", "accel", "critic"))
        anchor = _built_early(cfg, "anchor") if (cfg.get("anchor") or {}).get("_target_") else None
        if objective is not None and update is not None:  # the update's terms check themselves against the objective
            Updater(None, objective, None, engine, update, TorchLoop())  # (a token-level sampler correction for GSPO)
        critic_used = objective is not None and experience is not None and needs_critic(objective, experience)
        if critic_used and critic is not None:
            try:  # a missing critic.name_or_path now, not after the warm start
                check_critic_source(critic)
            except OSError as err:  # no folder, not a hub id: the one line naming the key, as for a bad value
                raise ConfigError(str(err)) from None
            max_steps = int(cfg.trainer.get("max_steps") or -1)
            if 0 < max_steps <= critic.warmup_steps:
                log.warning("critic.warmup_steps=%d >= trainer.max_steps=%d: every step trains the critic alone, the "
                            "policy not at all", critic.warmup_steps, max_steps)
        optimizer = optimizer_factory(instantiate(cfg.optimizer) if cfg.get("optimizer") else None)
        run_dir = _run_dir(cfg)
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.get("num_threads"):
            torch.set_num_threads(int(cfg.num_threads))
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        try:  # the callbacks' settings too (the collapse monitor's actions, the checkpoints' periods)
            own_callbacks = _instantiate_all(cfg.get("callbacks"))
        except Exception as err:
            _raise_named(err, "callbacks")
            raise

        quantization = as_quantization(_container(cfg, "quantization"))
        adapter = as_adapter(_container(cfg, "adapter"))
        check_combination(quantization, adapter)  # before anything loads
        strategy_cfg = _container(cfg, "strategy")
        kind = strategy_kind(strategy_cfg)
        if critic_used and critic is not None and critic.share_trunk and kind == "fsdp":
            raise ValueError(SHARED_UNDER_FSDP)
        check_strategy(kind, accelerator=str(cfg.trainer.get("accelerator", "auto")), quantized=quantization.mode,
                       micro_batch_tokens=update.micro_batch_tokens if update else None,
                       optimizer=(cfg.get("optimizer") or {}).get("name"),
                       backend=strategy_cfg.get("process_group_backend"))
        accelerator = str(cfg.trainer.get("accelerator", "auto"))
        if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():  # before the model loads and the warm start
            raise ValueError(f"trainer.accelerator={accelerator}: torch {torch.__version__} sees no CUDA device (a CPU "
                             "build of torch, or no driver): install a CUDA build of torch, or leave trainer=gpu out")
    model, tokenizer = instantiate(cfg.model)
    if (cfg.model.get("dtype") == "auto" and not quantization.enabled and not adapter.enabled
            and (half := train_in_float32(model)) is not None):
        log.info("model.dtype=auto: the checkpoint's %s weights train in float32 (an optimizer step at RL's learning "
                 "rates is mostly lost to %s rounding); model.dtype=%s trains them as they are",
                 str(half).replace("torch.", ""), str(half).replace("torch.", ""), str(half).replace("torch.", ""))
    task_cfg = _container(cfg, "task")
    task_rewards = task_cfg.pop("rewards", None) or {}  # a mixture's per-task reward overrides
    # the task, its rows, their rewards and the schedules over them before the warm start: one that cannot work here
    # (a sandbox refused, a reward model's missing folder, a row without its answer) fails now, naming its key, not
    # after minutes of supervised steps
    with _settings_refused():
        task = instantiate(task_cfg, _convert_="all") if task_cfg else None  # a mixture gets its tasks built
        # a multi-turn rollout's tools: the chat template shows the model their schemas, as TRL's and verl's do
        datamodule = PromptDataModule(task=task, tokenizer=tokenizer, tools=getattr(engine, "tools", None) or (),
                                      **OmegaConf.to_container(cfg.data, resolve=True))
        if hasattr(engine, "set_tokenizer"):  # a multi-turn rollout renders turns with the chat template: one it
            engine.set_tokenizer(tokenizer)  # lacks is refused now, not after the warm start
        rewards = _rewards(cfg, task, task_rewards)
        check_reward_rows(rewards["reward_fns"], datamodule)  # a row without its answer: now, not when first drawn
        if anchor is not None:
            anchor.check_rows(datamodule.train_rows)
        weight_schedulers = _weight_schedulers(cfg, task)
    warm = _warm_start(cfg, model, tokenizer, datamodule, quantization.mode, adapter.enabled)
    # the base of an adapter is kept in the run when no folder or hub id holds it (built, or changed by the warm start)
    base_dir = run_dir / "base_model" if adapter.enabled and (warm["ran"] or not model.name_or_path) else None
    model = prepare_policy(model, quantization, adapter, base_dir)
    if base_dir is not None:
        tokenizer.save_pretrained(base_dir)
    module = PolicyOptimizationModule(
        model, tokenizer, objective=objective, **rewards,
        generation=OmegaConf.to_container(cfg.generation, resolve=True), experience=experience, update=update,
        optimizer=optimizer, reference=reference, rollout_engine=engine, accel=accel, anchor=anchor, seed=cfg.seed,
        critic=critic,
    )
    loggers = _instantiate_all(cfg.get("logger"))
    history = ValidationHistory(monitor="val/accuracy", mode="max")
    callbacks = [*own_callbacks, *weight_schedulers, history]
    if cfg.trainer.get("enable_progress_bar", True):
        callbacks.append(progress_bar())
    else:  # log lines instead: the step, the reward, the time a step (log files, batch jobs)
        callbacks.append(ProgressLog())
    strategy = instantiate(cfg.strategy)(model=model) if strategy_cfg.get("_target_") else "auto"
    clip = module.update_config.max_grad_norm
    if kind == "deepspeed" and clip:  # DeepSpeed clips inside its engine, from its own config
        strategy.config = {**(strategy.config or {}), "gradient_clipping": float(clip)}
    precision, why = {}, None
    trained_in = checkpoint_precision(Path(cfg.ckpt_path)) if cfg.get("ckpt_path") else None
    if str(cfg.trainer.get("precision")) == "auto":  # Lightning has no such value: chosen here, by hardware and size
        precision["precision"], why = auto_precision(str(cfg.trainer.get("accelerator", "auto")), model=model)
        if trained_in and trained_in != precision["precision"]:  # a resumed run goes on as it was trained
            why = f"the checkpoint resumed was trained in {trained_in}, kept; here auto would take " \
                  f"{precision['precision']} ({why})"
            precision["precision"] = trained_in
        log.info("trainer.precision=auto: %s (%s)", precision["precision"], why)
    elif trained_in and trained_in != str(cfg.trainer.get("precision")):  # asked for: done, but said
        log.warning("trainer.precision=%s: the checkpoint resumed was trained in %s; the run goes on in %s as asked "
                    "(trainer.precision=auto keeps the checkpoint's)", cfg.trainer.precision, trained_in,
                    cfg.trainer.precision)
    trainer: L.Trainer = instantiate(cfg.trainer, logger=loggers or False, callbacks=callbacks,
                                     default_root_dir=str(run_dir), strategy=strategy,
                                     plugins=[AtomicCheckpointIO()] if kind != "deepspeed" else None, **precision)

    resuming = cfg.get("ckpt_path") is not None
    if resuming:  # a run resumed in its own directory finds its checkpoints there: that is expected
        import warnings

        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        done = checkpoint_step(Path(str(cfg.ckpt_path)))  # None for a folder, a keyword or no file
        if done is not None and trainer.max_steps >= 0 and done >= trainer.max_steps:
            log.warning("ckpt_path: the checkpoint is at step %d and trainer.max_steps=%d: nothing is left to train; "
                        "trainer.max_steps=N (N > %d) trains on from it", done, trainer.max_steps, done)
    # a resumed run's policy is the checkpoint's, not the starting one: its "before" is the one the run recorded
    before = _validate(trainer, module, datamodule) if cfg.get("validate_before", True) and not resuming else {}
    rl_start = time.perf_counter()
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    except BaseException as err:  # Ctrl-C reaches here as Lightning's SystemExit, after on_exception.ckpt is saved
        if trainer.is_global_zero:
            _say_how_to_resume(run_dir, err)
        if isinstance(err, SystemExit) and not err.code:  # SIGTERM: Lightning's SIGTERMException exits with 0
            raise SystemExit(128 + 15) from err  # a stopped run is not a finished one (schedulers, `&&` chains)
        raise
    rl_wall = time.perf_counter() - rl_start
    if resuming:
        before = next((r for r in history.records if not r["fitting"] and r["step"] == 0), {})
    after = _validate(trainer, module, datamodule)
    close_loggers(loggers)  # the last Trainer call: TensorBoard's one event file of the run is complete
    if kind in SHARDED:  # each process holds a shard: gather the whole policy into a checkpoint, export that
        final = run_dir / "checkpoints" / "final.ckpt"
        trainer.save_checkpoint(final)
        model_dir, adapter_dir = run_dir / "model", run_dir / "adapter" if adapter.enabled else None
        if trainer.is_global_zero:  # export_checkpoint consolidates a DeepSpeed folder itself (once: it is kept)
            export_checkpoint(final, model_dir, overwrite=True)
            if adapter_dir:
                export_checkpoint(final, adapter_dir, merge=False, overwrite=True)
    elif trainer.is_global_zero:  # the run's own folders (a resumed run writes them again): replaced whole
        model_dir = module.save_pretrained(run_dir / "model", overwrite=True)  # merged into its base with an adapter
        adapter_dir = (module.save_pretrained(run_dir / "adapter", merge=False, overwrite=True) if adapter.enabled
                       else None)
    # the rollout backend's engine (vLLM's, with its process groups) shut down by every process while the group is
    # still there: left to interpreter exit, vLLM's teardown runs after close_process_group and fails
    module.engine.close()
    if not trainer.is_global_zero:  # one summary and one results.json per run: the first process's
        return {"global_rank": trainer.global_rank, "steps": int(trainer.global_step)}
    best = history.best()
    best_ckpt = run_dir / "checkpoints" / "best.ckpt"

    results = {
        "objective": cfg.objective.get("name", type(objective).__name__.lower()),
        "steps": int(trainer.global_step),
        "wall_s": round(time.perf_counter() - start, 2),
        "rl_wall_s": round(rl_wall, 2),
        "warm_start_wall_s": round(float(warm.get("wall_s", 0.0)), 2),
        "warm_start_cached": bool(warm.get("cached", False)),
        "warm_start_skipped": bool(warm.get("skipped", False)),  # a resume: the checkpoint holds what it shaped
        "warm_start_steps": warm.get("steps"),
        "warm_start_probe_accuracy": warm.get("probe_accuracy"),
        "val_accuracy_before": before.get("val/accuracy"),
        "val_accuracy_after": after.get("val/accuracy"),
        # the best validation during RL (validations every trainer.val_check_interval rollouts) and its step
        "val_accuracy_best": best.get("val/accuracy") if best else None,
        "val_accuracy_best_step": best["step"] if best else None,
        "val_accuracy_best_rollout": best["rollout"] if best else None,
        "best_checkpoint": str(best_ckpt) if best_ckpt.is_file() else None,
        # the final policy in Hugging Face format: AutoModelForCausalLM.from_pretrained(model_dir)
        "model_dir": str(model_dir),
        # with an adapter: the adapter alone (peft) and the base it applies to
        "adapter_dir": str(adapter_dir) if adapter_dir else None,
        "base_model": module.policy.peft_config["default"].base_model_name_or_path if adapter_dir else None,
        "val_reward_before": before.get("val/reward"),
        "val_reward_after": after.get("val/reward"),
        # a task mixture: each task's accuracy before and after, and the task weights the run ended with
        "val_task_accuracy_before": {t: before.get(f"val/{t}/accuracy") for t in module.tasks} or None,
        "val_task_accuracy_after": {t: after.get(f"val/{t}/accuracy") for t in module.tasks} or None,
        "task_weights_final": datamodule.task_weights if module.tasks else None,
        "val_history": [{k: v for k, v in r.items() if k != "fitting"} for r in history.records if r["fitting"]],
        # the collapse monitor (callbacks.collapse): its events, rollbacks, and whether it stopped the run (the final
        # model is then the weights it stopped on: best.ckpt holds the best validated ones)
        **_collapse_summary(callbacks),
        "seed": int(cfg.seed),
        # processes that trained (trainer.devices x trainer.num_nodes) and their strategy
        "world_size": int(trainer.world_size),
        "strategy": kind,
        # what the steps computed in (trainer.precision, resolved where it was auto, and why)
        "precision": str(trainer.precision),
        "precision_auto": why,
        "run_dir": str(run_dir),
    }
    (run_dir / "results.json").write_text(json.dumps(_finite_or_null(results), indent=2, allow_nan=False))
    print(summary_table(results))
    return results


def _finite_or_null(value: Any) -> Any:
    """``value`` with every NaN or infinite float as ``None``: JSON has no NaN (a task without validation rows has no
    accuracy), and other readers than Python's refuse the file that writes one."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def summary_table(results: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    rows = [(k, fmt(results[k])) for k in ("objective", "steps", "val_accuracy_before", "val_accuracy_after",
                                           "val_accuracy_best", "val_accuracy_best_step", "warm_start_wall_s",
                                           "rl_wall_s", "wall_s", "model_dir", "run_dir")]
    width = max(len(k) for k, _ in rows)
    lines = ["polopt-train summary", "-" * (width + 30)] + [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def _collapse_summary(callbacks: list[Any]) -> dict[str, Any]:
    """``collapse_events``, ``collapse_rollbacks`` and ``collapse_stopped`` of the run's collapse monitor (``None``
    each without one)."""
    from .callbacks import CollapseMonitor

    monitor = next((c for c in callbacks if isinstance(c, CollapseMonitor)), None)
    if monitor is None:
        return {"collapse_events": None, "collapse_rollbacks": None, "collapse_stopped": None}
    return {"collapse_events": len(monitor.events), "collapse_rollbacks": int(monitor.rollbacks),
            "collapse_stopped": any(e.action == "stop" for e in monitor.events)}


class ConfigError(ValueError):
    """A setting refused before anything loads (it names its key): ``polopt-train`` prints it alone, without a
    traceback (``HYDRA_FULL_ERROR=1`` keeps one), and exits with 1."""


@contextmanager
def _settings_refused() -> Iterator[None]:
    """A ValueError inside is a setting refused: raised again as :class:`ConfigError`, unless it carries another
    kind of error than a ValueError or TypeError (an import that failed, a user's class that raised: its traceback
    is kept)."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as err:
        if err.__cause__ is not None and not isinstance(err.__cause__, (ValueError, TypeError)):
            raise
        raise ConfigError(str(err)) from err


@hydra.main(config_path=config_dir(), config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    import os

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from .distributed import close_process_group

    try:
        results = train(cfg)
    except ConfigError as err:
        for path, data in _RESUME_HYDRA_FILES.items():  # a refused resume leaves the run's saved configuration
            Path(path).write_bytes(data)
        # a sweep goes on with its other jobs (Hydra reports each failure); a single run says the refusal alone
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or HydraConfig.get().mode != RunMode.RUN:
            raise
        raise SystemExit(f"polopt-train: {err}") from None
    close_process_group()
    return results.get("val_accuracy_after")


def _external_rank() -> tuple[int, int] | None:
    """``(rank, world size)`` when torchrun or SLURM started this process as one of several, else ``None``."""
    import os

    for rank_var, world_var in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if os.environ.get(rank_var) is not None and int(os.environ.get(world_var, "1")) > 1:
            return int(os.environ[rank_var]), int(os.environ[world_var])
    return None


def launcher_overrides(argv: list[str]) -> list[str]:
    """The command line of a process that torchrun or SLURM started: every process of a run writes into the one run
    directory (which must then be named: each process would otherwise stamp its own with its start time), and the
    processes after the first keep their Hydra files and log apart, as Lightning's own launcher does for its
    processes (``train_ddp_process_<rank>.log``)."""
    external = _external_rank()
    if external is None or any(a.startswith("hydra.job.name=") for a in argv):  # Lightning's children name theirs
        return argv
    rank, world = external
    if not any(a.startswith("hydra.run.dir=") for a in argv) and not any(a in ("-m", "--multirun") for a in argv):
        raise SystemExit(f"polopt-train: process {rank} of {world} (started by torchrun or SLURM): give "
                         "hydra.run.dir=<a folder every process can reach> so they all write into one run directory")
    if rank == 0:
        return argv
    return [*argv, f"hydra.job.name=train_ddp_process_{rank}", "hydra.output_subdir=null"]


def _override_key(override: str) -> str:
    """The key an override sets: ``trainer.max_steps`` for ``trainer.max_steps=5``, ``+a.b=1``, ``~a.b``."""
    return override.lstrip("+~").split("=", 1)[0]


# keys that moved, old -> new: a command line or a saved run that uses the old name still works (renamed, said once);
# the module's old arguments (settings.MOVED_ARGUMENTS) under `module.` (`module.ref_quantization` never was a key: it
# goes where it would have), and the rollout's and the fast path's
MOVED_KEYS = {
    "module.rollout_dtype": "rollout.dtype", "module.compile_rollout": "rollout.compile",
    "module.onednn_linear": "accel.onednn_linear", "module.keep_host_memory": "accel.keep_host_memory",
    **{f"module.{old}": f"{group}.{new}" for old, (group, new) in MOVED_ARGUMENTS.items()},
}
# groups added since runs were first saved: a saved run without them took their defaults
NEW_GROUPS = ("rollout", "accel", "experience", "update", "reference", "critic")
# values a saved run wrote that mean what the shipped config now writes otherwise: key -> {saved: now}
# (Dr. GRPO's normaliser fell back to 256 when no generation block existed; generation is now a group, always there)
REWRITTEN_VALUES = {"objective.max_completion_length": {"${oc.select:generation.max_new_tokens,256}":
                                                        "${generation.max_new_tokens}"},
                    # the old default: the same weights for every objective it could run with (GSPO refused it)
                    "update.is_mode": {"token_truncate": None}}


def renamed(overrides: list[str], said: list[str] | None = None) -> list[str]:
    """``overrides`` with every moved key (:data:`MOVED_KEYS`) under its new name; each renaming is appended to
    ``said`` (``old -> new``)."""
    out = []
    for override in overrides:
        key = _override_key(override)
        if key in MOVED_KEYS:
            prefix = override[: len(override) - len(override.lstrip("+~"))]
            override = prefix + MOVED_KEYS[key] + override[len(prefix) + len(key):]
            if said is not None:
                said.append(f"{key} -> {MOVED_KEYS[key]}")
        out.append(override)
    return out


# Lightning's names for a checkpoint it looks up itself (fit(ckpt_path="last"), ...)
_CKPT_KEYWORDS = ("last", "best", "hpc", "registry")
# what resume_overrides found, for train() to say in the run's log
_RESUME: dict[str, str] = {}
# a resumed run's .hydra/*.yaml as they were before Hydra wrote this command's over them (put back if it is refused)
_RESUME_HYDRA_FILES: dict[str, bytes] = {}


def checkpoint_precision(path: Path) -> str | None:
    """The ``trainer.precision`` a checkpoint was trained in (recorded since ``trainer.precision=auto``), or ``None``
    where it holds none or cannot be read. Only the file's small pickle is read (tensors are mapped)."""
    import torch

    from .export import CHECKPOINT_KEY

    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get(CHECKPOINT_KEY) or {}
    except Exception:
        return None
    return state.get("precision")


def _held(folder: Path) -> str:
    """What ``folder`` holds, for a message: its checkpoints with their steps, and how to resume from the newest."""
    if not folder.is_dir():
        return f"{folder} does not exist"
    found = checkpoints_in(folder)
    if not found:
        return f"{folder} holds no checkpoint"
    shown = ", ".join(f"{p.name} (step {'?' if s is None else s})" for p, s in found)
    point = resume_point(folder)
    run = folder.parent if folder.name == "checkpoints" else folder
    hint = (f"; resume from the newest ({point[0].name}) with ckpt_path={run}" if point else
            "; none is past step 0 (the starting policy): nothing was trained to resume from")
    return f"{folder} holds {shown}{hint}"


def _say_how_to_resume(run_dir: Path, err: BaseException) -> None:
    """After training stopped on ``err``: the newest checkpoint of the run and the command that resumes from it."""
    how = "interrupted" if isinstance(err, (KeyboardInterrupt, SystemExit)) else f"stopped by {type(err).__name__}"
    point = resume_point(run_dir / "checkpoints")
    if point is None:
        log.error("training %s before any checkpoint past step 0 was written: nothing to resume from", how)
        return
    log.error("training %s; the newest checkpoint is %s (step %s). Resume with: polopt-train ckpt_path=%s", how,
              point[0], "?" if point[1] is None else point[1], run_dir)


def _wrote_outputs(run_dir: Path) -> bool:
    """Whether a run directory holds anything besides Hydra's ``.hydra/`` and its log files (``*.log``): a run that
    trained writes checkpoints, logs of its metrics or ``results.json``; one refused by a setting wrote none."""
    return any(entry.name != ".hydra" and not (entry.is_file() and entry.suffix == ".log")
               for entry in run_dir.iterdir())


def resume_overrides(argv: list[str]) -> list[str]:
    """The command line of a run, checked before Hydra writes anything into a run directory.

    - ``ckpt_path`` must exist; a refusal lists the checkpoints its folder holds. A folder (a run directory, its
      ``checkpoints/``) means its newest checkpoint (:func:`resume_point`), named in the run's log.
    - A checkpoint inside a ``polopt-train`` run (``<run>/checkpoints/<file>``) resumes with that run's configuration:
      the overrides it was started with (its ``.hydra/overrides.yaml``) are given again, those given now on top, and
      the result must equal the run's ``.hydra/config.yaml`` but for the keys given now (else it is refused, by key:
      a default that changed since the run). Without ``hydra.run.dir`` the run goes on in its own directory.
    - A new run (no ``ckpt_path``) is refused in a directory that holds a run already; one that holds only Hydra's
      files of a run that wrote nothing else (a setting refused) is taken, with a note.

    Every process that torchrun or SLURM started resumes alike (the same saved files give the same command line); the
    processes Lightning's launcher starts get the first one's command line already, and multiruns are left as they are.
    """
    from omegaconf import OmegaConf

    _RESUME.clear()
    _RESUME_HYDRA_FILES.clear()
    if any(a in ("-m", "--multirun") for a in argv) or any(a.startswith("hydra.job.name=") for a in argv):
        return argv
    external = _external_rank()
    first = external is None or external[0] == 0  # the others start once the first has written its run's files
    given = {_override_key(a): a.split("=", 1)[1] for a in argv if "=" in a}
    ckpt, run_dir = given.get("ckpt_path"), given.get("hydra.run.dir")
    if ckpt in (None, "null"):
        if first and run_dir and (Path(run_dir) / ".hydra" / "config.yaml").is_file():
            if _wrote_outputs(Path(run_dir)):
                raise SystemExit(f"polopt-train: hydra.run.dir={run_dir} holds a run already: resume it with "
                                 f"ckpt_path={run_dir}, or give another folder")
            _RESUME.update(note=f"hydra.run.dir={run_dir} holds only the configuration and log of a run that wrote "
                                "nothing else (refused before it began, or stopped while loading): this run replaces "
                                "its .hydra/ files")
        return argv
    if ckpt in _CKPT_KEYWORDS:
        return argv
    picked = ""  # which checkpoint a folder meant
    folder = checkpoint_folder(Path(ckpt))
    if folder is not None:
        point = resume_point(folder)
        if point is None:
            raise SystemExit(f"polopt-train: ckpt_path={ckpt}: no checkpoint to resume from: {_held(folder)} "
                             "(nothing was written)")
        picked = (f"ckpt_path={ckpt}: resuming from {point[0]} (step {'?' if point[1] is None else point[1]}), the "
                  f"newest of {', '.join(p.name for p, _ in checkpoints_in(folder))}; ")
        ckpt = str(point[0])
        argv = [a[: len(a) - len(a.lstrip("+"))] + f"ckpt_path={ckpt}" if _override_key(a) == "ckpt_path" else a
                for a in argv]
    elif not Path(ckpt).exists():
        raise SystemExit(f"polopt-train: ckpt_path={ckpt}: no such checkpoint; {_held(Path(ckpt).parent)} "
                         "(nothing was written)")
    source = Path(ckpt).resolve().parent.parent  # <run>/checkpoints/last.ckpt -> <run>
    saved = source / ".hydra"
    if not (saved / "overrides.yaml").is_file() or not (saved / "config.yaml").is_file():
        _RESUME.update(note=f"{picked}ckpt_path={ckpt} is not inside a polopt-train run directory (no "
                            f"{saved}/config.yaml): the configuration is the one composed from this command line")
        return argv
    now = [a for a in argv if "=" in a and not _override_key(a).startswith("hydra.")]
    replayed = [o for o in renamed(list(OmegaConf.load(saved / "overrides.yaml"))) if _override_key(o) not in given]
    differ = config_differences(OmegaConf.load(saved / "config.yaml"), [*replayed, *now],
                                {_override_key(a) for a in now})
    if differ:  # before Hydra writes the composed configuration over the saved one
        raise SystemExit(f"polopt-train: resuming {source}: the configuration composed now differs from the run's "
                         f".hydra/config.yaml at {len(differ)} key(s): {'; '.join(differ[:10])}. Give them on the "
                         "command line to resume with other values (nothing was written)")
    _RESUME.update(note=f"{picked}resuming the run in {source} with its saved configuration ({len(replayed)} overrides "
                        f"it was started with, replayed); given now: {', '.join(now) or 'nothing'}")
    extra = [] if run_dir else [f"hydra.run.dir={source}"]
    if first and (run_dir is None or Path(run_dir).resolve() == source):  # Hydra writes over them in a moment
        _RESUME_HYDRA_FILES.update({str(f): f.read_bytes() for f in saved.glob("*.yaml")})
    flags, given_now = _flags_apart(argv)  # Hydra takes its flags (--cfg job) before the overrides, not among them
    return [*flags, *replayed, *given_now, *extra]


# Hydra's flags that take a value (`--cfg job`, `-p PACKAGE`); `--info` may take one
_VALUED_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir",
                 "-cd", "--experimental-rerun", "--shell-completion", "-sc", "--info", "-i"}


def _flags_apart(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` as (Hydra's flags with their values, the overrides), each in its order."""
    flags: list[str] = []
    overrides: list[str] = []
    expect_value = False
    for arg in argv:
        if expect_value and not arg.startswith("-") and "=" not in arg:
            flags.append(arg)
        elif arg.startswith("-"):
            flags.append(arg)
        else:
            overrides.append(arg)
        expect_value = arg in _VALUED_FLAGS
    return flags, overrides


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def config_differences(saved: DictConfig, overrides: list[str], now: set[str]) -> list[str]:
    """``key: saved X, now Y`` for every key where ``train.yaml`` composed with ``overrides`` differs from ``saved``
    (a run's ``.hydra/config.yaml``; a moved key read under its new name), the keys given now (``now``, and
    everything under them) left out."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        composed = compose(config_name="train", overrides=overrides)
    flat = _flatten(OmegaConf.to_container(saved, resolve=False))
    # a moved key's saved value wins over what its new place held then (optimizer.lr was ${module.lr})
    before = {**{k: v for k, v in flat.items() if k not in MOVED_KEYS},
              **{MOVED_KEYS[k]: v for k, v in flat.items() if k in MOVED_KEYS}}
    before = {k: REWRITTEN_VALUES.get(k, {}).get(v, v) if isinstance(v, str) else v for k, v in before.items()}
    composed_plain = OmegaConf.to_container(composed, resolve=False)
    after = _flatten(composed_plain)

    def set_now(key: str) -> bool:
        return any(key == k or key.startswith(k + ".") for k in now)

    def added_since(key: str) -> bool:
        """A key the saved run's configuration did not hold: a group added since, or a setting whose default the code
        gives (conf/_schema) that it holds now unchanged."""
        if key in before:
            return False
        return key.split(".")[0] in NEW_GROUPS or code_default(composed_plain, key) == (True, after.get(key))

    keys = sorted(k for k in set(before) | set(after)
                  if not set_now(k) and not added_since(k) and before.get(k) != after.get(k))
    return [f"{k}: saved {before.get(k, '(absent)')!r}, now {after.get(k, '(absent)')!r}" for k in keys]


HELP = ["hydra.help.app_name=polopt-train",
        "hydra.help.header='polopt-train: RL post-training of language models (GRPO, GSPO and their variants) on "
        "Lightning.\n'",
        "hydra.help.footer='Every key, its default and what it does: docs/configuration.md. The configuration of a "
        "run: --cfg job.'"]


def _help_without_schemas() -> None:
    """``--help`` lists the groups a user chooses from: not ``_schema``, the code's defaults the options include
    (Hydra lists every folder of the config directory)."""
    from hydra._internal.hydra import Hydra

    listed = Hydra.format_config_groups

    def format_config_groups(self: Any, predicate: Any, compact: bool = True) -> str:
        return listed(self, lambda group: predicate(group) and not group.startswith("_"), compact)

    Hydra.format_config_groups = format_config_groups


def _name_close_keys() -> None:
    """An override of a key that does not exist (``trainer.max_step=4``) is refused by Hydra with only its way to add
    a new key (``use +trainer.max_step=4``), which leads a typo astray: the refusal names the closest existing key
    and the keys there instead, as for a mistyped ``+`` key (:func:`~polopt_lightning.settings.check_names`)."""
    import hydra._internal.utils as hydra_utils
    from hydra.errors import ConfigCompositionException

    from .settings import check_names

    report = hydra_utils.run_and_report

    def run_and_report(func: Any) -> Any:
        def composed() -> Any:
            try:
                return func()
            except ConfigCompositionException as err:
                cause = err.__cause__
                parent, key, full = (getattr(cause, name, None) for name in ("parent_node", "key", "full_key"))
                if not (str(err).startswith("Could not override") and hasattr(parent, "keys") and key and full):
                    raise
                new = str(err).split("use ", 1)[1] if "use +" in str(err) else f"+{full}=..."
                try:
                    check_names([str(key)], {str(k) for k in parent.keys()}, str(full)[:-len(str(key))].rstrip("."))
                except ValueError as refused:
                    raise ConfigCompositionException(f"polopt-train: {refused} (a key of your own: {new})") from None
                raise

        return report(composed)

    hydra_utils.run_and_report = run_and_report


def main() -> None:
    import os
    import sys

    # the folder the command runs in is importable, as under `python -m polopt_lightning` (whose sys.path starts with
    # it), so rollout.tools=[mytools.add] and reward functions' _target_ find a module beside the command; last, so a
    # file there cannot shadow an installed package
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    said: list[str] = []
    argv = renamed(sys.argv[1:], said)
    _name_close_keys()
    if "--help" in argv or "-h" in argv:
        _help_without_schemas()
        argv = [*argv, *HELP]
    if said:
        print(f"polopt-train: moved keys renamed: {', '.join(said)}", file=sys.stderr)
    sys.argv = [sys.argv[0], *launcher_overrides(resume_overrides(argv))]
    _hydra_main()


if __name__ == "__main__":
    main()
