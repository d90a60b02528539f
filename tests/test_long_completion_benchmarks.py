"""The long-completion benchmarks' smoke runs: benchmarks/lm_head.py (the head's three implementations: the fused head,
the head's own product with the chunked log-softmax, TRL's where installed), benchmarks/passes.py (the passes padded
and padding-free), benchmarks/balance.py (two DDP processes with and without token balancing), lengths.py,
drop_finished.py (a rollout with and without finished rows dropped), decode_positions.py and decode_attention.py
(a cached position's cost in the fused C step and in PyTorch), each case in a process of its own, with their
ratios."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "lm_head.py"
PASSES = SCRIPT.parent / "passes.py"
BALANCE = SCRIPT.parent / "balance.py"


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
                           "--live-memory", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["case"] for r in results] == ["padded", "padded+fused", "padding-free+fused"]
    lengths = results[0]["lengths"]
    assert all(r["lengths"] == lengths for r in results) and len(set(lengths)) > 1  # the same, varied lengths
    assert results[0]["real_tokens"] == sum(lengths) < results[0]["padded_tokens"] == 8 * max(lengths)
    for r in results:
        assert all(r[p]["median_s"] > 0 and len(r[p]["seconds"]) == 1 for p in ("reference", "training"))
        # --live-memory: each case ran with glibc returning its large frees
        assert r["live_memory"] and r["malloc_mmap_threshold"] == "131072"
    assert "padding-free+fused / padded: reference time" in proc.stdout


@pytest.mark.slow  # two 2-process runs (~1 min): python -m pytest -m slow
def test_a_small_balance_run_reports_both_settings_and_the_imbalance(tmp_path):
    proc = subprocess.run([sys.executable, str(BALANCE), "--steps", "3", "--runs", "1", "--new-tokens", "48",
                           "--min-tokens", "4", "--hidden", "64"], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ")[-1])
    assert result["unbalanced_s"] > 0 and result["balanced_s"] > 0
    # group lengths 4..48 drawn per prompt: the processes' tokens differ, and balancing brings them closer
    assert 1.0 <= result["imbalance_after"] < result["imbalance_before"]
    assert "2 steps a setting" in proc.stdout


@pytest.mark.slow  # four processes (~1 min): python -m pytest -m slow
def test_a_small_length_sweep_samples_lengths_below_the_cap_on_both_sides(tmp_path):
    impls = ["polopt"] + (["trl"] if importlib.util.find_spec("trl") else [])
    out, image, folder = tmp_path / "run.json", tmp_path / "run.png", tmp_path / "model"
    proc = subprocess.run([sys.executable, str(SCRIPT.parent / "lengths.py"), "--shape", "small", "--model-dir",
                           str(folder), "--lengths", "32", "96", "--steps", "3", "--impls", *impls, "--json", str(out),
                           "--plot", str(image)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert [row["cap"] for row in run["rows"]] == [32, 96] and image.stat().st_size > 0
    for row in run["rows"]:
        for impl in impls:
            r = row["results"][impl]
            tokens = r["tokens_per_step"]
            # sampled, not forced: below the cap's 8 x cap tokens, more than one token a completion
            assert len(tokens) == 2 and all(8 < t < 8 * row["cap"] for t in tokens), (row["cap"], impl, tokens)
            assert r["step_s"] > 0 and r["peak_gib"] > 0 and set(r["phases"]) == {"rollout", "reference", "training",
                                                                                  "rest"}
    # the folder's generation config is left as it was built: the tokenizer's EOS alone
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 1
    assert "cost per generated token" in proc.stdout


@pytest.mark.slow  # one process (~20 s): python -m pytest -m slow
def test_a_length_sweep_runs_both_trainers_under_the_setting_asked(tmp_path):
    """``--setting bf16-mixed``: each run is real_scale.py's bf16-mixed setting (polopt's Trainer in bf16-mixed, TRL's
    ``bf16=True``), recorded per result and in the run; ``--heap`` adds the allocator's live and held memory."""
    out, folder = tmp_path / "run.json", tmp_path / "model"
    proc = subprocess.run([sys.executable, str(SCRIPT.parent / "lengths.py"), "--shape", "small", "--model-dir",
                           str(folder), "--lengths", "32", "--steps", "2", "--setting", "bf16-mixed", "--impls",
                           "polopt", "--heap", "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())
    result = run["rows"][0]["results"]["polopt"]
    assert run["setting"] == "bf16-mixed" and result["setting"] == "bf16-mixed"
    assert "; bf16-mixed;" in proc.stdout
    # --heap: each phase's live and held allocator memory, live at most held (glibc here; elsewhere it says why not)
    if "phase_live_held_gib" in result:
        assert "allocator, live / held GiB by phase: rollout" in proc.stdout
        assert all(0 < live <= held for live, held in result["phase_live_held_gib"].values())
    else:
        assert "--heap: this C library has no mallinfo2" in proc.stdout


@pytest.mark.slow  # one process (~15 s): python -m pytest -m slow
def test_a_small_drop_finished_run_times_both_cases_and_counts_differing_tokens(tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, str(SCRIPT.parent / "drop_finished.py"), "--shape", "small",
                           "--model-dir", str(tmp_path / "model"), "--cap", "128", "--prompts", "2", "--threads", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    keep, drop = json.loads(out.read_text())["rows"]
    assert (keep["case"], drop["case"]) == ("keep", "drop") and keep["seconds"] > 0 and drop["seconds"] > 0
    assert len(keep["lengths"]) == 16 and min(keep["lengths"]) < max(keep["lengths"]) <= 128  # sampled lengths
    # the small shape's 4,096-token vocabulary draws with torch.multinomial: dropping rows draws for fewer of them
    assert keep["tokens_differing_from_first"] == 0 and "x the time of keep" in proc.stdout


@pytest.mark.slow  # one process (~20 s): python -m pytest -m slow
def test_a_small_decode_positions_run_times_every_token_of_both_samplers(tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, str(SCRIPT.parent / "decode_positions.py"), "--shape", "small",
                           "--model-dir", str(tmp_path / "model"), "--new-tokens", "64", "--bin", "16", "--threads",
                           "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())
    for impl in ("polopt", "transformers"):  # a step a token after the first, four bins of 16 positions
        assert len(run["steps"][impl]) == 63 and all(s > 0 for s in run["steps"][impl])
        assert len(run["bins"][impl]) == 4
    assert len(run["floor"]) == 4 and run["floor"][0] < run["floor"][-1]  # the keys and values read grow
    assert "last bin x" in proc.stdout


@pytest.mark.slow  # one process (~15 s): python -m pytest -m slow
def test_a_small_decode_attention_run_prices_a_cached_position_for_both_steps(tmp_path):
    from .helpers.kernel import needs_kernel

    needs_kernel()  # the fused C step: skipped, saying why, where this machine cannot build it
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, str(SCRIPT.parent / "decode_attention.py"), "--positions", "32", "160",
                           "--rows", "2", "--repeats", "1", "--threads", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert list(run["seconds"]) == ["polopt C step", "PyTorch step (SDPA)"]
    assert all(len(ts) == 2 and min(ts) > 0 for ts in run["seconds"].values()) and run["floor_us"] > 0
    assert "less time a cached position" in proc.stdout
