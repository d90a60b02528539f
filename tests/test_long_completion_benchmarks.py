"""The long-completion benchmarks' smoke runs: benchmarks/lm_head.py (the head's three implementations: the fused head,
the head's own product with the chunked log-softmax, TRL's where installed) and benchmarks/passes.py (the passes
padded and padding-free), each case in a process of its own, with their ratios."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "lm_head.py"
PASSES = SCRIPT.parent / "passes.py"


@pytest.mark.slow  # three processes (~15 s): python -m pytest -m slow
def test_a_small_run_times_and_measures_each_implementation(tmp_path):
    impls = ["fused", "chunked"] + (["trl"] if importlib.util.find_spec("trl") else [])
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--rows", "300", "--vocab", "3000", "--hidden", "64",
                           "--repeats", "2", "--entropy", "--impls", *impls, "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert [r["impl"] for r in run["results"]] == impls and run["cpu"]
    for r in run["results"]:
        assert r["rows"] == 300 and r["entropy"] and len(r["seconds"]) == 2 and r["median_s"] > 0
        assert r["onednn"] is False  # a 64 x 3,000 head is below the oneDNN products' size
    assert "fused / chunked: time" in proc.stdout


@pytest.mark.slow  # three processes (~20 s): python -m pytest -m slow
def test_a_small_run_of_the_passes_counts_real_and_padded_tokens(tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, str(PASSES), "--shape", "small", "--max-tokens", "64", "--repeats", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["case"] for r in results] == ["padded", "padded+fused", "padding-free+fused"]
    lengths = results[0]["lengths"]
    assert all(r["lengths"] == lengths for r in results) and len(set(lengths)) > 1  # the same, varied lengths
    assert results[0]["real_tokens"] == sum(lengths) < results[0]["padded_tokens"] == 8 * max(lengths)
    for r in results:
        assert all(r[p]["median_s"] > 0 and len(r[p]["seconds"]) == 1 for p in ("reference", "training"))
    assert "padding-free+fused / padded: reference time" in proc.stdout
