"""Settings objects built from what users give: the object itself, nothing (the defaults) or a dict of its fields,
and the range checks each one runs once, where it is made."""

from __future__ import annotations

import collections.abc
import numbers
import types
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, fields, is_dataclass
from typing import Any, ClassVar, Literal, TypeVar, Union

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


# what a value of each simple type is called in an error, alone and in a list
_CALLED = {bool: ("true or false", "true/false values"), int: ("an integer", "integers"),
           float: ("a number", "numbers"), str: ("a string", "strings"), type(None): ("null", "nulls")}
_SEQUENCES = (list, tuple, collections.abc.Sequence, collections.abc.MutableSequence)
_MAPPINGS = (dict, collections.abc.Mapping, collections.abc.MutableMapping)


def _accepts(value: Any, annotation: Any) -> tuple[bool | None, str]:
    """Whether ``annotation`` takes ``value`` (``None``: it says nothing checkable, a class or ``Any``), and what it
    asks for in words."""
    try:
        simple = annotation in _CALLED
    except TypeError:  # an unhashable annotation: nothing simple
        simple = False
    if simple:
        if annotation is bool:
            ok = isinstance(value, bool)
        elif annotation is int:
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        elif annotation is float:
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        else:
            ok = value is None if annotation is type(None) else isinstance(value, annotation)
        return ok, _CALLED[annotation][0]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return True, ""
        # a value of the right kind outside the choices: the owner's own check names the choices
        return (None if type(value) in {type(a) for a in args} else False), "one of " + ", ".join(map(repr, args))
    if origin is Union or origin is types.UnionType:
        verdicts = [_accepts(value, a) for a in args]
        if any(v is True for v, _ in verdicts):
            return True, ""
        if any(v is None for v, _ in verdicts):
            return None, ""
        return False, " or ".join(dict.fromkeys(d for _, d in verdicts))
    if origin in _SEQUENCES or annotation in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            return False, "a list"
        items = list(args) if origin is tuple and args and args[-1] is not Ellipsis else None
        if items is not None and len(items) != len(value):
            return False, f"a list of {len(items)} items"
        inner = args[0] if args else Any
        for i, item in enumerate(value):
            ok, _ = _accepts(item, items[i] if items is not None else inner)
            if ok is False:
                return False, f"a list of {_CALLED[inner][1]}" if inner in _CALLED else "a list"
        return True, ""
    if origin in _MAPPINGS or annotation is dict:
        return isinstance(value, Mapping), "a mapping ({key: value, ...})"
    try:
        if annotation is not Any and isinstance(annotation, type) and isinstance(value, annotation):
            return True, ""
    except TypeError:  # a class isinstance cannot take
        pass
    return None, ""  # Any, a callable, a class a value may become: not checked here


def type_mismatch(value: Any, annotation: Any) -> str | None:
    """What ``annotation`` (a type hint) asks for, where ``value`` is not that (``"a number"``); ``None`` where it
    is, or where the hint says nothing a value can be checked against (``Any``, a class)."""
    ok, wanted = _accepts(value, annotation)
    return wanted if ok is False else None


def annotations_of(target: Any) -> dict[str, Any]:
    """The type hints of ``target``'s parameters (a class: its ``__init__``'s, a dataclass's fields as the fallback),
    ``{}`` where they cannot be read."""
    sources = ((target.__init__, target) if is_dataclass(target) else (target.__init__,)) if isinstance(target, type) \
        else (target,)
    for source in sources:
        try:
            hints = typing.get_type_hints(source)
        except Exception:  # a hint naming what only type checkers import
            continue
        hints.pop("return", None)
        if hints:
            return hints
    return {}


def accepted_names(target: Any) -> set[str] | None:
    """The keyword arguments ``target`` takes, ``None`` where it takes any (``**kwargs``) or its signature cannot be
    read. A class whose ``__init__`` passes ``**kwargs`` on takes its own names and its bases' (up to the first base
    that takes no ``**kwargs``)."""
    import inspect

    inits = [c.__init__ for c in target.__mro__ if "__init__" in vars(c)] if isinstance(target, type) else [target]
    names: set[str] = set()
    for init in inits:
        try:
            params = list(inspect.signature(init).parameters.values())
        except (TypeError, ValueError):
            return None
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return names
    return None


def check_names(values: Mapping[str, Any], accepted: set[str] | None, key: str) -> None:
    """Raise a ValueError naming ``key.<name>`` for the first of ``values`` that ``accepted`` lacks (a typo such as
    ``generation.max_new_token``), with the closest accepted name and the rest."""
    import difflib

    if accepted is None:
        return
    for name in values:
        if name not in accepted:
            close = difflib.get_close_matches(str(name), accepted, n=1)
            hint = f"did you mean {key + '.' if key else ''}{close[0]}? " if close else ""
            raise ValueError(f"{key + '.' if key else ''}{name}: no such setting; {hint}"
                             f"the settings there: {', '.join(sorted(accepted))}")


def check_types(values: Mapping[str, Any], hints: Mapping[str, Any], key: str) -> None:
    """Raise a ValueError naming ``key.<name>`` and the type wanted for the first of ``values`` its hint refuses
    (``objective.beta: expected a number, got 'abc'``)."""
    for name, value in values.items():
        wanted = type_mismatch(value, hints[name]) if name in hints else None
        if wanted is not None:
            raise ValueError(f"{f'{key}.' if key else ''}{name}: expected {wanted}, got {value!r}")


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


# old keyword arguments of the module -> (their concern's argument, their name there); accepted with a FutureWarning
MOVED_ARGUMENTS = {
    **{k: ("experience", k) for k in ("num_generations", "advantage_scale", "dynamic_sampling", "max_extra_draws",
                                      "mask_truncated_completions")},
    **{k: ("update", k) for k in ("num_iterations", "mini_batches", "lr_schedule", "warmup_steps", "min_lr_ratio",
                                  "max_grad_norm", "micro_batch_tokens", "gradient_checkpointing", "share_prompt",
                                  "pack_groups", "reuse_sampling_logprobs", "disable_dropout")},
    "ref_dtype": ("reference", "dtype"), "ref_quantization": ("reference", "quantization"),
    "track_kl": ("reference", "track_kl"),
    **{k: ("optimizer", k) for k in ("lr", "weight_decay", "betas")},
}
