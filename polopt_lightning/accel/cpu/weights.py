"""Where a CPU model's weights live: out of the weight files ``from_pretrained`` maps, and on cache-line boundaries.
Used by :func:`polopt_lightning.models.load_pretrained` (every device: only CPU tensors are touched) and by the
module before training on the CPU (:func:`align_weights`)."""

from __future__ import annotations

import ctypes
import functools
import mmap
from collections.abc import Callable

import torch
from torch import Tensor, nn


def release_weight_files(model: nn.Module) -> None:
    """Copy a model's floating-point CPU weights out of the weight files they map, into 64-byte aligned memory.

    ``from_pretrained`` maps the safetensors files and keeps every tensor it did not convert (all of them when the
    dtype is the file's; embeddings, norms and biases of a quantized model) as a view into them. Two costs follow:
    - a tensor's data starts wherever the file put it, which safetensors aligns to 8 bytes only (every weight of a
      saved Qwen2.5-0.5B sits 16 bytes past a cache line), so every 64-byte vector load of it touches two cache
      lines (see :func:`align_weights`);
    - a quantized model keeps the whole mapping alive with every page the quantization read resident: at 0.5B
      parameters 1.4 GB of the process's memory for 0.5 GB of weights in use (nf4: 1.96 -> 1.13 GB resident).
    The copies are made one tensor at a time, and each copied tensor's pages of the file leave the process at once
    (``madvise(MADV_DONTNEED)`` on the whole pages inside its bytes; they are the file's own, so a later read gets
    them again): otherwise every page the copy read stays resident until the last view goes, and loading holds the
    weights twice (the measured high-water marks: docs/performance.md).
    Where the process's mappings can be read (``/proc/self/maps``), only tensors in a file mapping or off a cache
    line are copied (those ``from_pretrained`` converted are in fresh memory already); elsewhere every one is, and
    no page is handed back. Tensors on other devices are left as they are; tied weights stay tied (one parameter,
    one copy).
    """
    spans = _file_mappings()
    if spans is None:
        _copy_out(model, lambda tensor: True)
        return
    _copy_out(model, lambda tensor: _mapped(tensor.data_ptr(), spans) or tensor.data_ptr() % 64 != 0,
              after=lambda old: _hand_back(old, spans))


def align_weights(model: nn.Module) -> int:
    """Copy each floating-point CPU weight whose data does not start on a 64-byte boundary (a cache line, one
    AVX-512 vector) into fresh memory, which PyTorch's CPU allocator aligns; returns how many were copied.

    Vector loads from a misaligned weight each touch two cache lines (a model loaded from its safetensors file has
    every weight at the file's offsets; the offset is the cost, not the file). Values, parameter objects and ties
    are kept.
    """
    return _copy_out(model, lambda tensor: tensor.data_ptr() % 64 != 0)


def _copy_out(model: nn.Module, wanted: Callable[[Tensor], bool],
              after: Callable[[Tensor], None] | None = None) -> int:
    """Give each floating-point CPU parameter and buffer ``wanted`` picks a fresh copy of its data; ``after`` gets the
    old data once the tensor has let go of it."""
    copied = 0
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.dtype.is_floating_point and tensor.device.type == "cpu" and wanted(tensor):
                old = tensor.data
                tensor.data = old.clone()
                if after is not None:
                    after(old)
                copied += 1
    return copied


MADV_DONTNEED = 4  # Linux's <sys/mman.h>


def _file_mappings() -> list[tuple[int, int]] | None:
    """The address ranges ``[start, end)`` of this process's mappings of files (``/proc/self/maps``: those with a
    path), or ``None`` where they cannot be read (not Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return None
    spans = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    return spans


def _mapped(start: int, spans: list[tuple[int, int]], end: int | None = None) -> bool:
    """Whether the address ``start`` (through ``end``) lies in one of ``spans``."""
    end = start if end is None else end
    return any(lo <= start and end <= hi for lo, hi in spans)


@functools.cache
def _c_library() -> ctypes.CDLL:
    """The C library this process runs on."""
    return ctypes.CDLL(None)


def _hand_back(old: Tensor, spans: list[tuple[int, int]]) -> None:
    """Drop the whole pages inside a contiguous ``old``'s bytes from this process's memory when they belong to a
    file mapping (nothing otherwise, or when the C library has no ``madvise``)."""
    first = old.data_ptr()
    last = first + old.numel() * old.element_size()
    libc = _c_library()
    if not old.is_contiguous() or last == first or not _mapped(first, spans, last) or not hasattr(libc, "madvise"):
        return
    page = mmap.PAGESIZE
    start, end = -(-first // page) * page, last // page * page
    if end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)
