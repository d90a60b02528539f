"""Few-row float32 products for decoding on AVX-512 CPUs, on the weights as they are (``rowdot.c``).

Decoding multiplies 8-16 rows by every weight at every token, so the product is bound by how fast the weights stream
from memory. oneDNN streams a plain ``[out, in]`` weight at about half the rate a plain read reaches and gets close
to it only on a copy reordered into its blocked layout, which must be made again at every rollout (the policy
changes between rollouts). ``rowdot.c`` reads the plain layout at the blocked copy's rate, with no copy, and covers
a large head too (docs/performance.md). It is compiled with the machine's C compiler (``$CC``, else ``cc``) at its
first use in a process and kept in ``$POLOPT_CACHE`` (default ``~/.cache/polopt-lightning``) for the next; where
there is no compiler, no AVX-512 or the build fails, :func:`load` returns ``None`` (with the reason in
:func:`why_not`) and decoding keeps oneDNN's products. With PyTorch's Linux wheels its OpenMP threads are PyTorch's
own: the library asks for ``libgomp.so.1``, which PyTorch (imported first) has loaded already, so the two share one
thread pool (a build of PyTorch on another OpenMP runtime gets a second pool beside its own).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor, nn

from ..._cache import cache_root
from .. import trace
from .four_bit import four_bit_state

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rowdot.c")
FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp", "-shared", "-fPIC"]
ROWS = 8  # the kernel's row block: inputs are padded to a multiple of it
# up to this many rows a product runs here (each weight read once per 8 rows from memory, then from L1 for the next
# 8); beyond it a GEMM library reuses every weight better
MAX_ROWS = 16
K_MULTIPLE = 16  # the input width must be a multiple of this (one AVX-512 register of float32)
_state: dict = {}


def _build(compiler: str) -> Path:
    """The shared library for this source, flags and compiler, compiled once and kept (an atomic rename, so
    processes building it at the same time each leave a whole file)."""
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"rowdot-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".rowdot-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                              timeout=300)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def load():
    """The compiled ``polopt_rowdot`` function, or ``None`` where it cannot run here (see :func:`why_not`)."""
    if "fn" in _state:
        return _state["fn"]
    fn, reason = None, None
    if os.environ.get("POLOPT_ROWDOT", "1") == "0":
        reason = "POLOPT_ROWDOT=0"
    elif platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        reason = f"not an x86-64 Linux machine ({platform.system()} {platform.machine()})"
    elif "AVX512" not in torch.backends.cpu.get_cpu_capability():
        reason = f"the CPU has no AVX-512 (PyTorch reports {torch.backends.cpu.get_cpu_capability()})"
    else:
        compiler = shutil.which(os.environ.get("CC", "cc"))
        if compiler is None:
            reason = f"no C compiler ({os.environ.get('CC', 'cc')!r} is not on the PATH)"
        else:
            try:
                lib = ctypes.CDLL(str(_build(compiler)))
                fn = lib.polopt_rowdot
                fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
                fn.restype = None
                step = lib.polopt_decode_step
                step.argtypes = [ctypes.POINTER(Step), ctypes.c_int]
                step.restype = None
                four = lib.polopt_rowdot_4bit
                four.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
                four.restype = None
                _state["lib"] = lib
                reason = layout_mismatch(lib)
                if reason is None:
                    _state.update(step=step, four=four)
                else:
                    fn = None
            except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                reason = f"building {SOURCE.name} failed: {err}"
    if fn is None:
        log.info("the few-row decoding kernel is off (%s): decoding uses oneDNN's products", reason)
    _state.update(fn=fn, reason=reason)
    return fn


def library() -> ctypes.CDLL | None:
    """The compiled library (built by :func:`load`), or ``None`` where it was not built here."""
    load()
    return _state.get("lib")


def step_function():
    """The compiled ``polopt_decode_step`` (a whole decoding step, see :class:`Step`), or ``None`` where the kernel
    cannot run here."""
    return _state.get("step") if load() is not None else None


_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)


class Step(ctypes.Structure):
    """The arguments of ``polopt_decode_step`` (``rowdot.c``'s ``Step``, field for field)."""

    _fields_ = ([(name, ctypes.c_long) for name in ("M", "N", "H", "I", "heads", "kv_heads", "D", "layers", "V")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(name, _PP) for name in ("in_norm", "post_norm", "wq", "wk", "wv", "bq", "bk", "bv", "wo", "bo",
                                            "wg", "wu", "wd")]
                + [("final_norm", _P), ("head", _P)]
                + [(name, _PP) for name in ("ka", "va", "kb", "vb")]
                + [(name, ctypes.c_long) for name in ("a_group", "a_row", "a_head", "a_len", "b_row", "b_head",
                                                      "b_len", "slot", "bias_row")]
                + [("write_b", ctypes.c_int), ("a_bias", _P), ("cos", _P), ("sin", _P)]
                + [(name, _P) for name in ("x", "h", "q", "k", "v", "att", "gate", "up", "tmp", "scores",
                                           "logits")]
                + [(name, _PP) for name in ("lora_a", "lora_bt")]
                + [("lora_scale", _P), ("lora_rank", _P), ("lora_rmax", ctypes.c_long), ("lora_t", _P)]
                + [(name, _PP) for name in ("four_absmax", "four_table")]
                + [(name, ctypes.c_long) for name in ("four_blocksize", "four_chunk_bytes", "four_stride")]
                + [("four_buf", _P)])


def layout_mismatch(lib: ctypes.CDLL, structure: type[ctypes.Structure] = Step) -> str | None:
    """Where ``structure`` (default :class:`Step`) differs from the ``Step`` that ``lib`` was compiled with (field
    names, order, offsets, size), as a sentence naming the first difference; ``None`` where they agree. A mismatch
    would make the C step read and write the wrong memory, so :func:`load` refuses the kernel on one."""
    lib.polopt_step_fields.restype = ctypes.c_char_p
    lib.polopt_step_layout.argtypes = [ctypes.POINTER(ctypes.c_long), ctypes.c_long]
    lib.polopt_step_layout.restype = ctypes.c_long
    names = lib.polopt_step_fields().decode().rstrip(",").split(",")
    numbers = (ctypes.c_long * (2 * len(names) + 1))()
    if lib.polopt_step_layout(numbers, len(numbers)) != len(numbers):
        return f"{SOURCE.name}'s Step layout lists another number of fields than its names"
    size, places = numbers[0], list(zip(numbers[1::2], numbers[2::2]))  # (offset, size) of each field
    ours = [name for name, *_ in structure._fields_]
    for i, (theirs, mine) in enumerate(zip(names, ours)):
        if theirs != mine:
            return f"Step field {i} is {theirs!r} in {SOURCE.name} and {mine!r} in {Path(__file__).name}"
        field = getattr(structure, mine)
        if (field.offset, field.size) != places[i]:
            return (f"Step field {mine!r} takes bytes {places[i][0]}-{sum(places[i]) - 1} in {SOURCE.name} and "
                    f"{field.offset}-{field.offset + field.size - 1} in {Path(__file__).name}")
    if len(names) != len(ours):
        return f"Step has {len(names)} fields in {SOURCE.name} and {len(ours)} in {Path(__file__).name}"
    if size != ctypes.sizeof(structure):
        return f"Step is {size} bytes in {SOURCE.name} and {ctypes.sizeof(structure)} in {Path(__file__).name}"
    return None


def pointers(tensors: list[Tensor | None]) -> ctypes.Array:
    """A C array of the tensors' data pointers (``NULL`` for ``None``)."""
    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])


