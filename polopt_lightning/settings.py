"""Settings objects built from what users give: the object itself, nothing (the defaults) or a dict of its fields,
and the range checks each one runs once, where it is made."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, fields, is_dataclass
from typing import Any, ClassVar, TypeVar

T = TypeVar("T")

# a rule: (is the value allowed?, what the error says it must be)
Rule = tuple[Callable[[Any], bool], str]


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


def check_ranges(values: Mapping[str, Any], rules: Mapping[str, Rule], key: str) -> None:
    """Raise a ValueError naming ``key.<name>`` for the first of ``values`` that its rule refuses."""
    for name, value in values.items():
        if name in rules and not rules[name][0](value):
            raise ValueError(f"{key}.{name} must be {rules[name][1]}, got {value!r}")


class Settings:
    """Base of a concern's settings dataclass: ``KEY`` (its argument and config group, which errors name) and
    ``RULES`` (the allowed ranges, checked when it is made); :meth:`of` builds it from what users give."""

    KEY: ClassVar[str] = ""
    RULES: ClassVar[Mapping[str, Rule]] = {}

    def __post_init__(self) -> None:
        check_ranges(asdict(self), self.RULES, self.KEY)

    @classmethod
    def of(cls: type[T], value: T | Mapping[str, Any] | None) -> T:
        """``value`` itself, the defaults for ``None``, or the settings a dict names (unknown keys raise)."""
        return settings_of(cls, value, cls.KEY)


def with_moved(concerns: dict[str, Any], moved: Mapping[str, Any], table: Mapping[str, tuple[str, str]],
               owner: str) -> dict[str, Any]:
    """``concerns`` (argument name -> a settings object, a dict or None) with the keyword arguments of earlier
    releases ``moved`` merged into their concern's settings (``table``: old name -> (concern, its name there)), said
    in one FutureWarning; an unknown keyword raises a TypeError as Python would for ``owner``."""
    unknown = [k for k in moved if k not in table]
    if unknown:
        raise TypeError(f"{owner} got an unexpected keyword argument {unknown[0]!r}")
    if not moved:
        return concerns
    warnings.warn(f"{owner}: " + ", ".join(f"{k}= is now {'.'.join(table[k])}" for k in moved)
                  + " (the old names go in a later release)", FutureWarning, stacklevel=3)
    out = dict(concerns)
    for key, value in moved.items():
        concern, name = table[key]
        given = out[concern]
        if given is not None and not isinstance(given, Mapping):
            if not is_dataclass(given):  # a factory (the optimizer's): its settings are its own
                raise ValueError(f"{key}= beside a factory for {concern}: give it to the factory")
            given = asdict(given)
        out[concern] = {**(given or {}), name: value}
    return out
