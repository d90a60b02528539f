"""Quantized bases (bitsandbytes nf4/int8 through transformers) with LoRA adapters (peft), on the CPU: only the adapter
trains, the reference is the base with the adapter disabled, the speed levers keep working or step aside, exports
round-trip (merged and adapter alone) in a process that never imports this package, impossible combinations fail
with the keys named."""

import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from polopt_lightning import PolicyOptimizationModule, PromptDataModule
from polopt_lightning.accel import trace
from polopt_lightning.data import ArithmeticTask
from polopt_lightning.models import (
    Adapter,
    Quantization,
    apply_adapter,
    as_adapter,
    build_tiny_model,
    check_combination,
    is_quantized,
    prepare_policy,
    quantized_copy,
)
from polopt_lightning.optim import build_optimizer
from polopt_lightning.rewards import ExactMatchReward
from polopt_lightning.rollout import HFRolloutEngine, SamplingConfig
from polopt_lightning.step.logprobs import completion_logprobs, shared_prompt_completion_logprobs

pytest.importorskip("bitsandbytes", reason="bitsandbytes is a runtime dependency; these tests need it installed")
pytest.importorskip("peft", reason="peft is a runtime dependency; these tests need it installed")

TEXT = "12+34=46"


def distinct_chars(prompts, completions, **kw):
    """Varies between samples even for an untrained model, so every group has a learning signal."""
    return [float(len(set(c))) for c in completions]


def qlora(mode, tmp_path, seed=0, r=4):
    """A tiny Qwen2 (with q/k/v biases) quantized to ``mode`` and wrapped with LoRA; also returns its quantized base's
    folder (full-precision weights: reloading it quantized gives the same base)."""
    model, tok = build_tiny_model(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, seed=seed)
    base_dir = tmp_path / f"base_{mode}"
    policy = prepare_policy(model, Quantization(mode=mode), Adapter(kind="lora", r=r, alpha=2 * r), base_dir)
    tok.save_pretrained(base_dir)
    return policy, tok, base_dir


def data(tok, batch_size=2):
    train, val = ArithmeticTask(digits=1, train_size=40, val_size=8, seed=0).splits()
    return PromptDataModule(train=train, val=val, tokenizer=tok, batch_size=batch_size)


def module_for(policy, tok, objective="grpo", beta=0.04, **kwargs):
    settings = {"experience": {"num_generations": 4}, "update": {"mini_batches": 2}, "optimizer": {"lr": 1e-2}}
    for concern, given in settings.items():  # a dict given for a concern adds to these settings
        if isinstance(kwargs.get(concern), dict):
            kwargs[concern] = {**given, **kwargs[concern]}
    defaults = dict(reward_fns=[distinct_chars, ExactMatchReward()], generation={"max_new_tokens": 4}, **settings)
    return PolicyOptimizationModule(policy, tok, objective={"name": objective, "beta": beta}, **{**defaults, **kwargs})


def fit(module, tok, tmp_path, steps=4, **kwargs):
    settings = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", default_root_dir=str(tmp_path), **settings)
    trainer.fit(module, datamodule=data(tok))
    return trainer


def sequence_logprobs(model, tok, text=TEXT):
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]


