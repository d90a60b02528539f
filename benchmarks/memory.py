"""Peak memory and step time of one short RL job under full fine-tuning, LoRA, int8+LoRA and nf4+LoRA, polopt against
TRL's GRPOTrainer with the same settings, on a model shaped like Qwen2.5-0.5B (built from its config numbers with random
weights: no download).

    python benchmarks/memory.py                                   # every setting, polopt and TRL (~30 min on 2 cores)
    python benchmarks/memory.py --settings nf4+lora --impls polopt
    python benchmarks/memory.py --shape small --steps 2           # a smoke run (seconds)
    python benchmarks/memory.py --json benchmarks/results/memory_cpu.json

The job: 2 prompts x 4 completions, 32-token prompts, 16 new tokens forced (min = max), GRPO with a KL term
(beta 0.04, so a reference is needed), one update per rollout, fp32 (4-bit layers compute in fp32), no gradient
checkpointing on either side. The model is saved once (fp32 safetensors) and both implementations load it from that
folder with ``from_pretrained``, quantized by transformers' ``BitsAndBytesConfig`` where the setting says so; LoRA is
the same ``LoraConfig`` (r 16, alpha 32, the 7 projections of every block) on both sides, and both take the reference
from the base with the adapter disabled (polopt: its shared reference; TRL: what it does under peft). Under full
fine-tuning polopt keeps a separate frozen copy as the reference, TRL too.

Each (implementation, setting) runs in a fresh process, one after another (full fine-tuning needs ~12 GiB; two at
once would not fit a 24 GiB machine), and reports two peaks of its own resident memory (``VmHWM``): while loading the
model and building the trainer, and during training (the high-water mark is reset in between through
``/proc/self/clear_refs``, so the second is the training steps' own). Step time: the median of the steps after the
first (warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import (  # noqa: E402  (the same harness)
    _sync,
    length_reward,
    module_arguments,
    module_overrides,
    note_sampling_dtype,
    peak_rss_gib,
    run_child,
)

SHAPES = {
    # Qwen2.5-0.5B: 494M parameters, tied embeddings, q/k/v biases
    "qwen2.5-0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936),
    # for a smoke run and the test
    "small": dict(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, vocab=4096),
}
SETTINGS = {"none": ("none", "none"), "lora": ("none", "lora"), "int8+lora": ("int8", "lora"),
            "nf4+lora": ("nf4", "lora")}
JOB = dict(prompts=2, generations=4, prompt_len=32, new_tokens=16, beta=0.04, lr=1e-6, forced=True)
#: tokens each step generated (the reward function counts them, on both sides; :meth:`Phases.end` takes them)
GENERATED = [0]


def counted_length_reward(prompts, completions, completion_ids=None, **kwargs):
    """:func:`throughput.length_reward`, counting the completions' tokens (EOS included) as both trainers pass them."""
    GENERATED[0] += sum(len(ids) for ids in completion_ids or ())
    return length_reward(prompts, completions, **kwargs)
LORA = dict(r=16, alpha=32)


def make_model(shape: str, folder: str) -> None:
    """Build the shape with random weights (seed 0) and save it with its tokenizer: what both sides load."""
    from polopt_lightning.models import build_tiny_model

    s = SHAPES[shape]
    model, tok = build_tiny_model(hidden_size=s["hidden"], num_layers=s["layers"], num_heads=s["heads"],
                                  num_kv_heads=s["kv_heads"], intermediate_size=s["intermediate"],
                                  vocab_size=s["vocab"], max_position_embeddings=4096, seed=0)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)


def ensure_model(shape: str, folder: str) -> None:
    """:func:`make_model` in a process of its own unless ``folder`` holds a model already (the caller stays small)."""
    if (Path(folder) / "config.json").is_file():
        return
    code, _, err = run_child([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                              f"from memory import make_model; make_model({shape!r}, {folder!r})"])
    if code:
        raise SystemExit(f"building the model failed:\n{err[-3000:]}")


def prompts() -> list[str]:
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 +-="
    return ["".join(rng.choice(alphabet) for _ in range(JOB["prompt_len"])) for _ in range(64)]


