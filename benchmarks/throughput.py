"""Throughput of one RL step: polopt-lightning against TRL's GRPOTrainer, same weights, prompts and settings.

Each trial runs in a fresh subprocess (so peak resident memory is that run's own), alternating polopt / TRL, and
completions are forced to full length (min_new_tokens = max_new_tokens) so both do identical work.

    python benchmarks/throughput.py                       # all workloads, 2 alternating trials each
    python benchmarks/throughput.py --workloads tiny --trials 3 --steps 6
    python benchmarks/throughput.py --device cuda         # on a GPU machine (peak = GPU memory allocated)
    python benchmarks/throughput.py --interleave --json run.json         # step-paired speed-ups (see --help)
    python benchmarks/throughput.py --summarize a.json b.json --interleave  # several runs' step pairs pooled

Prints per workload: median seconds per rollout step (one optimizer step on-policy; all mini-batch steps of one
rollout off-policy), generated tokens per second, peak RSS (its own ``VmHWM``; GPU memory with --device cuda), the
speed-up against each TRL run (with --interleave: the median of per-step ratios, a 95% bootstrap interval of that
median, and their range), and two floors: the FLOP floor, the step's FLOPs (2N per generated or scored token, 6N
per trained token, prompts counted once per group, N = non-embedding parameters) with each phase at the matmul
throughput of the dtype it computes in, measured at the start of the run; and the roofline floor, where each
decoding step takes the longer of its FLOPs and the bytes it must read at the measured memory bandwidth.

TRL's GRPOConfig turns gradient checkpointing on by default: the default run measures TRL with and without it
(``trl`` and ``trl:gradient_checkpointing=false``), so polopt can be compared like for like.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

WORKLOADS = {
    # name: model shape and step settings
    "tiny": dict(hidden=256, layers=4, heads=4, intermediate=512, prompts=2, generations=8, prompt_len=8,
                 new_tokens=32, beta=0.04, mini_batches=1),
    "long-prompt": dict(hidden=512, layers=8, heads=8, intermediate=1376, prompts=2, generations=8, prompt_len=128,
                        new_tokens=128, beta=0.04, mini_batches=1),
    "off-policy": dict(hidden=512, layers=8, heads=8, intermediate=1376, prompts=2, generations=8, prompt_len=128,
                       new_tokens=128, beta=0.04, mini_batches=4),
}


@dataclass
class TrialResult:
    impl: str
    workload: str
    step_s: list[float]
    peak_rss_gib: float
    generated_tokens_per_step: int
    sample_dtype: str | None = None  # what polopt's engine sampled with (see note_sampling_dtype); None: TRL

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)


def build(workload: dict, seed: int = 0):
    """The workload's model (Qwen2 config, char tokenizer) and prompts; identical in every process."""
    import random

    from polopt_lightning.models import build_tiny_model

    model, tok = build_tiny_model(hidden_size=workload["hidden"], num_layers=workload["layers"],
                                  num_heads=workload["heads"], intermediate_size=workload["intermediate"], seed=seed)
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 +-="
    prompts = ["".join(rng.choice(alphabet) for _ in range(workload["prompt_len"])) for _ in range(64)]
    return model, tok, prompts


def _sync(device: str) -> None:
    """Wait for queued GPU work so a step's wall time is its own."""
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


class Baton:
    """A trial's turn in ``--interleave`` mode, where every implementation runs in its own process at the same time
    and the parent (:func:`run_interleaved`) lets one step run at a time. Before each rollout step a child asks for a
    turn, which also hands back the one it had (its previous step and whatever its trainer does after a step are
    done), and waits; after its last step it keeps the turn until it exits. Step i of each implementation then runs
    right after step i of the one before, so the machine's drift, which moves whole trials by 10-40% here, hits both
    sides of each pair alike, and no step shares the CPU with another process's work."""

    def __init__(self, fds: str) -> None:
        self.go, self.ask = (int(x) for x in fds.split(","))

    def wait(self, name: str) -> None:
        os.write(self.ask, b"w")
        if os.read(self.go, 1) != b"g":
            raise SystemExit(f"{name}: the benchmark's parent went away")


