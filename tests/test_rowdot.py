"""The few-row decoding kernel (polopt_lightning.accel.cpu.rowdot): F.linear's values within float32 tolerance for any
row count, width, bias and thread count; decoding on it with the modules' tokens and log-probs, on the weights as
they are (no blocked copy, the head included); off, with the reason, where it cannot run."""

import pytest
import torch
from torch.nn import functional as F

from polopt_lightning import lean_step
from polopt_lightning.accel import trace
from polopt_lightning.accel.cpu import decode as cpu_decode
from polopt_lightning.accel.cpu import linear as cpu_linear
from polopt_lightning.accel.cpu import rowdot
from polopt_lightning.models import build_tiny_model
from polopt_lightning.rollout import HFRolloutEngine, SamplingConfig

from .helpers import close, greedy_on_the_modules, one_decoding_step, onednn_model
from .helpers.kernel import dispatched_in_lean_step
from .helpers.kernel import needs_kernel as _needs_kernel  # skips where the machine cannot, fails where it should


@pytest.mark.parametrize("rows", [1, 3, 8, 11, 16])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_f_linear_for_every_row_count_width_and_bias(rows, threads):
    _needs_kernel()
    torch.manual_seed(rows)
    # outputs that leave 0, 1 and 2 rows after the blocks of 3, fewer outputs than threads x 3, a bias or none
    layers = [torch.nn.Linear(48, n, bias=b) for n, b in [(7, True), (2, False), (100, True), (9, False)]]
    x = torch.randn(rows, 1, 48)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = rowdot.RowDot(layers)(x)
        single = rowdot.RowDot([layers[2]])(torch.randn(48, rows).t())  # one layer, a non-contiguous input
    finally:
        torch.set_num_threads(previous)
    assert isinstance(got, tuple) and len(got) == len(layers)
    for layer, y in zip(layers, got):
        assert y.shape == (rows, 1, layer.out_features) and y.is_contiguous()
        torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert isinstance(single, torch.Tensor) and single.shape == (rows, 100)


def test_kernel_refuses_what_it_cannot_compute():
    _needs_kernel()
    assert not rowdot.fits([torch.nn.Linear(40, 8)])  # the input width is not a multiple of 16
    assert not rowdot.fits([torch.nn.Linear(48, 8).to(torch.bfloat16)])
    with pytest.raises(ValueError, match="multiple of 16"):
        rowdot.RowDot([torch.nn.Linear(40, 8)])
    with pytest.raises(ValueError, match="input width 32"):
        rowdot.RowDot([torch.nn.Linear(48, 8)])(torch.randn(8, 32))


def test_decoding_runs_on_the_kernel_with_the_modules_tokens_and_logprobs(monkeypatch):
    """Inside oneDNN's mode a float32 model decodes on the kernel: no weight reordered or packed (the head
    included), the tokens and log-probs of decoding on the modules, one step's logits within float tolerance."""
    _needs_kernel()
    model, tok, ids, mask, sampling, want = greedy_on_the_modules()
    kernel_calls = []
    call = rowdot.RowDot.__call__
    monkeypatch.setattr(rowdot.RowDot, "__call__", lambda self, x: kernel_calls.append(x.shape) or call(self, x))
    base = lean_step.llama_like(model)
    with cpu_linear.OneDNNLinear(), trace.routes() as ran:
        got = HFRolloutEngine(cpu={"fused_step": False}).generate(model, ids, mask, 2, sampling, tok.eos_token_id,
                                                         tok.pad_token_id)
        # the lean step ran, and the mode's dispatch saw nothing inside it (its products are prepacked)
        assert ran["lean_step"] and not dispatched_in_lean_step(ran)
        proj = cpu_decode.PackedProjections(base, 4)
        kernel, plain = (one_decoding_step(model, ids, packed=p, fused=False) for p in (True, False))
    assert proj.kernel and isinstance(proj.packed_head, rowdot.RowDot) and not ran["prepack"]
    assert proj.packed_qkv[0].weights[0] is not None and proj.packed_qkv[0].weights[0].data_ptr() == \
        model.model.layers[0].self_attn.q_proj.weight.data_ptr()  # the weight itself, no copy
    # per decoded token (2 of the 3 come from the lean step): q/k/v, o, gate/up, down per layer, then the head
    assert len(kernel_calls) >= 2 * (4 * len(model.model.layers) + 1)
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert close(got.sampling_logprobs, want.sampling_logprobs, rel=1e-4)
    assert close(kernel, plain, rel=1e-5)


