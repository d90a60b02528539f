"""Sampling in another precision (a bf16 copy of the policy) and the compiled static-shape decoding step."""

import copy

import lightning as L
import pytest
import torch

from polopt_lightning import PolicyOptimizationModule, PromptDataModule, models
from polopt_lightning.models import build_tiny_model, cast_weights
from polopt_lightning.rollout import HFRolloutEngine, SamplingConfig
from polopt_lightning.step.logprobs import completion_logprobs
from tests.helpers import distinct_chars


def _prompts(tok, texts):
    enc = tok(texts, padding=True, return_tensors="pt")
    return enc.input_ids, enc.attention_mask


def test_bf16_sampler_is_a_copy_that_follows_the_policy(tiny):
    model, tok = tiny
    engine = HFRolloutEngine(dtype="bfloat16")
    sampler = engine.sampling_model(model)
    assert sampler is not model and not engine.logprobs_match(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the policy is untouched
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in sampler.parameters())
    # buffers keep their precision (rotary frequencies in bf16 would shift every position)
    assert all(b.dtype == bb.dtype for b, bb in zip(model.buffers(), sampler.buffers()))

    def synced():
        return all(torch.equal(s, p.detach().to(torch.bfloat16))
                   for s, p in zip(engine.sampling_model(model).parameters(), model.parameters()))

    assert synced()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)  # an in-place update, as in training
    model(input_ids=torch.tensor([[3, 4, 5]])).logits.sum().backward()
    optimizer.step()
    assert not all(torch.equal(s, p.detach().to(torch.bfloat16)) for s, p in zip(sampler.parameters(),
                                                                                    model.parameters()))
    assert synced() and engine.sampling_model(model) is sampler  # refreshed in place, not copied again
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    assert synced()


def test_a_released_sampling_copy_samples_the_same_and_holds_no_weights_between_rollouts(tiny):
    """``release_copy``: the copy's weights are freed after each rollout and cast afresh at the next one, tokens and
    log-probs the same bits as with the copy kept; the 256 MiB rule keeps a small copy."""
    model, tok = tiny
    ids, mask = _prompts(tok, ["12+34=", "5+6="])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    engines = {True: HFRolloutEngine(dtype="bfloat16", release_copy=True),
               False: HFRolloutEngine(dtype="bfloat16", release_copy=False)}
    for step in range(2):
        outs = {key: e.generate(model, ids, mask, 3, SamplingConfig(max_new_tokens=5), tok.eos_token_id,
                                tok.pad_token_id, torch.Generator().manual_seed(step)) for key, e in engines.items()}
        assert torch.equal(outs[True].completion_ids, outs[False].completion_ids)
        assert torch.equal(outs[True].sampling_logprobs, outs[False].sampling_logprobs)
        released = engines[True]._sampler[1]
        assert all(p.numel() == 0 and p.dtype == torch.bfloat16 for p in released.parameters())
        assert all(p.numel() > 0 for p in engines[False]._sampler[1].parameters())
        model(input_ids=torch.tensor([[3, 4, 5]])).logits.sum().backward()  # the policy moves between rollouts
        optimizer.step()
        optimizer.zero_grad()
    assert engines[True].sampling_model(model) is released  # the same modules, weights cast afresh
    assert all(torch.equal(s, p.detach().to(torch.bfloat16)) for s, p in zip(released.parameters(),
                                                                              model.parameters()))
    auto = HFRolloutEngine(dtype="bfloat16")  # None: a copy under 256 MiB is kept
    auto.generate(model, ids, mask, 2, SamplingConfig(max_new_tokens=2), tok.eos_token_id, tok.pad_token_id)
    assert all(p.numel() > 0 for p in auto._sampler[1].parameters())