@pytest.mark.parametrize("mode", ["nf4", "int8"])
@pytest.mark.parametrize("objective", ["grpo", "gspo"])
def test_quantized_lora_trains_only_the_adapter(mode, objective, tmp_path):
    policy, tok, _ = qlora(mode, tmp_path)
    module = module_for(policy, tok, objective)
    assert module.ref_model is None and module.shared_reference  # no second copy of the base
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    trainer = fit(module, tok, tmp_path)
    assert trainer.global_step == 4  # 2 rollouts x 2 mini-batches (off-policy: the ratio and the clip act)
    after = policy.state_dict()
    lora = [k for k in before if "lora_" in k]
    assert lora and any(not torch.equal(before[k], after[k]) for k in lora), "the adapter did not train"
    frozen = [k for k in before if "lora_" not in k]
    changed = [k for k in frozen if not torch.equal(before[k], after[k])]
    assert not changed, f"base weights changed: {changed[:3]}"  # quantized weights, their constants, norms, biases
    assert torch.isfinite(torch.tensor(float(trainer.logged_metrics["train/kl"])))


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_shared_reference_equals_the_base_model(mode, tmp_path):
    """Reference log-probs (the adapter disabled) equal those of the quantized base alone, after the adapter trained
    away from it (so the check is not trivially the policy's own)."""
    model, tok = build_tiny_model(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, seed=0)
    base = quantized_copy(model, Quantization(mode=mode))
    module = module_for(apply_adapter(quantized_copy(model, Quantization(mode=mode)), Adapter(kind="lora", r=4)),
                        tok)
    fit(module, tok, tmp_path, steps=2)
    batch = next(iter(data(tok).train_dataloader()))
    exp, _ = module.make_experience(batch)
    with torch.no_grad():
        reference = module.reference_logprobs(exp)
        base.train()  # the reference keeps the training kernels (bitsandbytes' int8 layers have others in eval)
        expected = completion_logprobs(base, exp.prompt_ids, exp.prompt_mask, exp.completion_ids,
                                       exp.completion_mask)[0]
        policy = module.scorer.logprobs(module.policy, exp, slice(None))[0]
    mask = exp.completion_mask.bool()
    torch.testing.assert_close(reference[mask], expected[mask], atol=1e-5, rtol=1e-5)
    assert (policy[mask] - reference[mask]).abs().max() > 1e-4, "the adapter did not move the policy"


def test_lora_without_quantization_shares_the_reference_and_keeps_the_base(tmp_path, tiny):
    model, tok = tiny
    policy = apply_adapter(model, Adapter(kind="lora", r=4))
    module = module_for(policy, tok)
    assert module.ref_model is None and module.shared_reference
    base = {k: v.clone() for k, v in policy.state_dict().items() if "lora_" not in k}
    fit(module, tok, tmp_path, steps=2)
    assert all(torch.equal(v, policy.state_dict()[k]) for k, v in base.items())


