"""benchmarks/async_pipeline.py's smoke run: each mode (in-process sampling, a server taking turns, the pipeline) as
polopt-train runs it, a server process started and stopped for the server modes, the figures written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "async_pipeline.py"


@pytest.mark.slow  # three polopt-train runs and two servers (~40 s): python -m pytest -m slow
def test_a_small_run_of_each_mode_writes_its_figures(tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shape", "heavy", "--seeds", "0", "--json", str(out),
                           "--runs", str(tmp_path / "runs"), "--", "trainer.max_steps=4", "model.hidden_size=64",
                           "model.num_layers=1", "model.num_heads=2", "generation.max_new_tokens=8",
                           "generation.min_new_tokens=8"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["cpu"] and run["shape"] == "heavy"
    assert [r["mode"] for r in run["runs"]] == ["hf", "server", "server-async"]
    for r in run["runs"]:
        assert r["steps"] == 4 and r["rl_wall_s"] > 0
    for mode in ("server", "server-async"):  # the servers sampled the rollouts, the pipeline's one version behind
        log = (tmp_path / "runs" / f"{mode}_seed0" / "server.log").read_text()
        assert "weights version 1 received" in log and "sampled 8 x 8 completions" in log
    summary = proc.stdout.split("acc after")[1].splitlines()[1:]  # a row per mode, ratios to the first
    assert [row.split()[0] for row in summary if row.strip()] == ["hf", "server", "server-async"]
    assert "x1.00" in summary[0] and all(" x" in row for row in summary if row.strip())