def test_a_copy_in_another_dtype_is_cast_into_one_aligned_block_without_a_full_precision_copy(tiny, monkeypatch):
    """``frozen_copy(..., dtype)`` (the sampling copy, a reference in its own dtype) casts straight from the policy's
    weights into one block, every weight on a cache line, tied weights tied; a released sampling copy is cast afresh
    the same way. One block freed at once is what lets the training pass reuse it (a copy freed weight by weight
    slowed the next training pass at 0.5B: docs/performance.md)."""
    model, tok = tiny
    deep_copied = []
    real = torch.nn.Parameter.__deepcopy__
    monkeypatch.setattr(torch.nn.Parameter, "__deepcopy__",
                        lambda self, memo: deep_copied.append(self.shape) or real(self, memo))

    def one_block(copy_):
        params = list(copy_.parameters())
        return (len({p.untyped_storage().data_ptr() for p in params}) == 1
                and all(p.data_ptr() % models.BLOCK_ALIGN == 0 for p in params))

    ref = models.frozen_copy(model, torch.bfloat16, "reference.dtype")
    assert not deep_copied and one_block(ref)  # no weight went through deepcopy in float32
    assert ref.lm_head.weight is ref.get_input_embeddings().weight  # tied as in the policy
    assert all(torch.equal(r, p.detach().to(torch.bfloat16)) for r, p in zip(ref.parameters(), model.parameters()))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert one_block(models.frozen_copy(model)) is False and deep_copied  # without a dtype: a plain deep copy

    engine = HFRolloutEngine(dtype="bfloat16", release_copy=True)
    ids, mask = _prompts(tok, ["12+34="])
    for _ in range(2):
        engine.generate(model, ids, mask, 2, SamplingConfig(max_new_tokens=2), tok.eos_token_id, tok.pad_token_id)
        with torch.no_grad():
            model.lm_head.weight.add_(0.01)
    sampler = engine.sampling_model(model)  # cast afresh after its release
    assert one_block(sampler) and sampler.lm_head.weight is sampler.get_input_embeddings().weight
    assert all(torch.equal(s, p.detach().to(torch.bfloat16)) for s, p in zip(sampler.parameters(),
                                                                              model.parameters()))


def test_bf16_sampling_logprobs_are_close_to_the_fp32_forward(tiny):
    model, tok = tiny
    ids, mask = _prompts(tok, ["12+34=", "5+6="])
    out = HFRolloutEngine(dtype=torch.bfloat16).generate(model, ids, mask, 4, SamplingConfig(max_new_tokens=6),
                                                         tok.eos_token_id, tok.pad_token_id,
                                                         torch.Generator().manual_seed(0))
    assert out.sampling_logprobs.dtype == torch.float32
    fresh, _ = completion_logprobs(model, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
    m = out.completion_mask.bool()
    gap = (fresh[m] - out.sampling_logprobs[m]).abs()
    assert gap.max() < 0.1 and gap.max() > 0  # bf16 rounding, not another model
    assert next(model.parameters()).dtype == torch.float32 and model.training is True


def test_rollout_dtype_rejects_bad_values_and_quantized_weights(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="rollout.dtype must be one of"):
        HFRolloutEngine(dtype="int8")
    quantized = copy.deepcopy(model)
    quantized.model.norm.register_parameter("codes", torch.nn.Parameter(torch.zeros(2, dtype=torch.uint8),
                                                                        requires_grad=False))
    # a quantized policy has no floating-point copy to sample with: the lever steps aside and says so (once)
    engine = HFRolloutEngine(dtype="bfloat16")
    with pytest.warns(RuntimeWarning, match="rollout.dtype=bfloat16 is off: the policy is quantized"):
        assert engine.sampling_model(quantized) is quantized
    with pytest.raises(ValueError, match=r"ref_dtype=torch.bfloat16 needs .* model\.norm\.codes is torch\.uint8"):
        cast_weights(quantized, torch.bfloat16, "ref_dtype")
    with pytest.raises(ValueError, match="has quantized weights and no adapter: they cannot be trained"):
        PolicyOptimizationModule(quantized, tok, objective={"name": "grpo", "beta": 0.1}, reference={"dtype": "bf16"},
                                 reward_fns=[distinct_chars])
    with pytest.raises(ValueError, match="reference.dtype must be one of"):
        PolicyOptimizationModule(model, tok, objective={"name": "grpo", "beta": 0.1}, reference={"dtype": "half-ish"},
                                 reward_fns=[distinct_chars])
    def reward(prompts, completions, **kw):
        return [0.0] * len(prompts)

    # the backend by name or as a dict of its arguments; a wrong one names the argument
    module = PolicyOptimizationModule(model, tok, reward_fns=[reward], rollout_engine={"name": "hf", "dtype": "bf16"})
    assert isinstance(module.engine, HFRolloutEngine) and module.engine.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"rollout_engine: unknown rollout backend 'sglang'; known: \['hf', 'server', 'vllm'\]"):
        PolicyOptimizationModule(model, tok, reward_fns=[reward], rollout_engine="sglang")
    with pytest.raises(ValueError, match="rollout_engine must be a RolloutEngine"):
        PolicyOptimizationModule(model, tok, reward_fns=[reward], rollout_engine=42)


