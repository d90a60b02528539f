"""The training pass (forward and backward) and the reference pass alone on completions of different lengths: padded
against padding-free (``update.padding_free``), with the fused head (``update.fused_head``) on and off, each case in a
fresh process, on a model shaped like Qwen2.5-0.5B (random weights from its config numbers, no download).

    python benchmarks/passes.py                                   # 8 completions of 128-1,024 tokens, 0.5B shape
    python benchmarks/passes.py --max-tokens 512 --json benchmarks/results/passes_cpu.json
    python benchmarks/passes.py --shape small --max-tokens 64 --repeats 1    # a smoke run (seconds)

The completions' lengths are drawn once (seed 0) uniformly between an eighth of ``--max-tokens`` and all of it, as
sampled stops spread them (the padded passes run every row to the longest); one 32-token prompt shared by the group.
Each case: one pass as warm-up, then ``--repeats`` timed; the training pass's loss is a weighted sum of the log-probs
over real tokens, the whole model trains (full fine-tuning, float32) under activation checkpointing (what these
lengths need at 0.5B on 24 GiB; ``--no-checkpointing`` keeps the activations) inside the step's compute context
(``accel``). The rows are scored by the module's own scorer (``step.logprobs.Scorer``) under each case's settings: the
padded passes share the group's prompt's keys/values where no layer is checkpointed and give each completion its own
prompt where one is; padding-free runs the prompt once either way.
Memory: the process's resident high-water mark over the timed passes minus the resident memory before them. glibc's
allocator keeps some freed memory resident and returns some (its threshold for mapping an allocation on its own moves
with what was freed), so what a pass "adds" depends on what the passes before it freed: the gradients a pass makes
(1.84 GiB at 0.5B) count in full or not at all. ``--live-memory`` runs each case with ``MALLOC_MMAP_THRESHOLD_=131072``
(every allocation of 128 KiB and more mapped on its own and returned when freed), so resident memory follows the live
tensors and the cases compare; its times are not the default allocator's (slower: every large tensor faults its
pages in afresh).

    python benchmarks/passes.py --max-tokens 512 --repeats 1 --cases padded+fused padding-free+fused --live-memory
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_head import _cpu, timed  # noqa: E402
from memory import SHAPES  # noqa: E402

CASES = {  # name: (padding_free, fused_head)
    "padded": (False, False),
    "padded+fused": (False, True),
    "padding-free+fused": (True, True),
}


def child(case: str, shape: str, completions: int, max_tokens: int, repeats: int, threads: int,
          checkpointing: bool) -> dict:
    from types import SimpleNamespace

    import torch

    from polopt_lightning import accel
    from polopt_lightning.models import build_tiny_model, enable_gradient_checkpointing
    from polopt_lightning.step.logprobs import Scorer
    from polopt_lightning.step.update import UpdateConfig

    torch.set_num_threads(threads)
    padding_free, fused = CASES[case]
    s = SHAPES[shape]
    model, _ = build_tiny_model(hidden_size=s["hidden"], num_layers=s["layers"], num_heads=s["heads"],
                                num_kv_heads=s["kv_heads"], intermediate_size=s["intermediate"], vocab_size=s["vocab"],
                                max_position_embeddings=4096, seed=0)
    model.train()  # as the policy trains (checkpointing acts in training mode; no dropout in these models)
    if checkpointing:
        enable_gradient_checkpointing(model)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(1, max_tokens // 8), max_tokens + 1, (completions,), generator=g)
    prompt = torch.randint(0, s["vocab"], (1, 32), generator=g).expand(completions, -1)
    ids = torch.randint(0, s["vocab"], (completions, int(lengths.max())), generator=g)
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    weights = torch.randn(ids.shape, generator=g) * mask
    # the rows as an experience holds them, scored by the module's own scorer under these settings
    exp = SimpleNamespace(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=ids,
                          attention_mask=mask, group_index=torch.zeros(completions, dtype=torch.long))
    config = UpdateConfig(padding_free=padding_free, fused_head=fused, gradient_checkpointing=checkpointing)
    scorer = Scorer(model, None, False, config, 1.0)

    def scores():
        return scorer.logprobs(model, exp, slice(None))[0]

    def training():
        model.zero_grad(set_to_none=True)
        (scores() * weights).sum().backward()

    def reference():
        with torch.no_grad():
            scores()

    context = accel.training(None).compute(model, torch.device("cpu"))
    out = {}
    with context:
        for name, fn in (("reference", reference), ("training", training)):
            fn()
            model.zero_grad(set_to_none=True)
            times, added = timed(fn, repeats)
            model.zero_grad(set_to_none=True)
            out[name] = dict(seconds=times, median_s=statistics.median(times), added_peak_gib=added)
    return dict(case=case, shape=shape, checkpointing=checkpointing, lengths=lengths.tolist(), padded_tokens=int(mask.numel()),
                malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"),
                real_tokens=int(mask.sum()), **out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=list(SHAPES))
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="keep every layer's activations (at 0.5B and 8 x 1,024 tokens: more than 24 GiB)")
    parser.add_argument("--live-memory", action="store_true",
                        help="glibc returns every large freed allocation (MALLOC_MMAP_THRESHOLD_=131072): memory "
                             "comparable between cases, times slower")
    parser.add_argument("--json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.shape, args.completions, args.max_tokens, args.repeats, args.threads,
                               args.checkpointing)))
        return
    results = []
    for case in args.cases:
        cmd = [sys.executable, __file__, "--child", case, "--shape", args.shape, "--completions",
               str(args.completions), "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
               "--threads", str(args.threads), *([] if args.checkpointing else ["--no-checkpointing"])]
        env = {**os.environ, "PYTHONWARNINGS": "ignore", **({"MALLOC_MMAP_THRESHOLD_": "131072"} if args.live_memory
                                                             else {})}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"{case} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["live_memory"] = args.live_memory
        results.append(r)
        if len(results) == 1:
            print(f"{r['shape']}: {len(r['lengths'])} completions of {min(r['lengths'])}-{max(r['lengths'])} tokens, "
                  f"{r['real_tokens']} real of {r['padded_tokens']} padded; {_cpu()}", flush=True)
        print(f"{case:20s} reference {r['reference']['median_s']:7.2f} s +{r['reference']['added_peak_gib']:.2f} GiB"
              f"   training {r['training']['median_s']:7.2f} s +{r['training']['added_peak_gib']:.2f} GiB", flush=True)
    first = results[0]
    for r in results[1:]:
        print(f"{r['case']} / {first['case']}: " + ", ".join(
            f"{p} time {r[p]['median_s'] / first[p]['median_s']:.2f}x memory "
            f"{r[p]['added_peak_gib'] / max(first[p]['added_peak_gib'], 1e-9):.2f}x" for p in ("reference", "training")))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(cpu=_cpu(), results=results), indent=1))


if __name__ == "__main__":
    main()
