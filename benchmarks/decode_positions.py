"""Decoding time against position at long lengths: each new token's seconds, from the first to the ``--new-tokens``-th,
for polopt's sampler and for transformers' ``generate`` (what TRL's GRPOTrainer samples with), in one process.

    python benchmarks/decode_positions.py --model-dir /tmp/q05b --new-tokens 2048       # the 0.5B shape (built if missing)
    python benchmarks/decode_positions.py --shape small --new-tokens 256                # a smoke run

The job: 1 prompt x 8 completions, a 32-token prompt, lengths forced (min = max), fp32, the sampler inside the module's
oneDNN context and with glibc's kept heap (as in training). polopt: the time between successive decoding steps of
``HFRolloutEngine`` (the step and the token's draw). transformers: the time between successive calls of a logits
processor (``generate``'s step: the forward with its dynamic cache, the processors, the draw). Printed: milliseconds a
token, median over bins of positions, and each bin's time over the first bin's; the floor of a token (the weights read
once, plus the keys and values read so far, at the measured read bandwidth) for the same bins.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import JOB, cpu_description, ensure_model, prompts  # noqa: E402
from throughput import memory_gbps  # noqa: E402


def polopt_steps(model, tok, new_tokens: int, rows: int) -> list[float]:
    """Seconds of each decoding step of polopt's sampler (after the first token, which the prefill gives)."""
    import torch

    import polopt_lightning.rollout.hf as engine
    from polopt_lightning.accel.cpu.host_memory import KeptHostMemory
    from polopt_lightning.accel.cpu.linear import OneDNNLinear
    from polopt_lightning.rollout import HFRolloutEngine, SamplingConfig

    stamps: list[float] = []
    originals = {name: getattr(engine, name) for name in ("decode_step", "shared_prompt_decode_step")}

    def stamped(original):
        @functools.wraps(original)
        def run(*args, **kwargs):
            stamps.append(time.perf_counter())
            return original(*args, **kwargs)
        return run

    for name, original in originals.items():
        setattr(engine, name, stamped(original))
    batch = tok(prompts()[:1], return_tensors="pt")
    sampling = SamplingConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    try:
        with KeptHostMemory(), OneDNNLinear():
            HFRolloutEngine().generate(model, batch["input_ids"], batch["attention_mask"], rows,
                                       SamplingConfig(max_new_tokens=8, min_new_tokens=8), tok.eos_token_id,
                                       tok.pad_token_id, generator=torch.Generator().manual_seed(0))  # warm-up
            stamps.clear()
            HFRolloutEngine().generate(model, batch["input_ids"], batch["attention_mask"], rows, sampling,
                                       tok.eos_token_id, tok.pad_token_id, generator=torch.Generator().manual_seed(0))
            stamps.append(time.perf_counter())
    finally:
        for name, original in originals.items():
            setattr(engine, name, original)
    return [b - a for a, b in zip(stamps, stamps[1:])]


def transformers_steps(model, tok, new_tokens: int, rows: int) -> list[float]:
    """Seconds between successive steps of ``model.generate`` (sampling, its default dynamic cache)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    batch = tok(prompts()[:1], return_tensors="pt")
    ids, mask = batch["input_ids"].repeat(rows, 1), batch["attention_mask"].repeat(rows, 1)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=True,
                       top_k=0, pad_token_id=tok.pad_token_id)  # warm-up
        stamps.clear()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=True, top_k=0, pad_token_id=tok.pad_token_id, logits_processor=LogitsProcessorList([Stamp()]))
    return [b - a for a, b in zip(stamps, stamps[1:])]


def bins(steps: list[float], width: int) -> list[float]:
    return [statistics.median(steps[i:i + width]) for i in range(0, len(steps), width) if steps[i:i + width]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="the model's shape (memory.py's SHAPES)")
    parser.add_argument("--model-dir", help="where the model is saved (default: a temporary folder)")
    parser.add_argument("--new-tokens", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=8, help="completions of the one prompt")
    parser.add_argument("--bin", type=int, default=256, help="positions a bin")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--impls", nargs="+", default=["polopt", "transformers"], choices=["polopt", "transformers"])
    parser.add_argument("--json", help="also write the measurements to this file")
    args = parser.parse_args()
    import torch

    from polopt_lightning.models import load_pretrained

    torch.set_num_threads(args.threads)
    gbps = memory_gbps(args.threads)
    with tempfile.TemporaryDirectory(prefix="polopt_positions_") as tmp:
        folder = args.model_dir or tmp
        ensure_model(args.shape, folder)
        model, tok = load_pretrained(folder, dtype="float32")
        config = model.config
        weights = sum(p.numel() for p in model.parameters()) * 4
        head_dim = config.hidden_size // config.num_attention_heads
        per_position = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4 * args.rows
        results = {impl: (polopt_steps if impl == "polopt" else transformers_steps)(model, tok, args.new_tokens,
                                                                                    args.rows)
                   for impl in args.impls}
    start = JOB["prompt_len"]
    floor = [(weights + per_position * (start + i + args.bin / 2)) / (gbps * 1e9) for i in range(0, args.new_tokens,
                                                                                                  args.bin)]
    print(f"{cpu_description()}, {args.threads} threads, memory read {gbps:.1f} GB/s; {args.shape}, 1 prompt x "
          f"{args.rows} completions, {args.new_tokens} tokens forced, fp32")
    print("| positions | " + " | ".join(f"{i} ms/token (x first)" for i in args.impls) + " | floor ms (x first) |")
    print("|---|" + "---|" * (len(args.impls) + 1))
    table = {impl: bins(steps, args.bin) for impl, steps in results.items()}
    for k in range(len(floor)):
        cells = [f"{table[i][k] * 1e3:.1f} ({table[i][k] / table[i][0]:.2f})" if k < len(table[i]) else "-"
                 for i in args.impls]
        print(f"| {start + k * args.bin}-{start + (k + 1) * args.bin} | " + " | ".join(cells)
              + f" | {floor[k] * 1e3:.1f} ({floor[k] / floor[0]:.2f}) |")
    for impl in args.impls:
        print(f"{impl}: {sum(results[impl]):.1f} s for {len(results[impl])} steps; last bin x{table[impl][-1] / table[impl][0]:.2f}"
              f" the first (floor x{floor[-1] / floor[0]:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": cpu_description(), "gbps": gbps, "shape": args.shape,
                                               "rows": args.rows, "new_tokens": args.new_tokens, "bin": args.bin,
                                               "steps": results, "bins": table, "floor": floor}, indent=1))


if __name__ == "__main__":
    main()
