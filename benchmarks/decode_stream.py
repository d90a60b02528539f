"""Where the sampling phase's time goes at real scale, and how fast the decoding kernel streams the weights against a
plain read of the same weights, both measured round after round in one process.

    python benchmarks/decode_stream.py --model-dir /tmp/q05b        # real_scale.py's model (built there if missing)
    python benchmarks/decode_stream.py --model-dir /tmp/q05b --setting lora       # the rollout of LoRA, nf4+lora
    python benchmarks/decode_stream.py --shape small --rounds 2     # a smoke run (seconds)

1. Stream: every weight read the way one decoding step reads it (``rowdot``'s products of 8 rows: q/k/v in one call,
   o, gate/up in one, down, the head), then the same tensors summed by PyTorch (a plain read, what ``real_scale.py``'s
   bandwidth probe does, there on one 512 MiB tensor, best of 5), alternating round by round: GB/s of each and the
   kernel's share of the plain read, median (range).
2. Rollout: the job of ``real_scale.py`` (2 prompts x 4 completions, 32-token prompts, 16 new tokens forced, fp32,
   LoRA or nf4+LoRA as ``--setting`` says, inside the module's oneDNN context and with glibc's kept heap, as in
   training) piece by piece: the prefill (the
   model's forward over the prompts, the head at the last position included), the decoding steps, the token draw
   (log-softmax, softmax, filtering, the draw itself) and the rest (the loop, the batch built at the end); median
   (range) over the rounds after one warm-up rollout.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import JOB, _cpu_name, ensure_model, lora_config, prompts  # noqa: E402
from real_scale import phase_floors, quantization_and_adapter, shape_numbers  # noqa: E402
from throughput import matmul_gflops, memory_gbps  # noqa: E402


def spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    return (f"{statistics.median(values) * scale:.{digits}f} "
            f"({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})")


def stream(model, rounds: int) -> dict[str, list[float]] | str:
    """GB/s of the kernel's products over every weight (8 rows) and of a plain sum over the same tensors, per round;
    or why the kernel cannot run here."""
    import torch

    from polopt_lightning.accel.cpu import rowdot
    from polopt_lightning.accel.cpu.decode import _groups

    if rowdot.load() is None:
        return f"the decoding kernel does not run here: {rowdot.why_not()}"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model

    def plain(*modules):  # the float32 weights themselves (an adapter layer's frozen base)
        linears = [getattr(m, "base_layer", m) for m in modules]
        if not all(type(m) is torch.nn.Linear for m in linears) or not rowdot.fits(linears):
            raise TypeError(type(linears[0]).__name__)
        return rowdot.RowDot(linears)

    try:
        calls = [plain(*group) for layer in base.model.layers for group in _groups(layer)]
        calls.append(plain(base.lm_head))
    except TypeError as err:
        return f"the model's layers are not plain float32 weights the kernel reads ({err})"
    weights = [w for call in calls for w in call.weights]
    total = sum(w.numel() * w.element_size() for w in weights)
    inputs = [torch.randn(8, call.in_features) for call in calls]
    rates: dict[str, list[float]] = {"kernel": [], "sum": []}
    for r in range(rounds + 1):  # the first round warms up
        t = time.perf_counter()
        for call, x in zip(calls, inputs):
            call(x)
        kernel = time.perf_counter() - t
        t = time.perf_counter()
        for w in weights:
            w.sum()
        summed = time.perf_counter() - t
        if r:
            rates["kernel"].append(total / kernel / 1e9)
            rates["sum"].append(total / summed / 1e9)
    return rates


def rollout_pieces(model, tok, rounds: int, engine_args: dict | None = None) -> dict[str, list[float]]:
    """Seconds of each piece of the job's rollout, per round after a warm-up rollout (``engine_args``: the
    ``HFRolloutEngine``'s)."""
    import torch

    import polopt_lightning.rollout.hf as engine
    from polopt_lightning.accel.cpu.host_memory import KeptHostMemory
    from polopt_lightning.accel.cpu.linear import OneDNNLinear
    from polopt_lightning.rollout import HFRolloutEngine, SamplingConfig

    spent: Counter = Counter()

    def timed(owner, name: str, piece):
        """Wrap ``owner.name`` to add its seconds to ``piece`` (a name, or a function of the call's keywords)."""
        original = getattr(owner, name)

        @functools.wraps(original)  # the signature stays visible (the engine reads the forward's)
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[piece if isinstance(piece, str) else piece(kwargs)] += time.perf_counter() - t
        setattr(owner, name, run)
        return owner, name, original

    def forward_piece(kwargs) -> str:  # one new token a row: a decoding step through the model's own forward
        ids = kwargs.get("input_ids")
        return "decode" if ids is not None and ids.shape[-1] == 1 else "prefill"

    patched = [timed(type(model), "forward", forward_piece), timed(engine, "decode_step", "decode"),
               timed(engine, "shared_prompt_decode_step", "decode"), timed(engine, "sample_tokens", "draw"),
               timed(engine, "filter_logits", "draw"), timed(torch, "log_softmax", "draw"),
               timed(torch, "softmax", "draw")]
    batch = tok(prompts()[:JOB["prompts"]], return_tensors="pt", padding=True)  # the job's first prompts
    gen = torch.Generator().manual_seed(0)
    sampling = SamplingConfig(max_new_tokens=JOB["new_tokens"], min_new_tokens=JOB["new_tokens"])
    rollout = HFRolloutEngine(**(engine_args or {}))
    pieces: dict[str, list[float]] = {k: [] for k in ("rollout", "prefill", "decode", "draw", "rest")}
    try:
        with KeptHostMemory(), OneDNNLinear():
            for r in range(rounds + 1):
                spent.clear()
                t = time.perf_counter()
                rollout.generate(model, batch["input_ids"], batch["attention_mask"], JOB["generations"], sampling,
                                 tok.eos_token_id, tok.pad_token_id, generator=gen)
                whole = time.perf_counter() - t
                if r:
                    pieces["rollout"].append(whole)
                    for k in ("prefill", "decode", "draw"):
                        pieces[k].append(spent[k])
                    pieces["rest"].append(whole - sum(spent.values()))
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
    return pieces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="the model's shape (memory.py's SHAPES)")
    parser.add_argument("--model-dir", help="where the model is saved (default: a temporary folder)")
    parser.add_argument("--setting", default="fp32", choices=["fp32", "lora", "nf4+lora"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from polopt_lightning.models import Quantization, load_pretrained, prepare_policy

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model_dir or tmp
        ensure_model(args.shape, folder)
        quant, adapter = quantization_and_adapter(args.setting)
        model, tok = load_pretrained(folder, dtype="float32", quantization=quant)
        if adapter == "lora":
            model = prepare_policy(model, Quantization(mode=quant), lora_config())
        model.eval()
        gbps, gflops = memory_gbps(args.threads), matmul_gflops(args.threads, dtype="float32")
        numbers = shape_numbers(args.shape)
        floor = phase_floors(numbers, args.setting, "polopt", {"float32": gflops}, gbps, "float32")["rollout"]
        prefill = 2 * numbers["non_embedding"] * JOB["prompts"] * JOB["prompt_len"] / (gflops * 1e9)
        print(f"{_cpu_name()}, {args.threads} torch threads; {args.shape}, {args.setting}; probe (best of 5 sums of 512 MiB) "
              f"{gbps:.1f} GB/s, matmul {gflops:.0f} GFLOP/s fp32; the rollout's floor by real_scale.py's rules "
              f"{floor * 1e3:.0f} ms (prefill {prefill * 1e3:.0f}, {JOB['new_tokens']} tokens {(floor - prefill) * 1e3:.0f})")
        with torch.inference_mode():
            rates = stream(model, args.rounds)
        if isinstance(rates, str):
            print(f"\nStream: skipped ({rates})")
        else:
            share = [k / s for k, s in zip(rates["kernel"], rates["sum"])]
            print(f"\nStream, {args.rounds} alternating rounds over every weight (GB/s, median (range)):\n\n"
                  "| kernel, 8 rows | plain sum | kernel / sum |\n|---|---|---|\n"
                  f"| {spread(rates['kernel'])} | {spread(rates['sum'])} | {spread(share, digits=2)} |")
        pieces = rollout_pieces(model, tok, args.rounds)
        names = list(pieces)
        print(f"\nRollout, {args.rounds} rounds after a warm-up (ms, median (range)):\n\n| {' | '.join(names)} |\n"
              f"|{'---|' * len(names)}\n| {' | '.join(spread(pieces[k], 1e3, 0) for k in names)} |")
        print(f"\nThe rollout against its floor: {statistics.median(pieces['rollout']) / floor:.2f}x")


if __name__ == "__main__":
    main()
