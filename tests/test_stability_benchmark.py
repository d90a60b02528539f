"""benchmarks/stability.py in its quick form: the pipeline writes its table, curves and plots (not a result)."""

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_study_writes_results_curves_and_plots(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stability.py"), "--out", str(tmp_path / "out"),
                           "--runs", str(tmp_path / "runs"), "--quick", "--seeds", "0", "--jobs", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [(r["objective"], r["mode"]) for r in rows] == [("grpo", "warn"), ("gspo", "warn")]
    for column in ("objective", "warm_start", "num_iterations", "mini_batches", "lr", "seed", "accuracy_before",
                   "accuracy_best", "accuracy_final", "best_rollout", "collapsed", "events", "completions"):
        assert all(r[column] != "" for r in rows), column
    assert all(int(r["completions"]) == 6 * 64 for r in rows)  # equal budgets: 6 rollouts of 8 x 8
    metrics = {line["metric"] for line in csv.DictReader(open(out / "curves.csv"))}
    assert {"val/accuracy", "train/entropy", "train/kl"} <= metrics  # track_kl: the KL to the start, beta = 0
    assert (out / "accuracy.png").stat().st_size > 1000 and (out / "entropy.png").stat().st_size > 1000
    assert "| warn | good | on | 4e-05 | grpo | 1 |" in (out / "summary.md").read_text()