def reset_peak() -> None:
    """Start a new high-water mark of this process's resident memory (Linux: ``echo 5 > clear_refs``), after handing
    the heap that loading freed back to the system (glibc keeps it resident otherwise, and the new mark would start
    at it)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the mark starts at what is resident
        pass
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def lora_config():
    from polopt_lightning.models import LLAMA_TARGETS, Adapter

    return Adapter(kind="lora", target_modules=list(LLAMA_TARGETS), **LORA)


def run_polopt(folder: str, setting: str, steps: int, overrides: dict | None = None, baton=None,
               phases: Phases | None = None, device: str = "cpu") -> tuple[list[float], float]:
    """``steps`` RL steps of the job; returns each step's seconds and the peak resident memory of loading.

    ``overrides``: module arguments changed (the key ``precision`` is the Trainer's); ``baton``: wait for a turn
    before each step (:class:`throughput.Baton`); ``phases``: record each step's phases (:class:`Phases`);
    ``device``: ``cpu`` or ``cuda`` (the model loads onto GPU 0 and the step is timed between synchronisations)."""
    import lightning as L

    from polopt_lightning import PolicyOptimizationModule, PromptDataModule
    from polopt_lightning.models import Quantization, load_pretrained, prepare_policy

    precision, overrides = module_overrides(overrides)
    quant, adapter = SETTINGS[setting]
    model, tok = load_pretrained(folder, dtype="float32", quantization=quant,
                                 device_map={"": 0} if device == "cuda" else None)
    if adapter == "lora":
        model = prepare_policy(model, Quantization(mode=quant), lora_config())
    data = PromptDataModule(train=[{"prompt": p} for p in prompts()], tokenizer=tok, batch_size=JOB["prompts"],
                            shuffle=False)
    n = JOB["new_tokens"]
    module = PolicyOptimizationModule(model, tok, **module_arguments(dict(
        objective={"name": "grpo", "beta": JOB["beta"]}, reward_fns=[counted_length_reward],
        experience={"num_generations": JOB["generations"]},
        generation={"max_new_tokens": n, "min_new_tokens": n if JOB["forced"] else 0},
        optimizer={"lr": JOB["lr"]}), overrides))
    if phases is not None:
        note_sampling_dtype(module, phases.facts)
        phases.wrap(module, "rollout", "rollout")
        phases.wrap(module.scorer, "reference", "reference")
        phases.wrap(module.updater, "accumulate", "training")  # forward and backward of every mini-batch
    times: list[float] = []

    class Timer(L.Callback):
        def on_train_batch_start(self, *args):
            if baton:
                baton.wait("polopt")
            _sync(device)
            if phases is not None:
                phases.start()
            self.t = time.perf_counter()

        def on_train_batch_end(self, *args):
            _sync(device)
            times.append(time.perf_counter() - self.t)
            if phases is not None:
                phases.end(times[-1])

    trainer = L.Trainer(max_steps=steps, accelerator="gpu" if device == "cuda" else "cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[Timer()], precision=precision)
    load_peak = peak_rss_gib()
    reset_peak()
    trainer.fit(module, datamodule=data)
    return times, load_peak


def run_trl(folder: str, setting: str, steps: int, overrides: dict | None = None, baton=None,
            phases: Phases | None = None, device: str = "cpu") -> tuple[list[float], float]:
    """TRL's GRPOTrainer on the same job (see :func:`run_polopt`; ``overrides``: GRPOConfig arguments)."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from polopt_lightning.models import Quantization

    quant, adapter = SETTINGS[setting]
    tok = AutoTokenizer.from_pretrained(folder)
    n = JOB["new_tokens"]
    config = GRPOConfig(**{
        **dict(output_dir=tempfile.mkdtemp(prefix="trl_memory_"), use_cpu=device == "cpu", bf16=False, fp16=False,
               report_to="none", save_strategy="no", per_device_train_batch_size=JOB["prompts"] * JOB["generations"],
               gradient_accumulation_steps=1, num_generations=JOB["generations"], max_completion_length=n,
               generation_kwargs={"min_new_tokens": n if JOB["forced"] else 0}, temperature=1.0, beta=JOB["beta"], num_iterations=1,
               learning_rate=JOB["lr"], max_steps=steps, logging_steps=1, disable_dropout=True,
               shuffle_dataset=False, dataloader_num_workers=0, seed=0, gradient_checkpointing=False,
               model_init_kwargs={"dtype": "float32"}),
        **(overrides or {})})
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if baton:
                baton.wait("trl")
            _sync(device)
            if phases is not None:
                phases.start()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            _sync(device)
            times.append(time.perf_counter() - self.t)
            if phases is not None:
                phases.end(times[-1])

    trainer = GRPOTrainer(
        model=folder, reward_funcs=[counted_length_reward], args=config, processing_class=tok,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts()]), callbacks=[Timer()],
        quantization_config=Quantization(mode=quant).bnb_config(),
        peft_config=lora_config().peft_config(None) if adapter == "lora" else None)
    if phases is not None:
        phases.wrap(trainer, "_generate", "rollout")
        # the same function scores the reference (no gradient) and runs the training forward (with gradient)
        phases.wrap(trainer, "_get_per_token_logps_and_entropies",
                    lambda: "training" if torch.is_grad_enabled() else "reference")
        phases.wrap(trainer.accelerator, "backward", "training")
    load_peak = peak_rss_gib()
    reset_peak()
    trainer.train()
    return times, load_peak


