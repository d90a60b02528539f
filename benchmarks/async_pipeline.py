"""Generation apart from training on the CPU: the default job (or a generation-heavy shape) with rollouts sampled in the
training process (``rollout=hf``), on a ``polopt-serve`` process taking turns with the trainer (``rollout=server``,
synchronous), and on the server while the trainer trains (``experience.max_staleness=1``); the held-out accuracy each
reaches and the RL's wall time, per seed.

    python benchmarks/async_pipeline.py --json async_default.json                       # the default job, seeds 0-2
    python benchmarks/async_pipeline.py --shape heavy --seeds 0 --json async_heavy.json  # generation-heavy steps
    python benchmarks/async_pipeline.py --shape heavy --modes server server-async --server-args "--device cuda" -- trainer=gpu

Each run is ``polopt-train`` as a user runs it, in a process of its own (a server in another, started before it and
stopped after). Threads: the in-process run and the synchronous server run give each process both cores (the trainer
and the server take turns); the asynchronous run gives each one core, so that sampling and training overlap. On a
2-core machine that is the whole difference the pipeline can make: it hides the shorter of sampling and training
behind the longer, and a push of the weights per rollout is its cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import cpu_description  # noqa: E402

from polopt_lightning.rollout.wire import ServerError, free_port, wait_for_health  # noqa: E402

# name: (polopt-train overrides, trainer threads, server threads or None for no server)
MODES = {
    "hf": ([], 2, None),
    "server": (["rollout=server"], 2, 2),
    "server-async": (["rollout=server", "experience.max_staleness=1"], 1, 1),
    # the pipeline with both cores for each process (4 threads on 2 cores while they overlap)
    "server-async-2x2": (["rollout=server", "experience.max_staleness=1"], 2, 2),
}
# the generation-heavy shape: a wider model sampling 64 tokens, few rollouts, no validation while training
SHAPES = {
    "default": [],
    "heavy": ["model.hidden_size=512", "model.num_layers=4", "model.num_heads=8", "generation.max_new_tokens=64",
              "generation.min_new_tokens=64", "trainer.max_steps=40", "warm_start.enabled=false",
              "validate_before=false", "+trainer.limit_val_batches=0"],
}


def start_server(port: int, threads: int, log: Path, extra: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "polopt_lightning.serve", "--port", str(port), "--threads",
                             str(threads), *extra], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", 120, "polopt-serve", process=proc)
    except ServerError as err:
        proc.kill()
        raise RuntimeError(f"{err}: {log.read_text()[-2000:]}") from None
    return proc


def run(mode: str, seed: int, shape: str, folder: Path, extra: list[str], server_args: list[str]) -> dict:
    overrides, threads, server_threads = MODES[mode]
    run_dir = folder / f"{mode}_seed{seed}"
    server, args = None, [*SHAPES[shape], *overrides, f"seed={seed}", f"num_threads={threads}",
                          f"hydra.run.dir={run_dir}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if server_threads is not None:
        port = free_port()
        run_dir.mkdir(parents=True, exist_ok=True)
        server = start_server(port, server_threads, run_dir / "server.log", server_args)
        args.append(f"rollout.servers=127.0.0.1:{port}")
    try:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "polopt_lightning", *args], capture_output=True, text=True,
                              env=env, timeout=3600)
        wall = time.perf_counter() - start
    finally:
        if server is not None:
            server.kill()
            server.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} seed {seed} failed:\n{proc.stderr[-3000:]}")
    results = json.loads((run_dir / "results.json").read_text())
    out = {"mode": mode, "seed": seed, "shape": shape, "wall_s": wall, "rl_wall_s": results["rl_wall_s"],
           "steps": results["steps"], "val_accuracy_before": results.get("val_accuracy_before"),
           "val_accuracy_after": results.get("val_accuracy_after"), "val_accuracy_best": results.get("val_accuracy_best")}
    print(json.dumps(out), flush=True)
    return out


def summarize(rows: list[dict]) -> None:
    print(f"\n{'mode':<14} {'runs':>4} {'RL s (median, range)':>26} {'acc after (mean, range)':>28}")
    base = None
    for mode in MODES:
        sel = [r for r in rows if r["mode"] == mode]
        if not sel:
            continue
        times = [r["rl_wall_s"] for r in sel]
        accs = [r["val_accuracy_after"] for r in sel if r["val_accuracy_after"] is not None]
        median = statistics.median(times)
        base = base or median
        acc = (f"{statistics.mean(accs):.3f} ({min(accs):.3f}-{max(accs):.3f})" if accs else "-")
        print(f"{mode:<14} {len(sel):>4} {median:>10.1f} ({min(times):.1f}-{max(times):.1f}) x{median / base:.2f}"
              f"   {acc:>24}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["hf", "server", "server-async"], choices=list(MODES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--shape", default="default", choices=list(SHAPES))
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    parser.add_argument("--runs", type=Path, default=None, help="the runs' folders (default: a temporary one)")
    parser.add_argument("--server-args", default="", help="more polopt-serve arguments (\"--device cuda\")")
    parser.add_argument("extra", nargs="*", help="more polopt-train overrides, for every run (after --)")
    args = parser.parse_args()
    folder = args.runs or Path(tempfile.mkdtemp(prefix="polopt_async_"))
    print(f"# {cpu_description()}; shape {args.shape}; runs in {folder}", flush=True)
    rows = [run(mode, seed, args.shape, folder, args.extra, args.server_args.split()) for seed in args.seeds
            for mode in args.modes]
    summarize(rows)
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_description(), "shape": args.shape, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
