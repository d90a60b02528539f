"""oneDNN linear layers on the CPU (polopt_lightning.accel.cpu.linear): the same values and gradients as F.linear within
float32 tolerance, only where they apply, and the module's rule for turning them on."""

import copy
import dataclasses
from contextlib import nullcontext

import pytest
import torch
from hydra.utils import instantiate
from torch.nn import functional as F

from polopt_lightning import PolicyOptimizationModule, PromptDataModule, lean_step
from polopt_lightning.accel import precision, trace
from polopt_lightning.accel.cpu import decode as cpu_decode
from polopt_lightning.accel.cpu import linear as cpu_linear
from polopt_lightning.confschema import option
from polopt_lightning.models import float_dtype
from polopt_lightning.rewards import ExactMatchReward
from polopt_lightning.rollout import HFRolloutEngine, SamplingConfig

from .helpers import close, greedy_on_the_modules, one_decoding_step, onednn_model, run_if

pytestmark = run_if("onednn")


def _products(ran, kernel: bool = False) -> list:
    """The weight shapes of the mode's oneDNN products in a :func:`trace.routes` record (``kernel``: and of its
    few-row kernel's)."""
    return ran["onednn_product"] + (ran["kernel_product"] if kernel else [])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("frozen", [False, True])
def test_values_and_gradients_match_f_linear(bias, frozen):
    torch.manual_seed(0)
    layer = torch.nn.Linear(512, 640, bias=bias)  # 327,680 weight elements: above the threshold
    layer.requires_grad_(not frozen)
    x = torch.randn(3, 5, 512, requires_grad=True)
    out = layer(x)
    (out.square() * torch.linspace(-1, 1, 640)).sum().backward()
    want = [out.detach(), x.grad.clone()] + ([] if frozen else [p.grad.clone() for p in layer.parameters()])
    x.grad = None
    layer.zero_grad(set_to_none=True)
    with cpu_linear.OneDNNLinear(), trace.routes() as ran:
        out = layer(x)
        (out.square() * torch.linspace(-1, 1, 640)).sum().backward()
    got = [out.detach(), x.grad] + ([] if frozen else [p.grad for p in layer.parameters()])
    assert len(_products(ran)) == (2 if frozen else 3)  # forward, input gradient (and the weight's: none when frozen)
    assert all(close(g, w) for g, w in zip(got, want))
    if frozen:
        assert layer.weight.grad is None


@pytest.mark.parametrize("rows, kernel", [(4, True), (16, True), (4, False), (17, True)])
def test_without_gradient_it_is_one_product_few_rows_on_the_kernel(rows, kernel):
    """No gradient wanted: one oneDNN product, or for at most 16 rows one call of the few-row kernel where it runs
    here, unless ``few_row_kernel(False)`` (the rollout's ``decode_kernel=False``)."""
    from polopt_lightning.accel.cpu import rowdot

    layer = torch.nn.Linear(512, 640)
    x = torch.randn(rows, 1, 512)
    expected = F.linear(x, layer.weight, layer.bias).detach()  # outside the mode: no product of its own counted
    with cpu_linear.OneDNNLinear(), torch.inference_mode(), trace.routes() as ran:
        with cpu_linear.few_row_kernel(kernel):
            out = layer(x)
        fits = rows <= rowdot.MAX_ROWS and rowdot.load() is not None
        takes = kernel and fits
        assert (ran["kernel_product"], ran["onednn_product"]) == (([(640, 512)], []) if takes else ([], [(640, 512)]))
        assert out.shape == (rows, 1, 640) and close(out, expected)
        layer(x)  # after the context the switch is back: the kernel where it fits
        assert len(ran["kernel_product"]) == takes + fits


@pytest.mark.parametrize("case", ["small", "bfloat16", "autocast", "vector", "double"])
def test_everything_else_runs_as_without_the_mode(case):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32) if case == "small" else torch.nn.Linear(512, 640)
    x = torch.randn(4, layer.in_features)
    if case == "bfloat16":
        layer, x = layer.bfloat16(), x.bfloat16()
    if case == "double":
        layer, x = layer.double(), x.double()
    if case == "vector":
        x = x[0]
    context = torch.autocast("cpu", dtype=torch.bfloat16) if case == "autocast" else nullcontext()
    with context:
        want = layer(x)
    with cpu_linear.OneDNNLinear(), context, trace.routes() as ran:
        got = layer(x)
    assert _products(ran, kernel=True) == [] and torch.equal(got, want)


def _rows():
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4)]]


def test_active_counts_this_threads_open_contexts():
    """Nested contexts, a context left by an exception, and another thread, which has its own mode stack."""
    import threading

    assert not cpu_linear.active()
    with cpu_linear.OneDNNLinear():
        with cpu_linear.OneDNNLinear():
            assert cpu_linear.active()
        assert cpu_linear.active()  # the outer one still holds
        seen = []
        thread = threading.Thread(target=lambda: seen.append(cpu_linear.active()))
        thread.start()
        thread.join()
        assert seen == [False]
    assert not cpu_linear.active()
    with pytest.raises(RuntimeError), cpu_linear.OneDNNLinear():
        raise RuntimeError("inside")
    assert not cpu_linear.active()