def test_more_rows_than_the_kernel_takes_keep_the_blocked_layout():
    _needs_kernel()
    model, _ = onednn_model()
    with cpu_linear.OneDNNLinear():
        assert not cpu_decode.PackedProjections(lean_step.llama_like(model), cpu_decode.KERNEL_MAX_ROWS + 1).kernel


def test_without_a_compiler_decoding_keeps_the_blocked_layout_and_true_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(rowdot, "_state", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("POLOPT_CACHE", str(tmp_path))
    assert rowdot.load() is None and rowdot.why_not()
    with pytest.raises(ValueError, match=r"rollout.cpu.decode_kernel=True: .*cannot run here"):
        HFRolloutEngine(cpu={"decode_kernel": True})
    model, _ = onednn_model()
    with cpu_linear.OneDNNLinear():
        proj = cpu_decode.PackedProjections(lean_step.llama_like(model), 4)
    assert not proj.kernel and proj.packed_head is None  # the blocked layout, as before the kernel


def test_the_kernels_tests_skip_where_the_machine_cannot_and_fail_where_it_should_load_and_did_not(monkeypatch):
    """The gate of this file's tests: a CPU without AVX-512 or no compiler skips, naming which; a machine that can
    run the kernel where load() still gave None (a compile error, a Step layout mismatch) fails with load()'s reason."""
    from .helpers import kernel

    cannot_run_here = kernel.cannot_run_here
    monkeypatch.setattr(rowdot, "_state", {})
    monkeypatch.setattr(rowdot, "load", lambda: None)
    monkeypatch.setattr(rowdot, "why_not", lambda: "building rowdot.c failed: cc failed: rowdot.c:1: error: expected")
    monkeypatch.setattr(kernel, "cannot_run_here", lambda: None)  # an AVX-512 CPU with a working compiler
    with pytest.raises(pytest.fail.Exception, match="should run here .* did not load: building rowdot.c failed: cc"):
        kernel.needs_kernel()
    monkeypatch.setattr(kernel, "cannot_run_here", lambda: "the CPU: it has no AVX-512 (PyTorch reports AVX2)")
    with pytest.raises(pytest.skip.Exception, match="cannot run here: the CPU: it has no AVX-512"):
        kernel.needs_kernel()
    # the machine's own checks, found without load(): the CPU, then the compiler (one that cannot build AVX-512 code)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert cannot_run_here() == "the CPU: it has no AVX-512 (PyTorch reports AVX2)"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert cannot_run_here() == "the compiler: no C compiler ('no-such-compiler-here' is not on the PATH)"
    monkeypatch.setenv("CC", "false")  # a compiler that builds nothing
    assert cannot_run_here().startswith("the compiler: the C compiler /")
    monkeypatch.setenv("POLOPT_ROWDOT", "0")
    assert cannot_run_here() == "turned off (POLOPT_ROWDOT=0)"


def test_the_kernel_is_built_once_into_the_cache_and_a_failed_build_says_so(monkeypatch, tmp_path):
    if "AVX512" not in torch.backends.cpu.get_cpu_capability():
        pytest.skip(f"the CPU has no AVX-512 ({torch.backends.cpu.get_cpu_capability()})")
    monkeypatch.setattr(rowdot, "_state", {})
    monkeypatch.setenv("POLOPT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a 'compiler' that fails
    assert rowdot.load() is None and "building rowdot.c failed" in rowdot.why_not()
    assert not list((tmp_path / "kernels").glob("*"))  # no half-written file left
    monkeypatch.setattr(rowdot, "_state", {})
    monkeypatch.delenv("CC")
    _needs_kernel()  # no compiler that builds AVX-512 code: skipped; one that does and rowdot.c failed: failed
    built = list((tmp_path / "kernels").glob("rowdot-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(rowdot, "_state", {})
    assert rowdot.load() is not None and built[0].stat().st_mtime_ns == stamp  # taken from the cache


def test_adapter_decoding_runs_its_frozen_base_products_on_the_kernel(monkeypatch):
    """A LoRA policy on plain float32 weights decodes through :class:`cpu_decode.AdapterProjections` inside oneDNN's
    mode: its frozen base weights themselves on the kernel (q/k/v in one call, gate/up in another), each adapter's
    ``B(A(x)) * scaling`` added, no peft module and no mode dispatch inside the step; the tokens and log-probs of
    ``decode_kernel=False`` (peft's modules on oneDNN's products). A merged or disabled adapter goes back to the
    modules. (The step in PyTorch: ``fused_step=False``; the fused C step below.)"""
    _needs_kernel()
    from polopt_lightning.models import LLAMA_TARGETS, Adapter, apply_adapter

    model, tok, ids, mask, sampling, _ = greedy_on_the_modules()
    policy = _nonzero_b(apply_adapter(model, Adapter(kind="lora", r=4, target_modules=list(LLAMA_TARGETS))))
    built, read = [], []
    init = cpu_decode.AdapterProjections.__init__
    monkeypatch.setattr(cpu_decode.AdapterProjections, "__init__",
                        lambda self, *a: built.append(self) or init(self, *a))
    call = rowdot.RowDot.__call__
    monkeypatch.setattr(rowdot.RowDot, "__call__", lambda self, x: read.append(self.weights) or call(self, x))
    with cpu_linear.OneDNNLinear():
        with trace.routes() as ran:
            got = HFRolloutEngine(cpu={"fused_step": False}).generate(policy, ids, mask, 2, sampling,
                                                                      tok.eos_token_id, tok.pad_token_id)
        assert len(built) == 1 and read and ran["lean_step"] and not dispatched_in_lean_step(ran)
        off = HFRolloutEngine(cpu={"decode_kernel": False}).generate(policy, ids, mask, 2, sampling, tok.eos_token_id,
                                                            tok.pad_token_id)
        assert len(built) == 1  # decode_kernel=False: peft's modules
    attn = model.model.layers[0].self_attn
    bases = [attn.q_proj.base_layer.weight, attn.k_proj.base_layer.weight, attn.v_proj.base_layer.weight]
    assert any(len(w) == 3 and all(a.data_ptr() == b.data_ptr() for a, b in zip(w, bases)) for w in read)
    assert torch.equal(got.completion_ids, off.completion_ids)
    assert close(got.sampling_logprobs, off.sampling_logprobs, rel=1e-4)
    base = lean_step.llama_like(policy.eval())  # generate samples in eval mode (dropout off)
    with cpu_linear.OneDNNLinear():
        assert cpu_decode.AdapterProjections.applies(base, 4)
        assert not cpu_decode.AdapterProjections.applies(base, 4, kernel=False)
        assert not cpu_decode.AdapterProjections.applies(base, 17)  # more rows than the kernel takes
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not cpu_decode.AdapterProjections.applies(base, 4)
        with policy.disable_adapter():
            assert not cpu_decode.AdapterProjections.applies(base, 4)
        attn.q_proj.merge()
        assert not cpu_decode.AdapterProjections.applies(base, 4)
        attn.q_proj.unmerge()
    assert not cpu_decode.AdapterProjections.applies(base, 4)  # outside oneDNN's mode


def _gqa_model(**config):
    """Qwen2 (q/k/v biases) or Llama, grouped-query attention, two layers, weights above the mode's size."""
    model, tok = build_tiny_model(hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, intermediate_size=640,
                                  seed=0, **config)
    return model, tok


def _padded_prompts_and_fused_calls(tok, monkeypatch):
    """Two prompts (the second left-padded), 6 sampled tokens, and a list that records each fused step's call."""
    ids = torch.tensor([tok("12+34=")["input_ids"], tok("7*8=")["input_ids"] + [tok.pad_token_id] * 2])
    ids = torch.stack([ids[0], ids[1].roll(2)])
    mask = (torch.arange(ids.shape[1]) >= torch.tensor([[0], [2]])).long()
    sampling = SamplingConfig(max_new_tokens=6, min_new_tokens=6, temperature=1.0)
    return ids, mask, sampling, _fused_calls(monkeypatch)


def _fused_calls(monkeypatch) -> list:
    """A list that records each call of the fused step."""
    calls = []
    fused_call = cpu_decode.FusedStep.__call__
    monkeypatch.setattr(cpu_decode.FusedStep, "__call__", lambda self, *a, **k: calls.append(1) or
                        fused_call(self, *a, **k))
    return calls


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
@pytest.mark.parametrize("shared", [False, True])
def test_the_fused_step_samples_what_the_step_in_pytorch_samples(monkeypatch, architecture, shared):
    """The whole step in one C call (norms, rotary, attention, activation, residuals between the kernel's products):
    the sampled tokens and log-probs of the same step in PyTorch, for a left-padded prompt, 6 rows (padded to the
    kernel's 8), grouped-query attention, each sample's own cache or the prompt's kept once per group; one step's
    logits within float32 tolerance; ``fused_step=False`` never calls it."""
    _needs_kernel()
    model, tok = _gqa_model(architecture=architecture)
    ids, mask, sampling, calls = _padded_prompts_and_fused_calls(tok, monkeypatch)
    got = {}
    with cpu_linear.OneDNNLinear():
        for fused in (None, False):
            engine = HFRolloutEngine(shared_prompt_kv=shared, cpu={"fused_step": fused})
            got[fused] = engine.generate(model, ids, mask, 3, sampling, tok.eos_token_id, tok.pad_token_id,
                                         generator=torch.Generator().manual_seed(0))
            if fused is None:
                assert len(calls) == sampling.max_new_tokens - 1  # every token after the prefill's
        assert len(calls) == sampling.max_new_tokens - 1
        one, two = (one_decoding_step(model, ids, packed=True, fused=f) for f in (None, False))
    assert len(calls) == sampling.max_new_tokens
    assert torch.equal(got[None].completion_ids, got[False].completion_ids)
    assert close(got[None].sampling_logprobs, got[False].sampling_logprobs, rel=1e-5)
    assert close(one, two, rel=1e-5)


@pytest.mark.parametrize("width, heads, kv_heads, threads", [
    (512, 8, 2, 1), (448, 14, 2, 3), (640, 10, 2, 1), (512, 4, 4, 3), (512, 16, 1, 1), (768, 12, 1, 3)])
@pytest.mark.parametrize("shared", [False, True])
def test_the_fused_steps_attention_over_long_caches_is_the_steps_in_pytorch(monkeypatch, width, heads, kv_heads,
                                                                            threads, shared):
    """The fused step's attention takes sixteen keys at a time and a key/value head's queries together: over a 37-token
    prompt (the second row left-padded by 35, so closed keys also fall after the last block of sixteen) and 40 sampled
    tokens, so blocks of sixteen and the keys after them occur in the prompt's segment and in the completions', the
    tokens and log-probs of the step in PyTorch, with one query a key/value head, several (4; 5 and 7 as Qwen2.5's 14B
    and 0.5B have), eight and more (16: two full passes over the values; 12: a short second one), on one thread and on
    three (each its own scores)."""
    _needs_kernel()
    model, _ = build_tiny_model(hidden_size=width, num_layers=2, num_heads=heads, num_kv_heads=kv_heads,
                                intermediate_size=640, seed=0)
    ids = torch.randint(3, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :35], mask[1, :35] = 0, 0
    sampling = SamplingConfig(max_new_tokens=40, min_new_tokens=40, temperature=1.0)
    calls = _fused_calls(monkeypatch)
    got = {}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with cpu_linear.OneDNNLinear():
            for fused in (None, False):
                engine = HFRolloutEngine(shared_prompt_kv=shared, cpu={"fused_step": fused})
                got[fused] = engine.generate(model, ids, mask, 3, sampling, 1, 0,
                                             generator=torch.Generator().manual_seed(0))
    finally:
        torch.set_num_threads(previous)
    assert len(calls) == sampling.max_new_tokens - 1
    assert torch.equal(got[None].completion_ids, got[False].completion_ids)
    assert close(got[None].sampling_logprobs, got[False].sampling_logprobs, rel=1e-5)

def _lora(model, r: int, targets: list[str], seed: int = 0):
    """``model`` with LoRA adapters whose B is not zero (so they change the output)."""
    from polopt_lightning.models import Adapter, apply_adapter

    return _nonzero_b(apply_adapter(model, Adapter(kind="lora", r=r, target_modules=targets)), seed)


def _nonzero_b(policy, seed: int = 0):
    """``policy`` with its LoRA B matrices drawn at random (they start at zero: adapters that change the output)."""
    torch.manual_seed(seed)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return policy


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("r, targets", [(20, None), (4, ["q_proj", "v_proj", "down_proj"])])
def test_the_fused_step_adds_lora_adapters_as_peft_does(monkeypatch, architecture, shared, r, targets):
    """A LoRA policy on plain float32 weights decodes in the fused C step, each adapter's ``B(A(x)) * scaling`` added
    to its base product inside it (a rank above the 16 lanes, or some projections without an adapter): the sampled
    tokens and log-probs of the same step in PyTorch (:class:`cpu_decode.AdapterProjections`' products) and of
    peft's modules (``decode_kernel=False``)."""
    _needs_kernel()
    from polopt_lightning.models import LLAMA_TARGETS

    model, tok = _gqa_model(architecture=architecture)
    policy = _lora(model, r, targets or list(LLAMA_TARGETS))
    ids, mask, sampling, calls = _padded_prompts_and_fused_calls(tok, monkeypatch)
    got = {}
    with cpu_linear.OneDNNLinear():
        for name, options in (("fused", {}), ("python", {"fused_step": False}), ("peft", {"decode_kernel": False})):
            got[name] = HFRolloutEngine(shared_prompt_kv=shared, cpu=options).generate(
                policy, ids, mask, 3, sampling, tok.eos_token_id, tok.pad_token_id,
                generator=torch.Generator().manual_seed(0))
            assert len(calls) == (sampling.max_new_tokens - 1 if name == "fused" else len(calls))
    assert len(calls) == sampling.max_new_tokens - 1  # only the fused engine called it
    for other in ("python", "peft"):
        assert torch.equal(got["fused"].completion_ids, got[other].completion_ids)
        assert close(got["fused"].sampling_logprobs, got[other].sampling_logprobs, rel=1e-5)


def test_the_fused_step_leaves_several_adapters_or_a_biased_b_to_the_step_in_pytorch():
    """Two active adapters on a layer, or an adapter's B with a bias: no fused step (its C code adds one bias-free
    adapter a projection); AdapterProjections still decodes them."""
    _needs_kernel()
    from peft import LoraConfig

    from polopt_lightning.models import LLAMA_TARGETS

    model, _ = _gqa_model(architecture="llama")
    policy = _lora(model, 4, list(LLAMA_TARGETS))
    base = lean_step.llama_like(policy.eval())
    assert cpu_decode.FusedStep.fits(base)
    policy.add_adapter("second", LoraConfig(r=4, target_modules=["q_proj"]))
    policy.eval()  # the new adapter's dropout (an identity) comes in training mode
    q = base.model.layers[0].self_attn.q_proj
    q.set_adapter(["default", "second"])
    assert len(q.active_adapters) == 2 and not cpu_decode.FusedStep.fits(base)
    q.set_adapter("default")
    assert cpu_decode.FusedStep.fits(base)
    q.lora_B["default"].bias = torch.nn.Parameter(torch.zeros(q.out_features))
    assert not cpu_decode.FusedStep.fits(base)
    with cpu_linear.OneDNNLinear():
        proj = cpu_decode.AdapterProjections(base, 4)
    assert proj.fused is None


def test_the_fused_step_steps_aside_for_layers_it_does_not_compute():
    """Another activation than SiLU, or biased MLP layers: the kernel's products with PyTorch's operations between
    them, the same tokens as decoding on the modules."""
    _needs_kernel()
    gelu, tok = _gqa_model(architecture="llama")
    gelu.config.hidden_act = "gelu"
    for layer in gelu.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    biased, _ = _gqa_model(architecture="llama")
    biased.model.layers[1].mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(512))
    ids = torch.tensor([tok("12+34=")["input_ids"]] * 2)
    sampling = SamplingConfig(max_new_tokens=3, min_new_tokens=3, temperature=0.0)
    for model in (gelu, biased):
        base = lean_step.llama_like(model)
        assert not cpu_decode.FusedStep.fits(base)
        with cpu_linear.OneDNNLinear():
            proj = cpu_decode.PackedProjections(base, 4)
            got = HFRolloutEngine().generate(model, ids, torch.ones_like(ids), 2, sampling, tok.eos_token_id,
                                             tok.pad_token_id)
        want = HFRolloutEngine(cpu={"packed_weights": False}).generate(model, ids, torch.ones_like(ids), 2, sampling,
                                                              tok.eos_token_id, tok.pad_token_id)
        assert proj.kernel and proj.fused is None
        assert torch.equal(got.completion_ids, want.completion_ids)


def _four_bit_layers(quant_type: str, nested: bool, widths=((100, True), (7, False), (640, True)), K: int = 512):
    """bitsandbytes 4-bit layers with float32 compute, quantized from random float32 weights (out widths leaving 1 and
    2 rows after the blocks of 3), bitsandbytes' CPU repacking off as :func:`models.prepare_policy` leaves it."""
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is a runtime dependency; this test needs it")
    layers = []
    for n, bias in widths:
        plain = torch.nn.Linear(K, n, bias=bias)
        layer = bnb.nn.Linear4bit(K, n, bias=bias, compute_dtype=torch.float32, compress_statistics=nested,
                                  quant_type=quant_type)
        layer.load_state_dict(plain.state_dict())
        layer = layer.to("cpu")  # quantizes the weight
        layer.support_avx512bf16_for_cpu = False
        layers.append(layer)
    return layers


@pytest.mark.parametrize("quant_type, nested", [("nf4", True), ("nf4", False), ("fp4", True)])
@pytest.mark.parametrize("rows", [1, 8, 11])
def test_the_four_bit_kernel_computes_what_the_layers_compute(quant_type, nested, rows):
    """bitsandbytes 4-bit layers sharing an input, as one call on their 4-bit codes: the layers' own outputs within
    float32 tolerance (the same dequantized weights, summed in another order)."""
    _needs_kernel()
    torch.manual_seed(rows)
    layers = _four_bit_layers(quant_type, nested)
    x = torch.randn(rows, 512)
    assert rowdot.four_bit_fits(layers) and rowdot.takes_together(layers)
    got = rowdot.products(layers)(x)
    assert isinstance(got, tuple) and len(got) == len(layers)
    with torch.no_grad():
        for layer, y in zip(layers, got):
            torch.testing.assert_close(y, layer(x), rtol=1e-5, atol=1e-5)


def test_the_four_bit_kernel_refuses_what_it_does_not_compute():
    """bfloat16 compute, bitsandbytes' CPU repacking, an input width that is not a multiple of 16, or a mixed group:
    not taken (the layers run as they are)."""
    _needs_kernel()
    bf16, packed, plain = (_four_bit_layers("nf4", True, widths=((48, False),)) for _ in range(3))
    bf16[0].compute_dtype = torch.bfloat16
    packed[0].weight.quant_state.packing_format_for_cpu = True
    narrow = _four_bit_layers("nf4", True, widths=((48, False),), K=40)
    for layers in (bf16, packed, narrow, plain + [torch.nn.Linear(512, 8)]):
        assert not rowdot.takes_together(layers)
    with pytest.raises(ValueError, match="4-bit layers"):
        rowdot.FourBitRowDot(bf16)


@pytest.mark.parametrize("mode", ["nf4", "fp4"])
@pytest.mark.parametrize("shared", [False, True])
def test_four_bit_lora_policies_decode_on_their_codes_with_the_modules_tokens(monkeypatch, tmp_path, mode, shared):
    """A QLoRA policy (4-bit base, LoRA adapters) decodes in the fused C step, its base products on the 4-bit codes
    (``rows_of_4bit``) and its adapters added inside it; with ``fused_step=False`` through
    :class:`cpu_decode.AdapterProjections` on :class:`rowdot.FourBitRowDot`. Both give the sampled tokens of peft's
    and bitsandbytes' modules (``decode_kernel=False``), log-probs within float32 tolerance."""
    _needs_kernel()
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is a runtime dependency; this test needs it")
    from polopt_lightning.models import LLAMA_TARGETS, Adapter, Quantization, prepare_policy

    model, tok = _gqa_model(architecture="qwen2")
    policy = _nonzero_b(prepare_policy(model, Quantization(mode=mode), Adapter(kind="lora", r=4, alpha=8,
                                       target_modules=list(LLAMA_TARGETS)), tmp_path))
    # the tiny vocabulary's head is below the mode's size: lower it, so the mode is on as for a real head
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHT_ELEMENTS", 2**10)
    ids, mask, sampling, calls = _padded_prompts_and_fused_calls(tok, monkeypatch)
    four = []
    call = rowdot.FourBitRowDot.__call__
    monkeypatch.setattr(rowdot.FourBitRowDot, "__call__", lambda self, x: four.append(1) or call(self, x))
    got, tokens = {}, sampling.max_new_tokens - 1  # decoding steps after the prefill's token
    with cpu_linear.OneDNNLinear():
        for name, options in (("fused", {}), ("python", {"fused_step": False}), ("peft", {"decode_kernel": False})):
            got[name] = HFRolloutEngine(shared_prompt_kv=shared, cpu=options).generate(
                policy, ids, mask, 3, sampling, tok.eos_token_id, tok.pad_token_id,
                generator=torch.Generator().manual_seed(0))
            if name == "fused":
                assert (len(calls), len(four)) == (tokens, 0)
            if name == "python":  # 4 calls a layer (q/k/v, o, gate/up, down) for each token
                assert (len(calls), len(four)) == (tokens, 4 * len(model.model.layers) * tokens)
    assert (len(calls), len(four)) == (tokens, 4 * len(model.model.layers) * tokens)
    for other in ("python", "peft"):
        assert torch.equal(got["fused"].completion_ids, got[other].completion_ids)
        assert close(got["fused"].sampling_logprobs, got[other].sampling_logprobs, rel=1e-5)


def test_the_fused_step_takes_four_bit_bases_of_one_block_size_and_float32_compute(tmp_path):
    """The C step takes one block size for all 4-bit projections and float32 compute: another block size on one
    layer, or bfloat16 compute, leaves the step in PyTorch."""
    _needs_kernel()
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is a runtime dependency; this test needs it")
    from polopt_lightning.models import LLAMA_TARGETS, Adapter, Quantization, prepare_policy

    model, _ = _gqa_model(architecture="llama")
    policy = prepare_policy(model, Quantization(mode="nf4"), Adapter(kind="lora", r=4, target_modules=list(
        LLAMA_TARGETS)), tmp_path)
    base = lean_step.llama_like(policy.eval())
    assert cpu_decode.FusedStep.fits(base)
    down = base.model.layers[1].mlp.down_proj.base_layer
    state = down.weight.quant_state
    state.blocksize *= 2
    assert not cpu_decode.FusedStep.fits(base)
    state.blocksize //= 2
    down.compute_dtype = torch.bfloat16
    assert not cpu_decode.FusedStep.fits(base)


@pytest.mark.parametrize("quant_type, nested", [("nf4", True), ("nf4", False), ("fp4", True)])
def test_a_prefills_four_bit_products_run_on_the_kernel_inside_the_mode(quant_type, nested):
    """Inside :class:`cpu_linear.OneDNNLinear` bitsandbytes' 4-bit product without gradient (its ``gemm_4bit`` op)
    of at most 64 rows runs on the 4-bit kernel: the layers' outputs outside the mode within float32 tolerance. More
    rows or ``few_row_kernel(False)``: bitsandbytes' dequantization with oneDNN's product in place of MKL's (weights of
    the mode's size only). Where a gradient is wanted, bitsandbytes' autograd function calls the same op for its
    forward (on the kernel) and dequantizes for its backward: the same gradient."""
    _needs_kernel()
    layers = _four_bit_layers(quant_type, nested)
    torch.manual_seed(0)
    with trace.routes() as ran:
        for rows in (3, 64, 65):
            x = torch.randn(rows, 512)
            with torch.no_grad():
                want = [layer(x) for layer in layers]
                with cpu_linear.OneDNNLinear():
                    got = [layer(x) for layer in layers]
                    with cpu_linear.few_row_kernel(False):
                        [layer(x) for layer in layers]
            for y, w in zip(got, want):
                torch.testing.assert_close(y, w, rtol=1e-5, atol=1e-5)
        assert ran["four_bit_kernel"] == [3] * len(layers) + [64] * len(layers)
        # the 640 x 512 weight (the mode's size) under few_row_kernel(False) and at 65 rows: oneDNN's product
        assert ran["four_bit_onednn"] == [3, 64, 65, 65]
        x = torch.randn(4, 512, requires_grad=True)
        with cpu_linear.OneDNNLinear():
            y = layers[0](x)
        assert len(ran["four_bit_kernel"]) == 2 * len(layers) + 1
    y.sum().backward()
    inside, x.grad = x.grad, None
    layers[0](x).sum().backward()
    torch.testing.assert_close(inside, x.grad)


@pytest.mark.parametrize("quant_type, nested", [("nf4", True), ("fp4", False)])
def test_frozen_four_bit_layers_take_their_input_gradients_through_onednn_for_the_modes_model(quant_type, nested):
    """``OneDNNLinear(model)``: the frozen 4-bit layers of ``model`` of the mode's size compute ``grad @ W`` through
    oneDNN instead of bitsandbytes' backward (MKL, where no mode reaches): the outputs and input gradients of the
    layers outside the mode within float32 tolerance. A trainable bias, bfloat16 compute, a layer below the mode's
    size and a model not given to the mode stay with bitsandbytes; after the context the layers are as before."""
    layers = _four_bit_layers(quant_type, nested)  # out widths 100, 7 and 640 over 512: only the 640 one is large
    for layer in layers:
        layer.requires_grad_(False)
    trainable, bf16, other = (_four_bit_layers(quant_type, nested, widths=((640, True),))[0] for _ in range(3))
    trainable.weight.requires_grad_(False)
    bf16.requires_grad_(False)
    bf16.compute_dtype = torch.bfloat16
    other.requires_grad_(False)
    model = torch.nn.ModuleList(layers + [trainable, bf16])
    torch.manual_seed(0)
    x = torch.randn(3, 5, 512, requires_grad=True)

    def run(layer):
        y = layer(x)
        (y.float().square() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        grad, x.grad = x.grad, None
        return y.detach().float(), grad

    with trace.routes() as ran:
        for layer in [*model, other]:
            want = run(layer)
            with cpu_linear.OneDNNLinear(model):
                got = run(layer)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert ran["four_bit_input_grad"] == [(640, 512)]
    assert not any("forward" in vars(layer) for layer in [*model, other])


def test_the_step_struct_is_laid_out_alike_in_c_and_python_or_the_kernel_is_refused(monkeypatch):
    """The decoding step's argument struct is mirrored by hand in rowdot.py (ctypes) and rowdot.c: the library
    reports its layout and load() compares them, so a field added, moved or retyped on one side refuses the kernel
    with the difference named instead of corrupting memory."""
    import ctypes

    _needs_kernel()
    lib = rowdot.library()
    assert rowdot.layout_mismatch(lib) is None  # the shipped pair agrees
    fields = list(rowdot.Step._fields_)

    def struct(new_fields):
        return type("Drifted", (ctypes.Structure,), {"_fields_": new_fields})

    retyped = [(n, ctypes.c_int if n == "N" else t) for n, t in fields]  # a long read as an int (padding follows)
    assert rowdot.layout_mismatch(lib, struct(retyped)) == "Step field 'N' takes bytes 8-15 in rowdot.c and 8-11 in rowdot.py"
    moved = [(n, ctypes.c_double if n == "eps" else t) for n, t in fields]  # every later field moves too
    assert rowdot.layout_mismatch(lib, struct(moved)).startswith("Step field 'eps' takes bytes 72-75 in rowdot.c")
    swapped = [fields[1], fields[0], *fields[2:]]
    assert rowdot.layout_mismatch(lib, struct(swapped)) == "Step field 0 is 'M' in rowdot.c and 'N' in rowdot.py"
    n = len(fields)
    assert rowdot.layout_mismatch(lib, struct(fields[:-1])) == f"Step has {n} fields in rowdot.c and {n - 1} in rowdot.py"
    padded = struct([*fields, ("extra", ctypes.c_long)])
    assert "fields in rowdot.c" in rowdot.layout_mismatch(lib, padded)
    # load() refuses a library whose layout differs, with the difference as its reason
    monkeypatch.setattr(rowdot, "_state", {})
    monkeypatch.setattr(rowdot, "layout_mismatch", lambda lib: "Step field 'N' takes bytes 8-15 in rowdot.c and 8-11")
    assert rowdot.load() is None and rowdot.step_function() is None
    assert "Step field 'N' takes bytes 8-15" in rowdot.why_not()
