"""A prompt sampler that shards across processes and resumes at the batch where a run stopped.

Lightning replaces a loader's sampler with a ``DistributedSampler`` under DDP and restarts an interrupted epoch from its
first batch unless the loader is resumable. :class:`PromptSampler` is a ``DistributedSampler`` (so Lightning leaves it
alone) whose epoch order does not depend on how many epochs this process has iterated, and :class:`ResumableLoader`
saves and restores the position in it through Lightning's ``state_dict`` / ``load_state_dict`` interface.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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

    def state_dict(self) -> dict[str, Any]:
        epoch, consumed = self._position()
        sampler = self.sampler
        return {"epoch": int(epoch), "consumed": int(consumed), "batch_size": self.batch_size,
                "num_replicas": sampler.num_replicas, "seed": sampler.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler = self.sampler
        for key in ("num_replicas", "batch_size", "seed"):
            ours = sampler.num_replicas if key == "num_replicas" else getattr(self, key, getattr(sampler, key, None))
            if state.get(key) != ours:
                what = {"num_replicas": "processes (trainer.devices x trainer.num_nodes)",
                        "batch_size": "data.batch_size", "seed": "data.seed"}[key]
                raise ValueError(f"the checkpoint's data position was saved with {state.get(key)} {what}, this run has "
                                 f"{ours}: a resumed run needs the same to continue the same data order")
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
