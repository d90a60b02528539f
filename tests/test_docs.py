"""The docs stay true: the configuration reference equals what the configs say, every config key is explained,
the README stays a front page whose links resolve, and the recipes' Python blocks run."""

import re
import shlex
from pathlib import Path

from polopt_lightning.confdoc import _entries, render

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_configuration_reference_matches_the_configs():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(ROOT / "conf"), (
        "docs/configuration.md is stale: run `python -m polopt_lightning.confdoc > docs/configuration.md`")


def test_every_config_key_has_a_comment():
    """Every key of every option is explained: by the comment above it (or above its ``#| key``), by another option
    of the group, or by the docstring of what it builds (a key only the code's schema holds)."""
    bare = []
    for path in sorted((ROOT / "conf").rglob("*.yaml")):
        if path.parent.name == "_schema":
            continue
        for key, _value, comment in _entries(path.read_text(), "")[2]:
            if not comment and not key.endswith("_target_"):
                bare.append(f"{path.relative_to(ROOT)}: {key}")
    bare += [row for row in render(ROOT / "conf").splitlines()
             if row.startswith("| `") and row.endswith("|  |") and "._target_`" not in row]
    assert not bare, "keys without a comment above them:\n" + "\n".join(bare)


def _commands(page: Path) -> list[list[str]]:
    """The ``polopt-train`` command lines of a page's shell blocks, as argument lists (comments and placeholders
    left out; a multirun's sweep reduced to its first value)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if not line.startswith("polopt-train") or "<" in line:
                continue
            args = shlex.split(line)[1:]
            if "-m" in args or "--multirun" in args:  # a sweep: its first value of each swept key
                args = [a.split("=", 1)[0] + "=" + a.split("=", 1)[1].split(",")[0] if "=" in a else a
                        for a in args if a not in ("-m", "--multirun")]
            out.append(args)
    return out


def test_the_documented_command_lines_compose():
    """Every `polopt-train` line the README and the docs show is a configuration Hydra composes, with no key renamed
    (the docs use the current names) and every group option present."""
    from hydra import compose, initialize_config_dir

    from polopt_lightning.cli import renamed

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    commands = [(page.name, args) for page in pages for args in _commands(page)]
    assert len(commands) >= 20
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for name, args in commands:
            said: list[str] = []
            assert renamed(args, said) == args, f"{name}: {' '.join(args)} uses moved keys: {said}"
            compose(config_name="train", overrides=args)


def test_the_docs_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if target.startswith("http"):
                continue
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
    for doc in ("docs/configuration.md", "docs/recipes.md", "docs/performance.md", "docs/default_job.md"):
        assert f"]({doc})" in README, f"README does not link {doc}"


def _python_blocks(page: Path):
    text = page.read_text()
    for match in re.finditer(r"```python\n(.*?)```", text, re.S):
        before = text[: match.start()].rsplit("\n\n", 1)[-1]
        yield match.group(1), "needs the hub" in before.lower()


def test_recipes_python_blocks_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocks = list(_python_blocks(ROOT / "docs" / "recipes.md"))
    assert len(blocks) >= 4
    namespace: dict = {}
    for code, needs_hub in blocks:
        if needs_hub:
            continue
        exec(compile(code, "docs/recipes.md", "exec"), namespace)
    assert (tmp_path / "train.jsonl").is_file() and (tmp_path / "trained" / "config.json").is_file()
    assert (tmp_path / "qlora_merged" / "config.json").is_file()
    assert (tmp_path / "qlora_adapter" / "adapter_model.safetensors").is_file()
    assert "<user>2+3=\n<assistant>" in capsys.readouterr().out
    assert namespace["format_reward"]([""], [" 12"]) == [1.0]
    assert namespace["correctness"]([""], ["5"], answer=["5"]) == [1.0]
    assert namespace["exact_chat"](completions=[[{"role": "assistant", "content": " 5"}]], answer=["5"],
                                   trainer_state=None) == [1.0]
    assert len(namespace["gsm_train"]) == 16 and namespace["gsm_train"][0]["answer"].isdigit()
    assert namespace["loop"].global_step == 2 and float(namespace["metrics"]["grad_norm"]) > 0  # the loop of your own


def test_multitask_python_block_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocks = list(_python_blocks(ROOT / "docs" / "multitask.md"))
    assert len(blocks) == 1
    exec(compile(blocks[0][0], "docs/multitask.md", "exec"), {})
    assert "'sort':" in capsys.readouterr().out


def test_the_architecture_page_places_every_file():
    """docs/architecture.md names every module of the package (issue 50: every file on a part)."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    package = ROOT / "polopt_lightning"
    files = [p for p in sorted(package.rglob("*.py")) if p.name != "__init__.py"] + sorted(package.rglob("*.c"))
    unplaced = [str(p.relative_to(package)) for p in files if f"`{p.name}`" not in page
                and f"`{p.relative_to(package).as_posix()}`" not in page]
    assert not unplaced, f"files docs/architecture.md does not place: {unplaced}"
