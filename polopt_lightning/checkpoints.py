"""Where a run's checkpoints are and which is newest: what ``polopt-train ckpt_path=<run>`` resumes from and what
``polopt-export <run>`` exports. Only the files' small pickles are read (tensors are mapped)."""

from __future__ import annotations

from pathlib import Path


def checkpoint_step(path: Path) -> int | None:
    """The optimizer step a checkpoint stores (its ``global_step``); ``None`` where that cannot be read (a DeepSpeed
    checkpoint folder, a file that is no checkpoint). Only the file's small pickle is read (tensors are mapped)."""
    import torch

    if not path.is_file():
        return None
    try:
        step = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("global_step")
    except Exception:
        return None
    return int(step) if isinstance(step, int) else None


def checkpoints_in(folder: Path) -> list[tuple[Path, int | None]]:
    """Every checkpoint in ``folder`` (``*.ckpt``: files, or DeepSpeed's folders; no temporary files) with the step
    stored in it, newest first: the highest step; on a tie, any file before ``best.ckpt`` (a copy of a state another
    file holds too), then the one modified last. A checkpoint whose step cannot be read counts by modification time."""
    if not folder.is_dir():
        return []
    found = [(p, checkpoint_step(p)) for p in folder.iterdir()
             if p.name.endswith(".ckpt") and not p.name.startswith(".")]
    return sorted(found, key=lambda e: (-1 if e[1] is None else e[1], e[0].name != "best.ckpt", e[0].stat().st_mtime),
                  reverse=True)


def resume_point(folder: Path) -> tuple[Path, int | None] | None:
    """The checkpoint a run resumes from when ``ckpt_path`` names its folder: the newest in ``folder``
    (:func:`checkpoints_in`: last.ckpt, on_exception.ckpt, periodic ones, best.ckpt), one at step 0 (the starting
    policy, nothing trained) never; ``None`` when there is none."""
    return next(((p, s) for p, s in checkpoints_in(folder) if s != 0), None)


def checkpoint_folder(path: Path) -> Path | None:
    """What a ``ckpt_path`` that is a folder means: ``<run>/checkpoints`` for a run directory, else the folder itself;
    ``None`` for a DeepSpeed checkpoint (a folder that is one checkpoint, ``last.ckpt/``) or a file."""
    if not path.is_dir() or path.name.endswith(".ckpt"):
        return None
    return path / "checkpoints" if (path / "checkpoints").is_dir() or (path / ".hydra").is_dir() else path
