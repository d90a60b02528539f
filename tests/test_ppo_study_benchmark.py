"""benchmarks/ppo_study.py in its quick form: GRPO against PPO on the default task and per-episode against per-turn
credit on the tool task, each `polopt-train` from the command line, the table written (a pipeline check, not a
result)."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # four command-line runs (~45 s): python -m pytest -m slow
def test_quick_ppo_study_runs_from_the_command_line_and_writes_its_table(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ppo_study.py"), "--out", str(tmp_path / "out"),
                           "--runs", str(tmp_path / "runs"), "--quick", "--seeds", "0", "--jobs", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "out" / "results.csv")))
    assert sorted((r["study"], r["setting"]) for r in rows) == [("default", "grpo"), ("default", "ppo"),
                                                                 ("tool", "episode"), ("tool", "turn")]
    # the critic's explained variance was logged by the PPO run only
    assert [r["explained_variance_last"] != "" for r in rows if r["study"] == "default"] == [False, True]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "ppo minus grpo" in summary and "turn minus episode" in summary
