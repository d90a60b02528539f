"""Linear layers on the CPU through oneDNN's matrix products instead of the BLAS behind ``F.linear``.

On the CPU, PyTorch computes a float32 ``F.linear`` and its backward with the BLAS it was built with (MKL in the
official wheels). oneDNN (also in every official wheel, the library PyTorch already uses for bf16 products)
computes the same float32 products faster on the CPUs measured, most of all decoding's few-row products and large
weights (docs/performance.md). Both compute in float32; they round differently (a different summation order), well
within float32 tolerance (tested against ``F.linear``'s values and gradients).

:class:`OneDNNLinear` is a ``TorchFunctionMode``: inside it, every ``F.linear`` (so every ``nn.Linear``, also those
inside ``transformers`` models and peft's base layers) on plain float32 CPU tensors with a weight of at least
:data:`MIN_WEIGHT_ELEMENTS` elements runs forward and backward through oneDNN; everything else (small weights, other
dtypes, autocast, tensor subclasses such as FSDP's DTensors, compiled code) runs as it would without the mode.
Products that need no gradient and have at most 16 rows (decoding through a model's own modules) run on
:mod:`~polopt_lightning.accel.cpu.rowdot`'s few-row kernel instead where it runs (:func:`few_row_kernel`), and so do
bitsandbytes' 4-bit products without gradient of at most 64 rows (a short prompt's prefill; its ``gemm_4bit`` op
dequantizes the whole weight to float32 first): :func:`~polopt_lightning.accel.cpu.rowdot.four_bit_product`. Larger
ones (the passes' forward) keep bitsandbytes' dequantization and take oneDNN's product in place of the MKL one the
op would run. Given a model (``OneDNNLinear(model)``, as the module gives its policy), the input gradients of its
frozen 4-bit layers go through oneDNN too (:func:`four_bit_input_gradients`).
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from .. import trace
from . import rowdot
from .four_bit import four_bit_state

# From this many weight elements on, a product goes through oneDNN (smaller ones: a fixed ~10 us per call, where MKL
# takes 4 us at 64 x 32). The default tiny model's largest weight (256 x 512) stays below: its runs keep their bits.
MIN_WEIGHT_ELEMENTS = 2**18
_PLAIN = (Tensor, nn.Parameter)


def available() -> bool:
    """Whether this PyTorch build has oneDNN's CPU linear product."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _product(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` through oneDNN (``weight`` ``[out, in]``, any strides)."""
    if trace.OPEN:
        trace.note("onednn_product", tuple(weight.shape))
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _Linear(torch.autograd.Function):
    """``F.linear`` with its forward and both backward products through oneDNN."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        return _product(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).contiguous()  # [rows, out]
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _product(g, weight.t()).reshape(x.shape)  # g @ weight
        if ctx.needs_input_grad[1]:
            grad_weight = _product(g.t(), x.reshape(-1, x.shape[-1]).contiguous().t())  # g.T @ x
        if ctx.needs_input_grad[2]:
            grad_bias = g.sum(0)
        return grad_x, grad_weight, grad_bias


def covers(weight: Tensor) -> bool:
    """Whether a weight of this kind goes through oneDNN inside :class:`OneDNNLinear` (dtype, device, size)."""
    return (type(weight) in _PLAIN and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.numel() >= MIN_WEIGHT_ELEMENTS)


def backward_product(weight: Tensor):
    """oneDNN's product (``(x, w) -> x @ w.T``, any strides) for the products an autograd function's backward makes
    with ``weight``, where this thread is inside :class:`OneDNNLinear` (which sees no backward) and the weight is of
    the mode's kind (:func:`covers`); ``None`` elsewhere. Asked in the forward pass, where the mode is open."""
    return _product if active() and covers(weight) else None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN, with autograd where a gradient is wanted; without one, a product
    of at most 16 rows runs on the few-row kernel where it can (:func:`few_row_kernel`)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _Linear.apply(x, weight, bias)
    if getattr(_kernel, "on", True) and rowdot.takes(x, weight, bias):
        return rowdot.linear(x, weight, bias)
    return _product(x, weight, bias)


