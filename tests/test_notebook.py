"""The quick-start notebook executes top to bottom (with fewer steps to stay fast)."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebooks' tests need nbformat and nbclient (the dev extra)")
NotebookClient = pytest.importorskip("nbclient", reason="the notebooks' tests need nbclient (the dev extra)").NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKSTART_STEPS", "4")
    monkeypatch.setenv("QUICKSTART_WARM", "20")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    except Exception as exc:  # a missing kernel is an install problem, not a pass
        if "No such kernel" in str(exc):
            pytest.fail(f"no python3 Jupyter kernel in this environment: {exc}")
        raise
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "held-out accuracy:" in outputs
    assert (tmp_path / "outputs" / "quickstart_logs").is_dir()  # outputs/ is git-ignored
    assert (tmp_path / "outputs" / "quickstart_model" / "config.json").is_file()


def test_grpo_vs_gspo_notebook_reads_the_study(tmp_path, monkeypatch):
    """It reads the committed study (docs/stability) and prints the comparison its conclusion quotes."""
    study = NOTEBOOK.parents[1] / "docs" / "stability"
    assert (study / "results.csv").is_file(), "docs/stability/results.csv: run benchmarks/stability.py"
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK.parent / "grpo_vs_gspo.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert f"runs from {study}" in outputs and "GSPO - GRPO" in outputs and "all settings: median" in outputs
    assert "CONCLUSION" not in nb.cells[-1].source  # the paragraph is written from the measurements


def test_multi_turn_notebook_trains_the_tool_task(tmp_path, monkeypatch):
    """It warm-starts, shows a conversation with a tool call, trains on multi-turn rollouts and shows it again (a few
    steps here: the learning itself is benchmarks/tool_task.py's)."""
    monkeypatch.setenv("MULTI_TURN_WARM", "20")
    monkeypatch.setenv("MULTI_TURN_STEPS", "2")
    monkeypatch.setenv("MULTI_TURN_VAL", "16")
    monkeypatch.setenv("POLOPT_CACHE", str(tmp_path / "cache"))
    nb = nbformat.read(NOTEBOOK.parent / "multi_turn.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert outputs.count("assistant") >= 2 and "in the context" in outputs and "held-out accuracy" in outputs
