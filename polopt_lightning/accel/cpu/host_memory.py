"""Keep freed host memory in the process while training on the CPU (glibc's allocator).

A training step on the CPU allocates and frees the same large tensors every step: each weight's gradient (at
Qwen2.5-0.5B's shape the tied 151,936 x 896 table's alone is 545 MiB, made afresh by each lookup and head call),
the activations, the logits. glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh
``mmap`` and gives it back with ``munmap`` when freed, and trims the top of its heap on ``free``: the next step's
tensor lands on pages the kernel has to fault in and zero again, one 4 KiB page at a time (seconds a step at 0.5B:
docs/performance.md).

:class:`KeptHostMemory` turns both off with ``mallopt`` for as long as it is entered (``M_MMAP_MAX=0``: large
blocks come from the heap too; ``M_TRIM_THRESHOLD=-1``: the heap is never trimmed), so freed blocks are reused
by the next step's tensors, already faulted in. On leaving, glibc's defaults come back and ``malloc_trim(0)``
returns the free memory to the system. The process holds its high-water mark until the end of training instead of
giving memory back between phases, and that mark can sit above what the live tensors need: a large block that finds
no free space big enough grows the heap.
Numerics are untouched: only where tensors live changes. Other C libraries (musl, macOS) have no ``mallopt``:
:func:`available` is ``False`` there.
"""

from __future__ import annotations

import ctypes
import threading

import lightning as L

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_MAX = 128 * 1024, 65536  # glibc's defaults
_lock = threading.Lock()
_depth = 0


def _libc():
    try:
        libc = ctypes.CDLL(None)  # the C library this process runs on
    except OSError:  # pragma: no cover - no dynamic loader
        return None
    if not all(hasattr(libc, name) for name in ("gnu_get_libc_version", "mallopt", "malloc_trim")):
        return None
    return libc


def available() -> bool:
    """Whether this process runs on glibc, whose allocator :class:`KeptHostMemory` tunes."""
    return _libc() is not None


def _set(libc, trim_threshold: int, mmap_max: int) -> None:
    for option, value in ((M_TRIM_THRESHOLD, trim_threshold), (M_MMAP_MAX, mmap_max)):
        if libc.mallopt(ctypes.c_int(option), ctypes.c_int(value)) != 1:
            raise RuntimeError(f"glibc's mallopt refused option {option} = {value}")


class KeptHostMemory:
    """Context in which glibc keeps freed memory for reuse (see the module). Nested and repeated entries count: the
    defaults come back when the outermost one leaves."""

    def __enter__(self) -> KeptHostMemory:
        global _depth
        libc = _libc()
        if libc is None:
            raise RuntimeError("KeptHostMemory needs glibc's allocator (mallopt); this process has none")
        with _lock:
            if _depth == 0:
                _set(libc, -1, 0)  # -1: never trim (glibc reads it as the largest size)
            _depth += 1
        return self

    def __exit__(self, *exc) -> None:
        global _depth
        libc = _libc()
        with _lock:
            _depth -= 1
            if _depth == 0:
                _set(libc, DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_MAX)
                libc.malloc_trim(ctypes.c_size_t(0))


def active() -> bool:
    """Whether a :class:`KeptHostMemory` is entered in this process."""
    return _depth > 0


class KeepHostMemory(L.Callback):
    """Enters :class:`KeptHostMemory` when training starts, where the module's CPU fast path says so
    (``pl_module.accel.keeps_host_memory(device)``, :class:`~polopt_lightning.accel.cpu.fast_path.CPUFastPath`), and leaves it
    when training ends, fails or is torn down."""

    def __init__(self) -> None:
        self._kept: KeptHostMemory | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        keeps = getattr(getattr(pl_module, "accel", None), "keeps_host_memory", None)
        if self._kept is None and keeps is not None and keeps(pl_module.device):
            self._kept = KeptHostMemory().__enter__()

    def _leave(self) -> None:
        kept, self._kept = self._kept, None
        if kept is not None:
            kept.__exit__(None, None, None)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._leave()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._leave()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._leave()
