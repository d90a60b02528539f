"""benchmarks/decode_stream.py: the rollout's pieces add up to the rollout and every wrapper comes off again; the stream
measurement reads every weight of the model on the decoding kernel (where it runs here) and by a plain sum."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from .helpers.kernel import needs_kernel

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "decode_stream.py"
sys.path.insert(0, str(SCRIPT.parent))
spec = importlib.util.spec_from_file_location("decode_stream", SCRIPT)
decode_stream = importlib.util.module_from_spec(spec)
spec.loader.exec_module(decode_stream)


@pytest.fixture(scope="module")
def small():
    from polopt_lightning.models import build_tiny_model

    model, tok = build_tiny_model(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256,
                                  vocab_size=512, seed=0)
    return model.eval(), tok


@pytest.mark.parametrize("engine_args", [{}, {"fast_decode": False}], ids=["lean-step", "model-forward"])
def test_the_rollout_pieces_add_up_and_the_wrappers_come_off(small, engine_args):
    import polopt_lightning.rollout.hf as engine

    model, tok = small
    before = (torch.log_softmax, torch.softmax, engine.decode_step, engine.sample_tokens, type(model).forward)
    pieces = decode_stream.rollout_pieces(model, tok, rounds=2, engine_args=engine_args)
    assert (torch.log_softmax, torch.softmax, engine.decode_step, engine.sample_tokens, type(model).forward) == before
    assert all(len(v) == 2 for v in pieces.values())
    for r in range(2):
        parts = [pieces[k][r] for k in ("prefill", "decode", "draw", "rest")]
        assert sum(parts) == pytest.approx(pieces["rollout"][r])
        assert min(parts[:3]) > 0  # each piece was seen: the prefill, 15 decoding steps, 16 draws
        if engine_args:  # 15 decoding steps through the model's own forward count as decoding, not as the prefill
            assert parts[1] > parts[0]


def test_the_stream_reads_every_weight_on_the_kernel_and_by_a_sum(small):
    from polopt_lightning.accel.cpu import rowdot

    model, _ = small
    with torch.inference_mode():
        rates = decode_stream.stream(model, rounds=2)
    if rowdot.load() is None:
        assert isinstance(rates, str) and rowdot.why_not() in rates
        needs_kernel()  # skips where this machine cannot run the kernel, fails where it should have loaded
    assert set(rates) == {"kernel", "sum"} and all(len(v) == 2 and min(v) > 0 for v in rates.values())


def test_the_stream_reads_an_adapter_models_frozen_base_weights():
    from polopt_lightning.models import Adapter, Quantization, build_tiny_model, prepare_policy

    needs_kernel()  # skips where this machine cannot run the kernel, fails where it should have loaded
    model, _ = build_tiny_model(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256,
                                vocab_size=512, seed=0)
    policy = prepare_policy(model, Quantization(mode="none"), Adapter(kind="lora", r=4, alpha=8))
    with torch.inference_mode():
        rates = decode_stream.stream(policy, rounds=1)
    assert isinstance(rates, dict) and min(rates["kernel"]) > 0
    policy.get_base_model().model.layers[0].mlp.down_proj.base_layer = torch.nn.Identity()  # not a weight it reads
    assert "not plain float32 weights" in decode_stream.stream(policy, rounds=1)
