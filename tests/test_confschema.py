"""One default per setting (issue 50): the code holds each default, ``conf/_schema/`` renders them for Hydra, and the
group options set only what their recipe changes."""

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from polopt_lightning.cli import config_differences
from polopt_lightning.confschema import (
    check,
    code_defaults,
    file_nodes,
    option_files,
    schema_name,
)

CONF = Path(__file__).resolve().parents[1] / "conf"
_DOCUMENTED = re.compile(r"^\s*#\|\s*(\w+)\s*$")


def _same(value, default) -> bool:
    if isinstance(value, str) and "${" in value:  # an interpolation ties a setting to another: not a second default
        return False
    if isinstance(value, bool) or isinstance(default, bool):
        return type(value) is type(default) and value == default
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return value == default
    if isinstance(value, list) and isinstance(default, list):
        return len(value) == len(default) and all(_same(a, b) for a, b in zip(value, default))
    return type(value) is type(default) and value == default


def test_the_schemas_are_the_codes_defaults():
    assert check(CONF) == [], "conf/_schema is stale: run `python -m polopt_lightning.confschema`"


def test_no_setting_has_its_default_written_twice():
    """The settings defined twice: a key an option sets to the value the code gives it anyway. None: such a key is
    documented with ``#| key`` under its comment, and its value comes from the code."""
    twice = []
    for path in option_files(CONF):
        for where, node, target in file_nodes(path, CONF):
            defaults = code_defaults(target)
            twice += [f"{path.relative_to(CONF)}: {'.'.join(p for p in (where, k) if p)} = {v!r}"
                      for k, v in node.items() if k in defaults and _same(v, defaults[k])]
    assert not twice, "settings whose default is written in the YAML and in the code:\n" + "\n".join(twice)


def test_each_built_callable_includes_its_schema_and_names_every_setting():
    """Every node that builds a callable of this package includes that callable's schema (so each of its settings is
    in the composed configuration and overridden without ``+``), names each of its settings (a value, or ``#| key``
    under a comment: a reader of the file finds every key) and each ``#| key`` names one of its settings."""
    problems = []
    for path in option_files(CONF):
        text = path.read_text()
        documented = {m[1] for line in text.splitlines() if (m := _DOCUMENTED.match(line))}
        for where, node, target in file_nodes(path, CONF):
            entry = f"/_schema/{schema_name(target)}@{where or '_here_'}"
            if entry not in text:
                problems.append(f"{path.relative_to(CONF)}: no `- {entry}` in its defaults")
            problems += [f"{path.relative_to(CONF)}: {'.'.join(p for p in (where, k) if p)} is not in the file"
                         for k in code_defaults(target) if k not in node and k not in documented]
        settings = set().union(*[code_defaults(t) for _, _, t in file_nodes(path, CONF)] or [set()])
        problems += [f"{path.relative_to(CONF)}: `#| {m[1]}` is no setting of what the file builds"
                     for line in text.splitlines() if (m := _DOCUMENTED.match(line)) and m[1] not in settings]
    assert not problems, "\n".join(problems)


def _composed(overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def test_a_setting_only_the_code_defines_is_overridden_without_a_plus():
    cfg = _composed(["update.entropy_coef_max=0.5", "reward.functions.exact_match.case_sensitive=false",
                     "generation.top_k=5", "task.min_digits=2"])
    assert cfg["update"].entropy_coef_max == 0.5 and cfg.reward.functions.exact_match.case_sensitive is False
    assert cfg.generation.top_k == 5 and cfg.task.min_digits == 2
    # the recipe's own choices stay theirs, the code's defaults fill the rest
    cfg = _composed()
    update = cfg["update"]  # (cfg.update is DictConfig's own method)
    assert (update.mini_batches, update.lr_schedule, update.entropy_coef_max) == (2, "cosine", 1.0)
    assert cfg.generation.max_new_tokens == 6 and cfg.generation.temperature == 1.0


@pytest.mark.parametrize("change", [None, 0.5])
def test_a_run_saved_before_the_schemas_resumes_and_a_changed_default_is_still_refused(change):
    """A run written by an earlier version holds no key that the code's schema adds now: taking the code's default
    for it is what that run did, so it is no difference; a key it did hold with another value still is."""
    saved = OmegaConf.to_container(_composed(), resolve=False)
    del saved["update"]["entropy_coef_max"]  # an earlier version's options did not write it
    if change is not None:
        saved["update"]["entropy_coef_min"] = change
    differ = config_differences(OmegaConf.create(saved), [], set())
    assert differ == ([] if change is None else ["update.entropy_coef_min: saved 0.5, now 0.0"])


def test_a_dr_grpo_run_saved_with_the_old_length_fallback_resumes():
    """Dr. GRPO's normaliser was ``${oc.select:generation.max_new_tokens,256}`` (a second default, 256, for a
    configuration without a generation block); it is ``${generation.max_new_tokens}`` now that generation is a group.
    A run saved with the old text is no difference; another value still is."""
    saved = OmegaConf.to_container(_composed(["objective=dr_grpo"]), resolve=False)
    assert saved["objective"]["max_completion_length"] == "${generation.max_new_tokens}"
    saved["objective"]["max_completion_length"] = "${oc.select:generation.max_new_tokens,256}"
    assert config_differences(OmegaConf.create(saved), ["objective=dr_grpo"], set()) == []
    saved["objective"]["max_completion_length"] = 64
    assert config_differences(OmegaConf.create(saved), ["objective=dr_grpo"], set()) == [
        "objective.max_completion_length: saved 64, now '${generation.max_new_tokens}'"]


def test_a_run_saved_with_the_old_sampler_correction_mode_resumes():
    """``update.is_mode`` was ``token_truncate`` for every objective (GSPO refused it); it is ``None`` now (a weight a
    token for token-level objectives, one a sequence for GSPO): a run saved with the old default is no difference;
    another mode still is."""
    saved = OmegaConf.to_container(_composed(), resolve=False)
    assert saved["update"]["is_mode"] is None
    saved["update"]["is_mode"] = "token_truncate"
    assert config_differences(OmegaConf.create(saved), [], set()) == []
    saved["update"]["is_mode"] = "token_mask"
    assert config_differences(OmegaConf.create(saved), [], set()) == ["update.is_mode: saved 'token_mask', now None"]
