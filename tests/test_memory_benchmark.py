"""benchmarks/memory.py runs every setting of the job end to end (on a small shape, polopt only: TRL is the `bench`
extra's), writes its rows, and --summarize pools runs into medians with ranges."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "memory.py"


@pytest.mark.slow  # a benchmark's smoke run (~40 s): python -m pytest -m slow
def test_memory_benchmark_runs_each_setting_and_summarizes(tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shape", "small", "--impls", "polopt", "--steps", "2",
                           "--model-dir", str(tmp_path / "model"), "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["meta"]["shape"] == "small" and run["meta"]["job"]["beta"] > 0
    rows = {r["setting"]: r for r in run["rows"]}
    assert set(rows) == {"none", "lora", "int8+lora", "nf4+lora"}  # a setting that failed would be missing
    for row in rows.values():
        assert len(row["step_s"]) == 2 and all(t > 0 for t in row["step_s"])
        assert 0 < row["load_peak_gib"] < 8 and 0 < row["train_peak_gib"] < 8
    assert "| nf4+lora |" in proc.stdout and "polopt peak / its full fine-tuning" in proc.stdout
    proc = subprocess.run([sys.executable, str(SCRIPT), "--summarize", str(out), str(out)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 runs pooled" in proc.stdout and "| int8+lora |" in proc.stdout
