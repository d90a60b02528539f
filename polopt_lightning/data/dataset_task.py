"""Prompts from a dataset by hub name or local path, through ``datasets.load_dataset`` (``task=dataset``)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASETS_INSTALL = "task=dataset needs the datasets package: pip install 'polopt-lightning[datasets]'"


@dataclass
class DatasetTask:
    """Training and validation prompts from any dataset ``datasets.load_dataset`` reads: a hub name
    (``"openai/gsm8k"`` with ``name="main"``), a local folder, or files by format (``path="json"`` or ``"parquet"``
    or ``"csv"`` with ``data_files``).

    Rows keep every column (each reaches the reward functions); ``columns`` renames them first, e.g.
    ``{"question": "prompt"}``. A string prompt becomes a chat conversation when ``system_prompt`` is set or
    ``chat`` is true (``[{"role": "system", ...}, {"role": "user", "content": prompt}]``), as TRL's GSM8K recipes map
    their data.

    Attributes:
        path: hub name, local folder (of data files, or one ``save_to_disk`` wrote), or a builder name (``json``,
            ``parquet``, ``csv``) with ``data_files``.
        name: the dataset's configuration (GSM8K: ``main``).
        data_files: files for a builder name: a path, a list, or a split -> files mapping.
        split: the training split.
        val_split: the validation split (e.g. ``test``); ``None``: ``val_size`` rows held out of the training split.
        val_size: rows held out of the training split when there is no ``val_split`` (a share when below 1; 0: none).
        columns: renames, dataset column -> the name used here (``prompt``, ``answer``, any other).
        prompt_column: the prompt's column after renaming (``data.prompt_column`` must name the same).
        answer_after: keep only the text after the last occurrence of this marker in the ``answer`` column (GSM8K's
            ``"####"``); ``None``: as it is.
        system_prompt: a system message put before each string prompt (making it a conversation).
        chat: make string prompts conversations (a user message) even without a system prompt.
        train_limit, val_limit: keep at most this many rows (after shuffling).
        shuffle: shuffle the rows before the split and the limits (the data module also shuffles every epoch).
        seed: the shuffle's seed.
        revision: the hub revision.
        cache_dir: where ``datasets`` caches (``None``: its default).
    """

    path: str
    name: str | None = None
    data_files: Any = None
    split: str = "train"
    val_split: str | None = None
    val_size: float = 0
    columns: Mapping[str, str] | None = None
    prompt_column: str = "prompt"
    answer_after: str | None = None
    system_prompt: str | None = None
    chat: bool = False
    train_limit: int | None = None
    val_limit: int | None = None
    shuffle: bool = True
    seed: int = 0
    revision: str | None = None
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.val_size < 0:
            raise ValueError(f"task.val_size must be >= 0, got {self.val_size}")
        if self.val_split is not None and self.val_size:
            raise ValueError("task.val_split and task.val_size are both set: validate on the split, or hold rows out "
                             "of the training split, not both")
        for key in ("train_limit", "val_limit"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"task.{key} must be >= 1 or null, got {value}")

    def _load(self, split: str, key: str) -> list[dict[str, Any]]:
        try:
            import datasets
        except ImportError as exc:
            raise ImportError(DATASETS_INSTALL) from exc
        folder = Path(self.path)
        if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():  # save_to_disk's folder
            data = datasets.load_from_disk(str(folder))
            if isinstance(data, datasets.DatasetDict):
                if split not in data:
                    raise ValueError(f"{key}={split!r}: the dataset at {folder} has the splits {sorted(data)}")
                data = data[split]
            return [self._row(row, i, key) for i, row in enumerate(data)]
        try:
            data = datasets.load_dataset(self.path, self.name, data_files=self.data_files, split=split,
                                         revision=self.revision, cache_dir=self.cache_dir)
        except ValueError as exc:  # an unknown split: datasets names the ones there are
            raise ValueError(f"{key}={split!r}: {exc}") from exc
        except (FileNotFoundError, ConnectionError, OSError) as exc:
            raise FileNotFoundError(f"task.path={self.path!r}{f' (task.name={self.name!r})' if self.name else ''}: "
                                    f"could not be loaded (no such local dataset or files, and not reachable on the "
                                    f"hub): {exc}") from exc
        return [self._row(row, i, key) for i, row in enumerate(data)]

    def _row(self, row: Mapping[str, Any], index: int, key: str) -> dict[str, Any]:
        renames = dict(self.columns or {})
        missing = sorted(set(renames) - set(row))
        if missing:
            raise KeyError(f"task.columns names {missing}, which the {key} rows lack; their columns: {sorted(row)}")
        out = {renames.get(k, k): v for k, v in row.items()}
        if self.prompt_column not in out:
            raise KeyError(f"{key} row {index} has no prompt column {self.prompt_column!r} (rename one with "
                           f"task.columns, e.g. {{question: {self.prompt_column}}}); its columns: {sorted(out)}")
        prompt = out[self.prompt_column]
        if isinstance(prompt, str) and (self.system_prompt is not None or self.chat):
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
            out[self.prompt_column] = [*system, {"role": "user", "content": prompt}]
        if self.answer_after is not None and isinstance(out.get("answer"), str):
            out["answer"] = out["answer"].rsplit(self.answer_after, 1)[-1].strip()
        return out

    def splits(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        train = self._load(self.split, "task.split")
        val = self._load(self.val_split, "task.val_split") if self.val_split is not None else []
        if self.shuffle:
            random.Random(self.seed).shuffle(train)
            random.Random(self.seed + 1).shuffle(val)
        if self.val_split is None and self.val_size:
            n = int(round(self.val_size * len(train))) if self.val_size < 1 else int(self.val_size)
            if n >= len(train):
                raise ValueError(f"task.val_size={self.val_size} holds out {n} of the {len(train)} training rows: "
                                 "nothing would be left to train on")
            val, train = train[:n], train[n:]
        return _limited(train, self.train_limit), _limited(val, self.val_limit)


def _limited(rows: Sequence[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    return list(rows if limit is None else rows[:limit])
