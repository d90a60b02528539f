"""The CPU's decoding products for the lean step (:mod:`polopt_lightning.accel.lean_step`).

A 16-row product with a weight in PyTorch's ``[out, in]`` layout is 2-4x slower on the CPU than with the weight
reordered once for the math library: :class:`PackedProjections` prepacks them. Inside
:class:`~polopt_lightning.accel.cpu.linear.OneDNNLinear`, a float32 model's products (head included) run on
:mod:`.rowdot`'s few-row kernel on the weights as they are where it can run (AVX-512, a C compiler, at most
:data:`KERNEL_MAX_ROWS` rows), else its body on a copy in oneDNN's blocked layout and its head on the weight as it is.
A LoRA policy on plain float32 weights, or on bitsandbytes 4-bit ones (on the kernel's 4-bit form), runs its base
products on the same kernel and adds its adapters' products (:class:`AdapterProjections`), and where the layers
allow it the whole step runs in C (:class:`FusedStep`).
"""

from __future__ import annotations

import ctypes
import logging
import warnings
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ...settings import settings_of
from .. import precision, trace
from ..lean_step import Projections, _head_dim, _norm_eps, _without_torch_function
from . import linear as cpu_linear
from . import rowdot
from .rowdot import RowDot

KERNEL_MAX_ROWS = rowdot.MAX_ROWS  # up to this many rows the decoding products run on rowdot.c where it applies

log = logging.getLogger(__name__)


