"""benchmarks/multitask.py in its quick form: the pipeline writes its table, curves and plots (not a result)."""

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_multitask_study_writes_results_curves_and_plots(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multitask.py"), "--out", str(tmp_path / "out"),
                           "--runs", str(tmp_path / "runs"), "--quick", "--seeds", "0", "--jobs", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [(r["weights"], r["anchor"]) for r in rows] == [("static", "none"), ("signal", "constant")]
    for column in ("sort_before", "sort_best", "reverse_final", "count_final", "count_weight_final", "accuracy_best"):
        assert all(r[column] != "" for r in rows), column
    assert all(int(r["completions"]) == 6 * 64 for r in rows)  # equal budgets: 6 rollouts of 8 x 8
    metrics = {line["metric"] for line in csv.DictReader(open(out / "curves.csv"))}
    assert {"weights/sort", "weights/count", "val/reverse/accuracy"} <= metrics
    assert (out / "weights.png").stat().st_size > 1000 and (out / "accuracy.png").stat().st_size > 1000
    summary = (out / "summary.md").read_text()
    assert "| grpo | static | none | 1 |" in summary and "| grpo | signal | constant |" in summary
