"""benchmarks/small_models.py's smoke run: the default job's shape at equal samples against TRL, each trainer from the
same warm-started weights, both scored by one function (skipped, saying so, where TRL is not installed)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "small_models.py"


@pytest.mark.slow  # four processes (~45 s): python -m pytest -m slow
def test_a_small_run_trains_both_from_the_same_weights_and_scores_them_alike(tmp_path):
    if importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed (the bench extra): the benchmark compares against it")
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tasks", "arithmetic", "--seeds", "0", "--rollouts", "3",
                           "--val-size", "30", "--warm", "warm_start.steps=20", "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["rollouts"] == 3 and len(run["runs"]) == 1
    (one,) = run["runs"]
    assert one["task"] == "arithmetic" and one["warm_start"]["ran"]
    for impl in ("polopt", "trl"):
        assert one[impl]["rl_s"] > 0 and 0.0 <= one[impl]["accuracy"] <= 1.0
    assert "| arithmetic | 1 |" in proc.stdout and "TRL / polopt time" in proc.stdout