def length_reward(prompts, completions, **kwargs):
    """Cheap and varied, so groups carry signal (rewards are not what is measured)."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def note_sampling_dtype(module, facts: dict) -> None:
    """Record in ``facts["sample_dtype"]`` the dtype ``module``'s engine samples with, asked at each rollout, inside
    the step's contexts where the engine decides it (autocast, oneDNN's linear layers): the floors take it from
    here instead of repeating the engine's rule."""
    rollout = module.rollout

    def noting(*args, **kwargs):
        chosen = getattr(module.engine, "sampling_dtype", lambda model: None)(module.policy)
        dtype = chosen or next(p.dtype for p in module.policy.parameters() if p.is_floating_point())
        facts["sample_dtype"] = str(dtype).removeprefix("torch.")
        return rollout(*args, **kwargs)

    module.rollout = noting


def module_overrides(overrides: dict | None) -> tuple[str, dict]:
    """An implementation's overrides as (the Trainer's precision, the module's arguments): ``engine={...}`` are the
    rollout backend's arguments (e.g. ``engine={"cpu":{"packed_weights":false}}``, or ``engine={"name":"vllm"}`` for
    another backend; the CPU's levers also at the top,
    as older result files name them) and ``rollout_dtype`` is short for ``engine={"dtype":...}`` (the name older
    result files give); the module's keyword arguments of earlier releases (``ref_dtype``, ``share_prompt``, ...) go
    to their concern (``reference={"dtype":...}``, ``update={...}``); every other key is the module's."""
    from polopt_lightning.settings import MOVED_ARGUMENTS

    overrides = dict(overrides or {})
    precision = overrides.pop("precision", "32-true")
    engine = dict(overrides.pop("engine", None) or {})
    for key in ("packed_weights", "decode_kernel", "fused_step"):  # the CPU's levers, as older result files name them
        if key in engine:
            engine.setdefault("cpu", {})[key] = engine.pop(key)
    if "rollout_dtype" in overrides:
        engine["dtype"] = overrides.pop("rollout_dtype")
    if engine:
        overrides["rollout_engine"] = {"name": engine.pop("name", "hf"), **engine}
    for key in [k for k in overrides if k in MOVED_ARGUMENTS]:
        concern, name = MOVED_ARGUMENTS[key]
        overrides[concern] = {**overrides.get(concern, {}), name: overrides.pop(key)}
    return precision, overrides


