"""CollapseMonitor: see a collapse coming (entropy, KL, gradient, ratio, length, signal, reward and accuracy rules) and
answer it (warn, stop, or roll back to the last healthy state).

The rules are a pure class, :class:`CollapseRules`, fed one step's metrics or one validation's at a time: testable on a
synthetic stream, without a model. :class:`CollapseMonitor` is the Lightning callback that feeds it from
``trainer.callback_metrics``, logs each event (``collapse/<rule>`` and a line of ``events.jsonl``), keeps the last
healthy state (weights and optimizer) and restores it on a ``rollback``.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn

log = logging.getLogger(__name__)

ACTIONS = ("warn", "stop", "rollback")
#: every rule, the metric it reads, and its default action
RULES = {
    "nonfinite": ("train/skipped_updates", "warn"),
    "entropy_collapse": ("train/entropy", "warn"),
    "kl_spike": ("train/kl", "warn"),
    "grad_norm_spike": ("train/grad_norm", "warn"),
    "ratio_extreme": ("train/ratio_max", "warn"),
    "length_collapse": ("train/completion_len", "warn"),
    "length_explosion": ("train/completion_len", "warn"),
    "zero_signal": ("train/frac_zero_std", "warn"),
    "reward_drop": ("train/reward", "warn"),
    "val_drop": ("val/accuracy", "warn"),
}


@dataclass
class CollapseEvent:
    """One rule firing: where (optimizer step, rollout), what it saw, and what was done."""

    step: int
    rollout: int
    rule: str
    metric: str
    value: float
    threshold: float
    action: str
    message: str
    #: for a rollback: the rollout whose state came back
    restored_rollout: int | None = None


@dataclass
class CollapseRules:
    """The rules, with their thresholds (defaults documented in ``conf/callbacks/default.yaml``).

    A rule fires when its condition has held for ``patience`` consecutive observations, then stays quiet until the
    condition clears (one event per episode, not one per step). The "start" of a metric is the median of its first
    ``warmup_steps`` values; a "spike" is a value above ``factor`` times the median of the last ``window`` values
    (needs ``warmup_steps`` of them).

    Attributes:
        warmup_steps: observations that set a metric's start and that a spike median needs.
        window: observations in the running median of the spike rules and the reward's moving mean.
        patience: consecutive observations a step rule's condition must hold to fire.
        entropy_floor: ``entropy_collapse`` when entropy < this fraction of its start.
        kl_factor, kl_min: ``kl_spike`` when KL > factor x its running median and > kl_min.
        grad_norm_factor: ``grad_norm_spike`` when the gradient norm > factor x its running median.
        ratio_limit: ``ratio_extreme`` when the largest importance ratio of a step exceeds it.
        length_low, length_high: ``length_collapse`` / ``length_explosion`` when the mean completion length falls
            below / rises above these fractions of its start.
        zero_signal_limit: ``zero_signal`` when at least this share of groups has equal rewards (no gradient).
        reward_margin: ``reward_drop`` when the reward's moving mean falls this far (in reward units) below its best.
        val_margin, val_patience: ``val_drop`` when validation accuracy is this far below its best for this many
            validations in a row.
        actions: rule -> ``warn`` | ``stop`` | ``rollback`` (missing rules: their default in :data:`RULES`).
    """

    warmup_steps: int = 5
    window: int = 20
    patience: int = 3
    entropy_floor: float = 0.3
    kl_factor: float = 10.0
    kl_min: float = 0.1
    grad_norm_factor: float = 10.0
    ratio_limit: float = 10.0
    length_low: float = 0.3
    length_high: float = 3.0
    zero_signal_limit: float = 0.95
    reward_margin: float = 0.3
    val_margin: float = 0.05
    val_patience: int = 2
    actions: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, value in self.actions.items():
            if key not in RULES:
                raise ValueError(f"callbacks.collapse.actions.{key}: unknown rule; rules: {', '.join(RULES)}")
            if value not in ACTIONS:
                raise ValueError(f"callbacks.collapse.actions.{key}={value!r}: must be one of {ACTIONS}")
        for key in ("warmup_steps", "window", "patience", "val_patience"):
            if getattr(self, key) < 1:
                raise ValueError(f"callbacks.collapse.{key} must be >= 1, got {getattr(self, key)}")
        self.actions = {rule: self.actions.get(rule, default) for rule, (_, default) in RULES.items()}
        self.reset()

    # ---------------------------------------------------------------------------------------------------------
    def reset(self, keep_best: bool = True) -> None:
        """Forget the histories (after a rollback, the restored policy starts a new stream); the best validation and
        the starts stay unless ``keep_best=False``."""
        best = getattr(self, "best_val", None) if keep_best else None
        starts = getattr(self, "starts", {}) if keep_best else {}
        self.history: dict[str, deque] = {}
        self.first: dict[str, list[float]] = {k: [] for k in ("train/entropy", "train/completion_len")}
        self.starts: dict[str, float] = dict(starts)
        self.streak: dict[str, int] = {rule: 0 for rule in RULES}
        self.active: dict[str, bool] = {rule: False for rule in RULES}
        self.best_reward: float | None = None
        self.best_val: float | None = best

    def _median(self, key: str) -> float | None:
        values = self.history.get(key)
        return statistics.median(values) if values and len(values) >= self.warmup_steps else None

    def _push(self, key: str, value: float) -> None:
        self.history.setdefault(key, deque(maxlen=self.window)).append(value)

    def _start(self, key: str, value: float) -> float | None:
        if key not in self.starts:
            self.first.setdefault(key, []).append(value)
            if len(self.first[key]) >= self.warmup_steps:
                self.starts[key] = statistics.median(self.first[key])
        return self.starts.get(key)

    def _check(self, rule: str, holds: bool, value: float, threshold: float, step: int, rollout: int,
               message: str, patience: int | None = None) -> CollapseEvent | None:
        self.streak[rule] = self.streak[rule] + 1 if holds else 0
        if not holds:
            self.active[rule] = False
            return None
        if self.active[rule] or self.streak[rule] < (patience or self.patience):
            return None
        self.active[rule] = True
        return CollapseEvent(step, rollout, rule, RULES[rule][0], float(value), float(threshold),
                             self.actions[rule], message)

    # ---------------------------------------------------------------------------------------------------------
    def observe_step(self, step: int, rollout: int, metrics: Mapping[str, float]) -> list[CollapseEvent]:
        """The events one training step's metrics raise (metrics absent from the step are skipped)."""
        events: list[CollapseEvent | None] = []
        get = {k: float(v) for k, v in metrics.items()}
        loss = get.get("train/loss", 0.0)
        skipped = get.get("train/skipped_updates", 0.0)
        bad = skipped > 0 or not math.isfinite(loss)
        events.append(self._check("nonfinite", bad, skipped if math.isfinite(loss) else loss, 0.0, step, rollout,
                                  f"non-finite loss or gradient: {skipped:g} update(s) skipped", patience=1))
        if bad:  # a non-finite step says nothing about the other signals
            return [e for e in events if e]
        if "train/entropy" in get:
            value = get["train/entropy"]
            start = self._start("train/entropy", value)
            if start is not None:
                floor = self.entropy_floor * start
                events.append(self._check("entropy_collapse", value < floor, value, floor, step, rollout,
                                          f"entropy {value:.4g} < {self.entropy_floor:g} x its start {start:.4g}"))
        for rule, key, factor, minimum in (("kl_spike", "train/kl", self.kl_factor, self.kl_min),
                                           ("grad_norm_spike", "train/grad_norm", self.grad_norm_factor, 0.0)):
            if key not in get or (key == "train/grad_norm" and get[key] == 0):
                continue  # a step without a learning signal (every group's rewards equal) has no gradient to compare,
                # and its zeros would drag the running median to 0, making any later gradient a "spike"
            value, median = get[key], self._median(key)
            if median is not None:
                threshold = max(factor * median, minimum)
                events.append(self._check(rule, value > threshold, value, threshold, step, rollout,
                                          f"{key} {value:.4g} > {factor:g} x its running median {median:.4g}",
                                          patience=1))
            self._push(key, value)
        if "train/ratio_max" in get:
            value = get["train/ratio_max"]
            events.append(self._check("ratio_extreme", value > self.ratio_limit, value, self.ratio_limit, step,
                                      rollout, f"importance ratio {value:.4g} > {self.ratio_limit:g}", patience=1))
        if "train/completion_len" in get:
            value = get["train/completion_len"]
            start = self._start("train/completion_len", value)
            if start is not None:
                low, high = self.length_low * start, self.length_high * start
                events.append(self._check("length_collapse", value < low, value, low, step, rollout,
                                          f"mean completion length {value:.4g} < {self.length_low:g} x its start "
                                          f"{start:.4g}"))
                events.append(self._check("length_explosion", value > high, value, high, step, rollout,
                                          f"mean completion length {value:.4g} > {self.length_high:g} x its start "
                                          f"{start:.4g}"))
        if "train/frac_zero_std" in get:
            value = get["train/frac_zero_std"]
            events.append(self._check("zero_signal", value >= self.zero_signal_limit, value, self.zero_signal_limit,
                                      step, rollout, f"{value:.0%} of the groups have equal rewards (no gradient)",
                                      patience=self.window))
        if "train/reward" in get:
            self._push("train/reward", get["train/reward"])
            values = self.history["train/reward"]
            if len(values) >= self.window:
                mean = sum(values) / len(values)
                self.best_reward = mean if self.best_reward is None else max(self.best_reward, mean)
                threshold = self.best_reward - self.reward_margin
                events.append(self._check("reward_drop", mean < threshold, mean, threshold, step, rollout,
                                          f"reward moving mean {mean:.4g} < its best {self.best_reward:.4g} - "
                                          f"{self.reward_margin:g}", patience=1))
        return [e for e in events if e]

    def observe_validation(self, step: int, rollout: int, metrics: Mapping[str, float]) -> list[CollapseEvent]:
        """The events one validation raises (``val/accuracy`` against its best so far)."""
        if "val/accuracy" not in metrics:
            return []
        value = float(metrics["val/accuracy"])
        self.best_val = value if self.best_val is None else max(self.best_val, value)
        threshold = self.best_val - self.val_margin
        event = self._check("val_drop", value < threshold, value, threshold, step, rollout,
                            f"val/accuracy {value:.4g} < its best {self.best_val:.4g} - {self.val_margin:g} for "
                            f"{self.val_patience} validation(s)", patience=self.val_patience)
        return [event] if event else []

    def healthy(self) -> bool:
        """No rule in violation: the state may be kept as the one to roll back to."""
        return not any(self.streak.values())

    # ---------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"history": {k: list(v) for k, v in self.history.items()}, "first": self.first,
                "starts": self.starts, "streak": self.streak, "active": self.active,
                "best_reward": self.best_reward, "best_val": self.best_val}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = {k: deque(v, maxlen=self.window) for k, v in state["history"].items()}
        self.first = {k: list(v) for k, v in state["first"].items()}
        self.starts = dict(state["starts"])
        self.streak = {**{rule: 0 for rule in RULES}, **state["streak"]}
        self.active = {**{rule: False for rule in RULES}, **state["active"]}
        self.best_reward, self.best_val = state["best_reward"], state["best_val"]