@dataclass
class CPUDecoding:
    """The CPU's decoding levers, as the transformers backend reaches them (its ``cpu`` argument, ``rollout.cpu.*``
    in the CLI). Each acts on the CPU only; elsewhere the lean step runs on the model's own modules.

    Args:
        packed_weights: run the lean step's products on weights prepacked for the math library
            (:class:`PackedProjections`) where the model allows it: plain ``nn.Linear`` projections in float32 (MKL)
            or bfloat16 (oneDNN), autocast off, not compiled. The packed copy is rebuilt at each rollout and freed
            after it. Inside :class:`~polopt_lightning.accel.cpu.linear.OneDNNLinear` a float32 model packs its body
            in oneDNN's blocked layout instead, one copy per weight, and keeps its head as it is.
        decode_kernel: run the float32 products (where oneDNN computes them) on :mod:`.rowdot`'s kernel, on the
            weights as they are, head included, for batches of at most :data:`KERNEL_MAX_ROWS` rows. It needs an
            x86-64 CPU with AVX-512 and a C compiler (built once, cached). ``None`` uses it where it can run and
            falls back to the blocked layout otherwise; ``True`` requires it (an error here says why it cannot be);
            ``False`` keeps the blocked layout and also keeps the products decoding makes through the model's own
            modules (adapter layers' frozen base weights, the prefill's head) on oneDNN
            (:func:`~polopt_lightning.accel.cpu.linear.few_row_kernel`). The same greedy tokens as the blocked copy,
            log-probs within float32 tolerance (tested).
        fused_step: run the lean step as one call of the kernel's ``polopt_decode_step`` (:class:`FusedStep`) where
            its products run on the kernel and the model's layers allow it (SiLU MLPs without biases, RMSNorm, head
            size a multiple of 16). ``None`` uses it where it applies; ``False`` keeps PyTorch's operations between
            the kernel's products. The same sampled tokens, log-probs within float32 tolerance (tested).
    """

    packed_weights: bool = True
    decode_kernel: bool | None = None
    fused_step: bool | None = None

    def __post_init__(self) -> None:
        if self.decode_kernel and rowdot.load() is None:
            raise ValueError(f"rollout.cpu.decode_kernel=True: the few-row decoding kernel cannot run here "
                             f"({rowdot.why_not()})")
        self._said_unpacked = False

    @classmethod
    def of(cls, value: CPUDecoding | Mapping[str, Any] | None) -> CPUDecoding:
        """``value`` itself, the defaults for ``None``, or the settings a dict names (unknown keys raise)."""
        return settings_of(cls, value, "rollout.cpu")

    @staticmethod
    def sampling_dtype(model: nn.Module, device_type: str) -> torch.dtype | None:
        """Under autocast, the dtype an fp32 ``model`` samples in instead of a copy in the autocast dtype: float32 on
        the CPU where oneDNN computes its products and the CPU does not multiply the autocast dtype natively (a
        bfloat16 copy on a CPU with AMX or AVX512-BF16 decodes faster, reading half the bytes a token: measured in
        docs/performance.md, "Precision by the hardware"); else ``None``."""
        if device_type != "cpu" or not cpu_linear.applies(model):
            return None
        native = (torch.get_autocast_dtype("cpu") == torch.bfloat16 and bool(precision.cpu_bf16())
                  and precision.cpu_bf16_speedup() >= precision.BF16_CPU_MIN_SPEEDUP)  # AMX hidden: not native here
        return None if native else torch.float32

    def context(self) -> AbstractContextManager:
        """The context sampling runs in: the few-row kernel for oneDNN's decoding products unless
        ``decode_kernel=False``."""
        return cpu_linear.few_row_kernel(self.decode_kernel is not False)

    def projections(self, base: nn.Module, rows: int) -> Projections | None:
        """Prepacked products for this rollout of ``rows`` rows (a LoRA policy on plain float32 or bitsandbytes 4-bit
        weights: its base products on the kernel, its adapters added), or ``None`` (off, not applicable, or the math
        library refused once: then the modules run from here on, with a warning)."""
        if not self.packed_weights:
            return None
        if AdapterProjections.applies(base, rows, self.decode_kernel):  # LoRA or 4-bit bases: no copy either
            return AdapterProjections(base, rows, self.fused_step)
        if not PackedProjections.supported(base):
            if not self._said_unpacked:
                log.info("packed decoding weights are off for this model (adapter or quantized layers, or another "
                         "dtype or device): decoding runs on the model's own modules")
                self._said_unpacked = True
            return None
        try:
            return PackedProjections(base, rows, self.decode_kernel, self.fused_step)
        except RuntimeError as err:
            warnings.warn(f"rollout.cpu.packed_weights=True: prepacking the decoding weights failed ({err}); "
                          "decoding runs on the model's own modules", RuntimeWarning, stacklevel=3)
            self.packed_weights = False
            return None

    def fewer_rows(self, projections: Projections | None, base: nn.Module, before: int,
                   after: int) -> Projections | None:
        """The projections for a rollout whose decoding batch shrank from ``before`` to ``after`` rows (finished
        completions dropped): built afresh where the few-row kernel runs them at ``after`` rows and either did not at
        ``before`` (more than :data:`KERNEL_MAX_ROWS` rows) or its row blocks (:data:`rowdot.ROWS`) are now fewer
        (the kernel's products and the fused step compute whole blocks); else ``projections`` as they are (oneDNN's
        blocked weights take any number of rows; MKL's packed ones fall back to the unpacked product for another
        number, and packing them again would copy every weight). The kernel's projections use the weights as they
        are: rebuilding them copies nothing."""
        if not self.packed_weights or after >= before:
            return projections
        blocks = -(-after // rowdot.ROWS) < -(-before // rowdot.ROWS)
        if not (before > KERNEL_MAX_ROWS or blocks):
            return projections
        kernel = (AdapterProjections.applies(base, after, self.decode_kernel)
                  or (PackedProjections.supported(base) and PackedProjections.onednn_float32(base)
                      and PackedProjections.kernel_fits(base, after, self.decode_kernel)))
        return self.projections(base, after) if kernel else projections


def _groups(layer: nn.Module) -> tuple[list[nn.Module], ...]:
    """A decoder layer's projections as the step multiplies them, those sharing an input together: q/k/v, o,
    gate/up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]


def _projections(base: nn.Module) -> list[nn.Module] | None:
    """Every layer's seven projections in :func:`_groups`' order, or ``None`` where a layer's MLP is not gated
    (``gate_proj``, ``up_proj``, ``down_proj`` and ``act_fn``)."""
    modules = []
    for layer in base.model.layers:
        if not all(hasattr(layer.mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return None
        modules += [m for group in _groups(layer) for m in group]
    return modules


class _GroupedProjections(Projections):
    """Products run group by group (:func:`_groups`) by callables built once per rollout, none of them a module of
    the model: the step skips torch-function dispatch."""

    prepacked = True

    def __init__(self, base: nn.Module) -> None:
        super().__init__(base)
        self.act = [layer.mlp.act_fn for layer in self.layers]
        self.packed_qkv, self.packed_o, self.packed_gate_up, self.packed_down = [], [], [], []
        self.packed_head = None

    def qkv(self, i: int, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.packed_qkv[i](h)

    def o(self, i: int, x: Tensor) -> Tensor:
        return self.packed_o[i](x)

    def mlp(self, i: int, h: Tensor) -> Tensor:
        gate, up = self.packed_gate_up[i](h)
        return self.packed_down[i](self.act[i](gate) * up)

    def lm_head(self, x: Tensor) -> Tensor:
        return self.head(x) if self.packed_head is None else self.packed_head(x)


class _Packed:
    """One or more ``nn.Linear`` sharing an input, as one product on a prepacked weight (outputs split back)."""

    def __init__(self, linears: list[nn.Linear], rows: int, onednn: bool = False) -> None:
        weight = torch.cat([m.weight for m in linears]) if len(linears) > 1 else linears[0].weight
        weight = weight.detach().contiguous()
        if all(m.bias is None for m in linears):
            self.bias = None
        else:
            self.bias = torch.cat([m.weight.new_zeros(m.out_features) if m.bias is None else m.bias.detach()
                                   for m in linears])
        self.rows, self.splits = rows, [m.out_features for m in linears]
        if weight.dtype == torch.float32 and not onednn:  # MKL's packed GEMM
            self.weight, self.packed = weight, torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        else:  # oneDNN's blocked layout (bfloat16, or float32 where oneDNN computes the model's products)
            self.weight, self.packed = None, torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        if trace.OPEN:
            trace.note("prepack", ("onednn" if self.weight is None else "mkl", [tuple(m.weight.shape) for m in linears]))

    def __call__(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        if trace.OPEN:
            trace.note("prepacked_product", tuple(x.shape))
        if self.weight is not None:
            y = torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, self.rows)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return y.split(self.splits, dim=-1) if len(self.splits) > 1 else y


class _Each:
    """Linear layers sharing an input, each as its own packed product (outputs as a tuple)."""

    def __init__(self, linears: list[nn.Linear], rows: int, onednn: bool = False) -> None:
        self.parts = [_Packed([m], rows, onednn) for m in linears]

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        return tuple(part(x) for part in self.parts)


class PackedProjections(_GroupedProjections):
    """The decoding step's products on CPU weights prepacked for ``rows``-row inputs: MKL's packed GEMM for float32,
    oneDNN's blocked layout for bfloat16, q/k/v as one product and gate/up as another (float32 inside oneDNN's mode:
    below).

    Built from the current weights at each rollout (the policy changes between rollouts); the packed copy lives for
    the rollout only.

    A float32 model inside :class:`~polopt_lightning.accel.cpu.linear.OneDNNLinear` runs every product, head included, on
    :mod:`.rowdot`'s kernel where ``kernel`` is not ``False`` and it can run (:meth:`kernel_fits`): no copy at all,
    q/k/v and gate/up one call each. Otherwise it packs its body in oneDNN's blocked layout (float32, the same
    products oneDNN computes on the plain weights, rounded alike: tested) and keeps its head as it is (a copy of a
    large head does not pay). The copy is made after the optimizer step has freed the gradients, in the memory they
    leave. Measured effects: docs/performance.md.
    """

    def __init__(self, base: nn.Module, rows: int, kernel: bool | None = None, fused: bool | None = None) -> None:
        super().__init__(base)
        onednn = self.onednn_float32(base)
        self.kernel = onednn and self.kernel_fits(base, rows, kernel)
        if self.kernel:  # rowdot.c on the weights as they are: no copy; layers sharing an input in one call
            together = single = RowDot
        else:
            # MKL and bf16: one product per shared input on a concatenated copy; oneDNN's float32 blocked layout: one
            # per weight, reordered from the weight itself (concatenating first cost more than one product per input
            # saved)
            together = partial(_Packed if not onednn else _Each, rows=rows, onednn=onednn)
            single = partial(_Packed, rows=rows, onednn=onednn)
        for layer in self.layers:
            qkv, o, gate_up, down = _groups(layer)
            self.packed_qkv.append(together(qkv))
            self.packed_o.append(single(o))
            self.packed_gate_up.append(together(gate_up))
            self.packed_down.append(single(down))
        self.packed_head = RowDot([base.lm_head]) if self.kernel else None if onednn else _Packed([base.lm_head], rows)
        # the whole step in one C call where the products run on the kernel and the model's layers allow it
        use_fused = self.kernel and fused is not False and FusedStep.fits(base)
        self.fused = FusedStep(base, rows) if use_fused else None

    @staticmethod
    def kernel_fits(base: nn.Module, rows: int, kernel: bool | None = None) -> bool:
        """Whether the decoding products run on :mod:`.rowdot`'s kernel: ``kernel`` not ``False``, at most
        :data:`KERNEL_MAX_ROWS` rows, the kernel built here and every weight (head included) one it takes."""
        if kernel is False or rows > KERNEL_MAX_ROWS or rowdot.load() is None:
            return False
        linears = [base.lm_head] + [m for layer in base.model.layers for m in layer.modules() if isinstance(m, nn.Linear)]
        return rowdot.fits(linears)

    @staticmethod
    def onednn_float32(base: nn.Module) -> bool:
        """Whether ``base`` is a float32 model whose products oneDNN computes here (then its body packs in oneDNN's
        blocked layout and its head stays as it is)."""
        return base.lm_head.weight.dtype == torch.float32 and cpu_linear.applies(base)

    @staticmethod
    def supported(base: nn.Module) -> bool:
        """Whether every projection is a plain CPU ``nn.Linear`` in a dtype this PyTorch build can prepack, with
        autocast off (the packed products would bypass it)."""
        modules = _projections(base)
        if modules is None:
            return False
        linears = [base.lm_head, *modules]
        if not all(type(m) is nn.Linear for m in linears):  # LoRA wrappers, quantized layers (Linear subclasses)
            return False
        dtypes = {m.weight.dtype for m in linears}
        if len(dtypes) != 1 or not all(m.weight.is_cpu for m in linears) or torch.is_autocast_enabled("cpu"):
            return False
        dtype = dtypes.pop()
        if dtype == torch.float32:
            if cpu_linear.applies(base):  # oneDNN's blocked layout: faster than MKL's packed products
                return hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
        if dtype == torch.bfloat16:
            bf16_ok = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
            return torch.backends.mkldnn.is_available() and bf16_ok is not None and bool(bf16_ok())
        return False


def _kernel_layer(module: nn.Module | None) -> bool:
    """A layer whose product :mod:`.rowdot` computes: a plain ``nn.Linear`` (float32 checked by the caller) or a
    bitsandbytes 4-bit layer its 4-bit kernel takes."""
    return type(module) is nn.Linear or (module is not None and rowdot._four_bit_state(module) is not None)


def _lora_parts(module: nn.Module) -> tuple[nn.Module, list[tuple[Tensor, Tensor, Tensor | None, float]]] | None:
    """``(base layer, [(A, B, B's bias, scaling) per active adapter])`` of a plain ``nn.Linear`` or bitsandbytes 4-bit
    layer (:func:`_kernel_layer`; no adapters) or of a peft LoRA layer over one in the state its forward adds
    ``B(A(x)) * scaling`` in (unmerged, adapters on, plain LoRA without a variant such as DoRA, dropout off, float32
    adapters); ``None`` for anything else."""
    if _kernel_layer(module) and not hasattr(module, "base_layer"):
        return module, []
    base = getattr(module, "base_layer", None)
    if (not _kernel_layer(base) or not hasattr(module, "lora_A") or getattr(module, "merged", True)
            or getattr(module, "disable_adapters", True) or getattr(module, "lora_variant", None)):
        return None
    parts = []
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        A, B, dropout = module.lora_A[name], module.lora_B[name], module.lora_dropout[name]
        if (type(A) is not nn.Linear or type(B) is not nn.Linear or A.bias is not None or dropout.training
                or A.weight.dtype != torch.float32 or B.weight.dtype != torch.float32):
            return None
        parts.append((A.weight, B.weight, B.bias, module.scaling[name]))
    return base, parts


class _Adapted:
    """Layers sharing an input (plain float32 ``nn.Linear``, bitsandbytes 4-bit layers, or LoRA layers over them,
    :func:`_lora_parts`) as one kernel call on their base weights (:func:`rowdot.products`), each active adapter's
    ``B(A(x)) * scaling`` then added in peft's order and arithmetic; outputs as :class:`RowDot` returns them."""

    def __init__(self, modules: list[nn.Module]) -> None:
        parts = [_lora_parts(m) for m in modules]
        self.bases, self.adapters = [linear for linear, _ in parts], [a for _, a in parts]
        self.kernel = None  # built at the first call: a rollout the fused step decodes never makes one

    def __call__(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        if self.kernel is None:
            self.kernel = rowdot.products(self.bases)
        outs = self.kernel(x)
        outs = list(outs) if isinstance(outs, tuple) else [outs]
        for j, parts in enumerate(self.adapters):
            for A, B, bias, scaling in parts:
                outs[j] = outs[j] + F.linear(F.linear(x, A), B, bias) * scaling
        return tuple(outs) if len(outs) > 1 else outs[0]


class AdapterProjections(_GroupedProjections):
    """The decoding step's products for a LoRA policy whose frozen base layers the few-row kernel reads (plain float32
    weights, or bitsandbytes 4-bit ones on :class:`rowdot.FourBitRowDot`): the base products as
    :class:`PackedProjections` runs them (q/k/v in one kernel call, gate/up in another, on the weights as they
    are), each adapter's two small products added as peft's ``Linear`` adds them (``B(A(x)) * scaling``),
    without peft's per-module dispatch and the oneDNN mode's (the step's ~1,300 operations). The tokens peft's
    modules decode, log-probs within float32 tolerance (the k/v base products, below the mode's size, move from MKL
    to the kernel; tested)."""

    def __init__(self, base: nn.Module, rows: int, fused: bool | None = None) -> None:
        with _without_torch_function():  # no tensor access below needs the mode (its dispatch: ~1/3 of the time)
            self._build(base, rows, fused)

    def _build(self, base: nn.Module, rows: int, fused: bool | None) -> None:
        super().__init__(base)
        for layer in self.layers:
            qkv, o, gate_up, down = (_Adapted(group) for group in _groups(layer))
            self.packed_qkv.append(qkv)
            self.packed_o.append(o)
            self.packed_gate_up.append(gate_up)
            self.packed_down.append(down)
        self.packed_head = RowDot([base.lm_head])
        # the whole step in one C call, the adapters' products inside it, where the model's layers allow it
        self.fused = FusedStep(base, rows) if fused is not False and FusedStep.fits(base) else None

    @staticmethod
    def applies(base: nn.Module, rows: int, kernel: bool | None = None) -> bool:
        """Inside oneDNN's mode, where the kernel runs here (``kernel`` not ``False``, at most
        :data:`KERNEL_MAX_ROWS` rows, autocast off): every projection a plain float32 ``nn.Linear``, a bitsandbytes
        4-bit layer with float32 compute (:func:`rowdot.four_bit_fits`) or a LoRA layer over one (:func:`_lora_parts`),
        at least one of them adapted or quantized, layers sharing an input of one kind, a plain head, the MLPs gated
        with ``act_fn``."""
        if (kernel is False or rows > KERNEL_MAX_ROWS or not cpu_linear.applies(base) or rowdot.load() is None
                or torch.is_autocast_enabled("cpu")):  # the kernel's products would bypass autocast
            return False
        if _projections(base) is None:
            return False
        groups = [[_lora_parts(m) for m in group] for layer in base.model.layers for group in _groups(layer)]
        parts = [p for group in groups for p in group]
        if any(p is None for p in parts):
            return False
        if not any(adapters for _, adapters in parts) and all(type(linear) is nn.Linear for linear, _ in parts):
            return False  # a plain model: PackedProjections
        return (type(base.lm_head) is nn.Linear and rowdot.fits([base.lm_head])
                and all(rowdot.takes_together([linear for linear, _ in group]) for group in groups))


class FusedStep:
    """The whole decoding step in one call of :mod:`.rowdot`'s ``polopt_decode_step``: the products on the kernel as
    in :class:`PackedProjections`, and the norms, rotary, attention, activation and residuals between them in C on the
    same threads (PyTorch spends ~50 small operations a layer on those).
    Only the embedding lookup and the rotary tables stay in PyTorch. Built at each rollout from the current weights
    (references, no copy); :meth:`fits` says where it applies.

    A LoRA policy on plain float32 weights (one active adapter a projection, :func:`_lora_parts`) runs here too: each
    adapter's ``B(A(x)) * scaling`` is added to its base product inside the C step (B transposed once per rollout,
    r x out floats).

    So do bitsandbytes 4-bit bases (QLoRA; :func:`rowdot.four_bit_parts`, one block size for all): the C step
    multiplies them on their codes as :class:`rowdot.FourBitRowDot` does."""

    def __init__(self, base: nn.Module, rows: int) -> None:
        self.fn = rowdot.step_function()
        if self.fn is None or not self.fits(base):
            raise RuntimeError("the fused decoding step does not apply to this model here")
        self.base, config, inner = base, base.config, base.model
        layers = inner.layers
        heads, kv_heads, D = config.num_attention_heads, config.num_key_value_heads, _head_dim(config)
        H, V = config.hidden_size, base.lm_head.out_features
        parts = [_lora_parts(m) for m in _projections(base)]  # 7 a layer: q, k, v, o, gate, up, down
        inner_width = parts[4][0].out_features
        M = -(-rows // rowdot.ROWS) * rowdot.ROWS
        self.M, self.D, self.rep = M, D, heads // kv_heads
        self.keep: list = []  # tensors and C arrays the struct points into

        def each(get) -> ctypes.Array:
            return self._pointers([get(layer) for layer in layers])

        # 4-bit bases: the kernel reads their codes where a float32 base's weight is, beside their scales and table
        four = [rowdot.four_bit_parts(base) if type(base) is not nn.Linear else None for base, _ in parts]
        weights = [f[0] if f is not None else base.weight for (base, _), f in zip(parts, four)]

        def proj(j: int, part: str = "weight") -> ctypes.Array:  # the j-th projection's base weight (codes) or bias
            return self._pointers([weights[7 * i + j] if part == "weight" else parts[7 * i + j][0].bias
                                   for i in range(len(layers))])

        scratch = {name: torch.zeros(M, width) for name, width in
                   (("x", H), ("h", H), ("q", heads * D), ("k", kv_heads * D), ("v", kv_heads * D),
                    ("att", heads * D), ("gate", inner_width), ("up", inner_width), ("tmp", H))}
        self.scratch = scratch  # the struct points into it
        self.step = rowdot.Step(
            M=M, N=rows, H=H, I=inner_width, heads=heads, kv_heads=kv_heads, D=D, layers=len(layers), V=V,
            eps=_norm_eps(inner.norm), scale=layers[0].self_attn.scaling,
            in_norm=each(lambda layer: layer.input_layernorm.weight),
            post_norm=each(lambda layer: layer.post_attention_layernorm.weight),
            wq=proj(0), wk=proj(1), wv=proj(2), bq=proj(0, "bias"), bk=proj(1, "bias"), bv=proj(2, "bias"),
            wo=proj(3), bo=proj(3, "bias"), wg=proj(4), wu=proj(5), wd=proj(6),
            final_norm=inner.norm.weight.data_ptr(), head=base.lm_head.weight.data_ptr(),
            **{name: t.data_ptr() for name, t in scratch.items()})
        self._adapters([adapters for _, adapters in parts])
        self.four_stride = 0
        if any(f is not None for f in four):
            s = self.step
            s.four_absmax = self._pointers([None if f is None else f[1] for f in four])
            s.four_table = self._pointers([None if f is None else f[2] for f in four])
            s.four_blocksize = next(rowdot._four_bit_state(base).blocksize for (base, _), f in zip(parts, four) if f)
            s.four_chunk_bytes = rowdot.FOUR_BIT_CHUNK_BYTES
            self.four_stride = s.four_stride = rowdot.four_bit_scratch(max(H, heads * D, inner_width))

    def _pointers(self, tensors: list[Tensor | None]) -> ctypes.Array:
        """A C array of the tensors' pointers, the tensors and the array kept alive with the step."""
        tensors = [None if t is None else t.detach() for t in tensors]
        array = rowdot.pointers(tensors)
        self.keep += [tensors, array]
        return ctypes.cast(array, rowdot._PP)

    def _adapters(self, adapters: list[list[tuple]]) -> None:
        """LoRA's A, B transposed (a copy of B, [r, out], for products vectorized over the outputs), scaling and
        rank per projection (``adapters``: :func:`_lora_parts`' in :func:`_projections`' order), where any
        projection has an adapter."""
        self.rmax = max((A.shape[0] for parts in adapters for A, *_ in parts), default=0)
        if not self.rmax:
            return
        a = [parts[0][0].contiguous() if parts else None for parts in adapters]
        bt = [parts[0][1].detach().t().contiguous() if parts else None for parts in adapters]
        scale = torch.tensor([float(parts[0][3]) if parts else 0.0 for parts in adapters], dtype=torch.float32)
        rank = torch.tensor([t.shape[0] if t is not None else 0 for t in a], dtype=torch.long)
        self.keep += [scale, rank]
        s = self.step
        s.lora_a, s.lora_bt = self._pointers(a), self._pointers(bt)
        s.lora_scale, s.lora_rank, s.lora_rmax = scale.data_ptr(), rank.data_ptr(), self.rmax

    @staticmethod
    def fits(base: nn.Module) -> bool:
        """A float32 model whose products run on the kernel (:meth:`PackedProjections.kernel_fits`; or 4-bit
        projections of one block size, :func:`rowdot.four_bit_fits`), SiLU-gated MLPs
        without biases, RMSNorm layers with float32 weights, widths and head size multiples of 16 (head size at most
        256), one attention scaling for all layers."""
        config, inner = base.config, base.model
        D = _head_dim(config)
        if getattr(config, "hidden_act", None) not in ("silu", "swish") or D % 16 or D > 256:
            return False
        modules = _projections(base)
        parts = [_lora_parts(m) for m in modules] if modules is not None else [None]
        if any(p is None or len(p[1]) > 1 or any(b is not None for _, _, b, _ in p[1]) for p in parts):
            return False  # a layer the kernel does not read or a LoRA one over it, several adapters, B with a bias
        four = [linear for linear, _ in parts if type(linear) is not nn.Linear]  # 4-bit bases (_kernel_layer)
        if four and not rowdot.four_bit_fits(four):
            return False  # one block size for all
        if base.lm_head.bias is not None or config.hidden_size % 16:
            return False
        norms = [inner.norm] + [n for layer in inner.layers for n in (layer.input_layernorm,
                                                                      layer.post_attention_layernorm)]
        if not all(getattr(n, "weight", None) is not None and n.weight.dtype == torch.float32
                   and n.weight.is_contiguous() and not hasattr(n, "bias") and _norm_eps(n) == _norm_eps(inner.norm)
                   for n in norms):  # one epsilon for all (the C step takes one)
            return False
        for i, layer in enumerate(inner.layers):
            mlp = [linear for linear, _ in parts[7 * i + 4:7 * i + 7]]  # gate, up, down (:func:`_projections`)
            if any(linear.bias is not None for linear in mlp):
                return False
            if mlp[0].out_features % 16 or layer.self_attn.scaling != inner.layers[0].self_attn.scaling:
                return False
        return True

    def __call__(self, token: Tensor, position: Tensor, a: list[tuple[Tensor, Tensor]], a_len: int, a_bias: Tensor,
                 a_group: int, b: list[tuple[Tensor, Tensor]] | None = None, b_len: int = 0,
                 slot: int = 0) -> Tensor:
        """Logits ``[N, V]`` for one new token per row.

        ``a[i]``: layer i's keys/values ``[R, kv_heads, capacity, D]`` (one per ``a_group`` consecutive rows) of
        which the first ``a_len`` positions are attended under the additive ``a_bias`` ``[R, 1, 1, >= a_len]``;
        ``b[i]``: each row's own ``[N, kv_heads, capacity, D]``, the first ``b_len`` positions attended. The new
        key/value goes to position ``slot`` of ``b`` where it is given, else of ``a`` (then ``a_group`` is 1)."""
        N, M, s = token.shape[0], self.M, self.step
        x = self.scratch["x"]
        x[:N] = self.base.model.embed_tokens(token)
        x[N:] = 0
        cos, sin = self.base.model.rotary_emb(x[:N, None], position)  # [N, 1, D]
        cos, sin = cos[:, 0].float().contiguous(), sin[:, 0].float().contiguous()
        for t in [k for kv in a for k in kv] + [k for kv in (b or []) for k in kv]:
            if t.dtype != torch.float32 or t.stride(3) != 1 or t.stride(2) != self.D:
                raise ValueError("the fused step takes float32 keys/values with contiguous positions")
        if a_bias.dtype != torch.float32 or a_bias.stride(-1) != 1:
            raise ValueError("the fused step takes a float32 additive key mask")
        ka, va = rowdot.pointers([k for k, _ in a]), rowdot.pointers([v for _, v in a])
        kb, vb = (rowdot.pointers([k for k, _ in b]), rowdot.pointers([v for _, v in b])) if b else (ka, va)
        logits = x.new_empty(M, s.V)
        scores = x.new_empty(torch.get_num_threads(), self.rep * (a_len + b_len))  # a query group's scores
        lora_t = x.new_empty(torch.get_num_threads(), M, self.rmax)
        a0, b0 = a[0][0], (b[0][0] if b else a[0][0])
        s.N, s.a_group, s.a_row, s.a_head, s.a_len = N, a_group, a0.stride(0), a0.stride(1), a_len
        s.b_row, s.b_head, s.b_len, s.slot, s.write_b = b0.stride(0), b0.stride(1), b_len, slot, int(bool(b))
        s.ka, s.va = ctypes.cast(ka, rowdot._PP), ctypes.cast(va, rowdot._PP)
        s.kb, s.vb = ctypes.cast(kb, rowdot._PP), ctypes.cast(vb, rowdot._PP)
        s.a_bias, s.bias_row = a_bias.data_ptr(), a_bias.stride(0)
        s.cos, s.sin, s.scores, s.logits = cos.data_ptr(), sin.data_ptr(), scores.data_ptr(), logits.data_ptr()
        s.lora_t = lora_t.data_ptr()
        four_buf = x.new_empty(torch.get_num_threads(), self.four_stride)
        s.four_buf = four_buf.data_ptr()
        self.fn(ctypes.byref(s), torch.get_num_threads())
        return logits[:N]
