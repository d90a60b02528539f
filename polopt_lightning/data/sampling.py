"""A prompt sampler that shards across processes and resumes at the batch where a run stopped.

Lightning replaces a loader's sampler with a ``DistributedSampler`` under DDP and restarts an interrupted epoch from its
first batch unless the loader is resumable. :class:`PromptSampler` is a ``DistributedSampler`` (so Lightning leaves it
alone) whose epoch order does not depend on how many epochs this process has iterated, and :class:`ResumableLoader`
saves and restores the position in it through Lightning's ``state_dict`` / ``load_state_dict`` interface.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def process_rank() -> tuple[int, int]:
    """``(world_size, rank)`` of the default process group, ``(1, 0)`` outside one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


class PromptSampler(DistributedSampler):
    """Indices of one process's share of each epoch, from a permutation fixed by ``(seed, epoch)``.

    With one process and ``shuffle`` the permutations are those of ``DataLoader(shuffle=True,
    generator=torch.Generator().manual_seed(seed))`` epoch after epoch as Lightning iterates it (the order runs had
    before this sampler), but
    any epoch can be produced without iterating the ones before it. With ``W`` processes, process ``r`` takes every
    ``W``-th index of the same permutation from the ``r``-th on (``DistributedSampler``'s split), the tail cut so each
    gets the same number. ``skip`` indices at the start of the current epoch are left out: a resumed run's position.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.skip = 0
        self._offset = 0  # this sampler's epoch minus the one Lightning gives (see set_epoch)
        self._resumed_epoch: int | None = None

    def resume(self, epoch: int, skip: int) -> None:
        """Continue epoch ``epoch`` after its first ``skip`` indices."""
        super().set_epoch(epoch)
        self.skip, self._resumed_epoch = skip, epoch

    def set_epoch(self, epoch: int) -> None:
        # Lightning numbers epochs by its own count, which is one ahead of the data's when the checkpoint was saved
        # after `fit` stopped mid-epoch (at max_steps it counts the epoch as done). The first epoch Lightning sets
        # after a resume is the saved one, whatever number it gives; the following ones keep counting from there.
        if self._resumed_epoch is not None:
            self._offset, self._resumed_epoch = self._resumed_epoch - epoch, None
        super().set_epoch(epoch + self._offset)

    def permutation(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(epoch + 1):
            # what a DataLoader draws from its generator per epoch under Lightning: its workers' base seed, then the
            # permutation (Lightning stops after len(loader) batches, before RandomSampler would draw the empty
            # remainder of a second permutation)
            torch.empty((), dtype=torch.int64).random_(generator=generator)
            order = torch.randperm(n, generator=generator)
        return order.tolist()

    def __iter__(self) -> Iterator[int]:
        indices = self.permutation(self.epoch)
        if len(indices) < self.total_size:  # drop_last=False: repeat from the start, as DistributedSampler does
            indices = (indices * (self.total_size // max(len(indices), 1) + 1))[: self.total_size]
        indices = indices[: self.total_size][self.rank:self.total_size:self.num_replicas]
        skip, self.skip = self.skip, 0  # the resumed position applies to the epoch it was saved in, once
        return iter(indices[skip:])


class ResumableLoader(DataLoader):
    """A ``DataLoader`` over a :class:`PromptSampler` whose position survives a checkpoint.

    Args:
        position: returns ``(epoch, batches consumed in it)``, read when a checkpoint is saved. The loader cannot count
            batches itself: Lightning has already fetched the next one when it saves (its prefetching), so a count of
            the batches this loader yielded runs one ahead of the batches trained on.
    """

    def __init__(self, *args: Any, position: Callable[[], tuple[int, int]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._position = position
        self._start_count = 0

    def state_dict(self) -> dict[str, Any]:
        epoch, consumed = self._position()
        sampler = self.sampler
        state = {"epoch": int(epoch), "consumed": int(consumed), "batch_size": self.batch_size,
                 "num_replicas": sampler.num_replicas, "seed": sampler.seed}
        if isinstance(sampler, MixtureSampler):
            # the batch index in the sampler's epoch: Lightning's count since this iterator started, from where it
            # started (after a resume Lightning may count the rest of an epoch from 0 or from the batches before it)
            index = sampler.start + int(consumed) - self._start_count
            state["mixture"] = {**sampler.mixture_state(index), "index": index}
        return state

    def __iter__(self) -> Any:
        self._start_count = int(self._position()[1])
        return super().__iter__()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler = self.sampler
        for key in ("num_replicas", "batch_size", "seed"):
            ours = sampler.num_replicas if key == "num_replicas" else getattr(self, key, getattr(sampler, key, None))
            if state.get(key) != ours:
                what = {"num_replicas": "processes (trainer.devices x trainer.num_nodes)",
                        "batch_size": "data.batch_size", "seed": "data.seed"}[key]
                raise ValueError(f"the checkpoint's data position was saved with {state.get(key)} {what}, this run has "
                                 f"{ours}: a resumed run needs the same to continue the same data order")
        if isinstance(sampler, MixtureSampler):
            if "mixture" not in state:
                raise ValueError("the checkpoint's data position is a single task's, this run trains on a task mixture")
            sampler.set_epoch(int(state["epoch"]))
            sampler.load_mixture_state(state["mixture"], int(state["mixture"]["index"]))
            return
        sampler.resume(int(state["epoch"]), int(state["consumed"]) * self.batch_size)


PADDING = "_padding"  # the key a padded validation row carries (see ShardSampler)


class ShardSampler(DistributedSampler):
    """Every index once over the processes, in order: process ``r`` takes ``r, r + W, r + 2W, ...``, and the shorter
    shares end with one padding index (``-1``) so every process runs as many validation batches.

    ``DistributedSampler`` (Lightning's default under DDP) evens the shares by repeating samples, which counts them
    twice in the accuracy. Here a padding row is decoded like the others (a sharded model gathers its weights
    collectively: every process must run each batch) and left out of the metrics (``PromptDataModule`` marks it
    ``padding``), so the result is the mean over each sample once.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        self.num_samples = -(-len(dataset) // num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self) -> Iterator[int]:
        own = list(range(self.rank, len(self.dataset), self.num_replicas))
        return iter(own + [-1] * (self.num_samples - len(own)))


def allocate(weights: list[float], total: int, credit: list[float]) -> list[int]:
    """Split ``total`` prompts over tasks by ``weights`` (normalised), carrying each task's fractional remainder to the
    next batch in ``credit`` (updated in place): over many batches every task gets its share to within one prompt,
    also a task whose share of one batch is below one prompt. Deterministic: ties go to the earlier task."""
    norm = sum(weights)
    for i, w in enumerate(weights):
        credit[i] += total * w / norm
    counts = [max(int(math.floor(c)), 0) for c in credit]
    while sum(counts) > total:  # credits can run ahead after weights change: take back from the largest
        counts[max(range(len(counts)), key=lambda i: counts[i])] -= 1
    for i in sorted(range(len(counts)), key=lambda i: (-(credit[i] - counts[i]), i))[: total - sum(counts)]:
        counts[i] += 1
    for i, c in enumerate(counts):
        credit[i] -= c
    return counts


class MixtureSampler(DistributedSampler):
    """Batches of ``batch_size`` prompts drawn from several tasks in proportion to weights that may change between
    batches (:meth:`set_weights`); each batch is whole prompts, so each gets its whole group of completions.

    The rows of task ``t`` are ``offsets[t] ... offsets[t] + sizes[t] - 1`` of the dataset. Each task is an endless
    stream of its own permutations (seeded by ``(seed, t, pass)``), split over the processes as
    ``DistributedSampler`` splits one, and read from a cursor: a task drawn less often is not restarted, and a small
    task cycles through its rows on its own. An epoch is ``len(dataset) // (batch_size x processes)`` batches.

    The cursors, the carried remainders of :func:`allocate` and the composition of batches already fetched but not yet
    trained on (Lightning fetches ahead) make up :meth:`mixture_state`, so a resumed run draws the batches the
    uninterrupted one would have.
    """

    def __init__(self, dataset: Dataset, sizes: list[int], batch_size: int, weights: list[float], num_replicas: int = 1,
                 rank: int = 0, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        small = [i for i, n in enumerate(sizes) if n < num_replicas]
        if small:
            raise ValueError(f"task(s) {small} have fewer training rows than the {num_replicas} processes")
        self.sizes, self.batch_size = list(sizes), batch_size
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.batches = max(sum(sizes) // (batch_size * num_replicas), 1)
        self.num_samples = self.total_size = self.batches * batch_size
        self.set_weights(weights)
        self.cursors = [0] * len(sizes)
        self.credit = [0.0] * len(sizes)
        self._pending: list[list[int]] = []  # compositions to replay first after a resume
        self._skip = 0
        self.start = 0  # the first batch index of the current iteration (after a resume: the batches done before)
        self._records: dict[int, tuple[list[int], list[int]]] = {}  # batch -> (cursors before it, its counts)
        self._perms: dict[int, tuple[int, list[int]]] = {}

    def set_weights(self, weights: list[float]) -> None:
        weights = [float(w) for w in weights]
        if len(weights) != len(self.sizes) or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"task weights must be {len(self.sizes)} finite values >= 0, not all 0; got {weights}")
        self.weights = weights

    def __len__(self) -> int:
        return self.num_samples

    def _row(self, task: int, cursor: int) -> int:
        per_pass = self.sizes[task] // self.num_replicas
        n_pass, i = divmod(cursor, per_pass)
        if self._perms.get(task, (None,))[0] != n_pass:
            generator = torch.Generator().manual_seed(self.seed + 7919 * task + 104729 * n_pass)
            self._perms[task] = (n_pass, torch.randperm(self.sizes[task], generator=generator).tolist())
        return self.offsets[task] + self._perms[task][1][i * self.num_replicas + self.rank]

    def __iter__(self) -> Iterator[int]:
        start, self._skip = self._skip, 0
        self.start = start
        pending, self._pending = self._pending, []
        self._records = {}
        for j in range(start, self.batches):
            cursors = list(self.cursors)
            counts = pending.pop(0) if pending else allocate(self.weights, self.batch_size, self.credit)
            self._records[j] = (cursors, counts)
            for task, count in enumerate(counts):
                for _ in range(count):  # the cursor moves before the yield: a saved state never counts a row twice
                    row = self._row(task, self.cursors[task])
                    self.cursors[task] += 1
                    yield row

    def counts(self, index: int) -> list[int] | None:
        """The composition (prompts per task) of batch ``index`` of this epoch, once it has been drawn."""
        record = self._records.get(index)
        return None if record is None else record[1]

    def mixture_state(self, consumed: int) -> dict[str, Any]:
        """Where the streams stand after ``consumed`` batches of this epoch were trained on."""
        # the remainders are those after the last batch fetched: replaying the fetched ones leaves them there
        if consumed not in self._records:  # no batch fetched ahead: the streams stand where they are
            return {"cursors": list(self.cursors), "credit": list(self.credit), "pending": []}
        cursors, _ = self._records[consumed]
        pending = [self._records[j][1] for j in sorted(self._records) if j >= consumed]
        return {"cursors": list(cursors), "credit": list(self.credit), "pending": pending}

    def load_mixture_state(self, state: Mapping[str, Any], consumed: int) -> None:
        if len(state["cursors"]) != len(self.sizes):
            raise ValueError(f"the checkpoint's data position has {len(state['cursors'])} tasks, this run has "
                             f"{len(self.sizes)}: a resumed run needs the same task mixture")
        self.cursors, self.credit = [int(c) for c in state["cursors"]], [float(c) for c in state["credit"]]
        self._pending = [list(map(int, c)) for c in state["pending"]]
        self._skip = consumed