NO_HEAP = "--heap: this C library has no mallinfo2 (glibc >= 2.33): live and held memory left out"


class HeapSampler:
    """What the C library's allocator hands out against what it holds (glibc's ``mallinfo2``, read every
    ``interval`` seconds by a thread): the live blocks (``uordblks + hblkhd``: tensors and everything else malloc'd)
    and the held memory (``arena + hblkhd``: the heaps' size and the mapped blocks). A resident peak above the live
    peak is memory the allocator keeps around its blocks (freed blocks it has not given back, or that the next
    blocks did not fit). Readings every ``interval``: a peak shorter than that can be missed (the live figure is a
    lower bound of the true peak). ``take`` returns the highest live and held readings since the last ``take``. Off
    (``available`` False) without glibc >= 2.33."""

    def __init__(self, interval: float = 0.005) -> None:
        import ctypes
        import threading

        class Info(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in
                        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

        try:
            libc = ctypes.CDLL("libc.so.6")
            self._read = libc.mallinfo2
        except (OSError, AttributeError):
            self.available = False
            return
        self._read.restype = Info
        self.available, self.interval = True, interval
        self._live = self._held = 0
        self._lock, self._stop = threading.Lock(), threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def close(self) -> None:
        """Stop reading (the thread ends within one interval)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:  # read and kept together: a reading never lands in the phase after a take
                info = self._read()
                self._live = max(self._live, info.uordblks + info.hblkhd)
                self._held = max(self._held, info.arena + info.hblkhd)
            time.sleep(self.interval)

    def take(self) -> tuple[float, float]:
        """The highest live and held GiB since the last call (then a new maximum starts from the next reading)."""
        with self._lock:
            live, held, self._live, self._held = self._live, self._held, 0, 0
        return live / 2**30, held / 2**30


class Phases:
    """Wall time and peak resident memory of named phases inside each step: ``wrap`` times every call of a method
    under a phase name (or a function of no arguments that names it at call time); ``end`` closes a step, its
    remainder going to ``rest`` (for both trainers: rewards, advantages, the gradient norm and clipping, the
    optimizer step, zeroing, bookkeeping). The peaks come from ``VmHWM``, reset at each phase's start (Linux's
    ``clear_refs``: a cheap reset of the mark, no trimming), so each phase's is its own; ``rest`` has the peak of
    everything between phases. Without ``/proc`` the peaks are left out. ``heap``: also each phase's highest live
    and held allocator memory (:class:`HeapSampler`; a thread reads them every 5 ms, so timings move a little)."""

    def __init__(self, heap: bool = False) -> None:
        self.steps: list[dict[str, float]] = []
        self.peaks: list[dict[str, float]] = []
        self.current: dict[str, float] = {}
        self.current_peaks: dict[str, float] = {}
        self.depth = 0
        self.overall = 0.0  # the highest mark read: the process's peak since it started timing
        self.facts: dict = {}  # what the run noted besides times (the dtype polopt sampled with)
        self.tokens: list[int] = []  # each step's generated tokens (counted by the reward function)
        self.heap = HeapSampler() if heap else None
        if self.heap is not None and not self.heap.available:
            print(NO_HEAP, flush=True)
            self.heap = None
        self.heap_steps: list[dict[str, list[float]]] = []  # per step and phase: [live GiB, held GiB]
        self.current_heap: dict[str, list[float]] = {}

    def _mark(self, reset: bool) -> float | None:
        """The high-water mark so far (GiB), then, with ``reset``, a new one from what is resident now."""
        try:
            peak = peak_rss_gib()
            self.overall = max(self.overall, peak)
            if reset:
                with open("/proc/self/clear_refs", "w") as fh:
                    fh.write("5")
            return peak
        except OSError:
            return None

    def _note(self, key: str, peak: float | None) -> None:
        if peak is not None:
            self.current_peaks[key] = max(self.current_peaks.get(key, 0.0), peak)
        if self.heap is not None:
            live, held = self.heap.take()
            old = self.current_heap.get(key, [0.0, 0.0])
            self.current_heap[key] = [max(old[0], live), max(old[1], held)]

    def wrap(self, obj, name: str, phase) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            key = phase() if callable(phase) else phase
            outer = self.depth == 0  # a phase called inside another counts once, in the outer one
            if outer:
                self._note("rest", self._mark(reset=True))
            self.depth += 1
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.depth -= 1
                self.current[key] = self.current.get(key, 0.0) + time.perf_counter() - t
                if outer:
                    self._note(key, self._mark(reset=True))

        setattr(obj, name, timed)

    def start(self) -> None:
        self.current, self.current_peaks, self.current_heap = {}, {}, {}
        GENERATED[0] = 0
        self._mark(reset=True)
        if self.heap is not None:
            self.heap.take()  # what came before the step is no phase's

    def end(self, step_s: float) -> None:
        self._note("rest", self._mark(reset=False))
        self.steps.append({**self.current, "rest": step_s - sum(self.current.values())})
        self.peaks.append(dict(self.current_peaks))
        self.tokens.append(GENERATED[0])
        if self.heap is not None:
            self.heap_steps.append(dict(self.current_heap))


def child(impl: str, setting: str, folder: str, steps: int, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    times, load_peak = (run_polopt if impl == "polopt" else run_trl)(folder, setting, steps)
    print("RESULT " + json.dumps({"impl": impl, "setting": setting, "step_s": times, "load_peak_gib": load_peak,
                                  "train_peak_gib": peak_rss_gib()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=list(SHAPES))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--impls", nargs="+", default=["polopt", "trl"], choices=["polopt", "trl"])
    parser.add_argument("--steps", type=int, default=4, help="RL steps per run (the first is warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-dir", help="where the model is saved (default: a temporary folder)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--summarize", nargs="+", metavar="JSON",
                        help="pool runs written by --json: per setting and implementation, the median step over every "
                             "run's steps (warm-up left out) and each peak's median, with their ranges")
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "SETTING", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child, args.steps, args.threads)
    if args.summarize:
        return print_summary([json.loads(Path(p).read_text()) for p in args.summarize])

    with tempfile.TemporaryDirectory(prefix="polopt_memory_") as tmp:
        folder = args.model_dir or tmp
        ensure_model(args.shape, folder)
        rows = []
        for setting in args.settings:
            for impl in args.impls:
                start = time.perf_counter()
                code, out, err = run_child([sys.executable, __file__, "--child", impl, setting, folder,
                                            "--steps", str(args.steps), "--threads", str(args.threads)])
                line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
                if code or line is None:
                    print(f"{impl} {setting}: failed (exit {code})\n{err[-3000:]}", file=sys.stderr)
                    continue
                row = json.loads(line[len("RESULT "):])
                row["median_s"] = statistics.median(row["step_s"][1:] or row["step_s"])
                row["wall_s"] = round(time.perf_counter() - start, 1)
                rows.append(row)
                print(f"{impl:>6} {setting:<10} step {row['median_s']:7.2f} s   peak train {row['train_peak_gib']:6.2f} "
                      f"GiB   load {row['load_peak_gib']:6.2f} GiB   ({row['wall_s']} s in all)", flush=True)
    print_table(rows, args)
    if args.json:
        meta = {"shape": args.shape, "shape_numbers": SHAPES[args.shape], "job": JOB, "lora": LORA,
                "steps": args.steps, "threads": args.threads, "cpu": _cpu_name()}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def print_table(rows: list[dict], args) -> None:
    by = {(r["impl"], r["setting"]): r for r in rows}
    full = by.get(("polopt", "none"))
    print(f"\n{args.shape}, {args.threads} threads, {_cpu_name()}; median of steps 2-{args.steps}")
    print("| setting | polopt s/step | TRL s/step | speed-up | polopt peak GiB (train / load) | TRL peak GiB (train / load) "
          "| polopt peak / its full fine-tuning |")
    print("|---|---|---|---|---|---|---|")
    for setting in args.settings:
        p, t = by.get(("polopt", setting)), by.get(("trl", setting))

        def cell(r, key="median_s", fmt="{:.2f}"):
            return fmt.format(r[key]) if r else "-"

        speed = f"{t['median_s'] / p['median_s']:.2f}x" if p and t else "-"
        peaks = [f"{r['train_peak_gib']:.2f} / {r['load_peak_gib']:.2f}" if r else "-" for r in (p, t)]
        share = f"{max(p['train_peak_gib'], p['load_peak_gib']) / max(full['train_peak_gib'], full['load_peak_gib']):.2f}" \
            if p and full else "-"
        print(f"| {setting} | {cell(p)} | {cell(t)} | {speed} | {peaks[0]} | {peaks[1]} | {share} |")


def print_summary(runs: list[dict]) -> None:
    """Several runs of one build pooled: each cell is a median with its range (min-max) across runs and steps."""
    pooled: dict[tuple[str, str], dict[str, list[float]]] = {}
    for run in runs:
        for row in run["rows"]:
            cell = pooled.setdefault((row["impl"], row["setting"]), {"steps": [], "train": [], "load": []})
            cell["steps"] += row["step_s"][1:] or row["step_s"]
            cell["train"].append(row["train_peak_gib"])
            cell["load"].append(row["load_peak_gib"])

    def spread(values: list[float], fmt: str = "{:.2f}") -> str:
        return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"

    meta = runs[0]["meta"]
    print(f"{meta['shape']}, {meta['threads']} threads, {meta['cpu']}; {len(runs)} runs pooled; median (range) of "
          "every step after each run's first, and of each run's peaks")
    print("| setting | polopt s/step | TRL s/step | speed-up (ratio of medians) | polopt peak GiB train / load "
          "| TRL peak GiB train / load |")
    print("|---|---|---|---|---|---|")
    for setting in SETTINGS:
        p, t = pooled.get(("polopt", setting)), pooled.get(("trl", setting))
        if not (p or t):
            continue
        speed = (f"{statistics.median(t['steps']) / statistics.median(p['steps']):.2f}x" if p and t else "-")
        cells = [(spread(c["steps"]), f"{spread(c['train'])} / {spread(c['load'])}") if c else ("-", "-") for c in (p, t)]
        print(f"| {setting} | {cells[0][0]} | {cells[1][0]} | {speed} | {cells[0][1]} | {cells[1][1]} |")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        return os.uname().machine


def cpu_description() -> str:
    """The CPU's name, its cores, and which of the features that change the products' speed it has (AVX2, AVX-512,
    AVX512-BF16, AMX)."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next(x.split(":", 1)[1].split() for x in fh if x.startswith("flags"))
    except (OSError, StopIteration):
        flags = []
    features = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{_cpu_name()}, {os.cpu_count()} cores, {'+'.join(features) or 'no AVX2'}{capped_instructions()}"


ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def capped_instructions() -> str:
    """Where the libraries are told to use fewer of the CPU's instructions than it has (another CPU kind emulated:
    PyTorch's kernels, oneDNN's, MKL's), the settings that say so, for the figures' label; else nothing."""
    caps = [f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name)]
    return f", instructions capped ({' '.join(caps)}: another CPU kind emulated)" if caps else ""


if __name__ == "__main__":
    main()
