"""Rows of prompts (and any columns rewards need) from where users keep them: lists, JSON-lines files, datasets."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def load_rows(source: Any, what: str) -> list[dict[str, Any]]:
    """A list of dicts from a list, a JSON-lines path or a ``datasets.Dataset``; errors name ``what`` (the config key
    or argument the source came from) and, for a file, the line."""
    if source is None:
        return []
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"{what}: no JSON-lines file at {path}")
        rows = []
        with path.open() as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:  # its own "line N" counts inside this one line: left out
                        raise ValueError(f"{what}: {path}:{lineno} is not valid JSON: {exc.msg} at character "
                                         f"{exc.pos + 1} of that line (each line must hold one whole JSON object)"
                                         ) from None
        return rows
    if hasattr(source, "column_names") and hasattr(source, "to_list"):  # datasets.Dataset
        return list(source.to_list())
    if isinstance(source, Iterable):
        rows = list(source)
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise TypeError(f"{what}: row {i} is {type(row).__name__}, expected a dict of columns")
        return rows
    raise TypeError(f"{what}: expected a list of dicts, a JSON-lines path or a datasets.Dataset, got {type(source).__name__}")
