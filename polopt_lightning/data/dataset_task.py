"""Prompts from a dataset by hub name or local path, through ``datasets.load_dataset`` (``task=dataset``)."""

from __future__ import annotations

import glob
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASETS_INSTALL = "task=dataset needs the datasets package: pip install 'polopt-lightning[datasets]'"
# a local file's format by its suffix (the builder that reads it), and the builders read here from local files
FILE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
READERS = ("json", "parquet", "csv", "text")
# builder names task.path takes with task.data_files
BUILDERS = (*READERS, "arrow")


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
        return [self._row(row, i, key) for i, row in enumerate(self._dataset(datasets, split, key))]

    def _dataset(self, datasets: Any, split: str, key: str) -> Any:
        """The split's rows: local files and folders are read here, without asking the hub; anything else goes to
        ``datasets.load_dataset`` after one quick look at the hub."""
        local = Path(self.path).expanduser()
        if self.data_files is not None and self.path in BUILDERS:  # a builder name with files: task.data_files
            files = self._local_data_files()
            if files is not None and self.path in READERS:
                return _read(datasets, self.path, files, split, key, "task.data_files", self.cache_dir)
            return self._load_dataset(datasets, self.path, split, key)  # URLs: datasets fetches them
        if local.is_file():
            if self.data_files is not None:
                raise ValueError(f"task.path={self.path!r} is a file, and task.data_files is set too: give the file "
                                 "as task.path, or a format (json, parquet, csv) as task.path with task.data_files")
            builder = FILE_FORMATS.get(local.suffix.lower())
            if builder is None:
                raise ValueError(f"task.path={self.path!r}: {local.suffix or 'a file without a suffix'} is not a "
                                 f"data file this task reads; it reads {', '.join(sorted(FILE_FORMATS))} files")
            return _read(datasets, builder, {"train": [str(local)]}, split, key, f"task.path={self.path!r}",
                         self.cache_dir)
        if local.is_dir():
            if (local / "dataset_dict.json").is_file() or (local / "state.json").is_file():  # save_to_disk's
                data = datasets.load_from_disk(str(local))
                if isinstance(data, datasets.DatasetDict):
                    if split not in data:
                        raise ValueError(f"{key}={split!r}: the dataset at {local} has the splits {sorted(data)}")
                    data = data[split]
                return data
            return self._load_dataset(datasets, str(local), split, key)  # a folder of data files
        if self.path in BUILDERS:
            raise ValueError(f"task.path={self.path!r} names a file format: give the files with task.data_files "
                             "(a path, a list, or {train: ..., test: ...}), or the file itself as task.path")
        if _looks_local(self.path):
            raise FileNotFoundError(f"task.path={self.path!r}: no such file or folder ({local.resolve()})")
        offline = bool(datasets.config.HF_HUB_OFFLINE)
        if not offline:  # one request without retries: an unreachable hub fails now, not after a minute of them
            unreachable = _hub_unreachable(self.path, self.revision, datasets.config.HF_ENDPOINT)
            if unreachable:
                raise ConnectionError(f"task.path={self.path!r}: neither a local file or folder nor reachable on the "
                                      f"Hugging Face Hub ({unreachable}); a dataset already in the datasets cache "
                                      "loads with HF_HUB_OFFLINE=1")
        return self._load_dataset(datasets, self.path, split, key, offline=offline)

    def _load_dataset(self, datasets: Any, path: str, split: str, key: str, offline: bool = False) -> Any:
        try:
            return datasets.load_dataset(path, self.name, data_files=self.data_files, split=split,
                                         revision=self.revision, cache_dir=self.cache_dir)
        except ValueError as exc:  # an unknown split: datasets names the ones there are
            raise ValueError(f"{key}={split!r}: {exc}") from exc
        except (FileNotFoundError, ConnectionError, OSError) as exc:
            name = f" (task.name={self.name!r})" if self.name else ""
            if Path(path).is_dir():
                where = "a folder without data files datasets reads (json, jsonl, parquet, csv, ...)"
            elif offline:
                where = "neither a local file or folder nor in the datasets cache (HF_HUB_OFFLINE is set: the hub " \
                        "was not asked)"
            else:
                where = "neither a local file or folder nor a dataset that could be loaded from the hub"
            raise FileNotFoundError(f"task.path={self.path!r}{name}: {where}: {exc}") from exc

    def _local_data_files(self) -> dict[str, list[str]] | None:
        """``task.data_files`` as split -> files, each checked to exist (glob patterns expanded); ``None`` when one is
        a URL (``https://``, ``hf://``: ``datasets`` fetches those)."""
        spec = self.data_files
        if isinstance(spec, (str, os.PathLike)):
            spec = {"train": [spec]}
        elif isinstance(spec, Mapping):
            spec = {str(k): [v] if isinstance(v, (str, os.PathLike)) else list(v) for k, v in spec.items()}
        elif isinstance(spec, Sequence):
            spec = {"train": list(spec)}
        else:
            raise TypeError(f"task.data_files: expected a path, a list of paths or {{split: paths}}, got {spec!r}")
        out: dict[str, list[str]] = {}
        for split, items in spec.items():
            out[split] = []
            for item in map(str, items):
                if "://" in item:
                    return None
                where = f" (split {split})" if len(spec) > 1 else ""
                if glob.has_magic(item):
                    found = sorted(glob.glob(os.path.expanduser(item), recursive=True))
                    if not found:
                        raise FileNotFoundError(f"task.data_files: {item!r}{where} matches no file (in {Path.cwd()})")
                    out[split] += found
                elif not Path(item).expanduser().is_file():
                    raise FileNotFoundError(f"task.data_files: no such file {item!r}{where} "
                                            f"({Path(item).expanduser().resolve()})")
                else:
                    out[split].append(str(Path(item).expanduser()))
        return out

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


def _read(datasets: Any, builder: str, files: Mapping[str, list[str]], split: str, key: str, source: str,
          cache_dir: str | None) -> Any:
    """The ``split`` of local ``files`` (split -> paths) read by ``builder`` (``Dataset.from_json``, ...): no hub."""
    if split not in files:
        hint = "; hold rows out with task.val_size instead" if key == "task.val_split" and list(files) == ["train"] else ""
        raise ValueError(f"{key}={split!r}: {source} has the splits {sorted(files)}{hint}")
    return getattr(datasets.Dataset, f"from_{builder}")(files[split], split=split, cache_dir=cache_dir)


def _looks_local(path: str) -> bool:
    """Whether ``path`` is written as a local path (not a hub id ``name`` or ``org/name``)."""
    p = Path(path)
    return (p.is_absolute() or path.startswith((".", "~")) or "\\" in path or path.count("/") > 1
            or p.suffix.lower() in (*FILE_FORMATS, ".arrow"))


def _hub_unreachable(path: str, revision: str | None, endpoint: str) -> str | None:
    """Why the hub cannot be asked about the dataset ``path`` (one request, no retries), or ``None`` when it answered
    (whatever it said: ``load_dataset`` then says what it means)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        HfApi(endpoint=endpoint).dataset_info(path, revision=revision, timeout=10)
    except HfHubHTTPError:
        return None
    except Exception as exc:  # no network, no DNS, a timeout, an id the hub cannot hold
        return f"{type(exc).__name__}: {exc}"
    return None


def _limited(rows: Sequence[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    return list(rows if limit is None else rows[:limit])
