"""Render ``docs/configuration.md`` from the shipped configs: every group, option and key with its comment.

Each key in ``conf/`` carries the comment above it (what it does, its unit); this page is made from those comments,
and a test checks that the committed page equals what this renders, so the reference cannot drift from the configs.

    python -m polopt_lightning.confdoc > docs/configuration.md
"""

from __future__ import annotations

import re
from pathlib import Path

from .confschema import config_dir

CODE = "\x00"  # marks a value that is the code's default (a `#| key` line), shown as `value` (code)
_SCHEMA = re.compile(r"^\s*-\s*/_schema/(?P<name>\w+)@(?P<at>[\w.]+)\s*$")
_DOCUMENTED = re.compile(r"^(?P<indent>\s*)#\|\s*(?P<key>[A-Za-z_]\w*)\s*$")  # a key the schema gives, documented
_KEY = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z_][\w.]*|'[^']+'|\"[^\"]+\"):(?:\s+(?P<value>.*))?$")
_DEFAULT = re.compile(r"^\s*-\s*(?:override\s+)?(?P<group>[\w/]+):\s*(?P<value>\S+)\s*$")

HEADER = """# Configuration reference

Generated from the shipped configs (`conf/`) by `python -m polopt_lightning.confdoc > docs/configuration.md`;
a test fails when this page and the configs disagree. Every key can be overridden on the command line
(`polopt-train optimizer.lr=1e-5`), a group option is chosen with `group=option` (`polopt-train objective=gspo`),
and a key that is in no table (a new reward function, a task of a mixture) is added with `+key=value`. Values in
`${...}` are Hydra interpolations.

An option's file sets only what its recipe changes; every other setting of what it builds keeps the code's default
(the settings class, or the callable its `_target_` names), shown below as `value` (code) and written in the file as
a `#| key` line under its comment. `conf/_schema/` holds those defaults as Hydra reads them, generated from the code
(`python -m polopt_lightning.confschema`). So a value without "(code)" is the command line's recipe: a
`PolicyOptimizationModule` built in Python starts from the code's defaults instead (`update.mini_batches` 1, not 2).
One option as the command line composes it, in Python: `polopt_lightning.confschema.option("objective", "dr_grpo")`.
"""


def _entries(text: str, prefix: str, schema: dict[str, str] | None = None
             ) -> tuple[str, list[str], list[tuple[str, str, str]]]:
    """(file description, its defaults list, [(dotted key, value, comment)]) of one YAML file; a ``#| key`` line (a
    key whose default the code gives) takes its value from ``schema`` (dotted key -> value)."""
    lines = text.splitlines()
    description: list[str] = []
    i = 0
    while i < len(lines) and (lines[i].startswith("#") or not lines[i].strip()):
        if not lines[i].strip() and description:  # a blank line ends the description: comments below are a key's
            break
        line = lines[i].lstrip("#").strip()
        if line and not line.startswith("@package"):
            description.append(line)
        i += 1
    defaults: list[str] = []
    entries: list[tuple[str, str, str]] = []
    stack: list[tuple[int, str]] = []  # (indent, key) of the open mappings
    comment: list[str] = []
    in_defaults = False
    for line in lines[i:]:
        stripped = line.strip()
        if not stripped:
            comment = []
            continue
        documented = _DOCUMENTED.match(line)
        if documented:
            indent, key = len(documented["indent"]), documented["key"]
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = ".".join([p for p in (prefix, *[k for _, k in stack], key) if p])
            entries.append((path, (schema or {}).get(path, ""), " ".join(comment)))
            comment = []
            continue
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        if in_defaults and stripped.startswith("-"):
            match = _DEFAULT.match(line)
            if match:
                defaults.append(f"{match['group']}: {match['value']}")
            continue
        match = _KEY.match(line)
        if not match:  # a list item of a value, or a continuation
            comment = []
            continue
        indent, key, value = len(match["indent"]), match["key"].strip("'\""), (match["value"] or "").strip()
        in_defaults = indent == 0 and key == "defaults" and not value
        if in_defaults:
            comment = []
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([p for p in (prefix, *[k for _, k in stack], key) if p])
        if value:
            entries.append((path, value, " ".join(comment)))
        elif comment:
            entries.append((path, "", " ".join(comment)))
        if not value:
            stack.append((indent, key))
        comment = []
    return " ".join(description), defaults, entries


def _schema_values(root: Path, text: str, prefix: str) -> dict[str, str]:
    """The values the file's ``/_schema/...`` includes give: dotted key -> the value as YAML writes it."""
    import yaml

    from .confschema import flow

    values: dict[str, str] = {}
    for line in text.splitlines():
        match = _SCHEMA.match(line)
        if match:
            where = "" if match["at"] == "_here_" else match["at"]
            base = ".".join(p for p in (prefix, where) if p)
            schema = yaml.safe_load((root / "_schema" / f"{match['name']}.yaml").read_text()) or {}
            values.update({f"{base}.{key}" if base else key: flow(value) for key, value in schema.items()})
    return values


def _with_schema(root: Path, text: str, prefix: str) -> tuple[str, list[str], list[tuple[str, str, str]]]:
    """:func:`_entries` with the code's defaults (the schemas the file includes) as the values of its ``#| key``
    lines, marked as the code's."""
    values = _schema_values(root, text, prefix)
    return _entries(text, prefix, {key: CODE + value for key, value in values.items()})


def _table(entries: list[tuple[str, str, str]]) -> list[str]:
    if not entries:
        return ["(no keys)", ""]
    rows = ["| key | default | what it does |", "|---|---|---|"]
    for key, value, comment in entries:
        shown = f"`{value.lstrip(CODE)}` (code)" if value.startswith(CODE) else f"`{value}`" if value else ""
        rows.append(f"| `{key}` | {shown.replace('|', '&#124;')} | {comment.replace('|', '&#124;')} |")
    return [*rows, ""]


def render(conf: str | Path | None = None) -> str:
    """The configuration reference as Markdown."""
    root = Path(conf or config_dir())
    primary = (root / "train.yaml").read_text()
    description, defaults, entries = _with_schema(root, primary, "")
    chosen = dict(d.split(": ", 1) for d in defaults)
    out = [HEADER, "## The primary config (`conf/train.yaml`)", "", description, "",
           "Defaults list (one option per group): " + ", ".join(f"`{d.replace(': ', '=')}`" for d in defaults), "",
           *_table(entries)]
    for group in sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))):
        options = sorted((root / group).glob("*.yaml"))
        if not options:
            continue
        out += [f"## `{group}`", ""]
        for path in options:
            text = path.read_text()
            is_global = "@package _global_" in text
            description, option_defaults, entries = _with_schema(root, text, "" if is_global else group)
            mark = " (default)" if chosen.get(group) == path.stem else ""
            out += [f"### `{group}={path.stem}`{mark}", "", description, ""]
            if option_defaults:
                out += ["Starts from: " + ", ".join(f"`{d.replace(': ', '=')}`" for d in option_defaults), ""]
            out += _table(entries)
    return "\n".join(out).rstrip() + "\n"


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
