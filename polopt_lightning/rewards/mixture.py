"""Rewards of a task mixture: each row scored by the reward functions of its own task."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .composer import RewardComposer, RewardOutput, _nan_mean, _nan_std


class MixtureRewards:
    """One :class:`RewardComposer` per task; a batch's rows go to the composer their ``column`` names.

    The result has the interface of a single composer: ``per_function`` is ``[N, F]`` over every task's functions
    (named ``<task>/<function>``, NaN outside a row's own task), ``total`` the row's weighted sum under its task's
    weights. Reward weights are set per function by that name (:meth:`set_weights`), so a reward-weight schedule
    works on a mixture as on one task.

    Args:
        tasks: task name -> its composer (or a list of reward functions, composed with weight 1).
        accuracy: task name -> the function whose mean is that task's accuracy (default: its first function).
        column: the dataset column that names each row's task (:class:`~polopt_lightning.data.TaskMixture` adds it).
    """

    def __init__(self, tasks: Mapping[str, RewardComposer | Sequence[Any]], accuracy: Mapping[str, str] | None = None,
                 column: str = "task") -> None:
        if not tasks:
            raise ValueError("MixtureRewards needs at least one task")
        self.composers = {name: c if isinstance(c, RewardComposer) else RewardComposer(c) for name, c in tasks.items()}
        self.tasks = list(self.composers)
        self.column = column
        accuracy = dict(accuracy or {})
        unknown = sorted(set(accuracy) - set(self.tasks))
        if unknown:
            raise ValueError(f"reward accuracy names unknown tasks {unknown}; the tasks: {self.tasks}")
        self.accuracy_names: dict[str, str] = {}
        for task, composer in self.composers.items():
            name = accuracy.get(task) or composer.names[0]
            try:
                self.accuracy_names[task] = composer.resolve(name)  # its key or its name -> its name
            except ValueError:
                raise ValueError(f"the accuracy function of task {task!r} is {name!r}, which it does not have; its "
                                 f"functions' keys: {composer.keys}") from None
        self.names = [f"{task}/{fn}" for task, c in self.composers.items() for fn in c.names]
        self._columns: dict[str, slice] = {}
        start = 0
        for task, composer in self.composers.items():
            self._columns[task] = slice(start, start + len(composer.names))
            start += len(composer.names)

    # ------------------------------------------------------------------------------------------------------------
    @property
    def weights(self) -> Tensor:
        """Every function's weight, in the order of :attr:`names`."""
        return torch.cat([c.weights for c in self.composers.values()])

    def place(self, device: torch.device | str) -> None:
        """Every task's functions told the policy's device (:meth:`RewardComposer.place`)."""
        for composer in self.composers.values():
            composer.place(device)

    def resolve(self, name: str, what: str = "reward weights") -> str:
        """The logged name ``<task>/<function name>`` for ``<task>/<function key or name>``
        (:meth:`RewardComposer.resolve`); a ValueError that begins with ``what`` lists the known ones otherwise."""
        task, _, fn = name.partition("/")
        if task not in self.composers:
            raise ValueError(f"{what}: no reward function {name!r} (<task>/<function>); known: {self.names}")
        return f"{task}/{self.composers[task].resolve(fn, what)}"

    def set_weights(self, weights: Sequence[float] | Mapping[str, float]) -> None:
        """Replace weights: a list over :attr:`names`, or a mapping from ``<task>/<function>`` (the function by its key
        or name; others unchanged)."""
        if isinstance(weights, Mapping):
            resolved, unknown = {}, []
            for key, w in weights.items():
                try:
                    resolved[self.resolve(key)] = w
                except ValueError:
                    unknown.append(key)
            if unknown:
                raise ValueError(f"reward weights name unknown functions {sorted(unknown)}; known: {self.names}")
            weights = resolved
            for task, composer in self.composers.items():
                mine = {fn: float(weights[f"{task}/{fn}"]) for fn in composer.names if f"{task}/{fn}" in weights}
                if mine:
                    composer.set_weights({**dict(zip(composer.names, composer.weights.tolist())), **mine})
            return
        weights = [float(w) for w in weights]
        if len(weights) != len(self.names):
            raise ValueError(f"got {len(weights)} reward weights for {len(self.names)} reward functions {self.names}")
        for task, composer in self.composers.items():
            composer.set_weights(weights[self._columns[task]])

    def check_rows(self, rows: Sequence[Mapping[str, Any]], split: str) -> None:
        """:meth:`RewardComposer.check_rows` of each task's composer on that task's rows (counted within the task, which
        the ValueError names: ``task.tasks.<name>``): another task's rows cannot lend it a column it lacks, as they
        do in a batch that mixes them (the missing value would be ``None``)."""
        for task, composer in self.composers.items():
            mine = [row for row in rows if row.get(self.column) == task]
            if mine:
                composer.check_rows(mine, f"task.tasks.{task}'s {split}")

    def task_ids(self, columns: Mapping[str, Any], n: int | None = None) -> Tensor:
        """``[N]`` the index in :attr:`tasks` of each row's task, from ``columns[column]``."""
        if self.column not in columns:
            raise KeyError(f"a task mixture's rewards need the column {self.column!r} naming each row's task; the batch "
                           f"has {sorted(columns)}")
        names = columns[self.column]
        ids = []
        for i, name in enumerate(names):
            if name not in self.composers:
                raise ValueError(f"sample {i} belongs to task {name!r}, which has no rewards; the tasks: {self.tasks}")
            ids.append(self.tasks.index(name))
        if n is not None and len(ids) != n:
            raise ValueError(f"column {self.column!r} has {len(ids)} values for {n} completions")
        return torch.tensor(ids, dtype=torch.long)

    # ------------------------------------------------------------------------------------------------------------
    def __call__(self, prompts: list[str], completions: list[str], group_size: int | None = None,
                 **columns: Any) -> RewardOutput:
        """Each row scored by its task's composer; ``group_size``: the rows come in groups of this many (a group's
        rows share a prompt, so a task), for a composer that normalises within groups (its ``aggregation``)."""
        n = len(completions)
        ids = self.task_ids(columns, n)
        per_function = torch.full((n, len(self.names)), float("nan"))
        combined = per_function.clone()  # what each composer sums (its aggregation's)
        turns: list[list[float] | None] = [None] * n
        errors = torch.zeros(len(self.names))
        for t, (task, composer) in enumerate(self.composers.items()):
            rows = torch.nonzero(ids == t).flatten().tolist()
            if not rows:
                continue
            sub = {k: ([v[i] for i in rows] if isinstance(v, (list, tuple)) else v) for k, v in columns.items()}
            out = composer([prompts[i] for i in rows], [completions[i] for i in rows], **sub)
            per_function[rows, self._columns[task]] = out.per_function
            combined[rows, self._columns[task]] = composer.normalized(out.per_function, group_size)
            for i, parts in zip(rows, out.turns or []):
                turns[i] = parts
            errors[self._columns[task]] = torch.stack([out.metrics[f"reward_errors/{fn}"] for fn in composer.names])
        return RewardOutput(per_function=per_function, total=self.combine(combined),
                            metrics=self.summarize(per_function, errors),
                            turns=turns if any(t is not None for t in turns) else None)

    @property
    def aggregation(self) -> str:
        """``"normalize_each"`` where a task's composer normalises its functions within groups, else ``"sum"``."""
        return "normalize_each" if any(c.aggregation != "sum" for c in self.composers.values()) else "sum"

    def combine(self, per_function: Tensor) -> Tensor:
        """Each row's total under its own task's weights (NaN where no function of its task gave a value)."""
        total = torch.full((per_function.shape[0],), float("nan"))
        for task, composer in self.composers.items():
            part = composer.combine(per_function[:, self._columns[task]])
            total = torch.where(torch.isfinite(part), part, total)
        return total

    def row_tasks(self, per_function: Tensor) -> Tensor:
        """``[N]`` each row's task index as read from where its values are (-1: no value at all)."""
        ids = torch.full((per_function.shape[0],), -1, dtype=torch.long)
        for t, task in enumerate(self.tasks):
            ids[torch.isfinite(per_function[:, self._columns[task]]).any(-1)] = t
        return ids

    def summarize(self, per_function: Tensor, errors: Tensor) -> dict[str, Tensor]:
        """The metrics of one composer over the whole batch (names ``<task>/<function>``), plus ``<task>/reward``:
        the mean total of that task's rows (NaN when the batch holds none)."""
        total = self.combine(per_function)
        metrics = {"reward": _nan_mean(total), "reward_std": _nan_std(total)}
        ids = self.row_tasks(per_function)
        for t, (task, composer) in enumerate(self.composers.items()):
            mine = per_function[ids == t][:, self._columns[task]]
            metrics[f"{task}/reward"] = _nan_mean(total[ids == t])
            for j, fn in enumerate(composer.names):
                col = mine[:, j]
                metrics[f"rewards/{task}/{fn}/mean"] = _nan_mean(col)
                metrics[f"rewards/{task}/{fn}/std"] = _nan_std(col)
                metrics[f"rewards/{task}/{fn}/none_frac"] = ((~torch.isfinite(col)).float().mean() if col.numel()
                                                            else col.new_zeros(()))
                metrics[f"reward_errors/{task}/{fn}"] = errors[self._columns[task].start + j]
        return metrics

    def accuracy(self, per_function: Tensor, columns: Mapping[str, Any], name: str | None = None) -> Tensor:
        """``[N]`` each row's accuracy: its own task's accuracy function (``name`` must be None)."""
        if name is not None:
            raise ValueError("a task mixture's accuracy is each task's own (MixtureRewards(accuracy={task: function}))")
        ids = self.task_ids(columns, per_function.shape[0])
        index = torch.tensor([self.names.index(f"{task}/{self.accuracy_names[task]}") for task in self.tasks])
        return per_function.gather(1, index[ids][:, None]).squeeze(1)