def why_not() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` where it loaded, or before the first :func:`load`)."""
    return _state.get("reason")


def _weight_fits(weight: Tensor, bias: Tensor | None) -> bool:
    """A float32 CPU weight ``[out, in]``, contiguous, ``in`` a multiple of 16; a float32 bias or none."""
    return (weight.dim() == 2 and weight.dtype == torch.float32 and weight.is_cpu
            and weight.shape[1] % K_MULTIPLE == 0 and weight.is_contiguous()
            and (bias is None or bias.dtype == torch.float32))


def fits(linears: list[nn.Linear]) -> bool:
    """Whether these layers can run on the kernel: plain float32 CPU weights, contiguous, the input width a
    multiple of 16."""
    return all(_weight_fits(m.weight, m.bias) for m in linears)


class RowDot:
    """``nn.Linear`` layers sharing an input as one kernel call on their weights as they are (no copy); outputs as
    a tuple, or the one output for a single layer. Holds references to the weights: build it afresh after they are
    replaced (an in-place optimizer step is seen)."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.fn = load()
        if self.fn is None:
            raise RuntimeError(f"the few-row decoding kernel is not available: {why_not()}")
        if not fits(linears):
            raise ValueError("RowDot takes float32 CPU nn.Linear layers whose input width is a multiple of 16")
        self.weights = [m.weight.detach() for m in linears]
        self.biases = [None if m.bias is None else m.bias.detach().contiguous() for m in linears]
        self.outs = [m.out_features for m in linears]
        self.in_features = linears[0].in_features
        n = len(linears)
        self._weights, self._biases = pointers(self.weights), pointers(self.biases)
        self.single = n == 1

    def __call__(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input width {x.shape[-1]}, the layers take {self.in_features}")
        outputs = _run(self.fn, x, self._weights, self._biases, self.outs)
        return outputs[0] if self.single else outputs


def takes(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether :func:`linear` computes ``F.linear(x, weight, bias)`` on the kernel: it loaded here, at most
    :data:`MAX_ROWS` rows, float32 CPU tensors, a contiguous weight whose input width is a multiple of 16."""
    return (0 < x.numel() <= MAX_ROWS * x.shape[-1] and x.dtype == torch.float32 and x.is_cpu
            and _weight_fits(weight, bias) and (bias is None or bias.is_contiguous()) and load() is not None)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` on the kernel, without autograd (check :func:`takes` first)."""
    if trace.OPEN:
        trace.note("kernel_product", tuple(weight.shape))
    return _run(load(), x, pointers([weight]), pointers([bias]), [weight.shape[0]])[0]


def _run(fn, x: Tensor, weights, biases, outs: list[int]) -> tuple[Tensor, ...]:
    """One kernel call: ``x`` ``[..., K]`` against the weights and biases behind the ctypes pointer arrays, one output
    ``[..., outs[j]]`` each (rows padded to a multiple of :data:`ROWS` for the call)."""
    return _call(lambda rows, padded, K, outputs, counts, threads: fn(
        rows, padded, K, len(outs), weights, biases, outputs, counts, threads), x, outs)


def _call(run, x: Tensor, outs: list[int]) -> tuple[Tensor, ...]:
    """``run(rows, padded rows, K, outputs, output widths, threads)`` on ``x`` ``[..., K]`` padded to a multiple of
    :data:`ROWS` rows; the outputs ``[..., outs[j]]``."""
    lead, K = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, K)
    M = rows.shape[0]
    padded = -(-M // ROWS) * ROWS
    if padded != M or not rows.is_contiguous() or rows.dtype != torch.float32:
        rows = torch.cat([rows.float(), rows.new_zeros(padded - M, K, dtype=torch.float32)])
    outputs = [rows.new_empty(padded, n) for n in outs]
    run(rows.data_ptr(), padded, K, pointers(outputs), (ctypes.c_long * len(outs))(*outs), torch.get_num_threads())
    return tuple(y[:M].view(*lead, y.shape[1]) for y in outputs)


def _four_bit_state(module: nn.Module):
    """The quantization state of a bitsandbytes 4-bit layer (:func:`~polopt_lightning.four_bit.four_bit_state`:
    float32 compute on the CPU, bitsandbytes' own layout), nf4 or fp4, whose products the 4-bit kernel computes as
    the layer does (widths and block size multiples of 16, a float32 bias or none), else ``None``."""
    state = four_bit_state(module)
    if state is None:
        return None
    weight, shape = module.weight, tuple(state.shape)
    if (state.quant_type not in ("nf4", "fp4") or shape != (module.out_features, module.in_features)
            or shape[1] % K_MULTIPLE or state.blocksize % K_MULTIPLE or state.code.numel() != 16):
        return None
    if weight.numel() * weight.element_size() * 2 != shape[0] * shape[1]:
        return None
    if module.bias is not None and module.bias.dtype != torch.float32:
        return None
    return state


def takes_together(layers: list[nn.Module]) -> bool:
    """Whether :func:`products` runs these layers as one call: all plain float32 ``nn.Linear`` the kernel takes
    (:func:`fits`), or all 4-bit layers (:func:`four_bit_fits`)."""
    if all(type(m) is nn.Linear for m in layers):
        return fits(layers)
    return four_bit_fits(layers)


def products(layers: list[nn.Module]) -> RowDot | FourBitRowDot:
    """Layers sharing an input as one kernel call (:func:`takes_together`): :class:`RowDot` on float32 weights,
    :class:`FourBitRowDot` on 4-bit ones."""
    return RowDot(layers) if all(type(m) is nn.Linear for m in layers) else FourBitRowDot(layers)


def four_bit_fits(modules: list[nn.Module]) -> bool:
    """Whether these layers can run on the 4-bit kernel together: each a bitsandbytes 4-bit layer it computes
    (:func:`_four_bit_state`), one block size."""
    states = [_four_bit_state(m) for m in modules]
    return all(s is not None for s in states) and len({s.blocksize for s in states}) == 1


def four_bit_parts(module: nn.Module) -> tuple[Tensor, Tensor, Tensor]:
    """What the 4-bit kernel reads of a layer :func:`_four_bit_state` takes: its codes (flat ``uint8``, as they are),
    its block scales in float32 (nested ones dequantized as bitsandbytes does at each product) and its 16-entry
    table."""
    s = _four_bit_state(module)
    absmax = four_bit_scales(s.state2.absmax, s.absmax, s.state2.code, s.offset, s.state2.blocksize) if s.nested \
        else s.absmax
    return module.weight.data.reshape(-1).view(torch.uint8), absmax.float().contiguous(), s.code.float().contiguous()


class FourBitRowDot:
    """bitsandbytes 4-bit layers (nf4 or fp4, float32 compute) sharing an input as one kernel call on their 4-bit
    codes as they are: each thread dequantizes a chunk of its weight rows (:data:`FOUR_BIT_CHUNK_BYTES`) into a buffer
    in L2 (``table[code] * absmax[block]``, the weights bitsandbytes' ``dequantize_4bit`` gives, bit for bit; nested
    scales dequantized here once, as bitsandbytes does at each product) and multiplies them as :class:`RowDot` does,
    eight input rows at a time.
    bitsandbytes' own product dequantizes the whole weight to float32 in memory at each call, then multiplies it."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.fn = _state.get("four") if load() is not None else None
        if self.fn is None:
            raise RuntimeError(f"the few-row decoding kernel is not available: {why_not()}")
        if not four_bit_fits(modules):
            raise ValueError("FourBitRowDot takes bitsandbytes 4-bit layers with float32 compute, widths and block "
                             "size multiples of 16")
        self.codes, self.absmax, self.tables = (list(t) for t in zip(*(four_bit_parts(m) for m in modules)))
        self.biases = [None if m.bias is None else m.bias.detach().contiguous() for m in modules]
        self.blocksize, self.outs, self.in_features = _four_bit_state(modules[0]).blocksize, \
            [m.out_features for m in modules], modules[0].in_features
        self._arrays = [pointers(t) for t in (self.codes, self.absmax, self.tables, self.biases)]
        self.single = len(modules) == 1

    def __call__(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input width {x.shape[-1]}, the layers take {self.in_features}")
        outputs = _four_bit_call(self.fn, x, self._arrays, self.blocksize, self.outs)
        return outputs[0] if self.single else outputs


def _four_bit_call(fn, x: Tensor, arrays: list, blocksize: int, outs: list[int]) -> tuple[Tensor, ...]:
    """One call of ``polopt_rowdot_4bit``: ``arrays`` the pointer arrays of the codes, scales, tables and biases."""
    if trace.OPEN:
        trace.note("four_bit_kernel", x.shape[0])
    K = x.shape[-1]
    stride = four_bit_scratch(K)
    scratch = torch.empty(torch.get_num_threads() * stride)
    codes, absmax, tables, biases = arrays
    return _call(lambda rows, padded, _, out, counts, threads: fn(
        rows, padded, K, len(outs), codes, absmax, tables, blocksize, biases, out, counts, threads,
        scratch.data_ptr(), stride, FOUR_BIT_CHUNK_BYTES), x, outs)


FOUR_BIT_CHUNK_BYTES = 192 * 1024  # a thread's dequantized rows: in its L2 beside the inputs


def four_bit_scratch(K: int) -> int:
    """Floats a thread's buffer of dequantized rows takes for inputs of width up to ``K``: the chunk
    (:data:`FOUR_BIT_CHUNK_BYTES`, whole rows, a multiple of 3, at least 3; ``rowdot.c``'s ``rows_of_4bit`` picks
    them)."""
    return FOUR_BIT_CHUNK_BYTES // 4 + 3 * K


def four_bit_scales(absmax: Tensor, absmax_8bit: Tensor | None = None, absmax_code: Tensor | None = None,
                    absmax_offset: Tensor | None = None, nested_blocksize: int = 256) -> Tensor:
    """A 4-bit weight's block scales from ``gemm_4bit``'s arguments: ``absmax`` itself, or the nested 8-bit ones
    dequantized as bitsandbytes dequantizes them (its default ``gemm_4bit`` takes nested blocks of 256 only)."""
    if absmax_8bit is None:
        return absmax
    return torch.ops.bitsandbytes.dequantize_blockwise.default(absmax_8bit, absmax, absmax_code, nested_blocksize,
                                                               torch.float32) + absmax_offset


FOUR_BIT_MAX_ROWS = 64  # a 4-bit product of up to this many rows runs on the kernel (a prefill's; the inputs in L2)
_tables: dict[str, Tensor] = {}


def four_bit_product(A: Tensor, B: Tensor, shapeB, absmax: Tensor, blocksize: int, quant_type: str,
                     bias: Tensor | None = None, absmax_8bit: Tensor | None = None, absmax_code: Tensor | None = None,
                     absmax_offset: Tensor | None = None) -> Tensor | None:
    """bitsandbytes' ``gemm_4bit`` op (its product where no gradient is needed; the same arguments) on the 4-bit
    kernel: the weights its default implementation dequantizes (``table[code] * absmax[block]``, nested scales
    dequantized as it does), multiplied without a float32 copy of the weight; ``None`` where the kernel does not
    take it (more than :data:`FOUR_BIT_MAX_ROWS` rows, not float32, widths or block size not multiples of 16, the
    kernel not built here)."""
    N, K = int(shapeB[0]), int(shapeB[1])
    rows = A.numel() // K if K and A.shape[-1] == K else 0
    if (not 0 < rows <= FOUR_BIT_MAX_ROWS or type(A) not in (Tensor, nn.Parameter) or A.dtype != torch.float32
            or not A.is_cpu or K % K_MULTIPLE
            or blocksize % K_MULTIPLE or quant_type not in ("nf4", "fp4") or not B.is_contiguous()
            or B.numel() * B.element_size() * 2 != N * K or (bias is not None and bias.dtype != torch.float32)
            or load() is None):
        return None
    absmax = four_bit_scales(absmax, absmax_8bit, absmax_code, absmax_offset).float().contiguous()
    if absmax.numel() * blocksize < N * K:
        return None
    if quant_type not in _tables:
        from bitsandbytes.functional import get_4bit_type

        _tables[quant_type] = get_4bit_type(quant_type, device="cpu").float().contiguous()
    keep = [[B.reshape(-1).view(torch.uint8)], [absmax], [_tables[quant_type]],
            [None if bias is None else bias.contiguous()]]
    return _four_bit_call(_state["four"], A, [pointers(t) for t in keep], blocksize, [N])[0]
