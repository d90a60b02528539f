"""benchmarks/ppo_study.py in its quick form: GRPO against PPO on the default task and per-episode against per-turn
credit on the tool task, each `polopt-train` from the command line, the table written (a pipeline check, not a
result)."""

import pytest

from .helpers import quick_study


@pytest.mark.slow  # four command-line runs (~45 s): python -m pytest -m slow
def test_quick_ppo_study_runs_from_the_command_line_and_writes_its_table(tmp_path):
    rows, summary = quick_study("ppo_study.py", tmp_path)
    assert sorted((r["study"], r["setting"]) for r in rows) == [("default", "grpo"), ("default", "ppo"),
                                                                 ("tool", "episode"), ("tool", "turn")]
    # the critic's explained variance was logged by the PPO run only
    assert [r["explained_variance_last"] != "" for r in rows if r["study"] == "default"] == [False, True]
    assert "ppo minus grpo" in summary and "turn minus episode" in summary