_kernel = threading.local()  # whether few-row products without gradient may run on the kernel in this thread


@contextmanager
def few_row_kernel(enabled: bool):
    """Context in which products of at most 16 rows that need no gradient run on
    :mod:`~polopt_lightning.accel.cpu.rowdot`'s kernel (``enabled``, the default) or on oneDNN (``False``), in this
    thread. Inside :class:`OneDNNLinear` such products are the ones decoding makes through a model's own modules
    (adapter layers' frozen base weights, the prefill's head at the last position)."""
    before = getattr(_kernel, "on", True)
    _kernel.on = enabled
    try:
        yield
    finally:
        _kernel.on = before


def _eligible(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    return (covers(weight) and type(x) in _PLAIN and x.dtype == torch.float32 and x.device.type == "cpu"
            and x.dim() >= 2 and x.shape[-1] == weight.shape[1]
            and (bias is None or (type(bias) in _PLAIN and bias.dtype == torch.float32 and bias.dim() == 1))
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling())


_open = threading.local()  # how many OneDNNLinear contexts this thread has open (torch's mode stack is per thread)


class OneDNNLinear(TorchFunctionMode):
    """Inside this context, eligible ``F.linear`` calls run through oneDNN (see the module's docstring).

    ``model``: also the input gradients of its frozen bitsandbytes 4-bit layers (:func:`four_bit_input_gradients`),
    which the mode cannot reach otherwise: bitsandbytes computes them in its autograd function's backward, where no
    torch-function mode is active."""

    def __init__(self, model: nn.Module | None = None):
        super().__init__()
        self._model = model
        self._four_bit = None

    def __enter__(self):
        if self._model is not None:
            self._four_bit = four_bit_input_gradients(self._model)
            self._four_bit.__enter__()
        mode = super().__enter__()
        _open.depth = getattr(_open, "depth", 0) + 1
        return mode

    def __exit__(self, *exc):
        _open.depth -= 1
        try:
            return super().__exit__(*exc)
        finally:
            if self._four_bit is not None:
                self._four_bit, four_bit = None, self._four_bit
                four_bit.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if trace.OPEN:
            trace.note("mode_dispatch", func)
        if func is F.linear:
            x, weight = args[0] if args else kwargs["input"], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if _eligible(x, weight, bias):
                return linear(x, weight, bias)
        elif (isinstance(func, torch._ops.OpOverload) and str(func) == "bitsandbytes.gemm_4bit.default"
              and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()):
            out = rowdot.four_bit_product(*args, **kwargs) if getattr(_kernel, "on", True) else None
            if out is None:
                out = _four_bit_on_onednn(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def _four_bit_on_onednn(A: Tensor, B: Tensor, shapeB, absmax: Tensor, blocksize: int, quant_type: str,
                        bias: Tensor | None = None, absmax_8bit: Tensor | None = None,
                        absmax_code: Tensor | None = None, absmax_offset: Tensor | None = None) -> Tensor | None:
    """bitsandbytes' default ``gemm_4bit`` (dequantize the weight to float32, then ``F.linear``) with its product
    through oneDNN: its own ``F.linear`` runs inside the op, where this mode does not see it, on MKL (most of a 4-bit
    reference pass's time). ``None`` where the mode would not take the product
    (see :func:`_eligible`)."""
    if (type(A) not in _PLAIN or A.dtype != torch.float32 or A.device.type != "cpu" or A.dim() < 2
            or int(shapeB[0]) * int(shapeB[1]) < MIN_WEIGHT_ELEMENTS
            or (bias is not None and (bias.dtype != torch.float32 or bias.dim() != 1))):
        return None
    absmax = rowdot.four_bit_scales(absmax, absmax_8bit, absmax_code, absmax_offset)
    weight = torch.ops.bitsandbytes.dequantize_4bit.default(B, absmax, blocksize, quant_type, shapeB, A.dtype)
    if trace.OPEN:
        trace.note("four_bit_onednn", A.shape[0])
    return _product(A, weight, bias)


def _frozen_four_bit(layer: nn.Module) -> bool:
    """Whether ``layer`` is such a 4-bit layer (:func:`four_bit_state`) with frozen weights (a QLoRA base), of the
    mode's size (:data:`MIN_WEIGHT_ELEMENTS`)."""
    state = four_bit_state(layer)
    return (state is not None and not layer.weight.requires_grad and len(state.shape) == 2
            and int(state.shape[0]) * int(state.shape[1]) >= MIN_WEIGHT_ELEMENTS
            and (layer.bias is None or not layer.bias.requires_grad))


class _FourBitLinear(torch.autograd.Function):
    """A frozen 4-bit layer's forward as the layer computes it (inside :class:`OneDNNLinear` its ``gemm_4bit`` op runs
    through oneDNN), with the input gradient ``grad @ W`` through oneDNN on the weight dequantized as bitsandbytes'
    own backward dequantizes it (there: ``torch.matmul``, on MKL)."""

    @staticmethod
    def forward(ctx, x: Tensor, layer: nn.Module) -> Tensor:
        ctx.layer = layer
        return type(layer).forward(layer, x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        from bitsandbytes.functional import dequantize_4bit

        weight = ctx.layer.weight
        if trace.OPEN:
            trace.note("four_bit_input_grad", tuple(weight.quant_state.shape))
        dense = dequantize_4bit(weight.data, weight.quant_state).to(torch.float32)  # [out, in]
        g = grad.reshape(-1, grad.shape[-1]).contiguous()
        return _product(g, dense.t()).reshape(*grad.shape[:-1], dense.shape[1]), None


def _four_bit_forward(layer: nn.Module, x: Tensor, *args, **kwargs) -> Tensor:
    if (not args and not kwargs and torch.is_grad_enabled() and x.requires_grad and type(x) in _PLAIN
            and x.dtype == torch.float32 and x.device.type == "cpu" and active() and _frozen_four_bit(layer)
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()):
        return _FourBitLinear.apply(x, layer)
    return type(layer).forward(layer, x, *args, **kwargs)


@contextmanager
def four_bit_input_gradients(model: nn.Module):
    """Context in which ``model``'s frozen bitsandbytes 4-bit layers (float32 compute, on the CPU) compute their input
    gradient through oneDNN while an :class:`OneDNNLinear` context is open in the thread: bitsandbytes' backward
    multiplies the dequantized weight on MKL (a large share of a QLoRA training pass).
    The forward is the layer's own; the gradient is the same product in another summation order (float32
    tolerance). Each such layer's ``forward`` is an instance attribute for the context's span, removed after it."""
    layers = [m for m in model.modules() if _frozen_four_bit(m) and "forward" not in vars(m)]
    for layer in layers:
        layer.forward = functools.partial(_four_bit_forward, layer)
    try:
        yield
    finally:
        for layer in layers:
            vars(layer).pop("forward", None)


def active() -> bool:
    """Whether an :class:`OneDNNLinear` context is open in this thread."""
    return getattr(_open, "depth", 0) > 0


def recompute_contexts():
    """Activation checkpointing's ``context_fn``: the contexts a checkpointed layer's forward and its recomputation
    in the backward pass run in. The backward runs outside :class:`OneDNNLinear` (no torch-function mode is active
    there), so a layer whose forward ran inside it would be recomputed by other products, which save other tensors
    (torch's checkpoint then refuses: "a different number of tensors was saved"); the recomputation enters the mode
    again wherever the forward ran inside it."""
    from contextlib import nullcontext

    return nullcontext(), (OneDNNLinear() if active() else nullcontext())


def pays_for(model: nn.Module) -> bool:
    """Whether ``model`` has a linear weight :class:`OneDNNLinear` would take (and this build has oneDNN)."""
    return available() and any(covers(m.weight) for m in model.modules() if isinstance(m, nn.Linear))


def applies(model: nn.Module) -> bool:
    """Whether ``model``'s large float32 products go through oneDNN here: a :class:`OneDNNLinear` context is open
    and the model has a weight it takes."""
    return active() and pays_for(model)