def test_module_turns_it_on_only_for_models_with_large_cpu_weights():
    def mode(model, tok, **kw):
        module = PolicyOptimizationModule(model, tok, reward_fns=[ExactMatchReward()], **kw)
        return module.accel.compute(module.policy, module.device)

    model, tok = instantiate(option("model", "tiny"), seed=0)  # the default job's model: every weight below 2**18 elements
    assert isinstance(mode(model, tok), nullcontext)
    assert isinstance(mode(model, tok, accel={"onednn_linear": True}), cpu_linear.OneDNNLinear)
    big, tok = onednn_model()
    assert isinstance(mode(big, tok), cpu_linear.OneDNNLinear)
    assert isinstance(mode(big, tok, accel={"onednn_linear": False}), nullcontext)


def test_onednn_linear_true_without_onednn_names_the_key(monkeypatch, tiny):
    monkeypatch.setattr(cpu_linear, "available", lambda: False)
    with pytest.raises(ValueError, match="accel.onednn_linear=True"):
        PolicyOptimizationModule(*tiny, reward_fns=[ExactMatchReward()], accel={"onednn_linear": True})
    with pytest.raises(ValueError, match=r"accel: unknown settings \['onednn'\]"):
        PolicyOptimizationModule(*tiny, reward_fns=[ExactMatchReward()], accel={"onednn": True})


def test_a_training_step_gives_the_same_loss_and_gradients(monkeypatch):
    """The rollout, reference pass and training pass of one step with oneDNN against without: the same tokens are
    scored (the rollout is given), the loss and every gradient within float32 tolerance."""
    model, tok = onednn_model()
    batch = next(iter(PromptDataModule(train=_rows(), tokenizer=tok, batch_size=2).train_dataloader()))
    results = {}
    for use in (False, True):
        module = PolicyOptimizationModule(copy.deepcopy(model), tok, objective={"name": "grpo", "beta": 0.04},
                                          reward_fns=[ExactMatchReward()], experience={"num_generations": 2}, accel={"onednn_linear": use},
                                          generation={"max_new_tokens": 4, "min_new_tokens": 4}, seed=0)
        with module.accel.compute(module.policy, module.device):
            assert cpu_linear.active() is use
            if use:
                given = results[False][0]  # the same rollout, scored again
                exp = dataclasses.replace(given, **{f.name: getattr(given, f.name).clone() for f in dataclasses.fields(given)
                                                    if isinstance(getattr(given, f.name), torch.Tensor)})
                exp.ref_logprobs = None
            else:
                exp, _ = module.make_experience(batch)
            exp.ref_logprobs = module.reference_logprobs(exp)
            metrics = module.accumulate_gradients(exp, torch.arange(exp.completion_ids.shape[0]))
        results[use] = (exp, metrics, {n: p.grad.clone() for n, p in module.policy.named_parameters()})
    (exp0, m0, g0), (exp1, m1, g1) = results[False], results[True]
    assert close(exp1.ref_logprobs, exp0.ref_logprobs)
    assert float(m1["loss"]) == pytest.approx(float(m0["loss"]), rel=1e-5, abs=1e-7)
    for name in g0:
        assert close(g1[name], g0[name], rel=1e-4), name


@pytest.mark.parametrize("padding_free", [False, True])
def test_checkpointed_layers_are_recomputed_through_the_same_products(padding_free):
    """``update.gradient_checkpointing`` on a model whose products go through oneDNN: the backward pass (where no
    torch-function mode is active) recomputes each layer through oneDNN again, as its forward ran, so torch's
    checkpoint finds the same saved tensors (it refused with "a different number of tensors was saved" before) and
    the gradients are those of the layers kept whole, to the bit."""
    from polopt_lightning.models import enable_gradient_checkpointing
    from polopt_lightning.step.logprobs import completion_logprobs, padding_free_logprobs

    g = torch.Generator().manual_seed(0)
    ids, c_ids = torch.randint(5, 60, (4, 6), generator=g), torch.randint(5, 60, (4, 9), generator=g)
    mask, c_mask = torch.ones_like(ids), torch.ones_like(c_ids)
    grads = []
    for checkpointing in (False, True):
        model, _ = onednn_model()
        model.train()
        if checkpointing:
            enable_gradient_checkpointing(model)
        with cpu_linear.OneDNNLinear(model), trace.routes() as ran:
            if padding_free:
                logp = padding_free_logprobs(model, ids, mask, c_ids, c_mask, torch.tensor([0, 0, 1, 1]))[0]
            else:
                logp = completion_logprobs(model, ids, mask, c_ids, c_mask)[0]
            (logp * torch.linspace(-1, 1, 9)).sum().backward()
        assert _products(ran)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


