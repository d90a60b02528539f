"""Weight schedules during training: task weights of a mixture, reward weights inside a task, the anchor's lambda.

Each has a pure part that turns a stream of metrics into weights (testable on synthetic statistics, no model) and a
Lightning callback that feeds it the run's metrics and applies the weights through a public setter:
``PromptDataModule.set_task_weights``, ``RewardComposer.set_weights`` / ``MixtureRewards.set_weights`` and the
anchor's ``lambda``. Their state travels in the checkpoint, so a resumed run continues with the same weights.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn

from .collapse import CollapseMonitor, CollapseRules

log = logging.getLogger("polopt_lightning")

TASK_WEIGHT_MODES = ("static", "signal", "progress")


def _finite(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


class TaskWeights:
    """Task weights from a stream of statistics, smoothed and floored.

    - ``static``: the prior weights throughout, as they are (``floor`` is for the adaptive modes).
    - ``signal``: each task by its share of groups whose rewards differ (``1 - train/<task>/frac_zero_std``): where
      the objective still gets a gradient. A task the policy has mastered (or cannot do at all) gives equal rewards in
      every group and so no gradient; its prompts move to tasks that still teach something.
    - ``progress``: each task by the absolute change of its validation accuracy between consecutive validations
      (``val/<task>/accuracy``): where learning (or forgetting) happens now.

    Each task's score is an exponential moving average (``smoothing``: the weight of a new observation; the first
    one is taken as it is); weights are ``prior x score`` normalised, then mixed with the uniform share so none falls
    below ``floor``: ``w = floor + (1 - K x floor) x normalised``. Before any observation, and when every score is 0,
    the weights are the prior, floored.

    Args:
        names: the tasks.
        mode: ``static`` | ``signal`` | ``progress``.
        smoothing: EMA weight of a new observation, in (0, 1].
        floor: the least weight of a task in the adaptive modes, in [0, 1 / K] (not used by ``static``).
        prior: task -> starting weight (default equal); normalised.
    """

    def __init__(self, names: Sequence[str], mode: str = "static", smoothing: float = 0.3, floor: float = 0.1,
                 prior: Mapping[str, float] | None = None) -> None:
        self.names = list(names)
        if not self.names:
            raise ValueError("task weights need at least one task")
        if mode not in TASK_WEIGHT_MODES:
            raise ValueError(f"weights.tasks.mode must be one of {TASK_WEIGHT_MODES}, got {mode!r}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"weights.tasks.smoothing must be in (0, 1], got {smoothing}")
        if mode != "static" and not 0 <= floor <= 1 / len(self.names):
            raise ValueError(f"weights.tasks.floor must be in [0, 1/{len(self.names)}] for {len(self.names)} tasks, "
                             f"got {floor}")
        prior = {n: 1.0 for n in self.names} if prior is None else {n: float(prior.get(n, 0.0)) for n in self.names}
        if any(not math.isfinite(w) or w < 0 for w in prior.values()) or sum(prior.values()) <= 0:
            raise ValueError(f"task prior weights must be finite, >= 0 and not all 0, got {prior}")
        self.mode, self.smoothing, self.floor = mode, float(smoothing), float(floor)
        total = sum(prior.values())
        self.prior = {n: w / total for n, w in prior.items()}
        self.scores: dict[str, float] = {}  # the EMA of each task's statistic
        self.last_accuracy: dict[str, float] = {}  # progress: each task's previous validation accuracy

    def _update(self, name: str, value: float) -> None:
        old = self.scores.get(name)
        self.scores[name] = value if old is None else (1 - self.smoothing) * old + self.smoothing * value

    def observe_step(self, metrics: Mapping[str, Any]) -> bool:
        """One training step's metrics; returns whether a score moved (``signal`` reads ``train/<task>/frac_zero_std``,
        NaN or missing for a task with no prompt in the step, which keeps its score)."""
        if self.mode != "signal":
            return False
        moved = False
        for name in self.names:
            frac = _finite(metrics.get(f"train/{name}/frac_zero_std"))
            if frac is not None:
                self._update(name, 1.0 - frac)
                moved = True
        return moved

    def observe_validation(self, metrics: Mapping[str, Any]) -> bool:
        """One validation's metrics (``val/<task>/accuracy``); returns whether a score moved (``progress``)."""
        if self.mode != "progress":
            return False
        moved = False
        for name in self.names:
            accuracy = _finite(metrics.get(f"val/{name}/accuracy"))
            if accuracy is None:
                continue
            if name in self.last_accuracy:
                self._update(name, abs(accuracy - self.last_accuracy[name]))
                moved = True
            self.last_accuracy[name] = accuracy
        return moved

    @property
    def weights(self) -> dict[str, float]:
        """The current weights (sum 1; in the adaptive modes each at least ``floor``)."""
        raw = dict(self.prior)
        if self.mode == "static":
            return raw
        if self.mode != "static" and self.scores:
            # a task not yet observed counts at the mean score of those observed
            mean = sum(self.scores.values()) / len(self.scores)
            raw = {n: self.prior[n] * max(self.scores.get(n, mean), 0.0) for n in self.names}
            if sum(raw.values()) <= 0:
                raw = dict(self.prior)
        total = sum(raw.values())
        k = len(self.names)
        return {n: self.floor + (1 - k * self.floor) * raw[n] / total for n in self.names}

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "scores": dict(self.scores), "last_accuracy": dict(self.last_accuracy)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("mode") != self.mode:
            log.warning("task weights: the checkpoint's were computed in mode %r, this run uses %r: their scores are "
                        "taken over", state.get("mode"), self.mode)
        unknown = sorted(set(state["scores"]) - set(self.names))
        if unknown:
            raise ValueError(f"the checkpoint's task weights name tasks {unknown} this run does not have")
        self.scores = {k: float(v) for k, v in state["scores"].items()}
        self.last_accuracy = {k: float(v) for k, v in state["last_accuracy"].items()}


