"""``trainer.precision=auto``: bfloat16 mixed precision where the device multiplies bfloat16 natively, chosen before the
Trainer is made (Lightning itself has no such value), and the check of ``trainer.precision``'s value.

bfloat16 mixed precision (``bf16-mixed``: float32 master weights and optimizer state, bf16 products, float32
log-softmax) where the device has bf16 arithmetic: a CUDA device that supports it, a CPU with AMX (``amx_bf16``) or
AVX512-BF16 (``avx512_bf16``) for a model large enough that bf16 pays there (:data:`BF16_CPU_MIN_WEIGHTS`), where the
process's bf16 products measure faster than float32's (:data:`BF16_CPU_MIN_SPEEDUP`: AMX may be hidden); float32
(``32-true``) elsewhere, where bf16 products are emulated (AVX2, AVX-512 without BF16) and slower than float32's, and
for small models on the CPU. The CPU trainer's default (``conf/trainer/cpu.yaml``). Where it pays and what it costs:
docs/performance.md.
Each run chooses on the machine it runs on (every process for itself); a resumed run keeps the precision its
checkpoint was trained in (:func:`polopt_lightning.cli.train`). From a Trainer of your own:
``L.Trainer(precision=auto_precision("cpu", model=model)[0])``.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import torch

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")

#: On a CPU, bfloat16 pays only where the products are large enough to outweigh the casts around them: a model whose
#: largest linear layer (the output head aside) has fewer weights than this trains in float32 under ``auto`` (the
#: measurements that set it: docs/performance.md, "Precision by the hardware").
BF16_CPU_MIN_WEIGHTS = 2**19


#: where the flags say bf16 is native, ``auto`` takes it on this machine only if its bf16 products measure at least this
#: many times float32's (:func:`cpu_bf16_speedup`): the flags alone do not say whether AMX is available to the process
#: (a VM or a kernel may hide it); the measurements that set it: docs/performance.md, "Precision by the hardware"
BF16_CPU_MIN_SPEEDUP = 1.3


@functools.lru_cache(maxsize=1)
def cpu_bf16_speedup() -> float:
    """The rate of this process's bfloat16 matrix products over its float32 ones (``torch.mm``, ``[256, 1024] x
    [1024, 1024]``, the best of 5 timings each after 2 warm-up products; about 0.05 s), measured once."""
    import time

    rates = []
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(256, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
        for _ in range(2):
            a @ b
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        rates.append(1 / max(best, 1e-9))
    return rates[1] / rates[0]


def largest_linear(model: Any) -> int | None:
    """The most weights of one linear layer of ``model`` (its output head aside, which a tied model shares with the
    embeddings; a quantized or adapted layer counted by its shape; GPT-2's ``Conv1D`` layers, linear layers with a
    transposed weight, counted too), or ``None`` where it has none."""
    from torch import nn

    sizes = [m.in_features * m.out_features if isinstance(m, nn.Linear) else m.weight.numel()
             for name, m in model.named_modules()
             if (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D") and not name.endswith("lm_head")]
    return max(sizes) if sizes else None


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The CPU's feature flags (``/proc/cpuinfo``'s first ``flags`` line, ``Features`` on ARM), or ``None`` where they
    cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return None


@functools.lru_cache(maxsize=1)
def cpu_bf16() -> tuple[str, ...]:
    """The flags of :data:`BF16_CPU_FLAGS` this machine's CPU has (read once): empty where it multiplies bfloat16
    only by emulation, or its features cannot be read."""
    return bf16_flags(cpu_flags() or set())


def bf16_flags(flags: set[str]) -> tuple[str, ...]:
    """The flags of :data:`BF16_CPU_FLAGS` among ``flags``."""
    return tuple(flag for flag in BF16_CPU_FLAGS if flag in flags)


def auto_precision(accelerator: str = "auto", cpuinfo: str | None = None, model: Any = None) -> tuple[str, str]:
    """``(precision, why)`` for ``trainer.precision=auto`` on ``accelerator`` (``cpu``, ``gpu``/``cuda`` or ``auto``:
    CUDA where available): ``"bf16-mixed"`` where the device multiplies bfloat16 natively (on a CPU: for a ``model``
    whose largest linear layer has at least :data:`BF16_CPU_MIN_WEIGHTS` weights, and, on this machine, where its bf16
    products measure at least :data:`BF16_CPU_MIN_SPEEDUP` times float32's), else ``"32-true"``. ``cpuinfo`` stands
    for another CPU's ``/proc/cpuinfo`` (its flags decide; nothing is measured)."""
    cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if cuda:
        if not torch.cuda.is_available():
            return "32-true", f"trainer.accelerator={accelerator} but torch sees no CUDA device"
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16-mixed", f"{torch.cuda.get_device_name()} has bfloat16 arithmetic"
        return "32-true", f"{torch.cuda.get_device_name()} has no native bfloat16 arithmetic"
    if accelerator not in ("cpu", "auto"):
        return "32-true", f"trainer.accelerator={accelerator}: no rule for it, float32"
    here = cpuinfo is None
    flags = cpu_flags(cpuinfo)
    if flags is None:
        return "32-true", f"the CPU's features cannot be read on {sys.platform}: float32"
    have = bf16_flags(flags)
    if have:
        cpu = f"the CPU has {' and '.join(have)}"
        if model is None:
            return "bf16-mixed", f"{cpu} (no model given: its size not checked; pass model= for the size rule)"
        size = largest_linear(model)
        if size is not None and size < BF16_CPU_MIN_WEIGHTS:
            return "32-true", (f"{cpu}, but the model's largest linear layer has {size:,} weights (fewer than "
                               f"{BF16_CPU_MIN_WEIGHTS:,}): bfloat16's casts would cost more than its products save")
        why = (f"{cpu} and the model's largest linear layer has {size:,} weights (at least {BF16_CPU_MIN_WEIGHTS:,})"
               if size is not None else f"{cpu} (the model has no linear layer this rule knows: its size not checked)")
        if here:
            speedup = cpu_bf16_speedup()
            if speedup < BF16_CPU_MIN_SPEEDUP:
                return "32-true", (f"{cpu}, but its bfloat16 products measured {speedup:.2f}x float32's here (fewer "
                                   f"than {BF16_CPU_MIN_SPEEDUP}x: AMX unavailable to this process?): float32")
            why += f"; its bfloat16 products measured {speedup:.2f}x float32's here"
        return "bf16-mixed", why
    return "32-true", (f"the CPU has neither {' nor '.join(BF16_CPU_FLAGS)}: float32; bfloat16 products are emulated "
                       "there, or not measured")


#: what people type for Lightning's values
_HINTS = {"fp32": "32-true", "float32": "32-true", "32": "32-true", "bf16": "bf16-mixed", "bfloat16": "bf16-mixed",
          "fp16": "16-mixed", "float16": "16-mixed", "16": "16-mixed", "mixed": "bf16-mixed"}


def check_precision(value: object) -> None:
    """Refuse a ``trainer.precision`` that neither ``auto`` nor Lightning takes, before anything loads, listing what
    is taken and the likely one (``Auto`` -> ``auto``, ``fp32`` -> ``32-true``)."""
    import typing

    from lightning.fabric.connector import _PRECISION_INPUT

    taken = [str(v) for part in typing.get_args(_PRECISION_INPUT) for v in typing.get_args(part)]
    if value is None or isinstance(value, bool) or str(value) not in ("auto", *taken):
        text = str(value).strip().lower()
        guess = "auto" if text == "auto" else _HINTS.get(text, text if text in taken else None)
        raise ValueError(f"trainer.precision={value!r}: not one of auto, {', '.join(dict.fromkeys(taken))}"
                         + (f"; did you mean trainer.precision={guess}?" if guess else ""))