class CollapseMonitor(L.Callback):
    """Watch a :class:`~polopt_lightning.PolicyOptimizationModule` run for collapse and answer it.

    After every training step its metrics go through :class:`CollapseRules`; after every validation during ``fit``,
    ``val/accuracy``. Each event is logged (``collapse/<rule>`` = 1 at its step, and ``collapse/events`` /
    ``collapse/rollbacks`` totals), written as a line of ``<dirpath>/events.jsonl``, and acted on:

    - ``warn``: a warning in the log;
    - ``stop``: ``trainer.should_stop`` (the run ends after this step, checkpoints and logs kept);
    - ``rollback``: the weights and optimizer state of the last healthy point (the start of training, then every
      validation at which no rule was in violation) come back, the learning rate is scaled by ``lr_scale`` (peak and
      schedule), and training continues; after ``max_rollbacks`` of them the next rollback stops the run instead.

    The monitor's state (histories, best values, rollbacks) is part of the checkpoint; the healthy state is kept in
    CPU memory (a copy of the trainable weights and of the optimizer state).

    Args:
        dirpath: folder of ``events.jsonl`` (``None``: no file, events are still logged).
        rules: :class:`CollapseRules` fields (thresholds and ``actions``).
        lr_scale: learning-rate factor applied at each rollback.
        max_rollbacks: rollbacks allowed before a rollback stops the run.
    """

    def __init__(self, dirpath: str | Path | None = None, lr_scale: float = 0.5, max_rollbacks: int = 2,
                 **rules: Any) -> None:
        if not 0 < lr_scale <= 1:
            raise ValueError(f"callbacks.collapse.lr_scale must be in (0, 1], got {lr_scale}")
        if max_rollbacks < 0:
            raise ValueError(f"callbacks.collapse.max_rollbacks must be >= 0, got {max_rollbacks}")
        self.rules = CollapseRules(**rules)
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.lr_scale, self.max_rollbacks = lr_scale, max_rollbacks
        self.rollbacks = 0
        self.rollouts = 0
        self.events: list[CollapseEvent] = []
        self._healthy: dict[str, Any] | None = None

    # ---------------------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._healthy is None:
            self.keep_healthy(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        self.rollouts += 1
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
        self.handle(trainer, pl_module, self.rules.observe_step(trainer.global_step, self.rollouts, metrics))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if trainer.state.fn != TrainerFn.FITTING:
            # a validation before any training (polopt-train's "before") is the first best: accuracy that falls
            # below the starting model's is a collapse too. Other validate() runs are not part of the stream.
            if trainer.global_step == 0 and self.rules.best_val is None and "val/accuracy" in trainer.callback_metrics:
                self.rules.best_val = float(trainer.callback_metrics["val/accuracy"])
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        events = self.rules.observe_validation(trainer.global_step, self.rollouts, metrics)
        self.handle(trainer, pl_module, events)
        if not events and self.rules.healthy():
            self.keep_healthy(trainer, pl_module)

    # ---------------------------------------------------------------------------------------------------------
    def handle(self, trainer: L.Trainer, pl_module: L.LightningModule, events: list[CollapseEvent]) -> None:
        """Act on ``events`` (from :attr:`rules`): warn, stop the run, or roll back to the last healthy point (a stop
        once ``max_rollbacks`` are spent); each one logged and appended to ``events.jsonl``."""
        for event in events:
            if event.action == "rollback" and self.rollbacks >= self.max_rollbacks:
                event.action = "stop"
                event.message += f" (rollback limit {self.max_rollbacks} reached: stopping)"
            self.events.append(event)
            if event.action == "warn":
                log.warning("collapse monitor, step %d: %s [%s]", event.step, event.message, event.rule)
            elif event.action == "stop":
                log.warning("collapse monitor, step %d: %s [%s]: stopping", event.step, event.message, event.rule)
                trainer.should_stop = True
            else:
                self._rollback(trainer, pl_module, event)
            self._record(trainer, pl_module, event)

    def _record(self, trainer: L.Trainer, pl_module: L.LightningModule, event: CollapseEvent) -> None:
        values = {f"collapse/{event.rule}": 1.0, "collapse/events": float(len(self.events)),
                  "collapse/rollbacks": float(self.rollbacks)}
        for logger in trainer.loggers:  # at the step the training metrics of this rollout are logged at
            logger.log_metrics(values, step=trainer.fit_loop.epoch_loop._batches_that_stepped)
        if self.dirpath is not None and trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            with open(self.dirpath / "events.jsonl", "a") as fh:
                fh.write(json.dumps({**asdict(event), "time": time.time()}) + "\n")

    def keep_healthy(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Keep a CPU copy of the trainable weights and of the optimizer state: the point a rollback returns to (taken
        after each healthy validation)."""
        params = {n: p.detach().to("cpu", copy=True) for n, p in pl_module.named_parameters() if p.requires_grad}
        optimizers = [_cpu_copy(opt.optimizer.state_dict() if hasattr(opt, "optimizer") else opt.state_dict())
                      for opt in trainer.optimizers]
        self._healthy = {"params": params, "optimizers": optimizers, "step": trainer.global_step,
                         "rollout": self.rollouts}

    def _rollback(self, trainer: L.Trainer, pl_module: L.LightningModule, event: CollapseEvent) -> None:
        assert self._healthy is not None
        with torch.no_grad():
            for name, param in pl_module.named_parameters():
                if name in self._healthy["params"]:
                    param.copy_(self._healthy["params"][name].to(param.device))
        replaced = getattr(pl_module, "policy_replaced", None)
        if callable(replaced):  # a backend with weights of its own syncs them; stale rollouts in flight are dropped
            replaced()
        for optimizer, state in zip(trainer.optimizers, self._healthy["optimizers"]):
            optimizer.load_state_dict(state)
            for group in optimizer.param_groups:
                group["lr"] *= self.lr_scale
                if "initial_lr" in group:
                    group["initial_lr"] *= self.lr_scale
        for config in trainer.lr_scheduler_configs:  # the schedule computes from its base rates: scale them too
            scheduler = config.scheduler
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * self.lr_scale for lr in scheduler.base_lrs]
        self.rollbacks += 1
        event.restored_rollout = self._healthy["rollout"]
        self.rules.reset(keep_best=True)
        log.warning("collapse monitor, step %d: %s [%s]: rolled back to the state of step %d, learning rate x%g "
                    "(rollback %d of %d)", event.step, event.message, event.rule, self._healthy["step"],
                    self.lr_scale, self.rollbacks, self.max_rollbacks)

    # ---------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"rules": self.rules.state_dict(), "rollbacks": self.rollbacks, "rollouts": self.rollouts,
                "events": [asdict(e) for e in self.events]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rules.load_state_dict(state_dict["rules"])
        self.rollbacks, self.rollouts = int(state_dict["rollbacks"]), int(state_dict["rollouts"])
        self.events = [CollapseEvent(**e) for e in state_dict["events"]]


def _cpu_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cpu_copy(v) for v in value]
    return value
