"""The docs stay true: the configuration reference equals what the configs say, every config key is explained,
the README stays a front page whose links resolve, and the recipes' Python blocks run."""

import re
from pathlib import Path

from polopt_lightning.confdoc import _entries, render

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_configuration_reference_matches_the_configs():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(ROOT / "conf"), (
        "docs/configuration.md is stale: run `python -m polopt_lightning.confdoc > docs/configuration.md`")


def test_every_config_key_has_a_comment():
    bare = []
    for path in sorted((ROOT / "conf").rglob("*.yaml")):
        for key, _value, comment in _entries(path.read_text(), "")[2]:
            if not comment and not key.endswith("_target_"):
                bare.append(f"{path.relative_to(ROOT)}: {key}")
    assert not bare, "keys without a comment above them:\n" + "\n".join(bare)


def test_readme_is_a_front_page_and_its_links_resolve():
    assert len(README) < 12_000, f"README.md has {len(README)} characters; long material goes to docs/"
    for section in ("## Set-up: two commands", "## Quick start", "## The default job", "## Performance against",
                    "## Objectives", "## Documentation"):
        assert section in README
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


def test_multitask_python_block_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocks = list(_python_blocks(ROOT / "docs" / "multitask.md"))
    assert len(blocks) == 1
    exec(compile(blocks[0][0], "docs/multitask.md", "exec"), {})
    assert "'sort':" in capsys.readouterr().out