def module_arguments(base: dict, overrides: dict) -> dict:
    """The module's keyword arguments: ``base`` with ``overrides`` on top, a concern's settings (dicts) merged."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def run_polopt(workload: dict, steps: int, overrides: dict | None = None, device: str = "cpu",
               baton: Baton | None = None, name: str = "polopt", facts: dict | None = None) -> list[float]:
    import lightning as L
    import torch

    from polopt_lightning import PolicyOptimizationModule, PromptDataModule

    precision, overrides = module_overrides(overrides)
    model, tok, prompts = build(workload)
    data = PromptDataModule(train=[{"prompt": p} for p in prompts], tokenizer=tok, batch_size=workload["prompts"],
                            shuffle=False)
    n = workload["new_tokens"]
    module = PolicyOptimizationModule(model, tok, **module_arguments(dict(
        objective={"name": "grpo", "beta": workload["beta"]}, reward_fns=[length_reward],
        experience={"num_generations": workload["generations"]}, update={"mini_batches": workload["mini_batches"]},
        generation={"max_new_tokens": n, "min_new_tokens": n, "temperature": 1.0}, optimizer={"lr": 1e-6},
    ), overrides))
    if facts is not None:
        note_sampling_dtype(module, facts)
    times: list[float] = []

    class Timer(L.Callback):
        def on_train_batch_start(self, *args):
            if baton:
                baton.wait(name)
            _sync(device)
            self.t = time.perf_counter()

        def on_train_batch_end(self, *args):
            _sync(device)
            times.append(time.perf_counter() - self.t)

    trainer = L.Trainer(max_steps=steps * workload["mini_batches"], accelerator=device, devices=1, logger=False,
                        precision=precision,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Timer()])
    torch.manual_seed(0)
    trainer.fit(module, datamodule=data)
    return times


def run_trl(workload: dict, steps: int, overrides: dict | None = None, device: str = "cpu",
            baton: Baton | None = None, name: str = "trl") -> list[float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model, tok, prompts = build(workload)
    # TRL builds its reference model from the policy's path: save the (seeded, identical) weights first
    model_dir = tempfile.mkdtemp(prefix="trl_model_")
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    completions_per_rollout = workload["prompts"] * workload["generations"]
    mb = workload["mini_batches"]
    n = workload["new_tokens"]
    out = tempfile.mkdtemp(prefix="trl_bench_")
    overrides = {"bf16": False, **(overrides or {})}
    config = GRPOConfig(
        output_dir=out, use_cpu=device == "cpu", fp16=False, report_to="none", save_strategy="no",
        per_device_train_batch_size=completions_per_rollout // mb, steps_per_generation=mb,
        gradient_accumulation_steps=1, num_generations=workload["generations"], max_completion_length=n,
        generation_kwargs={"min_new_tokens": n}, temperature=1.0, beta=workload["beta"], num_iterations=1,
        learning_rate=1e-6, max_steps=steps * mb, logging_steps=1, disable_dropout=True, shuffle_dataset=False,
        dataloader_num_workers=0, seed=0, **overrides,
    )
    step_times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if baton and state.global_step % mb == 0:  # a rollout starts: TRL generates in this step
                baton.wait(name)
            _sync(device)
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            _sync(device)
            step_times.append(time.perf_counter() - self.t)

    trainer = GRPOTrainer(model=model_dir, reward_funcs=[length_reward], args=config,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), processing_class=tok,
                          callbacks=[Timer()])
    trainer.train()
    # one rollout = mb optimizer steps (TRL generates on the first of them)
    return [sum(step_times[i:i + mb]) for i in range(0, len(step_times) - mb + 1, mb)]


def run_impl(impl: str, workload: dict, steps: int, device: str = "cpu", baton: Baton | None = None,
             facts: dict | None = None) -> list[float]:
    peer, overrides = parse_impl(impl)
    if peer == "trl":  # "trl" or "trl:bf16=true" (GRPOConfig arguments)
        return run_trl(workload, steps, overrides, device, baton, impl)
    # "polopt" or a lever changed, e.g. "polopt:share_prompt=false", 'polopt:precision="bf16-mixed"' or
    # 'polopt:engine={"cpu":{"packed_weights":false}}' (rollout engine arguments)
    return run_polopt(workload, steps, overrides, device, baton, impl, facts)


def child(impl: str, name: str, steps: int, threads: int, device: str = "cpu", baton: Baton | None = None) -> None:
    import torch

    torch.set_num_threads(threads)
    workload = WORKLOADS[name]
    facts: dict = {}
    times = run_impl(impl, workload, steps, device, baton, facts)
    if device == "cpu":
        peak = peak_rss_gib()
    else:  # accelerator memory is what bounds a GPU run
        peak = torch.cuda.max_memory_allocated() / 2**30
    generated = workload["prompts"] * workload["generations"] * workload["new_tokens"]
    print("RESULT " + json.dumps(asdict(TrialResult(impl, name, times[1:] or times, peak, generated,
                                                    facts.get("sample_dtype")))))


def peak_rss_gib() -> float:
    """This process's peak resident memory. Linux's ``ru_maxrss`` survives ``exec`` (a child started by this script
    would report at least the parent's peak, e.g. the bandwidth probe's 512 MiB): ``VmHWM`` is the process's own."""
    try:
        with open("/proc/self/status") as fh:
            line = next(x for x in fh if x.startswith("VmHWM:"))
        return int(line.split()[1]) / 2**20  # kB -> GiB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB (Linux) -> GiB


def parse_impl(impl: str) -> tuple[str, dict]:
    """``"polopt:KEY=JSON,KEY=JSON"`` -> ``("polopt", {KEY: value, ...})`` (a JSON value may hold commas)."""
    name, _, rest = impl.partition(":")
    overrides = {}
    for item in re.split(r",(?=\w+=)", rest) if rest else []:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    return name, overrides


def paired_speedups(run: dict, peer: dict, steps: bool = False) -> list[float]:
    """The peer's time over the run's, trial by trial: trial i of each ran back to back, so the machine's drift (which
    moves a whole trial by 10-40% here) mostly cancels in each ratio, where the medians over all trials mix fast and
    slow hours. ``steps``: step by step instead (``--interleave``, where step i of each ran back to back)."""
    if steps:
        return [p / r for rt, pt in zip(run["step_s"], peer["step_s"]) for r, p in zip(rt, pt)]
    return [p / r for r, p in zip(run["trial_s_per_step"], peer["trial_s_per_step"])]