def _log(trainer: L.Trainer, values: Mapping[str, float]) -> None:
    """Metrics at the step the training metrics of this rollout are logged at (as the collapse monitor's)."""
    for logger in trainer.loggers:
        logger.log_metrics(dict(values), step=trainer.fit_loop.epoch_loop._batches_that_stepped)


class TaskWeightScheduler(L.Callback):
    """Moves a task mixture's weights during training (:class:`TaskWeights` rules) and applies them through
    ``trainer.datamodule.set_task_weights``: the batches fetched from then on draw that many prompts of each task
    (Lightning fetches one batch ahead, so a change shows in the batch after next). Logs ``weights/<task>`` at every
    step; the scores are in the checkpoint.

    Args:
        mode, smoothing, floor: see :class:`TaskWeights`; the prior is the mixture's own ``weights``.
    """

    def __init__(self, mode: str = "static", smoothing: float = 0.3, floor: float = 0.1) -> None:
        if mode not in TASK_WEIGHT_MODES:
            raise ValueError(f"weights.tasks.mode must be one of {TASK_WEIGHT_MODES}, got {mode!r}")
        self.mode, self.smoothing, self.floor = mode, smoothing, floor
        self.rule: TaskWeights | None = None
        self._restored: dict[str, Any] | None = None

    def check(self, names: Any, prior: Any) -> None:
        """The settings against the tasks (``floor`` at most 1 / their number) before anything trains."""
        TaskWeights(names, self.mode, self.smoothing, self.floor, prior=prior)

    def _datamodule(self, trainer: L.Trainer) -> Any:
        dm = trainer.datamodule
        if dm is None or getattr(dm, "mixture", None) is None:
            raise ValueError("TaskWeightScheduler needs a PromptDataModule over a TaskMixture (task=mixture in the CLI)")
        return dm

    def _rule(self, trainer: L.Trainer) -> TaskWeights:
        if self.rule is None:
            dm = self._datamodule(trainer)
            self.rule = TaskWeights(dm.task_names, self.mode, self.smoothing, self.floor, prior=dm.mixture.weights)
            if self._restored is not None:
                self.rule.load_state_dict(self._restored)
                self._restored = None
        return self.rule

    def _apply(self, trainer: L.Trainer) -> dict[str, float]:
        weights = self._rule(trainer).weights
        self._datamodule(trainer).set_task_weights(weights)
        return weights

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.mode != "static" and not hasattr(getattr(pl_module, "rewards", None), "tasks"):
            raise ValueError(f"TaskWeightScheduler(mode={self.mode!r}) reads each task's metrics, which only a task "
                             "mixture's rewards log: give the module reward_fns=mixture.rewards(...) (TaskMixture."
                             "rewards), not one composer or list for every task")
        self._apply(trainer)  # the prior, or a resumed run's weights, before the first batch is drawn

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        self._rule(trainer).observe_step(trainer.callback_metrics)
        weights = self._apply(trainer)
        _log(trainer, {f"weights/{name}": w for name, w in weights.items()})

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.datamodule is None:
            return
        # a validation before training (polopt-train's "before") is the first one progress compares with
        if trainer.state.fn != TrainerFn.FITTING and trainer.global_step != 0:
            return
        if self._rule(trainer).observe_validation(trainer.callback_metrics) and trainer.state.fn == TrainerFn.FITTING:
            self._apply(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {} if self.rule is None else self.rule.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.rule is not None:
            self.rule.load_state_dict(state_dict)
        else:
            self._restored = dict(state_dict)


class RewardWeights:
    """Reward weights that fade as a function is learned: a function's weight goes from its starting value to
    ``floor x`` that value as the EMA of its batch mean (``train/rewards/<name>/mean``) rises from ``start`` to
    ``end``, linearly (e.g. a format reward that matters until the format is learned, then gives way to
    correctness). ``start > end`` makes a weight grow instead as the mean falls.

    Args:
        base: function name -> starting weight (all of the composer's functions).
        fade: function name -> ``{"start": mean where fading starts, "end": mean where it is done, "floor": the
            final fraction of the starting weight (default 0)}``.
        smoothing: EMA weight of a new observation, in (0, 1].
    """

    def __init__(self, base: Mapping[str, float], fade: Mapping[str, Mapping[str, float]],
                 smoothing: float = 0.3) -> None:
        self.base = {k: float(v) for k, v in base.items()}
        unknown = sorted(set(fade) - set(self.base))
        if unknown:
            raise ValueError(f"weights.rewards.fade names unknown reward functions {unknown}; known: {sorted(self.base)}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"weights.rewards.smoothing must be in (0, 1], got {smoothing}")
        self.fade: dict[str, dict[str, float]] = {}
        for name, rule in fade.items():
            extra = sorted(set(rule) - {"start", "end", "floor"})
            if extra or "start" not in rule or "end" not in rule:
                raise ValueError(f"weights.rewards.fade.{name} needs start and end (and optionally floor), got "
                                 f"{dict(rule)}")
            start, end, floor = float(rule["start"]), float(rule["end"]), float(rule.get("floor", 0.0))
            if start == end or not 0 <= floor <= 1:
                raise ValueError(f"weights.rewards.fade.{name}: start must differ from end and floor be in [0, 1], got "
                                 f"{dict(rule)}")
            self.fade[name] = {"start": start, "end": end, "floor": floor}
        self.smoothing = float(smoothing)
        self.means: dict[str, float] = {}

    def observe_step(self, metrics: Mapping[str, Any]) -> bool:
        moved = False
        for name in self.fade:
            value = _finite(metrics.get(f"train/rewards/{name}/mean"))
            if value is not None:
                old = self.means.get(name)
                self.means[name] = value if old is None else (1 - self.smoothing) * old + self.smoothing * value
                moved = True
        return moved

    @property
    def weights(self) -> dict[str, float]:
        out = dict(self.base)
        for name, rule in self.fade.items():
            if name not in self.means:
                continue
            progress = min(1.0, max(0.0, (self.means[name] - rule["start"]) / (rule["end"] - rule["start"])))
            out[name] = self.base[name] * (1 - (1 - rule["floor"]) * progress)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"means": dict(self.means), "base": dict(self.base)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.means = {k: float(v) for k, v in state["means"].items()}
        self.base = {k: float(v) for k, v in state["base"].items()}


def _logged_name(rewards: Any, name: str) -> str:
    """The name the module's rewards log the function ``name`` under (a key of ``reward.functions`` -> its function's
    name); ``name`` itself when they do not know it (:class:`RewardWeights` then refuses it, listing the names)."""
    try:
        return rewards.resolve(name) if name not in rewards.names else name
    except (AttributeError, ValueError):
        return name


class RewardWeightScheduler(L.Callback):
    """Fades reward weights (:class:`RewardWeights`) through ``pl_module.rewards.set_weights`` after every step; logs
    ``reward_weights/<name>``. The names are those of the module's rewards (``<task>/<function>`` in a mixture).

    Args:
        fade: function key or name (``reward.functions.<key>``; ``<task>/<function>`` in a mixture) -> ``{start, end,
            floor}`` (see :class:`RewardWeights`); logged under the function's name.
        smoothing: EMA weight of a new observation.
    """

    def __init__(self, fade: Mapping[str, Mapping[str, float]], smoothing: float = 0.3) -> None:
        self.fade = {k: dict(v) for k, v in fade.items()}
        self.smoothing = smoothing
        self.rule: RewardWeights | None = None
        self._restored: dict[str, Any] | None = None

    def _rule(self, pl_module: L.LightningModule) -> RewardWeights:
        if self.rule is None:
            rewards = pl_module.rewards
            fade = {_logged_name(rewards, k): v for k, v in self.fade.items()}
            self.rule = RewardWeights(dict(zip(rewards.names, rewards.weights.tolist())), fade, self.smoothing)
            if self._restored is not None:
                self.rule.load_state_dict(self._restored)
                self._restored = None
        return self.rule

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._rule(pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        rule = self._rule(pl_module)
        rule.observe_step(trainer.callback_metrics)
        weights = rule.weights
        pl_module.rewards.set_weights(weights)
        _log(trainer, {f"reward_weights/{name}": weights[name] for name in rule.fade})

    def state_dict(self) -> dict[str, Any]:
        return {} if self.rule is None else self.rule.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._restored = dict(state_dict)
            self.rule = None


class AnchorScheduler(L.Callback):
    """Runs the module's :class:`~polopt_lightning.objectives.SupervisedAnchor` schedule: ``constant`` and
    ``linear-decay`` from the step count before each step; ``adaptive`` after each step and validation from the
    collapse events of that step (the run's :class:`CollapseMonitor` when it has one; otherwise the same rules at
    their default settings, run here). The module logs the ``lambda`` of each step as ``train/anchor_coef``; it is in
    the module's checkpoint.
    :class:`~polopt_lightning.PolicyOptimizationModule` adds one itself when it has an anchor.
    """

    def __init__(self) -> None:
        self.rules: CollapseRules | None = None  # the rules run here when the trainer has no monitor
        self._seen = 0  # events of the monitor already counted
        self._restored: dict[str, Any] | None = None
        self._rollouts = 0

    @staticmethod
    def _monitor(trainer: L.Trainer) -> CollapseMonitor | None:
        return next((c for c in trainer.callbacks if isinstance(c, CollapseMonitor)), None)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        monitor = self._monitor(trainer)
        if monitor is not None:
            self._seen = len(monitor.events)
        elif self.rules is None:
            self.rules = CollapseRules()
            if self._restored is not None:
                self.rules.load_state_dict(self._restored)
        self._restored = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        anchor = pl_module.anchor
        anchor.at_step(trainer.global_step, trainer.max_steps if trainer.max_steps > 0 else None)

    def _events(self, trainer: L.Trainer, found: int) -> None:
        value = trainer.lightning_module.anchor.observe(found)
        if found:
            log.info("anchor: %d collapse event(s) at step %d: lambda raised to %.4g", found, trainer.global_step, value)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        if pl_module.anchor.schedule == "adaptive":
            self._rollouts += 1
            monitor = self._monitor(trainer)
            if monitor is not None:
                found, self._seen = len(monitor.events) - self._seen, len(monitor.events)
            else:
                metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
                found = len(self.rules.observe_step(trainer.global_step, self._rollouts, metrics))
            self._events(trainer, found)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        anchor = getattr(pl_module, "anchor", None)
        if anchor is None or anchor.schedule != "adaptive" or trainer.sanity_checking:
            return
        if trainer.state.fn != TrainerFn.FITTING:
            return
        monitor = self._monitor(trainer)
        if monitor is not None:  # its validation events: counted at the next step (callbacks run in order)
            return
        if self.rules is not None:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
            found = self.rules.observe_validation(trainer.global_step, self._rollouts, metrics)
            if found:  # raised as at a step with events (no relaxing here: a validation is not a step)
                self._events(trainer, len(found))

    def state_dict(self) -> dict[str, Any]:
        return {"rules": self.rules.state_dict() if self.rules is not None else None, "rollouts": self._rollouts}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict.get("rules")
        self._rollouts = int(state_dict.get("rollouts", 0))
