"""benchmarks/real_scale.py: the phase floors by hand at the 0.5B shape, and a smoke run on a small shape whose
phases add up to each step (polopt in the default run; TRL, the `bench` extra's, where it is installed)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "real_scale.py"
sys.path.insert(0, str(SCRIPT.parent))
spec = importlib.util.spec_from_file_location("real_scale", SCRIPT)
real_scale = importlib.util.module_from_spec(spec)
spec.loader.exec_module(real_scale)


def test_floors_count_the_head_and_the_vocabulary_at_the_05b_shape():
    n = real_scale.shape_numbers("qwen2.5-0.5b")
    assert n["total"] == 494_032_768 and n["embedding"] == 151936 * 896  # Qwen2.5-0.5B, tied embeddings
    rates, bw = {"float32": 200.0, "bfloat16": 400.0}, 40.0
    f = real_scale.phase_floors(n, "fp32", "polopt", rates, bw)
    # each of the 16 tokens reads every weight (the head included) once and the 8 x 151,936 logits twice
    per_token_bytes = n["total"] * 4 + 2 * 8 * 151936 * 4
    assert per_token_bytes / 40e9 > 2 * (n["non_embedding"] + n["embedding"]) * 8 / 200e9  # memory-bound
    prefill = 2 * n["non_embedding"] * 2 * 32 / 200e9
    assert f["rollout"] == pytest.approx(prefill + 16 * per_token_bytes / 40e9, rel=0.02)  # + the KV cache
    scored = 2 * n["non_embedding"] * (2 * 32 + 8 * 16) + 2 * n["embedding"] * 8 * 16
    assert f["reference"] == pytest.approx(scored / 200e9) and f["training"] == pytest.approx(3 * scored / 200e9)
    assert f["rest"] == pytest.approx(32 * n["total"] / 40e9)
    # an adapter trains a few million weights and skips the weights' gradients; bf16 halves the sampled bytes
    lora = real_scale.phase_floors(n, "lora", "polopt", rates, bw)
    assert lora["training"] == pytest.approx(2 * scored / 200e9) and lora["rest"] < f["rest"] / 50
    bf16 = real_scale.phase_floors(n, "fp32", 'polopt:rollout_dtype="bfloat16"', rates, bw)
    assert 0.45 < bf16["rollout"] / f["rollout"] < 0.6
    nf4, slow = (real_scale.phase_floors(n, s, "polopt", rates, 1.0)["rollout"] for s in ("nf4+lora", "lora"))
    assert 0.3 < nf4 / slow < 0.4  # memory-bound: 4-bit blocks, the 544 MB head in fp32
    trl_mixed = real_scale.phase_floors(n, "bf16-mixed", "trl", rates, bw)  # reads its fp32 weights
    assert trl_mixed["rollout"] == pytest.approx(f["rollout"] - prefill / 2, rel=0.01)  # prefill at the bf16 rate
    assert trl_mixed["training"] == pytest.approx(f["training"] / 2)
    # under bf16-mixed polopt samples what its trials recorded: the float32 policy through oneDNN on the CPU
    self_sampled = real_scale.phase_floors(n, "bf16-mixed", "polopt", rates, bw, sampled="float32")
    assert self_sampled["rollout"] == pytest.approx(f["rollout"]) and self_sampled["training"] == trl_mixed["training"]
    copy = real_scale.phase_floors(n, "bf16-mixed", "polopt", rates, bw, sampled="bfloat16")
    assert copy["rollout"] == pytest.approx(real_scale.phase_floors(n, "bf16-mixed", "polopt", rates, bw)["rollout"])
    assert 0.45 < copy["rollout"] / f["rollout"] < 0.6


def _smoke(tmp_path, impls, *extra, settings=("fp32", "lora")):
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shape", "small", "--steps", "2", "--trials", "1",
                           "--settings", *settings, "--impls", *impls, "--model-dir", str(tmp_path / "model"),
                           "--json", str(out), *extra], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.slow  # a benchmark's smoke run (~45 s; longer where bf16 has no hardware): python -m pytest -m slow
def test_a_small_run_records_every_phase_of_every_step(tmp_path):
    stdout, run = _smoke(tmp_path, ["polopt", 'polopt:rollout_dtype="bfloat16"'])
    assert [r["setting"] for r in run["rows"]] == ["fp32", "lora"]
    for row in run["rows"]:
        for impl, trials in row["trials"].items():
            assert len(trials) == 1 and all(v > 0 for v in row["floors"][impl].values())
            # asked of the engine inside the step: the bf16 sampler where it is asked for, else the policy itself
            want = "bfloat16" if "rollout_dtype" in impl else "float32"
            assert [t["sample_dtype"] for t in trials] == [want], impl
            for trial in trials:
                assert len(trial["step_s"]) == 2 and len(trial["phases"]) == 2
                for step, phases, peaks in zip(trial["step_s"], trial["phases"], trial["phase_peaks"]):
                    assert set(phases) == set(real_scale.PHASES) == set(peaks)
                    assert sum(phases.values()) == pytest.approx(step) and phases["rest"] >= 0
                    assert 0 < max(peaks.values()) <= trial["train_peak_gib"]
    assert "| fp32 | polopt |" in stdout and "floor" in stdout and "Peak resident memory in each phase" in stdout
    pooled = subprocess.run([sys.executable, str(SCRIPT), "--summarize", *[str(tmp_path / "run.json")] * 2],
                            capture_output=True, text=True, timeout=120)
    assert pooled.returncode == 0 and "2 runs pooled" in pooled.stdout, pooled.stderr[-2000:]


@pytest.mark.slow  # the smoke run with TRL beside it (~60 s): python -m pytest -m slow
def test_trl_phases_and_the_paired_speed_up(tmp_path):
    if importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed (the bench extra: pip install -e '.[bench]')")
    stdout, run = _smoke(tmp_path, ["polopt", "trl"])
    for row in run["rows"]:
        for trial in row["trials"]["trl"]:
            assert all(set(p) == set(real_scale.PHASES) and p["reference"] > 0 and p["training"] > 0
                       for p in trial["phases"])
    assert "pairs" in stdout


@pytest.mark.slow  # a smoke run (~30 s): python -m pytest -m slow
def test_the_jobs_sizes_come_from_the_command_line_to_every_trial(tmp_path, monkeypatch):
    """``--new-tokens``, ``--generations``, ``--prompts``: the long-completion runs (docs/performance.md, "Long
    completions") size the job from the command line; every child trains that job and the floors count it."""
    default = real_scale.phase_floors(real_scale.shape_numbers("small"), "fp32", "polopt", {"float32": 200.0,
                                      "bfloat16": 400.0}, 40.0)
    stdout, run = _smoke(tmp_path, ["polopt", 'polopt:update={"fused_head":true}'], "--new-tokens", "40",
                         "--generations", "4", "--prompts", "1", settings=("fp32",))
    job = {**real_scale.JOB, "new_tokens": 40, "generations": 4, "prompts": 1}
    assert run["job"] == job and f"job: {job}" in stdout
    assert all(t["job"] == job for trials in run["rows"][0]["trials"].values() for t in trials)
    for key, value in job.items():  # the floors of the job run (this process's JOB is the script's)
        monkeypatch.setitem(real_scale.JOB, key, value)
    long = real_scale.phase_floors(run["numbers"], "fp32", "polopt", {"float32": 200.0, "bfloat16": 400.0}, 40.0)
    assert long["training"] > default["training"]  # 4 x 40 completion tokens against 8 x 16


def test_pooled_runs_measure_each_step_against_its_own_runs_floors():
    def run(gflops, seconds):
        trial = {"step_s": [9.0, *seconds], "phases": [{"training": 9.0}, *({"training": s} for s in seconds)]}
        return {"rows": [{"setting": "fp32", "interleave": False, "trials": {"polopt": [trial]},
                          "floors": {"polopt": {"training": 1000.0 / gflops, "rest": 0.0}}}]}

    fast, slow = run(1000.0, [1.5, 1.5]), run(500.0, [3.0, 3.0])  # the same 1.5x of each run's own floor
    row = real_scale.pool([fast, slow])[0]
    ratios, floors = real_scale.floor_ratios(row, "polopt", row["trials"]["polopt"], "training")
    assert ratios == [1.5] * 4 and floors == [1.0, 2.0]  # the last run's floor alone would say 0.75x and 1.5x
    assert real_scale.floor_cell(ratios, floors) == "floor 1.00-2.00 (1.50x)"
    whole, _ = real_scale.floor_ratios(row, "polopt", row["trials"]["polopt"])
    assert whole == [1.5] * 4
    # a run that recorded its rates gets its floors by the current rules, in the row and in each trial
    measured = {"numbers": real_scale.shape_numbers("qwen2.5-0.5b"), "gflops": {"float32": 200.0, "bfloat16": 400.0},
                "memory_gbps": 40.0, **run(1000.0, [1.5])}
    current = real_scale.phase_floors(measured["numbers"], "fp32", "polopt", measured["gflops"], 40.0)
    row = real_scale.pool([measured])[0]
    assert row["floors"]["polopt"] == current and row["trials"]["polopt"][0]["floors"] == current
