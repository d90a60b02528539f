"""Render ``docs/configuration.md`` from the shipped configs: every group, option and key with its comment.

Each key in ``conf/`` carries the comment above it (what it does, its unit); this page is made from those comments,
and a test checks that the committed page equals what this renders, so the reference cannot drift from the configs.

    python -m polopt_lightning.confdoc > docs/configuration.md
"""

from __future__ import annotations

import re
from pathlib import Path

from .cli import config_dir

_SCHEMA = re.compile(r"^\s*-\s*/_schema/(?P<name>\w+)@(?P<at>[\w.]+)\s*$")
_DOCUMENTED = re.compile(r"^(?P<indent>\s*)#\|\s*(?P<key>[A-Za-z_]\w*)\s*$")  # a key the schema gives, documented
_KEY = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z_][\w.]*|'[^']+'|\"[^\"]+\"):(?:\s+(?P<value>.*))?$")
_DEFAULT = re.compile(r"^\s*-\s*(?:override\s+)?(?P<group>[\w/]+):\s*(?P<value>\S+)\s*$")

HEADER = """# Configuration reference

Generated from the shipped configs (`conf/`) by `python -m polopt_lightning.confdoc > docs/configuration.md`;
a test fails when this page and the configs disagree. Every key can be overridden on the command line
(`polopt-train optimizer.lr=1e-5`), a group option is chosen with `group=option` (`polopt-train objective=gspo`),
and a key that is in no table (a new reward function, a task of a mixture) is added with `+key=value`. Values in
`${...}` are Hydra interpolations. Each default shown is the code's (the settings class or the callable a `_target_`
names, rendered under `conf/_schema/`) unless the option sets its own: an option's file holds only what it changes.
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


def _schema_values(root: Path, text: str, prefix: str) -> tuple[dict[str, str], dict[str, str]]:
    """The values the file's ``/_schema/...`` includes give (dotted key -> value as YAML writes it) and the
    descriptions of their callables' docstrings (dotted key -> text)."""
    import yaml

    from .confschema import arg_docs, flow

    values: dict[str, str] = {}
    docs: dict[str, str] = {}
    for line in text.splitlines():
        match = _SCHEMA.match(line)
        if not match:
            continue
        schema = root / "_schema" / f"{match['name']}.yaml"
        where = "" if match["at"] == "_here_" else match["at"]
        base = ".".join(p for p in (prefix, where) if p)
        head = re.search(r"The defaults of (\S+),", schema.read_text())
        described = arg_docs(head[1]) if head else {}
        for key, value in (yaml.safe_load(schema.read_text()) or {}).items():
            path = f"{base}.{key}" if base else key
            values[path] = flow(value)
            docs[path] = described.get(key, "")
    return values, docs


def _with_schema(root: Path, text: str, prefix: str, group_docs: dict[str, str] | None = None
                 ) -> tuple[str, list[str], list[tuple[str, str, str]]]:
    """:func:`_entries` with the schema's values filled in and its keys the file does not mention added, described by
    the comment another option of the group has for that key (``group_docs``), else by the callable's docstring."""
    values, docs = _schema_values(root, text, prefix)
    description, defaults, entries = _entries(text, prefix, values)
    named = {key for key, _, _ in entries}
    entries += [(key, value, (group_docs or {}).get(key) or docs[key])
                for key, value in values.items() if key not in named]
    return description, defaults, entries


def _group_docs(root: Path, options: list[Path], prefix: str) -> dict[str, str]:
    """Each key's comment in the group's options (the first option that has one)."""
    out: dict[str, str] = {}
    for path in options:
        for key, _, comment in _entries(path.read_text(), prefix)[2]:
            if comment:
                out.setdefault(key, comment)
    return out


def _table(entries: list[tuple[str, str, str]]) -> list[str]:
    if not entries:
        return ["(no keys)", ""]
    rows = ["| key | default | what it does |", "|---|---|---|"]
    for key, value, comment in entries:
        shown = f"`{value}`" if value else ""
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
        group_docs = _group_docs(root, options, group)
        for path in options:
            text = path.read_text()
            is_global = "@package _global_" in text
            description, option_defaults, entries = _with_schema(root, text, "" if is_global else group, group_docs)
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