def test_decoding_under_the_mode_packs_the_body_in_onednns_layout_and_keeps_the_head():
    """Inside the mode, with the few-row kernel off (no AVX-512 or no compiler, or ``decode_kernel=False``), a float32
    model decodes on a copy of its body in oneDNN's blocked layout (one per weight, no MKL packing, no concatenation)
    and on its head as it is, with the plain decoding's tokens and log-probs."""
    model, tok, ids, mask, sampling, want = greedy_on_the_modules()
    base = lean_step.llama_like(model)
    with cpu_linear.OneDNNLinear(), trace.routes() as ran:
        assert cpu_decode.PackedProjections.supported(base) and cpu_decode.PackedProjections.onednn_float32(base)
        got = HFRolloutEngine(cpu={"decode_kernel": False}).generate(model, ids, mask, 2, sampling, tok.eos_token_id,
                                                            tok.pad_token_id)
        proj = cpu_decode.PackedProjections(base, 4, kernel=False)
    layer = model.model.layers[0]
    # every body weight on its own (q, k, v, o, gate, up, down), the head not at all
    shapes = [tuple(m.weight.shape) for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                               layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                                               layer.mlp.down_proj)]
    reordered = [weights for layout, weights in ran["prepack"] if layout == "onednn"]
    assert reordered[:7] == [[shape] for shape in shapes] and [tuple(model.lm_head.weight.shape)] not in reordered
    assert all(layout == "onednn" for layout, _ in ran["prepack"])  # no MKL packing
    assert proj.packed_head is None
    assert _products(ran)  # the products that are not packed (prefill, the head where it is large) went through the mode
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert close(got.sampling_logprobs, want.sampling_logprobs, rel=1e-4)
    # one decoding step's logits from the same cache: blocked layout against the modules
    with cpu_linear.OneDNNLinear():
        blocked, plain = (one_decoding_step(model, ids, packed=p, kernel=False) for p in (True, False))
    assert close(blocked, plain, rel=1e-5)


@pytest.mark.parametrize("flags,speedup", [((), 1.0), (("amx_bf16",), 5.0), (("avx512_bf16",), 0.75)],
                         ids=["no-native-bf16", "native-bf16", "amx-hidden"])
def test_under_autocast_the_fp32_policy_samples_itself_through_onednn_unless_the_cpu_has_bf16(flags, speedup,
                                                                                                monkeypatch, caplog):
    """A bf16-mixed step on the CPU: inside the mode, on a CPU without native bf16 products, the policy samples in
    fp32 with autocast off (faster than an emulated bf16 copy, without its memory); on a CPU with AMX or AVX512-BF16
    (stood in for here) it samples a bf16 copy, which reads half the bytes a token (1.5x faster rollouts at 0.5B on
    AMX), unless its bf16 products measure slower than float32's (an Intel core whose AMX is unavailable: 0.75x);
    outside the mode, or for the default tiny model, it gets the bf16 copy either way."""
    monkeypatch.setattr(precision, "cpu_bf16", lambda: flags)
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: speedup)
    native_bf16 = bool(flags) and speedup >= precision.BF16_CPU_MIN_SPEEDUP
    model, tok = onednn_model()
    ids = torch.tensor([tok("12+34=")["input_ids"]] * 2)
    mask = torch.ones_like(ids)
    sampling = SamplingConfig(max_new_tokens=3, min_new_tokens=3, temperature=0.0)
    plain = HFRolloutEngine().generate(model, ids, mask, 2, sampling, tok.eos_token_id, tok.pad_token_id)
    engine = HFRolloutEngine()
    caplog.set_level("INFO", logger="polopt_lightning.rollout.hf")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert engine.sampling_dtype(model) == torch.bfloat16  # no mode: the bf16 copy, as before
        with cpu_linear.OneDNNLinear(), trace.routes() as ran:
            assert not engine.logprobs_match(model)  # the training pass computes in bf16 either way
            if native_bf16:
                assert engine.sampling_dtype(model) == torch.bfloat16
                assert engine.sampling_model(model) is not model and engine.sampling_copy is not None
            else:
                assert engine.sampling_dtype(model) == torch.float32 and engine.sampling_model(model) is model
            got = engine.generate(model, ids, mask, 2, sampling, tok.eos_token_id, tok.pad_token_id)
    said = [r.getMessage() for r in caplog.records if r.name == "polopt_lightning.rollout.hf"]
    assert len(said) == 1, said  # once, however many rollouts
    assert ("bfloat16 copy of the policy (the training step's autocast dtype)" in said[0] if native_bf16
            else "float32 policy itself with autocast off (no native bfloat16 products on this CPU" in said[0])
    if native_bf16:
        assert float_dtype(engine.sampling_copy) == torch.bfloat16
        assert got.completion_ids.shape == plain.completion_ids.shape
        assert close(got.sampling_logprobs, plain.sampling_logprobs, rel=5e-2)  # bf16 rounding
        return
    assert _products(ran, kernel=True) and engine.sampling_copy is None  # through the mode (oneDNN, the few-row kernel), and no copy was made
    assert torch.equal(got.completion_ids, plain.completion_ids)
    assert close(got.sampling_logprobs, plain.sampling_logprobs, rel=1e-4)
