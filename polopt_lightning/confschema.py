"""One default per setting: the code's defaults as Hydra configs (``conf/_schema/``), the YAML carrying only what differs.

Every setting of this package has its default in one place, the code: a settings dataclass's field or a parameter of
the callable a ``_target_`` names. This module renders those defaults as one config per callable under
``conf/_schema/`` (``UpdateConfig.yaml``, ``ExactMatchReward.yaml``, ...), and each group option includes the ones it
builds (``defaults: [/_schema/UpdateConfig@_here_, _self_]``), so that every setting is in the composed
configuration, is overridden on the command line without ``+`` and shows its default in ``docs/configuration.md``.
An option file then sets only what its recipe changes (``update.mini_batches: 2`` against the code's 1); a key it
documents without changing is written ``#| key`` under its comment. Tests check that the files equal what this
renders from the code and that no option repeats a code default (``tests/test_confschema.py``).

    python -m polopt_lightning.confschema            # rewrite conf/_schema/ from the code
    python -m polopt_lightning.confschema --check    # exit 1, naming the files, where they differ

Generated files rather than ``ConfigStore`` entries: Hydra's compose API, the CLI and a notebook see them without
importing anything first, and a reader sees every default in one folder. Callables of other libraries (Lightning's
``Trainer``, its loggers) are left to their own defaults: their options set the keys they need.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

PACKAGE = "polopt_lightning."
SCHEMA_DIR = "_schema"
# plain blocks (no _target_): the settings class each is read into (the CLI's check uses the same table)
PLAIN_BLOCKS = {"generation": "polopt_lightning.rollout.base.SamplingConfig",
                "data": "polopt_lightning.data.PromptDataModule",
                "warm_start": "polopt_lightning.warmstart.WarmStartConfig",
                "quantization": "polopt_lightning.models.Quantization", "adapter": "polopt_lightning.models.Adapter",
                # built where code runs (the code reward, untrusted tools), never by the CLI itself
                "sandbox": "polopt_lightning.sandbox.Sandbox", "sandbox.limits": "polopt_lightning.sandbox.Limits"}
# parameters that are not settings: objects the caller passes (built elsewhere), or the key an error message names
NOT_SETTINGS = {"polopt_lightning.data.datamodule.PromptDataModule": {"train", "val", "task", "tokenizer", "tools"},
                "polopt_lightning.models.load_pretrained": {"quantization_config"},
                "polopt_lightning.models.Adapter": {"key"}, "polopt_lightning.models.Quantization": {"key"},
                "polopt_lightning.optim.build_optimizer": {"key"},
                "polopt_lightning.models.build_tiny_model": {"tokenizer"},
                "polopt_lightning.rollout.multi_turn.MultiTurnEngine": {"tokenizer"},
                "polopt_lightning.sandbox.core.Sandbox": {"limits"}}  # a block of its own (sandbox.limits: Limits)
NOT_SETTINGS_ANYWHERE = {"model"}  # the model a strategy wraps
HEADER = ("# The defaults of {path}, written by `python -m polopt_lightning.confschema`:\n"
          "# edit the code, not this file (tests/test_confschema.py compares them). Options include it and set only\n"
          "# what differs.\n")


def config_dir() -> str:
    """The shipped configs: ``polopt_lightning.conf`` in a wheel, or ``conf/`` beside the package in a checkout."""
    source = Path(__file__).resolve().parents[1] / "conf"
    if (source / "train.yaml").is_file():
        return str(source)
    spec = importlib.util.find_spec("polopt_lightning.conf")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("polopt_lightning.conf is missing: reinstall polopt-lightning")
    return str(Path(list(spec.submodule_search_locations)[0]))


def option(group: str, name: str, overrides: Sequence[str] = ()) -> Any:
    """A group option as ``polopt-train`` composes it (``DictConfig``): its schemas included, its interpolations
    resolving against the rest of ``train.yaml`` (``option("objective", "dr_grpo")``, ``option("rollout", "vllm")``).
    Loading the option's file alone gives only what it changes, and its ``defaults`` list. A few keys are the CLI's
    to take apart before it builds (``task.rewards``, ``warm_start.enabled``); an experiment changes several groups:
    compose ``train`` with ``experiment=NAME`` for it."""
    from hydra import compose, initialize_config_dir

    if group == "experiment":
        raise ValueError(f"experiment={name} changes several groups: compose train.yaml with experiment={name} "
                         "(hydra.compose(config_name='train', overrides=['experiment=...'])), not one option")
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="train", overrides=[f"{group}={name}", *overrides])[group]


def _representable(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_representable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _representable(v) for k, v in value.items())
    return False


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def target_of(node: dict[str, Any], where: str = "") -> tuple[Any, bool]:
    """``(the callable a config node builds, whether a registry named it)``: its ``_target_`` (through a registry's
    factory's ``target_for``, e.g. ``build_objective`` with ``name: gspo`` -> ``GSPO``: the node then also holds the
    registered ``name``), or, for a top-level block without one (``where`` its dotted path: ``generation``), the
    settings class it is read into (:data:`PLAIN_BLOCKS`); ``(None, False)`` for neither."""
    from hydra.utils import get_object

    path = node.get("_target_")
    path = path if isinstance(path, str) else PLAIN_BLOCKS.get(where)
    if not path:
        return None, False
    target = get_object(path)
    registered = target.target_for(node) if hasattr(target, "target_for") else None
    return (registered, True) if registered else (target, False)


def resolve(node: dict[str, Any], where: str = "") -> Any:
    """The callable of this package whose defaults a config node takes (:func:`target_of`), else ``None``."""
    path = node.get("_target_")
    if not (path if isinstance(path, str) else PLAIN_BLOCKS.get(where, "")).startswith(PACKAGE):
        return None
    return target_of(node, where)[0]


def code_defaults(target: Any) -> dict[str, Any]:
    """The settings ``target`` declares in this package, each with its default: a dataclass's fields, or the keyword
    parameters of a function or of a class's ``__init__`` (and of its bases' in this package, up to the first that
    takes no ``**kwargs``), where the default is a value a config can hold."""
    name = f"{target.__module__}.{target.__qualname__}"
    skip = NOT_SETTINGS.get(name, set()) | NOT_SETTINGS_ANYWHERE
    out: dict[str, Any] = {}
    if dataclasses.is_dataclass(target):
        for field in dataclasses.fields(target):
            if field.default is not dataclasses.MISSING:
                default = field.default
            elif field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            else:
                continue
            if field.init and not field.name.startswith("_") and _representable(default):
                out[field.name] = _plain(default)
        return {k: v for k, v in out.items() if k not in skip}
    owners = [c for c in target.__mro__ if "__init__" in vars(c)] if isinstance(target, type) else [target]
    for owner in owners:
        if not getattr(owner, "__module__", "").startswith(PACKAGE):
            break
        params = list(inspect.signature(owner.__init__ if isinstance(owner, type) else owner).parameters.values())
        for p in params:
            if (p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in out and p.name != "self"
                    and p.default is not p.empty and _representable(p.default)):
                out[p.name] = _plain(p.default)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return {k: v for k, v in out.items() if k not in skip}


def code_default(config: Any, key: str) -> tuple[bool, Any]:
    """``(True, default)`` where the dotted ``key`` of a composed configuration (a plain container) is a setting whose
    default the code gives (a parameter of the callable its node builds), else ``(False, None)``."""
    *parents, name = key.split(".")
    node = config
    for part in parents:
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    if not isinstance(node, dict):
        return False, None
    try:
        target = resolve(node, ".".join(parents))
    except Exception:
        return False, None
    defaults = code_defaults(target) if target is not None else {}
    return (True, defaults[name]) if name in defaults else (False, None)


def schema_name(target: Any) -> str:
    return target.__qualname__


def option_files(conf: Path) -> Iterator[Path]:
    """The group options whose defaults the schemas give: not experiments (they change a recipe) nor an option
    ``none`` (it turns its concern off: there is nothing to set)."""
    for path in sorted(conf.rglob("*.yaml")):
        rel = path.relative_to(conf)
        if rel.parts[0] not in (SCHEMA_DIR, "experiment") and path.name != "none.yaml":
            yield path


def target_nodes(data: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any], Any]]:
    """``(path inside the file, node, callable)`` for every node of ``data`` that builds a callable of this package."""
    if isinstance(data, dict):
        target = resolve(data, path)
        if target is not None:
            yield path, data, target
        for key, value in data.items():
            where = f"{path}.{key}" if path else str(key)
            # a plain block whose keys are all documented, none set (``limits:`` then ``#| wall_s`` lines) reads as null
            yield from target_nodes({} if value is None and where in PLAIN_BLOCKS else value, where)


def file_nodes(path: Path, conf: Path) -> list[tuple[str, dict[str, Any], Any]]:
    """:func:`target_nodes` of an option file, paths from the top of its package (a file of group ``g`` is read at
    ``g``; the primary config at the root)."""
    text = path.read_text()
    data = yaml.safe_load(text) or {}
    data.pop("defaults", None)
    group = path.parent.relative_to(conf).as_posix()
    if group == ".":
        return list(target_nodes(data))
    if "@package _global_" in text:
        return []
    # the group's own node (e.g. quantization, a plain block) is checked under the group's name
    nodes = list(target_nodes({group: data}))
    return [(p[len(group) + 1:] if p != group else "", node, target) for p, node, target in nodes]


def schemas(conf: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    """schema name -> (the callable's path, its defaults), for every callable the options build."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for path in option_files(conf):
        for _, _, target in file_nodes(path, conf):
            name = schema_name(target)
            full = f"{target.__module__}.{target.__qualname__}"
            if name in out and out[name][0] != full:
                raise ValueError(f"two callables named {name}: {out[name][0]} and {full}")
            out[name] = (full, code_defaults(target))
    return out


def flow(value: Any) -> str:
    """``value`` as YAML on one line (``null``, ``[think, answer]``, ``'1'`` for a string YAML would read otherwise)."""
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def render(full: str, defaults: dict[str, Any]) -> str:
    body = "".join(f"{key}: {flow(value)}\n" for key, value in defaults.items()) or "{}\n"
    return HEADER.format(path=full) + body


def check(conf: Path) -> list[str]:
    """The schema files that differ from what the code renders (missing, changed or left over)."""
    folder = conf / SCHEMA_DIR
    want = {f"{name}.yaml": render(*spec) for name, spec in schemas(conf).items()}
    have = {p.name: p.read_text() for p in folder.glob("*.yaml")} if folder.is_dir() else {}
    return sorted(n for n in set(want) | set(have) if want.get(n) != have.get(n))


def write(conf: Path) -> list[str]:
    folder = conf / SCHEMA_DIR
    folder.mkdir(exist_ok=True)
    want = {f"{name}.yaml": render(*spec) for name, spec in schemas(conf).items()}
    for stale in set(p.name for p in folder.glob("*.yaml")) - set(want):
        (folder / stale).unlink()  # a schema of a callable no option builds any more: this module wrote it
    for name, text in want.items():
        (folder / name).write_text(text)
    return sorted(want)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    conf = Path(config_dir())
    if "--check" in argv:
        differ = check(conf)
        if differ:
            print("conf/_schema differs from the code's defaults: " + ", ".join(differ)
                  + " (python -m polopt_lightning.confschema rewrites it)", file=sys.stderr)
        return 1 if differ else 0
    print(f"wrote {len(write(conf))} schemas to {conf / SCHEMA_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