def phase_dtypes(impl: str, sampled: str | None = None) -> dict[str, str]:
    """The dtype each phase's matrix products run in: sampling (with prefill), reference pass, training pass.
    ``sampled``: what polopt's engine sampled with, as its trials recorded it (:func:`note_sampling_dtype`; under
    autocast it may sample in float32); without it (older result files) the rollout computes in the autocast
    dtype or ``rollout_dtype``."""
    name, o = parse_impl(impl)
    if name == "trl":  # bf16=True: autocast over the whole step
        return dict.fromkeys(("sample", "ref", "train"), "bfloat16" if o.get("bf16") else "float32")
    mixed = "bfloat16" if str(o.get("precision", "")).startswith("bf16") else "float32"  # autocast dtype
    return {"sample": sampled or o.get("rollout_dtype") or mixed, "ref": o.get("ref_dtype") or mixed, "train": mixed}


def matmul_gflops(threads: int, size: int = 2048, repeats: int = 5, rounds: int = 5, device: str = "cpu",
                  dtype: str = "float32", budget_s: float = 20.0) -> float:
    """Best of ``rounds`` timings of ``size x size`` matrix products in ``dtype``: what the hardware gives this
    process. On the CPU the products run both through ``torch.mm`` (the BLAS: MKL) and through oneDNN (what
    ``polopt_lightning.accel.cpu.linear`` uses; on AMD CPUs about twice MKL's float32 rate), and the faster counts.

    The probe takes about ``budget_s`` at most: a first product of a quarter of ``size`` estimates each path's
    rate, and where the whole probe would take longer (bf16 on a CPU without hardware bf16 multiplies at a few
    GFLOP/s: 2048-square products then take minutes) the size halves, then the repeats and rounds shrink."""
    import torch

    torch.set_num_threads(threads)
    if device != "cpu":  # a GPU needs more work per timing to be measured at all
        size, repeats = 8192, 20
    dt = getattr(torch, dtype)
    products = [lambda a, b: a @ b]
    if device == "cpu":
        from polopt_lightning.accel.cpu import linear as cpu_linear

        if cpu_linear.available():
            products.append(lambda a, b: cpu_linear._product(a, b))  # a @ b.T: the same FLOPs

    def runs(product) -> bool:  # oneDNN has no bf16 product on a CPU without AVX-512 (it raises)
        try:
            product(torch.ones(16, 16, device=device, dtype=dt), torch.ones(16, 16, device=device, dtype=dt))
            return True
        except RuntimeError:
            return False

    products = [p for p in products if runs(p)]

    def seconds(product, a, b, times: int) -> float:
        t = time.perf_counter()
        for _ in range(times):
            product(a, b)
        _sync(device)
        return time.perf_counter() - t

    probe = max(size // 4, 64)
    a, b = torch.randn(probe, probe, device=device, dtype=dt), torch.randn(probe, probe, device=device, dtype=dt)
    for product in products:  # first calls: kernels picked, weights' layouts made
        product(a, b)
    rate = min(2 * probe**3 / max(seconds(p, a, b, 1), 1e-9) for p in products)  # FLOP/s of the slower path
    while size > probe and len(products) * (rounds * repeats + 1) * 2 * size**3 / rate > budget_s:
        size //= 2
    while (repeats > 1 or rounds > 1) and len(products) * (rounds * repeats + 1) * 2 * size**3 / rate > budget_s:
        repeats, rounds = max(1, repeats // 2), max(1, rounds - 1)
    a, b = torch.randn(size, size, device=device, dtype=dt), torch.randn(size, size, device=device, dtype=dt)
    best = float("inf")
    for product in products:
        product(a, b)
        _sync(device)
        for _ in range(rounds):
            best = min(best, seconds(product, a, b, repeats))
    return 2 * size**3 * repeats / best / 1e9


def memory_gbps(threads: int, mib: int = 512, rounds: int = 5, device: str = "cpu") -> float:
    """Best of ``rounds`` timings of reading a ``mib`` MiB tensor (a sum): the memory bandwidth a decoding step
    that streams its weights and KV cache can hope for."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(mib * 2**20 // 4, device=device)
    x.sum()
    best = float("inf")
    for _ in range(rounds):
        _sync(device)
        t = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def step_costs(workload: dict) -> dict:
    """Per phase of one rollout step: FLOPs (each prompt counted once per group) and, for sampling, the bytes each
    decoding step must read at the least (every weight once, each prompt's keys/values once per group, each
    sample's completion keys/values) as a function of the dtype's size."""
    from polopt_lightning.models import build_tiny_model, count_parameters

    model, _ = build_tiny_model(hidden_size=workload["hidden"], num_layers=workload["layers"],
                                num_heads=workload["heads"], intermediate_size=workload["intermediate"])
    N = count_parameters(model, non_embedding=True)
    weights = count_parameters(model)  # the tied embedding is read once, as the output head
    P, G, Lp, T = workload["prompts"], workload["generations"], workload["prompt_len"], workload["new_tokens"]
    cfg = model.config
    kv_width = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    scored = P * Lp + P * G * T  # prompt once per group + every completion token
    return {
        "prefill_flops": 2 * N * P * Lp,
        "decode_flops_per_step": 2 * N * P * G,
        "decode_elements_per_step": [weights + kv_width * (P * Lp + P * G * t) for t in range(T)],
        "ref_flops": 2 * N * scored if workload["beta"] > 0 else 0,
        "train_flops": 6 * N * scored,  # forward + backward
    }


def floors(costs: dict, dtypes: dict[str, str], gflops: dict[str, float], gbps: float) -> tuple[float, float]:
    """Seconds one step needs at the least: (FLOP floor, roofline floor).

    FLOP floor: every phase's FLOPs at the measured matmul throughput of the dtype it computes in. Roofline: the
    same, except that each decoding step takes the longer of its FLOPs and its bytes at the measured bandwidth."""
    def rate(phase):
        return gflops[dtypes[phase]] * 1e9

    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtypes["sample"]]
    decode = costs["decode_flops_per_step"] / rate("sample")  # seconds of one decoding step's FLOPs
    reads = [elements * size / (gbps * 1e9) for elements in costs["decode_elements_per_step"]]
    rest = (costs["prefill_flops"] / rate("sample") + costs["ref_flops"] / rate("ref")
            + costs["train_flops"] / rate("train"))
    return rest + decode * len(reads), rest + sum(max(decode, r) for r in reads)


CHILD_ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
HANDOVER_PAUSE_S = 0.1


def run_child(cmd: list[str]) -> tuple[int, str, str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=CHILD_ENV)
    return proc.returncode, proc.stdout, proc.stderr


def child_result(cmd: list[str], what: str, env: dict | None = None) -> dict:
    """The ``RESULT`` line (JSON) a child process printed; where it failed or printed none, the tail of its errors and
    an exit that names ``what``."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env or CHILD_ENV)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        print(proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"{what} failed (exit {proc.returncode})")
    return json.loads(line[len("RESULT "):])


def run_interleaved(cmds: list[list[str]]) -> list[tuple[int, str, str]]:
    """Start every command at once and hand out turns round-robin (see :class:`Baton`): no step starts before every
    child is ready for its first, and only one child holds the turn at a time. Each child's output goes to a file, so
    a waiting child can never block on a full pipe."""
    procs, asks, gos, files = [], [], [], []
    for cmd in cmds:
        go_r, go_w = os.pipe()
        ask_r, ask_w = os.pipe()
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        procs.append(subprocess.Popen([*cmd, "--baton", f"{go_r},{ask_w}"], stdout=out, stderr=err, env=CHILD_ENV,
                                      pass_fds=(go_r, ask_w), text=True))
        os.close(go_r)
        os.close(ask_w)
        asks.append(ask_r)
        gos.append(go_w)
        files.append((out, err))
    # every child asks for its first turn once set up (one that exits first has failed: its output tells)
    waiting = [i for i in range(len(cmds)) if os.read(asks[i], 1) == b"w"]
    while waiting:
        for i in list(waiting):
            # let the previous holder's OpenMP workers stop spinning (libgomp spins some milliseconds after its last
            # parallel region) before the next step starts: measured, a polopt step ran 12% slower against another
            # polopt process without this pause
            time.sleep(HANDOVER_PAUSE_S)
            os.write(gos[i], b"g")
            if os.read(asks[i], 1) != b"w":  # it exited: after its last step, or failed
                waiting.remove(i)
    outputs = []
    for proc, ask, go, (out, err) in zip(procs, asks, gos, files):
        code = proc.wait()
        os.close(ask)
        os.close(go)
        out.seek(0)
        err.seek(0)
        outputs.append((code, out.read(), err.read()))
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--trials", type=int, default=2, help="alternating polopt/TRL trials per workload")
    parser.add_argument("--steps", type=int, default=4, help="rollout steps per trial (the first is warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where both trainers run")
    parser.add_argument("--impls", nargs="+", default=["polopt", "trl:gradient_checkpointing=false", "trl"],
                        help="polopt, trl, polopt:KEY=JSON,... (module arguments changed, to measure a lever, e.g. "
                             "polopt:share_prompt=false or 'polopt:rollout_dtype=\"bfloat16\"'; the key precision "
                             "is the Trainer's) or trl:KEY=JSON,... (GRPOConfig arguments, e.g. trl:bf16=true)")
    parser.add_argument("--interleave", action="store_true",
                        help="run the impls of a trial side by side, each in its own process, taking turns step by "
                             "step (speed-ups from pairs of steps that ran back to back)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--summarize", nargs="+", metavar="JSON",
                        help="measure nothing: print the table of these --json files pooled (runs of one build with "
                             "the same settings; with --interleave for step-paired runs, which older files do not "
                             "record)")
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "WORKLOAD"), help=argparse.SUPPRESS)
    parser.add_argument("--baton", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.steps, args.threads, args.device,
                     Baton(args.baton) if args.baton else None)

    if args.summarize:
        results = []
        for path in args.summarize:
            with open(path) as fh:
                results.append(json.load(fh))
        interleave = args.interleave or all(r.get("interleave") for r in results)
        return print_table(pool(results), interleave)

    gflops = {dt: matmul_gflops(args.threads, device=args.device, dtype=dt) for dt in ("float32", "bfloat16")}
    gbps = memory_gbps(args.threads, device=args.device)
    from memory import cpu_description  # (memory.py imports this file's harness)

    machine = cpu_description()
    print(f"machine: {machine}, {args.threads} torch threads, device {args.device}; matmul "
          f"{gflops['float32']:.0f} GFLOP/s fp32, {gflops['bfloat16']:.0f} bf16; memory read {gbps:.1f} GB/s; "
          f"peak = {'resident memory' if args.device == 'cpu' else 'GPU memory allocated'}")
    rows = []
    for name in args.workloads:
        results: dict[str, list[TrialResult]] = {impl: [] for impl in args.impls}
        for trial in range(args.trials):
            cmds = [[sys.executable, __file__, "--child", impl, name, "--steps", str(args.steps), "--threads",
                     str(args.threads), "--device", args.device] for impl in args.impls]
            # interleaved: the impls' processes run side by side, taking turns step by step; otherwise one after the
            # other, alternating A/B so drift on the machine hits both
            outputs = run_interleaved(cmds) if args.interleave else [run_child(cmd) for cmd in cmds]
            for impl, (code, out, err) in zip(args.impls, outputs):
                line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
                if code or line is None:
                    print(out[-2000:], err[-4000:], file=sys.stderr)
                    raise SystemExit(f"{impl} on {name} failed (trial {trial})")
                r = TrialResult(**json.loads(line[len("RESULT "):]))
                results[impl].append(r)
                print(f"  {name:12s} {impl:20s} trial {trial}: {r.median_s:.3f} s/step, peak {r.peak_rss_gib:.2f} GiB",
                      flush=True)
        costs = step_costs(WORKLOADS[name])
        row = {"workload": name, "runs": {}}
        for impl, rs in results.items():
            all_steps = [s for r in rs for s in r.step_s]
            flop_s, roofline_s = floors(costs, phase_dtypes(impl, rs[0].sample_dtype), gflops, gbps)
            row["runs"][impl] = {"s_per_step": statistics.median(all_steps),
                                 "trial_s_per_step": [r.median_s for r in rs],
                                 "step_s": [r.step_s for r in rs],
                                 "tokens_per_s": rs[0].generated_tokens_per_step / statistics.median(all_steps),
                                 "peak_rss_gib": max(r.peak_rss_gib for r in rs),
                                 "flop_floor_s": flop_s, "roofline_s": roofline_s}
        rows.append(row)

    print()
    print_table(rows, args.interleave)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine, "gflops": gflops, "memory_gbps": gbps, "interleave": args.interleave,
                       "rows": rows}, fh, indent=2)