def test_the_modules_cpu_context_takes_the_four_bit_input_gradients_the_lora_gradients_unchanged(monkeypatch, tmp_path):
    """On the CPU the module's oneDNN context (``accel.onednn_linear``) is given its policy: a QLoRA policy's frozen nf4
    layers compute their input gradients through oneDNN (bitsandbytes' own backward: MKL). The adapter's gradients of
    a pass outside the context within float32 tolerance; the layers as before after it."""
    from polopt_lightning.accel.cpu import linear as cpu_linear

    monkeypatch.setattr(cpu_linear, "MIN_WEIGHT_ELEMENTS", 2**10)  # the tiny model's 64 x 64 weights count
    policy, tok, _ = qlora("nf4", tmp_path)
    with torch.no_grad():  # a non-zero adapter, so every layer's input gradient reaches a LoRA weight
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    module = module_for(policy, tok, accel={"onednn_linear": True})
    ids = tok(["1+2=", "3+4="], return_tensors="pt", padding=True)
    completions = torch.randint(3, 40, (2, 5))
    grads, ran = [], []
    for context in (lambda: module.accel.compute(module.policy, module.device), lambda: torch.enable_grad()):
        policy.zero_grad(set_to_none=True)
        with context(), trace.routes() as routes:
            logprobs = completion_logprobs(policy, ids["input_ids"], ids["attention_mask"], completions,
                                           torch.ones_like(completions))[0]
            logprobs.sum().backward()
        ran.append(routes["four_bit_input_grad"])
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
    import bitsandbytes as bnb

    layers = [m for m in policy.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 14 and not any(p.requires_grad for m in layers for p in m.parameters())
    # inside the fast path: every frozen 4-bit layer's input gradient through oneDNN but the first block's q/k/v,
    # whose input wants none; outside it: bitsandbytes' own backward
    assert len(ran[0]) == len(layers) - 3 and ran[1] == []
    assert not any("forward" in vars(m) for m in layers)
    assert grads[0].keys() == grads[1].keys() and all("lora_" in n for n in grads[0])
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_shared_prompt_passes_equal_the_plain_pass_on_quantized_lora(mode, tmp_path):
    policy, tok, _ = qlora(mode, tmp_path)
    policy.train()
    with torch.no_grad():  # a non-zero adapter, so its path counts
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    prompts = tok(["1+2=", "3+4="], return_tensors="pt", padding=True)
    G = 3
    p_ids, p_mask = prompts["input_ids"].repeat_interleave(G, 0), prompts["attention_mask"].repeat_interleave(G, 0)
    c_ids = torch.randint(3, 40, (6, 5))
    c_mask = torch.ones(6, 5, dtype=torch.long)
    c_mask[1, 3:] = 0
    group = torch.arange(2).repeat_interleave(G)
    plain = completion_logprobs(policy, p_ids, p_mask, c_ids, c_mask)[0]
    plain.sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad(set_to_none=True)
    shared = shared_prompt_completion_logprobs(policy, p_ids, p_mask, c_ids, c_mask, group)[0]
    shared.sum().backward()
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    assert grads and all(n.count("lora_") for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(dict(policy.named_parameters())[name].grad, grad, atol=1e-4, rtol=1e-4)


def test_sampler_runs_quantized_lora_layers_and_their_logprobs_are_reused_only_where_they_match(tmp_path):
    """The lean decoding step calls the model's own (LoRA-wrapped, quantized) modules: nf4 sampling log-probs equal
    a training forward's; int8 layers compute with int8 activations in eval mode, so the engine says they differ."""
    for mode, match in (("nf4", True), ("int8", False)):
        policy, tok, _ = qlora(mode, tmp_path)
        engine = HFRolloutEngine()
        prompts = tok(["1+2=", "33+4="], return_tensors="pt", padding=True)
        batch = engine.generate(policy, prompts["input_ids"], prompts["attention_mask"], 3,
                                SamplingConfig(max_new_tokens=4), tok.eos_token_id, tok.pad_token_id,
                                generator=torch.Generator().manual_seed(0))
        assert engine.logprobs_match(policy) is match
        policy.train()
        with torch.no_grad():
            fresh = completion_logprobs(policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                        batch.completion_mask)[0]
        mask = batch.completion_mask.bool()
        gap = (batch.sampling_logprobs[mask] - fresh[mask]).abs().max()
        if match:
            assert gap < 1e-4, gap
        for module in policy.modules():  # the repacking that broke training after eval-mode passes stays off
            state = getattr(getattr(module, "weight", None), "quant_state", None)
            assert not getattr(state, "packing_format_for_cpu", False)


def test_gradient_checkpointing_and_micro_batches_work_on_quantized_lora(tmp_path):
    policy, tok, _ = qlora("nf4", tmp_path)
    module = module_for(policy, tok, update={"gradient_checkpointing": True, "micro_batch_tokens": 24})
    lora = {k: v.clone() for k, v in policy.state_dict().items() if "lora_" in k}
    fit(module, tok, tmp_path, steps=2)
    assert any(not torch.equal(v, policy.state_dict()[k]) for k, v in lora.items())


def test_micro_batches_give_the_same_gradient_on_quantized_lora(tmp_path):
    grads = []
    for budget in (None, 16):
        torch.manual_seed(0)  # peft draws lora_A from the global generator
        policy, tok, _ = qlora("nf4", tmp_path)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        module = module_for(policy, tok, update={"micro_batch_tokens": budget})
        batch = next(iter(data(tok).train_dataloader()))
        exp, _ = module.make_experience(batch)
        with torch.no_grad():
            exp.ref_logprobs = module.reference_logprobs(exp)
        exp.old_logprobs = torch.zeros_like(exp.sampling_logprobs)  # filled by the pass (record_old)
        module.accumulate_gradients(exp, torch.arange(exp.completion_ids.shape[0]), record_old=True)
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4)


def test_rollout_dtype_steps_aside_for_a_quantized_policy_and_says_so_once(tmp_path):
    policy, tok, _ = qlora("nf4", tmp_path)
    engine = HFRolloutEngine(dtype="bfloat16")
    prompts = tok(["1+2="], return_tensors="pt")
    with pytest.warns(RuntimeWarning, match="rollout.dtype=bfloat16 is off: the policy is quantized"):
        engine.generate(policy, prompts["input_ids"], prompts["attention_mask"], 2, SamplingConfig(max_new_tokens=2),
                        tok.eos_token_id, tok.pad_token_id)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.generate(policy, prompts["input_ids"], prompts["attention_mask"], 2, SamplingConfig(max_new_tokens=2),
                        tok.eos_token_id, tok.pad_token_id)
    assert engine.sampling_model(policy) is policy


def test_quantized_reference_for_full_fine_tuning(tmp_path, tiny):
    model, tok = tiny
    module = module_for(model, tok, reference={"quantization": "nf4"}, optimizer={"lr": 1e-3})
    assert module.ref_model is not None and is_quantized(module.ref_model) and not module.shared_reference
    ref_before = {k: v.clone() for k, v in module.ref_model.state_dict().items()}
    trainer = fit(module, tok, tmp_path, steps=2)
    assert all(torch.equal(v, module.ref_model.state_dict()[k]) for k, v in ref_before.items())
    # the 4-bit reference differs from the full-precision policy from the first step (k3 is never negative: ">= 0"
    # would hold for a KL taken against the policy itself)
    assert 0 < float(trainer.logged_metrics["train/kl"]) < 1


ELSEWHERE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig


def merged(folder, quant):
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert "quantization_config" not in model.config.to_dict()
    return model


def adapter(folder, quant):
    from peft import PeftModel

    config = (BitsAndBytesConfig(load_in_8bit=True) if quant == "int8" else
              BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=torch.float32))
    spec = json.load(open(folder + "/adapter_config.json"))
    base = AutoModelForCausalLM.from_pretrained(spec["base_model_name_or_path"], quantization_config=config)
    model = PeftModel.from_pretrained(base, folder)
    model.train()  # the kernels the policy trained with (int8 layers compute otherwise in eval mode); no dropout here
    return model


