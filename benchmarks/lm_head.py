"""The output head and its log-softmax alone, forward and backward, at the sizes long completions bring: the fused head
(``update.fused_head``: :func:`~polopt_lightning.step.logprobs.head_log_softmax`) against the head's own product with
polopt's chunked log-softmax (:func:`~polopt_lightning.step.logprobs.selective_log_softmax`) and against TRL's
``selective_log_softmax`` (its log-softmax as GRPOTrainer takes it), each in a fresh process.

    python benchmarks/lm_head.py                       # 0.5B head (896 x 151,936), 1k / 4k / 8k rows
    python benchmarks/lm_head.py --rows 512 --vocab 4096 --hidden 64 --repeats 1   # a smoke run (seconds)
    python benchmarks/lm_head.py --json benchmarks/results/lm_head_cpu.json

Rows are completion tokens of one pass (groups of 8 completions of 1,024 tokens: 8,192). Each case: one forward and
backward as warm-up, then ``--repeats`` timed; the loss is a weighted sum of the log-probs (as an objective's), the
head's weight trains (full fine-tuning; under LoRA the head is frozen and its gradient is skipped). Peak memory: the
process's resident high-water mark over the timed passes (reset through ``/proc/self/clear_refs`` after the inputs
are made), minus the resident memory before them: what the pass itself adds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

IMPLS = ("fused", "chunked", "trl")


def _rss_gib(field: str) -> float:
    with open("/proc/self/status") as fh:
        return int(next(x for x in fh if x.startswith(field)).split()[1]) / 2**20


def timed(fn, repeats: int) -> tuple[list[float], float]:
    """``fn`` run ``repeats`` times: each run's seconds, and the resident memory the runs added at their peak (the
    high-water mark, reset first, minus what was resident before them)."""
    base = _rss_gib("VmRSS:")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times, _rss_gib("VmHWM:") - base


def child(impl: str, rows: int, hidden: int, vocab: int, repeats: int, entropy: bool) -> dict:
    import torch
    import torch.nn.functional as F

    from polopt_lightning.step.logprobs import head_log_softmax, selective_log_softmax

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(rows, hidden, requires_grad=True)
    index = torch.randint(0, vocab, (rows,))
    weights = torch.randn(rows)

    def step():
        head.weight.grad = h.grad = None
        if impl == "fused":
            logp, ent = head_log_softmax(h, head, index, with_entropy=entropy)
        elif impl == "chunked":
            logp, ent = selective_log_softmax(F.linear(h, head.weight), index, with_entropy=entropy)
        else:
            from trl.trainer.utils import entropy_from_logits
            from trl.trainer.utils import selective_log_softmax as trl_selective

            logits = F.linear(h, head.weight)
            logp = trl_selective(logits[None], index[None])[0]
            ent = entropy_from_logits(logits) if entropy else None
        loss = (logp * weights).sum() + (ent.sum() if entropy else 0)
        loss.backward()

    # polopt's passes run inside the step's compute context (on this CPU oneDNN's products where it pays), TRL's not
    from contextlib import nullcontext

    from polopt_lightning import accel

    context = accel.training(None).compute(head, h.device) if impl != "trl" else nullcontext()
    context.__enter__()
    step()
    head.weight.grad = h.grad = None
    times, added = timed(step, repeats)
    onednn = type(context).__name__ == "OneDNNLinear"
    context.__exit__(None, None, None)
    return dict(impl=impl, onednn=onednn, rows=rows, hidden=hidden, vocab=vocab, entropy=entropy, seconds=times,
                median_s=statistics.median(times), added_peak_gib=added)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--entropy", action="store_true", help="the entropy's gradient too (an entropy bonus)")
    parser.add_argument("--json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        impl, rows = args.child.split(":")
        print(json.dumps(child(impl, int(rows), args.hidden, args.vocab, args.repeats, args.entropy)))
        return
    results = []
    for rows in args.rows:
        for impl in args.impls:
            cmd = [sys.executable, __file__, "--child", f"{impl}:{rows}", "--hidden", str(args.hidden), "--vocab",
                   str(args.vocab), "--repeats", str(args.repeats), *(["--entropy"] if args.entropy else [])]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if proc.returncode:
                raise SystemExit(f"{impl} at {rows} rows failed:\n{proc.stderr[-3000:]}")
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            r = results[-1]
            print(f"rows {rows:6d}  {impl:8s} {r['median_s']:7.3f} s (of {len(r['seconds'])})  "
                  f"+{r['added_peak_gib']:.2f} GiB", flush=True)
        by = {r["impl"]: r for r in results if r["rows"] == rows}
        if "fused" in by:
            for other in set(by) - {"fused"}:
                print(f"rows {rows:6d}  fused / {other}: time {by['fused']['median_s'] / by[other]['median_s']:.2f}x"
                      f"  added memory {by['fused']['added_peak_gib'] / max(by[other]['added_peak_gib'], 1e-9):.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(cpu=_cpu(), results=results), indent=1))


def _cpu() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from memory import cpu_description

    return cpu_description()


if __name__ == "__main__":
    main()