def _pairs(run: dict, peer: dict, steps: bool) -> str:
    ratios = paired_speedups(run, peer, steps)
    if not steps:
        return ", ".join(f"{x:.2f}" for x in ratios)
    lo, hi = bootstrap_ci(ratios)
    return (f"{statistics.median(ratios):.2f}x, 95% CI {lo:.2f}-{hi:.2f}, {min(ratios):.2f}-{max(ratios):.2f} "
            f"over {len(ratios)}")


def bootstrap_ci(values: list[float], level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of ``values`` (resampled with replacement, fixed seed): how far the
    median of this many step pairs may sit from the machine's true speed-up, given their spread."""
    import random

    if not values:
        raise ValueError("bootstrap_ci needs at least one value")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * resamples)], medians[min(resamples - 1, int((1 - tail) * resamples))]


def pool(results: list[dict]) -> list[dict]:
    """Rows of several runs' ``--json`` files (same build and settings) as one run: each workload's trials of each
    implementation together, so the step pairs of all of them feed one median and one interval. Floors are the
    median of the runs' (each run measured its own matmul and memory rates)."""
    pooled: dict[str, dict] = {}
    for i, result in enumerate(results):
        for row in result["rows"]:
            target = pooled.setdefault(row["workload"], {"workload": row["workload"], "runs": {}})
            if target["runs"] and set(target["runs"]) != set(row["runs"]):  # trials pair up only within one run
                raise ValueError(f"run {i} of those pooled measured {row['workload']} with {sorted(row['runs'])}, an "
                                 f"earlier one with {sorted(target['runs'])}: pool only runs of the same settings")
            for impl, r in row["runs"].items():
                into = target["runs"].setdefault(impl, {"trial_s_per_step": [], "step_s": [], "peak_rss_gib": 0.0,
                                                        "tokens": [], "flop_floor_s": [], "roofline_s": []})
                into["trial_s_per_step"] += r["trial_s_per_step"]
                into["step_s"] += r["step_s"]
                into["peak_rss_gib"] = max(into["peak_rss_gib"], r["peak_rss_gib"])
                into["tokens"].append(r["tokens_per_s"] * r["s_per_step"])  # generated tokens per step
                into["flop_floor_s"].append(r["flop_floor_s"])
                into["roofline_s"].append(r["roofline_s"])
    for row in pooled.values():
        for r in row["runs"].values():
            r["s_per_step"] = statistics.median(s for trial in r["step_s"] for s in trial)
            r["tokens_per_s"] = statistics.median(r.pop("tokens")) / r["s_per_step"]
            r["flop_floor_s"] = statistics.median(r["flop_floor_s"])
            r["roofline_s"] = statistics.median(r["roofline_s"])
    return list(pooled.values())


