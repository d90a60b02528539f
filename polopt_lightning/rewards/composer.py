"""Reward protocol and :class:`RewardComposer`: runs reward functions, checks what they return, weights them."""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

ON_ERROR = ("raise", "none")
#: how the functions' rewards become one: their weighted sum, or each normalised within its group first (GDPO)
AGGREGATIONS = ("sum", "normalize_each")
# a group whose rewards from one function spread less than this carries none of its signal
_FLAT = 1e-6


@runtime_checkable
class RewardFunction(Protocol):
    """TRL's reward convention, so existing reward functions work unchanged.

    ``fn(prompts, completions, **columns) -> list[float | None]``. For a dataset of chat prompts ``prompts`` are
    lists of messages and each completion is ``[{"role": "assistant", "content": text}]``; otherwise both are
    strings. ``columns`` holds every extra dataset column (one value per completion), ``completion_ids`` and
    ``trainer_state`` (a :class:`TrainerState`). ``None`` means "not applicable to this sample". The function may be
    ``async``. For a multi-turn completion a value may be a list, one reward per policy turn (``None`` for none): the
    completion's reward is their sum, and per-turn credit (``experience.turn_credit=turn``) gives each to its turn.
    """

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]: ...


@dataclass(frozen=True)
class TrainerState:
    """Where training stands, passed to every reward function as ``trainer_state`` (the attributes TRL's reward
    functions read from ``transformers.TrainerState``), e.g. to ramp a reward over training.

    Attributes:
        global_step: optimizer steps taken so far.
        epoch: epochs completed so far.
        max_steps: the planned number of steps (-1: bounded by epochs).
        num_train_epochs: the planned number of epochs (``None`` or -1: bounded by steps).
        stage: ``"train"`` (a training step's rollouts), ``"validate"`` or ``"none"`` (outside a Trainer).
        is_world_process_zero: whether this is the first process.
    """

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = -1
    num_train_epochs: int | None = None
    stage: str = "train"
    is_world_process_zero: bool = True

    @classmethod
    def of(cls, trainer: Any) -> TrainerState:
        """Where ``trainer`` (a Lightning Trainer) stands; ``stage="none"`` without one."""
        if trainer is None:
            return cls(stage="none")
        return cls(global_step=trainer.global_step, epoch=float(trainer.current_epoch), max_steps=trainer.max_steps,
                   num_train_epochs=trainer.max_epochs, stage="train" if trainer.training else "validate",
                   is_world_process_zero=trainer.is_global_zero)


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable; the message names the function and sample."""


def reward_name(fn: Callable) -> str:
    """The name a reward function is logged under: ``__name__``, the wrapped function's, or the class name."""
    for obj in (fn, getattr(fn, "func", None)):
        name = getattr(obj, "__name__", None)
        if isinstance(name, str) and name != "<lambda>":
            return name
    return type(fn).__name__ if not inspect.isfunction(fn) else "reward"


def _unique_names(fns: Sequence[Callable]) -> list[str]:
    names: list[str] = []
    for fn in fns:
        base = reward_name(fn)
        name, k = base, 1
        while name in names:
            k += 1
            name = f"{base}_{k}"
        names.append(name)
    return names


def _run_coroutines(coros: list[Awaitable]) -> list[Any]:
    """Run coroutines concurrently, also when the caller already sits in an event loop (a notebook)."""

    async def gather() -> list[Any]:
        return list(await asyncio.gather(*coros, return_exceptions=True))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(result=asyncio.run(gather())))
    thread.start()
    thread.join()
    return box["result"]


@dataclass
class RewardOutput:
    """What :class:`RewardComposer` returns for a batch of ``N`` completions.

    Attributes:
        per_function: ``[N, F]`` rewards, NaN where a function gave ``None`` (or failed with ``on_error="none"``).
        total: ``[N]`` weighted sum over the functions that gave a value; NaN where none did.
        metrics: ``reward``, ``reward_std``, ``rewards/<name>/mean``, ``rewards/<name>/std``,
            ``rewards/<name>/none_frac`` and ``reward_errors/<name>`` (count of failures turned into ``None``).
    """

    per_function: Tensor
    total: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    #: per completion, the weighted sum of the per-turn rewards that functions gave as lists (one per policy turn; their
    #: sums are in ``total`` too); ``None`` where no function gave one
    turns: list[list[float] | None] | None = None


