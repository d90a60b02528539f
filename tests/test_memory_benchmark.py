"""benchmarks/memory.py runs every setting of the job end to end (on a small shape, polopt only: TRL is the `bench`
extra's), writes its rows, and --summarize pools runs into medians with ranges."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import run_if

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


@run_if("glibc")
def test_the_heap_sampler_reads_each_phases_live_and_held_memory():
    """``--heap`` (lengths.py, real_scale.py): a phase that holds 256 MiB at once reads at least that much live, the
    phase after it (the block freed) reads less; each reading is attributed to the phase it came in."""
    sys.path.insert(0, str(SCRIPT.parent))
    import time

    import torch
    from memory import Phases

    class Work:
        def hold(self):
            block = torch.ones(2**26)  # 256 MiB, filled: its pages are resident
            time.sleep(0.1)  # the sampler reads every 5 ms
            return float(block[-1])

        def light(self):
            time.sleep(0.1)

    work, phases = Work(), Phases(heap=True)
    if phases.heap is None:
        pytest.skip("this C library has no mallinfo2 (glibc >= 2.33)")
    phases.wrap(work, "hold", "training")
    phases.wrap(work, "light", "reference")
    try:
        phases.start()
        work.hold()
        work.light()
        phases.end(0.3)
    finally:
        phases.heap.close()
    (step,) = phases.heap_steps
    live_training, held_training = step["training"]
    assert live_training >= 0.25 and held_training >= live_training
    assert step["reference"][0] < live_training - 0.2


def test_the_machine_label_says_when_another_cpu_kind_is_emulated(monkeypatch):
    """A figure measured with the libraries' instructions capped (AVX2 emulated on an AVX-512 CPU) says so next to the
    CPU's own features; without the settings, the label is the CPU's alone."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import memory

    for name in memory.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    plain = memory.cpu_description()
    assert "capped" not in plain
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    capped = memory.cpu_description()
    assert capped.startswith(plain) and "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2" in capped