def print_table(rows: list[dict], interleave: bool) -> None:
    impls = list(dict.fromkeys(impl for row in rows for impl in row["runs"]))
    peers = [impl for impl in impls if parse_impl(impl)[0] == "trl"]
    pairs = "median of per-step pairs, 95% CI, range" if interleave else "per trial"
    header = ("| workload | run | s/step | " + "".join(f"speed-up vs {p} ({pairs}) | " for p in peers)
              + "generated tok/s | peak GiB | FLOP floor s | s/step / FLOP floor | roofline s | s/step / roofline |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for row in rows:
        runs = row["runs"]
        for impl, r in runs.items():
            speed = "".join(f"{runs[p]['s_per_step'] / r['s_per_step']:.2f}x ({_pairs(r, runs[p], interleave)}) | "
                            if p in runs else "- | " for p in peers)
            print(f"| {row['workload']} | {impl} | {r['s_per_step']:.3f} | {speed}{r['tokens_per_s']:.0f} "
                  f"| {r['peak_rss_gib']:.2f} | {r['flop_floor_s']:.3f} | {r['s_per_step'] / r['flop_floor_s']:.2f}x "
                  f"| {r['roofline_s']:.3f} | {r['s_per_step'] / r['roofline_s']:.2f}x |")


if __name__ == "__main__":
    main()
