"""The benchmark's floors: the dtype each phase computes in, and the FLOP and roofline floors built from them."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

spec = importlib.util.spec_from_file_location("throughput", Path(__file__).parents[1] / "benchmarks" / "throughput.py")
throughput = importlib.util.module_from_spec(spec)
sys.modules["throughput"] = throughput  # its dataclass looks its module up
spec.loader.exec_module(throughput)


def test_phase_dtypes_follow_the_run_settings():
    fp32 = dict.fromkeys(("sample", "ref", "train"), "float32")
    bf16 = dict.fromkeys(("sample", "ref", "train"), "bfloat16")
    assert throughput.phase_dtypes("polopt") == fp32 and throughput.phase_dtypes("trl") == fp32
    assert throughput.phase_dtypes("trl:bf16=true") == bf16
    assert throughput.phase_dtypes('polopt:precision="bf16-mixed"') == bf16
    # what the trials recorded the engine sampling with wins (under autocast it may sample in float32)
    assert throughput.phase_dtypes('polopt:precision="bf16-mixed"', "float32") == {**bf16, "sample": "float32"}
    assert throughput.phase_dtypes('polopt:rollout_dtype="bfloat16",ref_dtype="bfloat16"') == {
        "sample": "bfloat16", "ref": "bfloat16", "train": "float32"}
    assert throughput.parse_impl('polopt:share_prompt=false,micro_batch_tokens=512') == (
        "polopt", {"share_prompt": False, "micro_batch_tokens": 512})
    assert throughput.parse_impl('polopt:engine={"packed_weights":false,"shared_prompt_kv":true},lr=0.1') == (
        "polopt", {"engine": {"packed_weights": False, "shared_prompt_kv": True}, "lr": 0.1})


def test_floors_count_flops_per_phase_and_decoding_reads():
    workload = dict(throughput.WORKLOADS["tiny"])
    costs = throughput.step_costs(workload)
    P, G, Lp, T = (workload[k] for k in ("prompts", "generations", "prompt_len", "new_tokens"))
    N = costs["prefill_flops"] // (2 * P * Lp)  # non-embedding parameters
    assert costs["train_flops"] == 6 * N * (P * Lp + P * G * T) and costs["ref_flops"] == costs["train_flops"] // 3
    assert len(costs["decode_elements_per_step"]) == T
    growth = costs["decode_elements_per_step"][1] - costs["decode_elements_per_step"][0]
    assert growth == 2 * workload["layers"] * workload["hidden"] * P * G  # one key and value per sample and layer
    total_flops = (costs["prefill_flops"] + T * costs["decode_flops_per_step"] + costs["ref_flops"]
                   + costs["train_flops"])
    dtypes = throughput.phase_dtypes("polopt")
    flop, roofline = throughput.floors(costs, dtypes, {"float32": 100.0}, gbps=1e9)  # bandwidth never binds
    assert flop == pytest.approx(total_flops / 100e9) and roofline == pytest.approx(flop)
    flop, slow = throughput.floors(costs, dtypes, {"float32": 100.0}, gbps=1e-3)  # every decoding step reads
    assert slow == pytest.approx(flop - T * costs["decode_flops_per_step"] / 100e9
                                 + sum(costs["decode_elements_per_step"]) * 4 / 1e6)
    mixed = throughput.floors(costs, throughput.phase_dtypes("trl:bf16=true"), {"bfloat16": 200.0}, gbps=1e-3)
    assert mixed[0] == pytest.approx(total_flops / 200e9)
    assert mixed[1] - mixed[0] == pytest.approx((slow - flop) / 2)  # half the bytes, twice the FLOP rate


def test_peak_memory_is_the_child_process_own():
    """Each trial runs in a child process; its peak must not inherit this (larger) process's."""
    import subprocess

    import torch

    held = torch.ones(64 * 2**20)  # 256 MiB resident here
    code = f"import sys; sys.path.insert(0, {str(Path(throughput.__file__).parent)!r}); import throughput; " \
           "print(throughput.peak_rss_gib())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0 < child < 0.2 < throughput.peak_rss_gib()
    del held


def test_paired_speedups_compare_trials_that_ran_back_to_back():
    run = {"trial_s_per_step": [3.0, 5.0]}
    peer = {"trial_s_per_step": [7.2, 7.5]}
    assert throughput.paired_speedups(run, peer) == [2.4, 1.5]
    assert throughput.paired_speedups(peer, peer) == [1.0, 1.0]
    # --interleave: step i of each side ran back to back
    run, peer = {"step_s": [[1.0, 2.0], [4.0]]}, {"step_s": [[3.0, 3.0], [6.0]]}
    assert throughput.paired_speedups(run, peer, steps=True) == [3.0, 1.5, 1.5]



def test_bootstrap_interval_brackets_the_median_and_narrows_with_more_pairs():
    import statistics

    spread = [1.6, 1.8, 1.9, 1.95, 2.0, 2.05, 2.1, 2.2]
    lo, hi = throughput.bootstrap_ci(spread)
    assert min(spread) <= lo <= statistics.median(spread) <= hi <= max(spread) and lo < hi
    assert throughput.bootstrap_ci(spread) == (lo, hi)  # fixed seed: the table is reproducible
    lo4, hi4 = throughput.bootstrap_ci(spread * 4)  # the same spread, four times the pairs
    assert hi4 - lo4 < hi - lo
    assert throughput.bootstrap_ci([2.0] * 5) == (2.0, 2.0)
    with pytest.raises(ValueError, match="at least one"):
        throughput.bootstrap_ci([])


