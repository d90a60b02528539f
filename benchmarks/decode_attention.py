"""Attention over a long KV cache in one decoding step: what each cached position costs polopt's fused C step and the
same step in PyTorch (``scaled_dot_product_attention`` over the cache, what the step runs where the C step does not
apply), against the floor of reading the keys and values once.

    python benchmarks/decode_attention.py                        # Qwen2.5-0.5B's attention, positions 32 to 2,048
    python benchmarks/decode_attention.py --positions 32 256 --repeats 3     # a smoke run

The model has Qwen2.5-0.5B's attention (24 layers, 14 query heads over 2 key/value heads of 64, hidden 896) and an
MLP 16 wide with a 512-token vocabulary, so the step's weights are small (~180 MB) and its time grows with the cache
alone. The cache (8 rows, every position written, random keys and values) is the preallocated one the sampler
decodes into; each case runs ``--repeats`` steps after a warm-up, the median printed. The cost of a position is the
slope between the first and the last position (``(t(last) - t(first)) / (last - first)``), against the floor: its
keys and values (8 rows x 24 layers x 2 heads x 64 x 2 x 4 bytes) read at the measured memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import cpu_description  # noqa: E402
from throughput import memory_gbps  # noqa: E402


def step_times(positions: list[int], rows: int, repeats: int) -> tuple[dict[str, list[float]], int]:
    """Median seconds of one decoding step at each cache length, for the fused C step and the step in PyTorch, and
    the bytes of keys and values a cached position adds to a step."""
    import torch

    from polopt_lightning.accel.cpu import decode as cpu_decode
    from polopt_lightning.accel.cpu.host_memory import KeptHostMemory
    from polopt_lightning.accel.cpu.linear import OneDNNLinear
    from polopt_lightning.accel.lean_step import _step, llama_like
    from polopt_lightning.models import build_tiny_model

    model, _ = build_tiny_model(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=16,
                                vocab_size=512, max_position_embeddings=max(positions) + 64, seed=0)
    base, config = llama_like(model), model.config
    D = config.hidden_size // config.num_attention_heads
    capacity = max(positions) + 1
    gen = torch.Generator().manual_seed(0)
    cache = [(torch.randn(rows, config.num_key_value_heads, capacity, D, generator=gen),
              torch.randn(rows, config.num_key_value_heads, capacity, D, generator=gen))
             for _ in range(config.num_hidden_layers)]
    bias = torch.zeros(rows, 1, 1, capacity)
    token = torch.randint(0, 512, (rows,), generator=gen)
    out: dict[str, list[float]] = {"polopt C step": [], "PyTorch step (SDPA)": []}
    with torch.no_grad(), KeptHostMemory(), OneDNNLinear():
        projections = cpu_decode.PackedProjections(base, rows)
        if projections.fused is None:
            raise SystemExit("the fused decoding step does not run here (it needs AVX-512 and a C compiler): "
                             "nothing to compare")

        def fused(length: int):
            projections.fused(token, torch.full((rows, 1), length), cache, length + 1, bias[:, 0, 0], 1, slot=length)

        def eager(length: int):
            def attend(k_buf, v_buf):
                def run(q, k, v, scale):
                    k_buf[:, :, length:length + 1], v_buf[:, :, length:length + 1] = k, v
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, k_buf[:, :, :length + 1], v_buf[:, :, :length + 1], attn_mask=bias[..., :length + 1],
                        scale=scale, enable_gqa=True)
                return run
            _step(base, [attend(k, v) for k, v in cache], token, torch.full((rows, 1), length), projections)

        for name, run in zip(out, (fused, eager)):
            for length in positions:
                run(length)  # warm-up
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    run(length)
                    times.append(time.perf_counter() - start)
                out[name].append(statistics.median(times))
    return out, rows * config.num_hidden_layers * config.num_key_value_heads * D * 2 * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, nargs="+", default=[32, 512, 1024, 2048])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the measurements to this file")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    gbps = memory_gbps(args.threads)
    times, per_position = step_times(args.positions, args.rows, args.repeats)
    floor_us = per_position / (gbps * 1e9) * 1e6
    first, last = args.positions[0], args.positions[-1]
    print(f"{cpu_description()}, {args.threads} threads, memory read {gbps:.1f} GB/s; Qwen2.5-0.5B's attention, "
          f"{args.rows} rows, fp32")
    print("| step | " + " | ".join(f"ms at {p}" for p in args.positions) + " | us a cached position | x floor |")
    print("|---|" + "---|" * (len(args.positions) + 2))
    slopes = {}
    for name, ts in times.items():
        slopes[name] = (ts[-1] - ts[0]) / (last - first) * 1e6
        print(f"| {name} | " + " | ".join(f"{t * 1e3:.1f}" for t in ts)
              + f" | {slopes[name]:.2f} | {slopes[name] / floor_us:.1f} |")
    print(f"| floor (keys and values read once) | | | | | {floor_us:.2f} | 1.0 |" if len(args.positions) == 4
          else f"floor (keys and values read once): {floor_us:.2f} us a cached position")
    names = list(times)
    print(f"polopt's C step: {slopes[names[1]] / slopes[names[0]]:.2f}x less time a cached position than the step in "
          f"PyTorch")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": cpu_description(), "gbps": gbps, "rows": args.rows,
                                               "positions": args.positions, "seconds": times,
                                               "us_per_position": slopes, "floor_us": floor_us}, indent=1))


if __name__ == "__main__":
    main()