@pytest.mark.parametrize("rollout_dtype,mini_batches,num_iterations", [(None, 3, 2), ("bfloat16", 3, 2),
                                                                         ("bfloat16", 1, 3)])
def test_off_policy_old_logprobs_are_the_policy_before_the_first_step(tmp_path, tiny, arithmetic_rows, rollout_dtype,
                                                                      mini_batches, num_iterations):
    """With a pass (bf16 sampling, or reuse off), every row's old log-probs are the pre-update policy's: the first
    mini-batch records its own during its update, the others come from one no-grad pass."""
    model, tok = tiny
    module = PolicyOptimizationModule(model, tok, objective="gspo", reward_fns=[distinct_chars], experience={"num_generations": 4},
                                      update={"mini_batches": mini_batches, "num_iterations": num_iterations, "reuse_sampling_logprobs": False}, generation={"max_new_tokens": 4}, optimizer={"lr": 1e-2},
                                      rollout_engine={"dtype": rollout_dtype}, seed=1)
    captured = {}
    make_experience, accumulate = module.make_experience, module.updater.accumulate

    def spy_experience(batch):
        exp, metrics = make_experience(batch)
        captured.setdefault("exp", exp)
        captured.setdefault("before", copy.deepcopy(module.policy))
        return exp, metrics

    def spy_accumulate(exp, rows, record_old=False):
        captured.setdefault("calls", []).append(record_old)
        return accumulate(exp, rows, record_old)

    module.make_experience, module.updater.accumulate = spy_experience, spy_accumulate
    dm = PromptDataModule(train=arithmetic_rows[0], val=arithmetic_rows[1], tokenizer=tok, batch_size=3)
    settings = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
    L.Trainer(limit_val_batches=1, **settings).validate(module, datamodule=dm, verbose=False)  # bf16 copy made here,
    # under inference mode
    L.Trainer(max_steps=6, limit_val_batches=0, **settings).fit(module, datamodule=dm)
    per_rollout = mini_batches * num_iterations  # optimizer steps; the first of each rollout records, the rest read
    assert captured["calls"] == ([True] + [False] * (per_rollout - 1)) * (6 // per_rollout)
    assert rollout_dtype is None or module.engine.sampling_copy is not None
    exp = captured["exp"]
    with torch.no_grad():
        expected, _ = completion_logprobs(captured["before"].train(), exp.prompt_ids, exp.prompt_mask,
                                          exp.completion_ids, exp.completion_mask)
    m = exp.completion_mask.bool()
    torch.testing.assert_close(exp.old_logprobs[m], expected[m], atol=1e-5, rtol=1e-5)
    assert not any(torch.equal(a, b) for a, b in zip(captured["before"].parameters(), module.policy.parameters()))


def test_compiled_decode_step_samples_what_the_eager_one_does():
    model, tok = build_tiny_model(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0)
    ids, mask = _prompts(tok, ["12+34=", "5+6="])  # left padding: the static mask must close it
    sampling = SamplingConfig(max_new_tokens=6)
    eager, compiled = HFRolloutEngine(), HFRolloutEngine(compile=True)

    def both():
        return [engine.generate(model, ids, mask, 3, sampling, tok.eos_token_id, tok.pad_token_id,
                                torch.Generator().manual_seed(0)) for engine in (eager, compiled)]

    for _ in range(2):  # the second round after a weight update: the compiled step reads the live weights
        a, b = both()
        assert torch.equal(a.completion_ids, b.completion_ids)
        torch.testing.assert_close(b.sampling_logprobs, a.sampling_logprobs, atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))


