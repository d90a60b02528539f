"""One rollout with finished completions dropped from the decoding batch and one without, same prompts, same
generator: seconds each and how many tokens differ (``rollout.drop_finished``, issue 51; a token can differ where the
shrinking batch moves from oneDNN's products to the C kernel, which round float32 sums in another order).

    python benchmarks/drop_finished.py --model-dir /tmp/q05b --cap 256 --prompts 4          # 32 rows
    python benchmarks/drop_finished.py --model-dir /tmp/q05b --cap 1024 --prompts 1         # 8 rows
    python benchmarks/drop_finished.py --model-dir /tmp/q05b --cap 256 --prompt-tokens 300 \
        --cases keep:shared_prompt_kv=true drop:shared_prompt_kv=false                      # against the shared prompt

Lengths vary as sampled ones do (``lengths.py``'s stop tokens: one in every ``0.5 x cap`` of the vocabulary). The
policy samples in float32 inside the training step's oneDNN context, as it does in a training run on the CPU. Each
case is ``keep`` (``drop_finished=False``) or ``drop`` (``True``), with engine arguments after a colon; cases run in
turn in one process, the model loaded once (``--model-dir``: built at ``--shape`` where it holds no model).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lengths import set_stops  # noqa: E402
from memory import SHAPES, cpu_description, ensure_model  # noqa: E402


def parse_case(text: str) -> tuple[str, dict]:
    """``"drop:shared_prompt_kv=false"`` -> ``("drop", {"drop_finished": True, "shared_prompt_kv": False})``."""
    name, _, rest = text.partition(":")
    if name not in ("keep", "drop"):
        raise SystemExit(f"--cases: {text!r} must start with keep or drop")
    settings = {"drop_finished": name == "drop"}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        settings[key] = json.loads(value)
    return text, settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=list(SHAPES))
    parser.add_argument("--model-dir", required=True, help="the model's folder (built at --shape there if missing)")
    parser.add_argument("--cap", type=int, default=256, help="max_new_tokens")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--cases", nargs="+", default=["keep", "drop"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the measurements to this file")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from polopt_lightning.accel.cpu.linear import OneDNNLinear
    from polopt_lightning.rollout import HFRolloutEngine, SamplingConfig

    torch.set_num_threads(args.threads)
    ensure_model(args.shape, args.model_dir)
    stops = set_stops(args.model_dir, args.cap // 2)
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    finally:
        set_stops(args.model_dir, None)  # the folder's generation config as it was built
    ids = torch.randint(100, 1000, (args.prompts, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    sampling = SamplingConfig(max_new_tokens=args.cap)
    print(cpu_description(), flush=True)
    rows, first = [], None
    for name, settings in map(parse_case, args.cases):
        with OneDNNLinear(model):
            start = time.perf_counter()
            out = HFRolloutEngine(**settings).generate(model, ids, torch.ones_like(ids), args.generations, sampling,
                                                       stops, 0, torch.Generator().manual_seed(1))
            seconds = time.perf_counter() - start
        lengths = out.completion_mask.sum(1).tolist()
        first = first or out
        same = out.completion_ids.shape == first.completion_ids.shape and bool(
            torch.equal(out.completion_ids, first.completion_ids))
        width = min(out.completion_ids.shape[1], first.completion_ids.shape[1])
        real = (out.completion_mask[:, :width] + first.completion_mask[:, :width]) > 0
        differ = int(((out.completion_ids[:, :width] != first.completion_ids[:, :width]) & real).sum())
        rows.append({"case": name, "seconds": seconds, "lengths": lengths, "same_tokens_as_first": same,
                     "tokens_differing_from_first": differ,
                     "max_logprob_diff": float((out.sampling_logprobs[:, :width]
                                                - first.sampling_logprobs[:, :width]).abs().max())})
        print(f"{name:45s} {seconds:7.1f} s  {sum(lengths)} tokens, {lengths.count(args.cap)} at the cap, "
              f"lengths {min(lengths)}-{max(lengths)}; tokens differing from the first case's: {differ}", flush=True)
    for row in rows[1:]:
        print(f"{row['case']}: {row['seconds'] / rows[0]['seconds']:.2f}x the time of {rows[0]['case']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": cpu_description(), "args": vars(args), "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