def _nan_std(values: Tensor) -> Tensor:
    valid = values[torch.isfinite(values)]
    return valid.std() if valid.numel() > 1 else values.new_zeros(())


def _nan_mean(values: Tensor) -> Tensor:
    valid = values[torch.isfinite(values)]
    return valid.mean() if valid.numel() else values.new_full((), float("nan"))


class RewardComposer:
    """Runs reward functions on a batch and combines them with weights.

    Args:
        reward_fns: callables following :class:`RewardFunction` (sync or async): a list, or a mapping from a key of
            your choosing to each (the CLI's ``reward.functions.<key>``).
        weights: one weight per function (list, or mapping from function key or name); default all 1.
        on_error: ``"raise"`` (default) raises :class:`RewardError` naming the function and sample index;
            ``"none"`` turns the bad sample's reward into ``None`` with a warning and counts it in
            ``reward_errors/<name>``. Nothing is silently zeroed.
        aggregation: ``"sum"``, the weighted sum of the functions' rewards (TRL's ``sum_then_normalize``);
            ``"normalize_each"``, each function's rewards normalised within their group first (``(r - mean) / std``
            over the group's completions that have one; 0 for a group where they are all equal), then the weighted sum
            (GDPO, Liu et al. 2026; TRL's ``multi_objective_aggregation="normalize_then_sum"``): a function whose
            rewards spread widely no longer drowns the others, and two functions' different combinations no longer
            collapse into the same advantage. It acts where completions come in groups (training), with the group size
            given to the call; the logged ``reward`` stays the weighted sum of the raw rewards. GDPO then scales the
            sum over the batch: ``experience.advantage_scale=batch``.

    Each function is logged under its name (:attr:`names`: its ``__name__``, the class name, ``_2`` added to a repeat)
    and known by its key too (:attr:`keys`: the mapping's key; for a list, its name): weights, ``set_weights`` and the
    accuracy function may name it either way (:meth:`resolve`; a key wins over another function's name).
    """

    def __init__(
        self,
        reward_fns: Sequence[Callable] | Mapping[str, Callable] | Callable,
        weights: Sequence[float] | Mapping[str, float] | None = None,
        on_error: str = "raise",
        aggregation: str = "sum",
    ) -> None:
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"reward.aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        self.aggregation = aggregation
        if callable(reward_fns):
            reward_fns = [reward_fns]
        keys = [str(k) for k in reward_fns] if isinstance(reward_fns, Mapping) else None
        self.reward_fns = list(reward_fns.values() if isinstance(reward_fns, Mapping) else reward_fns)
        if not self.reward_fns:
            raise ValueError("RewardComposer needs at least one reward function")
        for i, fn in enumerate(self.reward_fns):
            if not callable(fn):
                raise TypeError(f"reward_fns[{keys[i] if keys else i}] is not callable: {fn!r}")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        self.on_error = on_error
        self.names = _unique_names(self.reward_fns)
        self.keys = keys or list(self.names)
        self.weights = self._check_weights(weights)

    def check_rows(self, rows: Sequence[Mapping[str, Any]], split: str) -> None:
        """Before training: every function that checks rows (the built-ins reading a reference answer: ``check_row``)
        on each of ``rows`` (``split`` names them, e.g. ``data.train``); the first bad row is a ValueError naming the
        function, the row (counted from 0) and what is wrong, instead of a failure when a batch first draws it."""
        for key, name, fn in zip(self.keys, self.names, self.reward_fns):
            check = getattr(fn, "check_row", None)
            if check is None:
                continue
            for i, row in enumerate(rows):
                problem = check(row)
                if problem:
                    called = name if key == name else f"{key} ({name})"
                    raise ValueError(f"reward function {called}: {split} row {i} (counted from 0) {problem}; its "
                                     f"columns: {sorted(row)}")

    def resolve(self, name: str, what: str = "reward weights") -> str:
        """The logged name (:attr:`names`) of the function ``name`` names: its key (:attr:`keys`) or its name. A
        ValueError that begins with ``what`` (the setting that names it) lists the keys (and the names) otherwise."""
        if name in self.keys:
            return self.names[self.keys.index(name)]
        if name in self.names:
            return name
        also = f" (or the functions' names {self.names})" if self.names != self.keys else ""
        raise ValueError(f"{what}: no reward function {name!r}; the keys: {self.keys}{also}")

    def _check_weights(self, weights: Sequence[float] | Mapping[str, float] | None) -> Tensor:
        if weights is None:
            return torch.ones(len(self.reward_fns))
        if isinstance(weights, Mapping):
            unknown = [k for k in weights if k not in self.keys and k not in self.names]
            if unknown:
                also = f" (or the functions' names {self.names})" if self.names != self.keys else ""
                raise ValueError(f"reward weights name unknown functions {sorted(unknown)}; the keys: "
                                 f"{self.keys}{also}")
            by_name: dict[str, float] = {}
            for key, w in weights.items():
                name = self.resolve(key)
                if name in by_name:
                    raise ValueError(f"reward weights give the function {name!r} twice (by its key and its name)")
                by_name[name] = w
            weights = [float(by_name.get(name, 1.0)) for name in self.names]
        weights = [float(w) for w in weights]
        if len(weights) != len(self.reward_fns):
            raise ValueError(f"got {len(weights)} reward weights for {len(self.reward_fns)} reward functions {self.names}")
        for name, w in zip(self.names, weights):
            if not math.isfinite(w):
                raise ValueError(f"reward weight of {name!r} is not finite: {w}")
        return torch.tensor(weights, dtype=torch.float32)

    def set_weights(self, weights: Sequence[float] | Mapping[str, float]) -> None:
        """Replace the weights (dynamic weighting schedules call this between steps)."""
        self.weights = self._check_weights(weights)

    def place(self, device: torch.device | str) -> None:
        """Tell the functions that run a model (e.g. :class:`~polopt_lightning.rewards.RewardModel`) the policy's
        device: the module calls this when training or validation starts. Functions without ``place`` are left."""
        for fn in self.reward_fns:
            if callable(getattr(fn, "place", None)):
                fn.place(device)

    def accuracy(self, per_function: Tensor, columns: Mapping[str, Any] | None = None, name: str | None = None) -> Tensor:
        """``[N]`` the values of the function ``name`` (its key or name; default: the first), whose mean is the
        accuracy."""
        return per_function[:, self.names.index(self.resolve(name, "accuracy_reward") if name else self.names[0])]

    # ------------------------------------------------------------------------------------------------------------
    def __call__(self, prompts: list[str], completions: list[str], group_size: int | None = None,
                 **columns: Any) -> RewardOutput:
        """The rewards of ``completions`` (``columns``: the reward functions' extra arguments). ``group_size``: the
        completions come in groups of this many, one after the other (``aggregation="normalize_each"`` normalises each
        function's rewards within them)."""
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"got {len(prompts)} prompts for {n} completions; pass one prompt per completion")
        for key, col in columns.items():
            if isinstance(col, (list, tuple)) and len(col) != n:
                raise ValueError(f"column {key!r} has {len(col)} values for {n} completions")
        raw: list[Any] = []
        pending: dict[int, Awaitable] = {}
        for i, fn in enumerate(self.reward_fns):
            try:
                out = fn(prompts=prompts, completions=completions, **columns)
            except Exception as exc:  # located per sample below
                out = exc
            if inspect.isawaitable(out):
                pending[i] = out
            raw.append(out)
        if pending:
            for i, result in zip(pending, _run_coroutines(list(pending.values()))):
                raw[i] = result

        per_function = torch.full((n, len(self.reward_fns)), float("nan"))
        errors = torch.zeros(len(self.reward_fns))
        turns: list[list[float] | None] = [None] * n
        for j, (fn, name, out) in enumerate(zip(self.reward_fns, self.names, raw)):
            lists: dict[int, list[float]] = {}
            values, n_err = self._check_output(fn, name, out, prompts, completions, columns, turns=lists)
            per_function[:, j] = values
            errors[j] = n_err
            for i, parts in lists.items():  # this function's per-turn rewards, weighted, added to the sample's
                if torch.isfinite(values[i]):
                    mine = [float(self.weights[j]) * p for p in parts]
                    old = turns[i] or []
                    turns[i] = [(old[k] if k < len(old) else 0.0) + (mine[k] if k < len(mine) else 0.0)
                                for k in range(max(len(old), len(mine)))]

        total = self.combine(self.normalized(per_function, group_size))
        return RewardOutput(per_function=per_function, total=total, metrics=self.summarize(per_function, errors),
                            turns=turns if any(t is not None for t in turns) else None)

    def normalized(self, per_function: Tensor, group_size: int | None) -> Tensor:
        """``[N, F]`` rewards as :meth:`combine` sums them: as they are (``aggregation="sum"``, or no groups), or each
        function's normalised within each group of ``group_size`` consecutive completions (NaN kept)."""
        if self.aggregation == "sum" or not group_size or group_size < 2:
            return per_function
        if per_function.shape[0] % group_size:
            raise ValueError(f"reward.aggregation=normalize_each: {per_function.shape[0]} completions are not whole "
                             f"groups of {group_size}")
        grouped = per_function.view(-1, group_size, per_function.shape[1])  # [P, G, F]
        valid = torch.isfinite(grouped)
        count = valid.sum(1, keepdim=True)
        values = torch.where(valid, grouped, torch.zeros_like(grouped))
        mean = values.sum(1, keepdim=True) / count.clamp(min=1)
        sq = torch.where(valid, (grouped - mean) ** 2, torch.zeros_like(grouped)).sum(1, keepdim=True)
        std = (sq / (count - 1).clamp(min=1)).sqrt()
        flat = (count < 2) | (std <= _FLAT)
        out = torch.where(flat, torch.zeros_like(grouped), (grouped - mean) / std.clamp(min=_FLAT))
        return torch.where(valid, out, grouped).view_as(per_function)

    def combine(self, per_function: Tensor) -> Tensor:
        """Weighted sum over the functions that gave a value (TRL's nansum); NaN where none did."""
        valid = torch.isfinite(per_function)
        weighted = torch.where(valid, per_function * self.weights.to(per_function), torch.zeros_like(per_function))
        return torch.where(valid.any(-1), weighted.sum(-1), torch.full_like(weighted[:, 0], float("nan")))

    def summarize(self, per_function: Tensor, errors: Tensor) -> dict[str, Tensor]:
        """The metrics of :class:`RewardOutput` for rewards ``[N, F]`` and error counts ``[F]`` (e.g. gathered from every
        process, so the standard deviations are those of the whole batch)."""
        total = self.combine(per_function)
        metrics = {"reward": _nan_mean(total), "reward_std": _nan_std(total)}
        for j, name in enumerate(self.names):
            col = per_function[:, j]
            metrics[f"rewards/{name}/mean"] = _nan_mean(col)
            metrics[f"rewards/{name}/std"] = _nan_std(col)
            metrics[f"rewards/{name}/none_frac"] = (~torch.isfinite(col)).float().mean()
            metrics[f"reward_errors/{name}"] = errors[j]
        return metrics

    # ------------------------------------------------------------------------------------------------------------
    def _fail(self, message: str, cause: BaseException | None = None) -> None:
        """Raise or warn, per ``on_error``."""
        if self.on_error == "raise":
            raise RewardError(message) from cause
        warnings.warn(message + " -> treated as None (on_error='none')", RuntimeWarning, stacklevel=4)

    def _check_output(self, fn, name, out, prompts, completions, columns, offset: int = 0,
                      turns: dict[int, list[float]] | None = None) -> tuple[Tensor, int]:
        """``out`` checked: ``[n]`` values (NaN: none) and the failures counted; a sample's list of per-turn rewards
        (None: 0) is summed, and kept in ``turns`` by sample."""
        n = len(completions)
        values = torch.full((n,), float("nan"))
        if isinstance(out, BaseException):
            return self._locate_exception(fn, name, out, prompts, completions, columns, turns)
        if isinstance(out, Tensor):
            out = out.detach().cpu().reshape(-1).tolist()
        try:
            out = list(out)
        except TypeError:
            self._fail(f"reward function {name!r} returned {type(out).__name__}, expected a list of {n} floats/None")
            return values, n
        if len(out) != n:
            self._fail(f"reward function {name!r} returned {len(out)} values for {n} completions")
            return values, n
        n_err = 0
        for i, v in enumerate(out):
            if v is None:
                continue
            if isinstance(v, Tensor) and v.numel() == 1:
                v = v.item()
            if isinstance(v, (list, tuple)):  # one reward per policy turn
                if not all(p is None or (isinstance(p, numbers.Real) and math.isfinite(float(p))) for p in v):
                    self._fail(f"reward function {name!r} returned the per-turn rewards {v!r} for sample {offset + i}, "
                               "expected finite floats or None")
                    n_err += 1
                    continue
                parts = [0.0 if p is None else float(p) for p in v]
                if turns is not None:
                    turns[i] = parts
                v = sum(parts)
            if not isinstance(v, numbers.Real):
                self._fail(f"reward function {name!r} returned {type(v).__name__} {v!r} for sample {offset + i}, expected float or None")
                n_err += 1
                continue
            if not math.isfinite(float(v)):
                self._fail(f"reward function {name!r} returned non-finite {float(v)} for sample {offset + i}")
                n_err += 1
                continue
            values[i] = float(v)
        return values, n_err

    def _locate_exception(self, fn, name, exc, prompts, completions, columns,
                          turns: dict[int, list[float]] | None = None) -> tuple[Tensor, int]:
        """Re-run a failing function one sample at a time to name the sample(s) that make it raise."""
        n = len(completions)
        values = torch.full((n,), float("nan"))
        n_err = 0
        for i in range(n):
            cols = {k: ([v[i]] if isinstance(v, (list, tuple)) else v) for k, v in columns.items()}
            try:
                out = fn(prompts=[prompts[i]], completions=[completions[i]], **cols)
                if inspect.isawaitable(out):
                    out = _run_coroutines([out])[0]
                    if isinstance(out, BaseException):
                        raise out
            except Exception as sample_exc:
                self._fail(f"reward function {name!r} raised on sample {i}: {type(sample_exc).__name__}: {sample_exc}"
                           f"{_format_hint(sample_exc, completions[i])}", sample_exc)
                n_err += 1
                continue
            sample_turns: dict[int, list[float]] = {}
            single, err = self._check_output(fn, name, out, [prompts[i]], [completions[i]], cols, offset=i,
                                             turns=sample_turns)
            if 0 in sample_turns and turns is not None:
                turns[i] = sample_turns[0]
            values[i] = single[0]
            n_err += err
        if n_err == 0:
            # Every sample passes alone, so the batch call itself is what fails.
            self._fail(f"reward function {name!r} raised on the batch of {n}: {type(exc).__name__}: {exc}", exc)
            return torch.full((n,), float("nan")), n
        return values, n_err


def _format_hint(exc: Exception, completion: Any) -> str:
    """For a reward that indexes a completion as TRL's conversational format (``completion[0]["content"]``) where it
    is a plain string: what the completions are and why (the prompts are strings, not chat messages)."""
    if isinstance(exc, TypeError) and isinstance(completion, str) and "string indices must be integers" in str(exc):
        return (" (the completions are plain strings here, since the prompts are: a reward reading "
                "completion[0]['content'] needs chat prompts, lists of messages, as in TRL)")
    return ""


def check_reward_rows(rewards: Any, datamodule: Any) -> None:
    """``rewards.check_rows`` (a :class:`RewardComposer`'s, or a task mixture's, which checks each task's rows with
    that task's composer) on a data module's training and validation rows (``train_rows``, ``val_rows``)."""
    check = getattr(rewards, "check_rows", None)
    if check is None:  # plain reward functions: nothing declares what a row needs
        return
    for split, rows in (("training", getattr(datamodule, "train_rows", None)),
                        ("validation", getattr(datamodule, "val_rows", None))):
        if rows:
            check(rows, split)