def test_bf16_reference_gives_the_kl_term_within_rounding(tmp_path, tiny, arithmetic_rows):
    model, tok = tiny
    kwargs = dict(objective={"name": "grpo", "beta": 0.1}, reward_fns=[distinct_chars],
                  experience={"num_generations": 4}, generation={"max_new_tokens": 4}, seed=1)
    module = PolicyOptimizationModule(model, tok, reference={"dtype": "bfloat16"}, **kwargs)
    assert all(p.dtype == torch.bfloat16 for p in module.ref_model.parameters())
    assert all(p.dtype == torch.float32 for p in module.policy.parameters())
    enc = tok(["12+34=", "5+6="], padding=True, return_tensors="pt")
    exp, _ = module.make_experience({"prompt_ids": enc.input_ids, "prompt_mask": enc.attention_mask,
                                     "prompts": ["12+34=", "5+6="], "columns": {}})
    with torch.no_grad():
        half = module.scorer.logprobs(module.ref_model, exp, slice(None))[0]
        full = module.scorer.logprobs(model, exp, slice(None))[0]  # the policy has not moved: same weights
    m = exp.completion_mask.bool()
    assert 0 < (half[m] - full[m]).abs().max() < 0.1
    given = copy.deepcopy(model)
    assert PolicyOptimizationModule(model, tok, ref_model=given, reference={"dtype": "bf16"}, **kwargs).ref_model is given
    assert next(given.parameters()).dtype == torch.bfloat16  # cast in place, as documented


