"""benchmarks/tool_task.py in its quick form: `polopt-train experiment=tool_arithmetic` from the command line with and
without the tool (rollout=tools, its tools by import path), the table written (a pipeline check, not a result)."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # three command-line runs (~50 s): python -m pytest -m slow
def test_quick_tool_task_runs_from_the_command_line_and_writes_its_table(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tool_task.py"), "--out", str(tmp_path / "out"),
                           "--runs", str(tmp_path / "runs"), "--quick", "--seeds", "0", "--jobs", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "out" / "results.csv")))
    assert sorted(r["setting"] for r in rows) == ["direct", "no_tool", "tool"]
    tool = next(r for r in rows if r["setting"] == "tool")
    assert tool["tool_calls_first"] != "" and tool["tool_calls_last"] != ""  # multi-turn metrics were logged
    assert all(r["tool_calls_first"] == "" for r in rows if r["setting"] != "tool")  # one turn: none
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| tool | 1 |" in summary and "tool minus no_tool" in summary and "tool minus direct" in summary