def test_pooled_runs_keep_each_trial_paired_with_its_peer(capsys):
    def run(polopt, trl, floor):
        def side(trials):
            steps = [s for t in trials for s in t]
            return {"s_per_step": sorted(steps)[len(steps) // 2], "trial_s_per_step": [max(t) for t in trials],
                    "step_s": trials, "tokens_per_s": 100 / sorted(steps)[len(steps) // 2], "peak_rss_gib": floor,
                    "flop_floor_s": floor, "roofline_s": 2 * floor}
        return {"interleave": True, "rows": [{"workload": "tiny", "runs": {"polopt": side(polopt),
                                                                           "trl": side(trl)}}]}

    a = run([[1.0, 2.0]], [[3.0, 3.0]], floor=0.5)
    b = run([[4.0], [2.0]], [[6.0], [2.0]], floor=1.5)
    (row,) = throughput.pool([a, b])
    polopt, trl = row["runs"]["polopt"], row["runs"]["trl"]
    assert polopt["step_s"] == [[1.0, 2.0], [4.0], [2.0]] and trl["step_s"] == [[3.0, 3.0], [6.0], [2.0]]
    assert throughput.paired_speedups(polopt, trl, steps=True) == [3.0, 1.5, 1.5, 1.0]
    assert polopt["s_per_step"] == 2.0 and trl["s_per_step"] == 3.0  # medians over every step of every run
    assert polopt["tokens_per_s"] == pytest.approx(50.0)  # 100 generated tokens per step
    assert polopt["peak_rss_gib"] == 1.5 and polopt["flop_floor_s"] == 1.0 and polopt["roofline_s"] == 2.0
    throughput.print_table([row], interleave=True)
    out = capsys.readouterr().out
    lo, hi = throughput.bootstrap_ci([3.0, 1.5, 1.5, 1.0])
    assert f"| tiny | polopt | 2.000 | 1.50x (1.50x, 95% CI {lo:.2f}-{hi:.2f}, 1.00-3.00 over 4) |" in out
    del b["rows"][0]["runs"]["trl"]  # a run without the peer would pair its trials with another run's
    with pytest.raises(ValueError, match=r"run 1 of those pooled measured tiny with \['polopt'\]"):
        throughput.pool([a, b])


_CHILD = """
import sys, time
sys.path.insert(0, {bench!r})
import throughput
name, steps, fail_at, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
baton = throughput.Baton(sys.argv[-1])
if fail_at == -2:  # fails while setting up, before asking for a turn
    sys.exit(4)
for step in range(steps):
    baton.wait(name)
    if step == fail_at:
        sys.exit(3)
    with open(log, "a") as fh:
        fh.write(f"start {{name}} {{step}} {{time.perf_counter()}}\\n")
    time.sleep(0.05)
    with open(log, "a") as fh:
        fh.write(f"end {{name}} {{step}} {{time.perf_counter()}}\\n")
print("RESULT", name)
"""


def test_interleaved_trials_take_turns_step_by_step(tmp_path, monkeypatch):
    """``--interleave``: children run side by side but one step at a time, in turn, and one that fails (before its
    first step or during a later one) neither hangs the others nor hides its exit code."""
    monkeypatch.setattr(throughput, "HANDOVER_PAUSE_S", 0.0)
    log = tmp_path / "log"
    script = _CHILD.format(bench=str(Path(throughput.__file__).parent))

    def cmd(name, steps, fail_at=-1):
        return [sys.executable, "-c", script, name, str(steps), str(fail_at), str(log)]

    outputs = throughput.run_interleaved([cmd("a", 3), cmd("b", 3)])
    assert [code for code, _, _ in outputs] == [0, 0] and all("RESULT" in out for _, out, _ in outputs)
    events = [line.split() for line in log.read_text().splitlines()]
    assert [(kind, name) for kind, name, _, _ in events] == [("start", "a"), ("end", "a"), ("start", "b"),
                                                              ("end", "b")] * 3
    times = [float(t) for *_, t in events]
    assert times == sorted(times)  # no step began before the one before it ended

    log.unlink()
    outputs = throughput.run_interleaved([cmd("a", 3, fail_at=1), cmd("b", 3), cmd("c", 2, fail_at=0),
                                          cmd("d", 2, fail_at=-2)])
    assert [code for code, _, _ in outputs] == [3, 0, 3, 4]
    steps = [(name, step) for kind, name, step, _ in (line.split() for line in log.read_text().splitlines())
             if kind == "start"]
    assert steps == [("a", "0"), ("b", "0"), ("b", "1"), ("b", "2")]


def test_an_implementations_overrides_reach_the_module_and_its_rollout_backend():
    """`polopt:KEY=JSON` overrides, older result files' names included: the Trainer's precision, the backend's
    arguments (the CPU's levers under `cpu`, `rollout_dtype` as its dtype), the module's the rest (its arguments of
    earlier releases under their concern, merged with the harness's own settings)."""
    precision, kwargs = throughput.module_overrides({"engine": {"packed_weights": False}, "rollout_dtype": "bfloat16",
                                                      "precision": "bf16-mixed", "share_prompt": False,
                                                      "ref_dtype": "bfloat16"})
    assert precision == "bf16-mixed"
    assert kwargs == {"update": {"share_prompt": False}, "reference": {"dtype": "bfloat16"},
                      "rollout_engine": {"name": "hf", "cpu": {"packed_weights": False}, "dtype": "bfloat16"}}
    merged = throughput.module_arguments({"update": {"mini_batches": 2}, "seed": 1}, kwargs)
    assert merged["update"] == {"mini_batches": 2, "share_prompt": False} and merged["seed"] == 1
    from polopt_lightning.rollout import build_engine

    engine = build_engine(kwargs["rollout_engine"])
    assert engine.cpu.packed_weights is False and engine.dtype == torch.bfloat16
    assert throughput.module_overrides(None) == ("32-true", {})