def test_under_autocast_sampling_uses_a_copy_in_the_autocast_dtype(tiny):
    """A mixed-precision trainer runs the rollout under autocast: an fp32 policy samples through a bf16 copy with
    autocast off (autocast would cast every weight at every token), and ``rollout_dtype=float32`` opts out."""
    model, tok = tiny
    ids, mask = _prompts(tok, ["12+34=", "5+6="])
    sampling = SamplingConfig(max_new_tokens=6)

    def sample(engine):
        return engine.generate(model, ids, mask, 3, sampling, tok.eos_token_id, tok.pad_token_id,
                               torch.Generator().manual_seed(0))

    engine = HFRolloutEngine()
    assert engine.sampling_dtype(model) is None and engine.logprobs_match(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert engine.sampling_dtype(model) == torch.bfloat16 and not engine.logprobs_match(model)
        sampler = engine.sampling_model(model)
        assert sampler is not model and all(p.dtype == torch.bfloat16 for p in sampler.parameters())
        mixed = sample(engine)
        full = sample(HFRolloutEngine(dtype="float32"))
        assert not HFRolloutEngine(dtype="float32").logprobs_match(model)  # training computes in bf16
    assert engine.sampling_model(model) is model  # outside autocast the policy samples itself again
    half, plain = sample(HFRolloutEngine(dtype="bfloat16")), sample(HFRolloutEngine())
    assert torch.equal(mixed.completion_ids, half.completion_ids)
    assert torch.equal(mixed.sampling_logprobs, half.sampling_logprobs)
    assert torch.equal(full.completion_ids, plain.completion_ids)  # fp32 with autocast off inside
    assert torch.equal(full.sampling_logprobs, plain.sampling_logprobs)


def test_bf16_mixed_trainer_fits_off_policy_with_gradient_clipping(tmp_path, tiny, arithmetic_rows):
    """Lightning's mixed-precision plugin refuses to clip the gradients of a fused optimizer; under bf16-mixed (no
    loss scaler) the module clips in place, so it keeps the fused AdamW, and the rollout samples through the bf16
    copy."""
    model, tok = tiny
    before = copy.deepcopy(model)
    module = PolicyOptimizationModule(model, tok, objective="gspo", reward_fns=[distinct_chars], experience={"num_generations": 4},
                                      update={"mini_batches": 2, "max_grad_norm": 1.0}, generation={"max_new_tokens": 4}, optimizer={"lr": 1e-2}, seed=1)
    dm = PromptDataModule(train=arithmetic_rows[0], tokenizer=tok, batch_size=2)
    trainer = L.Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 4
    assert trainer.optimizers[0].defaults.get("fused")
    assert module.engine.sampling_copy is not None and next(module.engine.sampling_copy.parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in module.policy.parameters())
    assert not any(torch.equal(a, b) for a, b in zip(before.parameters(), module.policy.parameters()))
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


@pytest.mark.parametrize("precision,dtype,expected", [("bf16-mixed", None, torch.bfloat16),
                                                       ("bf16-mixed", "float32", torch.float32),
                                                       ("32-true", None, torch.float32)])
def test_under_bf16_mixed_the_reference_copy_holds_bf16_weights_unless_told(tmp_path, tiny, arithmetic_rows, precision,
                                                                            dtype, expected):
    """The frozen reference copy made by the module follows bf16-mixed (its products are bf16 under autocast anyway:
    half the memory, no cast of every weight each pass); `reference.dtype=float32` keeps it, and float32 training
    leaves it as it is."""
    model, tok = tiny
    module = PolicyOptimizationModule(model, tok, objective={"name": "grpo", "beta": 0.04}, reward_fns=[distinct_chars],
                                      experience={"num_generations": 2}, generation={"max_new_tokens": 4},
                                      reference={"dtype": dtype}, seed=1)
    dm = PromptDataModule(train=arithmetic_rows[0], tokenizer=tok, batch_size=2)
    trainer = L.Trainer(accelerator="cpu", precision=precision, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, datamodule=dm)
    assert {p.dtype for p in module.ref_model.parameters()} == {expected}
    assert all(p.dtype == torch.float32 for p in module.policy.parameters())
    assert torch.isfinite(trainer.callback_metrics["train/kl"])


def test_the_optimizer_is_unfused_where_lightning_clips(tiny):
    """A loss scaler (16-mixed) or sharded gradients clip through Lightning, which refuses a fused optimizer: the rule,
    then the optimizer a module attached to a bf16-mixed Trainer builds (clipped in place: fused)."""
    from types import SimpleNamespace

    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    from polopt_lightning.step.loop import clips_in_place

    model, tok = tiny
    for scaler, mesh, in_place in ((None, None, True), (object(), None, False), (None, object(), False)):
        plugin = MixedPrecision("bf16-mixed", "cpu")
        plugin.scaler = scaler
        assert clips_in_place(SimpleNamespace(precision_plugin=plugin, strategy=None), model, mesh) is in_place
    assert clips_in_place(None, model)
    module = PolicyOptimizationModule(model, tok, reward_fns=[distinct_chars], update={"max_grad_norm": 1.0})
    module.trainer = L.Trainer(precision="bf16-mixed", accelerator="cpu", max_steps=4, logger=False)
    assert module.configure_optimizers()["optimizer"].defaults.get("fused") is True


def test_a_backend_hears_of_every_optimizer_step_and_samples_the_updated_policy(tmp_path, tiny, arithmetic_rows):
    """The interface's contract as a backend with weights of its own sees it: `policy_updated` after each optimizer
    step (4 steps of 2 mini-batches: 4 calls, each after the weights moved), then the next rollout."""
    from tests.helpers import make, trainer

    class Recording(HFRolloutEngine):
        def __init__(self):
            super().__init__()
            self.events, self.last = [], None

        def generate(self, model, *args, **kwargs):
            self.events.append("generate")
            return super().generate(model, *args, **kwargs)

        def policy_updated(self, model):
            weights = torch.cat([p.detach().flatten() for p in model.parameters()])
            self.events.append("updated" if self.last is None or not torch.equal(weights, self.last) else "unchanged")
            self.last = weights.clone()

    engine = Recording()
    module, dm = make(tiny, arithmetic_rows, update={"mini_batches": 2}, rollout_engine=engine, optimizer={"lr": 1e-2})
    trainer(tmp_path, 4, limit_val_batches=0).fit(module, datamodule=dm)
    assert engine.events == ["generate", "updated", "updated"] * 2
