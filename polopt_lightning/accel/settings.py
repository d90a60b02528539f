"""Settings objects built from what users give: the object itself, nothing (the defaults) or a dict of its fields."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def settings_of(cls: type[T], value: T | Mapping[str, Any] | None, key: str) -> T:
    """``value`` itself when it is a ``cls``, ``cls()`` for ``None``, or ``cls(**value)`` for a dict of its fields; an
    unknown field or another type raises an error naming ``key`` (the argument or config key)."""
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    if isinstance(value, Mapping):
        known = [f.name for f in fields(cls)]
        unknown = set(value) - set(known)
        if unknown:
            raise ValueError(f"{key}: unknown settings {sorted(unknown)}; known: {', '.join(known)}")
        return cls(**value)
    raise TypeError(f"{key} must be a {cls.__name__}, a dict of its settings or None, got {type(value).__name__}")
