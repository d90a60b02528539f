"""benchmarks/tool_task.py in its quick form: `polopt-train experiment=tool_arithmetic` from the command line with and
without the tool (rollout=tools, its tools by import path), the table written (a pipeline check, not a result)."""

import pytest

from .helpers import quick_study


@pytest.mark.slow  # three command-line runs (~50 s): python -m pytest -m slow
def test_quick_tool_task_runs_from_the_command_line_and_writes_its_table(tmp_path):
    rows, summary = quick_study("tool_task.py", tmp_path)
    assert sorted(r["setting"] for r in rows) == ["direct", "no_tool", "tool"]
    tool = next(r for r in rows if r["setting"] == "tool")
    assert tool["tool_calls_first"] != "" and tool["tool_calls_last"] != ""  # multi-turn metrics were logged
    assert all(r["tool_calls_first"] == "" for r in rows if r["setting"] != "tool")  # one turn: none
    assert "| tool | 1 |" in summary and "tool minus no_tool" in summary and "tool minus direct" in summary
