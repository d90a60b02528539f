"""The asynchronous pipeline (``experience.max_staleness``): rollouts submitted ahead of the updates that train on them,
so a backend that samples apart from the trainer (``rollout=server``) samples the next rollouts while the current one
trains.

At every training batch the pipeline submits that batch's rollout, sampled from the policy as it is then; once it holds
more than ``max_staleness`` rollouts it gives the oldest back to be trained on. A rollout is trained on after exactly
``max_staleness`` rollouts' updates (each rollout's optimizer steps count as one policy version, one weight push): the
first ``max_staleness`` batches only fill the pipeline, and the last ones submitted when training stops are never
trained on. The sampler's log-probs then come from an older policy than the one the update starts from: the sampler
correction (``update.is_correction``) weighs each token by ``exp(trainer - sampler)``, which covers that staleness as
it covers another backend's numerics.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..rollout import RolloutBatch


@dataclass
class InFlight:
    """A submitted rollout: its prompt batch, the rollout (a future until sampled; ``None``: lost with a failure, to be
    sampled again) and the policy version that samples it (rollouts trained before it was submitted)."""

    batch: Mapping[str, Any]
    rollout: Future[RolloutBatch] | None
    version: int


class RolloutPipeline:
    """Rollouts in flight, oldest first, with the count of rollouts trained so far (the policy's version)."""

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self.queue: deque[InFlight] = deque()
        self.version = 0  # rollouts trained on so far

    def put(self, batch: Mapping[str, Any], rollout: Future[RolloutBatch]) -> None:
        self.queue.append(InFlight(batch, rollout, self.version))

    def ready(self) -> bool:
        """Whether the oldest rollout is due: more than ``max_staleness`` are in flight."""
        return len(self.queue) > self.max_staleness

    def take(self) -> tuple[InFlight, int]:
        """The oldest rollout and its staleness (policy versions between the one that sampled it and the one the update
        starts from); never more than ``max_staleness``."""
        item = self.queue.popleft()
        staleness = self.version - item.version
        if staleness > self.max_staleness:  # the order of put/take/trained broken: never train on it
            raise RuntimeError(f"a rollout {staleness} policy versions old reached the update "
                               f"(experience.max_staleness={self.max_staleness})")
        return item, staleness

    def trained(self) -> None:
        self.version += 1

    def undo(self, due: InFlight) -> None:
        """Back to the state before the step that took ``due`` (and put the newest): the step failed."""
        self.queue.pop()
        self.queue.appendleft(due)

    # -- checkpoints: the rollouts in flight saved with the step, so that a resumed run trains on the same ones -----
    def state_dict(self) -> dict[str, Any]:
        """The version and every rollout in flight, waited for (plain tensors, lists and dicts: ``torch.load``'s
        ``weights_only`` reads it)."""
        return {"version": self.version, "max_staleness": self.max_staleness,
                "in_flight": [{"batch": _plain(item.batch), "version": item.version, "rollout": _done(item.rollout)}
                              for item in self.queue]}

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device) -> None:
        self.version = int(state["version"])
        self.queue.clear()
        for item in state["in_flight"]:
            future: Future[RolloutBatch] | None = None
            if item["rollout"] is not None:
                future = Future()
                future.set_result(RolloutBatch(**_to(item["rollout"], device)))
            self.queue.append(InFlight(_to(item["batch"], device), future, int(item["version"])))


def _done(rollout: Future[RolloutBatch] | None) -> dict[str, Any] | None:
    """A rollout in flight as plain values once sampled; ``None`` where its sampling failed (a server that died):
    a resumed run samples it again."""
    try:
        batch = rollout.result() if rollout is not None else None
    except Exception:
        return None
    return None if batch is None else {f.name: _plain(getattr(batch, f.name)) for f in fields(batch)}


def _to(values: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in values.items()}


def _plain(value: Any) -> Any:
    """Tensors on the CPU, mappings as dicts, sequences as lists: what a checkpoint holds."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