out = []
for kind, folder, quant in json.loads(sys.argv[2]):
    model = {"merged": merged, "adapter": adapter}[kind](folder, quant)
    ids = AutoTokenizer.from_pretrained(folder)(sys.argv[1], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    out.append(torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0].tolist())
assert not any(m.startswith("polopt_lightning") for m in sys.modules), "polopt_lightning was imported"
print(json.dumps(out))
"""


def score_elsewhere(exports: list[tuple[str, Path]], quant: str) -> list[torch.Tensor]:
    """Each export's log-probs of TEXT, loaded by transformers (and peft) alone in one fresh process: ``exports`` are
    ``("merged" | "adapter", folder)``, an adapter's base quantized as ``quant``."""
    spec = json.dumps([(kind, str(folder), quant) for kind, folder in exports])
    proc = subprocess.run([sys.executable, "-c", ELSEWHERE, TEXT, spec], capture_output=True,
                          text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.tensor(lp) for lp in json.loads(proc.stdout.strip().splitlines()[-1])]


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_export_round_trips_merged_and_adapter_alone(mode, tmp_path):
    policy, tok, base_dir = qlora(mode, tmp_path)
    module = module_for(policy, tok)
    trainer = fit(module, tok, tmp_path, steps=2, enable_checkpointing=False)
    policy.train()  # the training kernels (dropout is off)
    live = sequence_logprobs(policy, tok)
    module.save_pretrained(tmp_path / "merged")
    module.save_pretrained(tmp_path / "adapter", merge=False)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        base_dir)
    # the same from a checkpoint, through the command line
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    for flags, folder in (([], "ckpt_merged"), (["--adapter-only"], "ckpt_adapter")):
        proc = subprocess.run([sys.executable, "-m", "polopt_lightning.export", str(tmp_path / "last.ckpt"),
                               str(tmp_path / folder), *flags], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    # each export loaded by transformers and peft alone (one process for the four): the policy's log-probs
    exports = [("merged", tmp_path / "merged"), ("adapter", tmp_path / "adapter"),
               ("merged", tmp_path / "ckpt_merged"), ("adapter", tmp_path / "ckpt_adapter")]
    for (kind, folder), scored in zip(exports, score_elsewhere(exports, mode)):
        torch.testing.assert_close(scored, live, atol=1e-4 if kind == "merged" else 1e-5, rtol=0, msg=str(folder))


def test_adapter_only_export_of_a_full_fine_tuning_checkpoint_is_refused(tmp_path, tiny):
    from polopt_lightning.export import export_checkpoint

    model, tok = tiny
    module = module_for(model, tok, beta=0.0, optimizer={"lr": 1e-3})
    trainer = fit(module, tok, tmp_path, steps=1, enable_checkpointing=False)
    trainer.save_checkpoint(tmp_path / "full.ckpt")
    with pytest.raises(ValueError, match="--adapter-only: .*full.ckpt holds a policy without an adapter"):
        export_checkpoint(tmp_path / "full.ckpt", tmp_path / "out", merge=False)


def test_impossible_combinations_name_their_keys(tmp_path, tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="quantization=nf4 needs an adapter.*adapter=lora"):
        check_combination(Quantization(mode="nf4"), Adapter())
    with pytest.raises(ValueError, match=r"quantization.mode must be one of .* got 'int4'"):
        Quantization(mode="int4")
    with pytest.raises(ValueError, match="quantization.compute_dtype must be one of"):
        Quantization(mode="nf4", compute_dtype="float64")
    with pytest.raises(ValueError, match="adapter.r must be >= 1, got 0"):
        as_adapter({"kind": "lora", "r": 0})
    with pytest.raises(ValueError, match="adapter.kind must be one of"):
        Adapter(kind="ia3")
    quantized = quantized_copy(model, Quantization(mode="nf4"))
    with pytest.raises(ValueError, match="has quantized weights and no adapter.*adapter=lora"):
        module_for(quantized, tok)
    policy = apply_adapter(quantized, Adapter(kind="lora", r=4))
    with pytest.raises(ValueError, match="reference.dtype='bfloat16' has nothing to act on: the policy has an adapter"):
        module_for(policy, tok, reference={"dtype": "bfloat16"})
    with pytest.raises(ValueError, match="reference.quantization='int8' has nothing to act on"):
        module_for(policy, tok, reference={"quantization": "int8"})
    with pytest.raises(ValueError, match="reference.quantization and reference.dtype both set"):
        module_for(build_tiny_model(hidden_size=32, num_layers=1, num_heads=2)[0], tok, reference={"quantization": "nf4", "dtype": "bfloat16"})
    with pytest.raises(ValueError, match="already has a peft adapter"):
        apply_adapter(policy, Adapter(kind="lora"))


def test_optimizer_factories(tmp_path, tiny):
    params = [torch.nn.Parameter(torch.randn(64, 64))]
    with pytest.raises(ValueError, match="optimizer.name=paged_adamw_8bit pages optimizer state through CUDA"):
        build_optimizer(params, name="paged_adamw_8bit")
    with pytest.raises(ValueError, match=r"optimizer.name must be one of .* got 'adafactor'"):
        build_optimizer(params, name="adafactor")
    assert build_optimizer(params).defaults["fused"] is True
    assert not build_optimizer(params, fused=False).defaults["fused"]
    # bitsandbytes' 8-bit AdamW on the CPU, through the module's factory argument
    from functools import partial

    import bitsandbytes as bnb

    policy, tok, _ = qlora("nf4", tmp_path)
    module = module_for(policy, tok, optimizer=partial(build_optimizer, name="adamw_8bit", lr=1e-2))
    lora = {k: v.clone() for k, v in policy.state_dict().items() if "lora_" in k}
    trainer = fit(module, tok, tmp_path, steps=2)
    assert isinstance(trainer.optimizers[0], bnb.optim.AdamW8bit)
    assert any(not torch.equal(v, policy.state_dict()[k]) for k, v in lora.items())
