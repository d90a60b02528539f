"""Generation servers (``polopt-serve``, ``rollout=server``): the weights a server samples with are the trainer's after
every push, prompts spread over several servers, and a server that dies or stops answering is an error naming it
within the time limit, with the run's checkpoints kept."""

from __future__ import annotations

import re
import socket
import threading
import time

import lightning as L
import pytest
import torch

from polopt_lightning.models import build_tiny_model
from polopt_lightning.rollout import HFRolloutEngine, SamplingConfig, build_engine
from polopt_lightning.rollout.wire import ServerError, buckets, call, pack, tensor_layout, unpack

from .helpers import free_port, make, run_if, start_server


@pytest.fixture
def servers(request):
    """``request.param`` generation servers (transformers backend), killed after the test."""
    ports = [free_port() for _ in range(request.param)]
    procs = [start_server(port, "--threads", "1") for port in ports]
    yield [f"127.0.0.1:{port}" for port in ports], procs
    for proc in procs:
        proc.kill()
        proc.wait()


def prompts(tok):
    enc = tok(["12+34=", "7*8=", "9-1=", "5+5="], return_tensors="pt", padding=True, padding_side="left")
    return enc.input_ids, enc.attention_mask


def local(model, tok, ids, mask, sampling, generator=None):
    return HFRolloutEngine().generate(model, ids, mask, 2, sampling, tok.eos_token_id, tok.pad_token_id,
                                      generator=generator)


def moved(model, seed):
    """Every weight moved by noise (as optimizer steps move them)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


@pytest.mark.parametrize("servers", [1, pytest.param(2, marks=pytest.mark.slow)], indirect=True,
                         ids=["one-server", "two-servers"])  # two servers: in -m slow (the default suite's time)
def test_the_servers_sample_with_the_trainers_weights_after_every_push(servers, tmp_path):
    addresses, _ = servers
    model, tok = build_tiny_model(hidden_size=64, num_layers=2, seed=0)
    engine = build_engine({"name": "server", "servers": addresses, "timeout_s": 60, "bucket_mib": 0.01})
    ids, mask = prompts(tok)
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0)
    for push in range(1, 4):
        got = engine.generate(model, ids, mask, 2, greedy, tok.eos_token_id, tok.pad_token_id)
        want = local(model, tok, ids, mask, greedy)
        assert engine.version == push and engine.last_versions == [push] * 8
        assert torch.equal(got.completion_ids, want.completion_ids), push
        assert torch.equal(got.completion_mask, want.completion_mask) and torch.equal(got.finished, want.finished)
        assert torch.allclose(got.sampling_logprobs, want.sampling_logprobs, atol=1e-5)
        assert torch.equal(got.prompt_ids, ids.repeat_interleave(2, 0))
        moved(model, push)
        engine.policy_updated(model)
    # sampled: the same seed gives the same rollouts (each server's share seeded from the trainer's generator)
    warm = SamplingConfig(max_new_tokens=8, temperature=1.0)
    first, second = (engine.generate(model, ids, mask, 2, warm, tok.eos_token_id, tok.pad_token_id,
                                     generator=torch.Generator().manual_seed(7)) for _ in range(2))
    assert torch.equal(first.completion_ids, second.completion_ids)
    assert engine.version == 4  # no push without an optimizer step


@pytest.mark.parametrize("servers", [1], indirect=True)
@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_a_lora_policy_sends_its_base_once_then_only_its_adapters(servers, quantization):
    """Adapter-only sync: the first push carries the base and the adapters, the next ones the adapters alone (a small
    share of the bytes); the server's weights sample the trainer's greedy tokens after each (a float base: the
    adapters merged into it; a 4-bit base: held packed as the trainer holds it, in fewer bytes than the float
    weights, the adapters beside it); with ``adapter_only=false`` every push carries the merged weights (refused for a
    quantized base, which has no plain form)."""
    from polopt_lightning.models import Adapter, Quantization, apply_adapter, quantized_copy

    addresses, _ = servers
    base, tok = build_tiny_model(hidden_size=64, num_layers=2, seed=0)
    full = sum(p.numel() * p.element_size() for p in base.parameters())
    if quantization != "none":
        base = quantized_copy(base, Quantization(mode=quantization))
    model = apply_adapter(base, Adapter(kind="lora", r=4, alpha=8.0)).eval()
    ids, mask = prompts(tok)
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0)
    engine = build_engine({"name": "server", "servers": addresses, "timeout_s": 60})
    sizes = []
    for push in range(1, 4):
        got = engine.generate(model, ids, mask, 2, greedy, tok.eos_token_id, tok.pad_token_id)
        want = local(model, tok, ids, mask, greedy)
        assert torch.equal(got.completion_ids, want.completion_ids), push
        assert torch.allclose(got.sampling_logprobs, want.sampling_logprobs, atol=1e-4)
        sizes.append(engine.last_push_bytes)
        gen = torch.Generator().manual_seed(push)
        with torch.no_grad():  # the adapters move (B starts at zero: the first push's merge changes nothing)
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.3)
        engine.policy_updated(model)
    adapters = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    assert sizes[1] == sizes[2] == adapters < full / 10, (sizes, full)
    health = call(f"http://{addresses[0]}", "/health", None, 5.0, "the server")
    if quantization == "none":
        assert sizes[0] >= full + adapters and health["quantization"] is None, (sizes, full, health)
    else:  # the linear layers' 4-bit bytes, not their float values
        # the policy's own tensors (its adapters included), the head tied to the embeddings sent once
        held = sum(t.numel() * t.element_size() for k, t in base.state_dict().items() if k != "lm_head.weight")
        assert sizes[0] == held < full and health["quantization"] == quantization, (sizes, full, held, health)
    merged = build_engine({"name": "server", "servers": addresses, "timeout_s": 60, "adapter_only": False})
    if quantization != "none":
        with pytest.raises(ValueError, match=r"rollout=server with rollout\.adapter_only=false .*QLoRA policy samples "
                                             r"on servers with rollout\.adapter_only=null"):
            merged.push(model)
        return
    merged.generate(model, ids, mask, 2, greedy, tok.eos_token_id, tok.pad_token_id)
    assert merged.last_push_bytes >= full  # the merged weights (tied embeddings once)
    plain, _ = build_tiny_model(hidden_size=64, num_layers=2, seed=0)
    with pytest.raises(ValueError, match=r"rollout\.adapter_only=true: the policy is not a plain LoRA policy"):
        build_engine({"name": "server", "servers": addresses, "adapter_only": True}).push(plain)


@pytest.mark.vllm
@run_if("vllm")
def test_a_vllm_server_samples_with_the_trainers_weights_after_every_push():
    """``polopt-serve --backend vllm``: greedy tokens equal the transformers backend's in the trainer, before and after
    the policy moves (vLLM's own kernels: its log-probs within 1e-4)."""
    port = free_port()
    proc = start_server(port, "--backend", "vllm", "--set", "kv_cache_gib=1", "--threads", "1")
    try:
        model, tok = build_tiny_model(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256, seed=3)
        engine = build_engine({"name": "server", "servers": f"127.0.0.1:{port}", "timeout_s": 300})
        ids, mask = prompts(tok)
        greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
        seen = []
        for push in (1, 2):
            got = engine.generate(model, ids, mask, 1, greedy, tok.eos_token_id, tok.pad_token_id)  # vLLM: n=1 greedy
            want = HFRolloutEngine().generate(model, ids, mask, 1, greedy, tok.eos_token_id, tok.pad_token_id)
            width = got.completion_ids.shape[1]
            assert engine.last_versions == [push] * 4
            assert torch.equal(got.completion_ids * got.completion_mask,
                               (want.completion_ids * want.completion_mask)[:, :width]), push
            assert torch.allclose(got.sampling_logprobs, want.sampling_logprobs[:, :width], atol=1e-4)
            seen.append(got.completion_ids)
            moved(model, push)
            engine.policy_updated(model)
        assert not torch.equal(seen[0], seen[1])
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("servers", [1], indirect=True)
@pytest.mark.parametrize("staleness", [0, 1])
def test_a_server_killed_mid_run_is_a_named_error_and_the_checkpoints_survive(servers, tiny, arithmetic_rows,
                                                                             tmp_path, staleness):
    """Also with the pipeline: the exception checkpoint is written with the rollout in flight."""
    from polopt_lightning.callbacks import ExceptionCheckpoint

    addresses, (proc,) = servers

    class KillAfterTwo(L.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            if trainer.global_step == 2:
                proc.kill()
                proc.wait()

    module, dm = make(tiny, arithmetic_rows, rollout_engine={"name": "server", "servers": addresses, "timeout_s": 20},
                      experience={"max_staleness": staleness})
    saves = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    fit = L.Trainer(max_steps=4, accelerator="cpu", logger=False,
                    callbacks=[saves, KillAfterTwo(), ExceptionCheckpoint(tmp_path / "ckpt")],
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    start = time.monotonic()
    with pytest.raises(ServerError, match=r"rollout\.servers\[0\].*127\.0\.0\.1:\d+.*(could not be reached|does not answer)"):
        fit.fit(module, datamodule=dm)
    assert time.monotonic() - start < 60
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt"))
    assert saved == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "on_exception.ckpt"], saved
    pipeline = torch.load(tmp_path / "ckpt" / "on_exception.ckpt", weights_only=True)["polopt"]["pipeline"]
    if staleness:  # the rollout in flight (sampled before the server died, or saved to be sampled again)
        assert len(pipeline[0]["in_flight"]) == 1 and pipeline[0]["version"] == 2
    else:
        assert pipeline is None
    for step in (1, 2):
        state = torch.load(tmp_path / "ckpt" / f"epoch=0-step={step}.ckpt", weights_only=False)
        assert state["global_step"] == step and state["state_dict"]


def test_a_server_that_does_not_answer_is_a_named_error_within_the_time_limit(tiny):
    """A port that accepts connections and never answers (a hung server), and a port nobody listens on."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held = []
    threading.Thread(target=lambda: held.extend(listener.accept() for _ in range(8)), daemon=True).start()
    model, tok = tiny
    ids, mask = prompts(tok)
    sampling = SamplingConfig(max_new_tokens=2)
    hung = build_engine({"name": "server", "servers": f"127.0.0.1:{listener.getsockname()[1]}", "timeout_s": 1,
                         "connect_timeout_s": 1})
    start = time.monotonic()
    with pytest.raises(ServerError, match=r"rollout\.servers\[0\] \(http://127\.0\.0\.1:\d+\) did not answer "
                                          r"/health.*rollout\.connect_timeout_s"):
        hung.generate(model, ids, mask, 2, sampling, tok.eos_token_id, tok.pad_token_id)
    assert time.monotonic() - start < 30
    absent = build_engine({"name": "server", "servers": ["127.0.0.1:1", f"127.0.0.1:{free_port()}"],
                           "connect_timeout_s": 1})
    with pytest.raises(ServerError, match=r"rollout\.servers\[0\] \(http://127\.0\.0\.1:1\).*is `polopt-serve` "
                                          "running there"):
        absent.generate(model, ids, mask, 2, sampling, tok.eos_token_id, tok.pad_token_id)
    listener.close()


@pytest.mark.parametrize("bad,match", [({"servers": []}, r"rollout\.servers"),
                                       ({"servers": ["localhost"]}, r"rollout\.servers: 'localhost' is not host:port"),
                                       ({"servers": "127.0.0.1:99999"}, r"is not host:port \(a port in 1-65535\)"),
                                       ({"group_backend": "mpi"}, r"rollout\.group_backend"),
                                       ({"timeout_s": 0}, r"rollout\.timeout_s")])
def test_bad_server_settings_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        build_engine({"name": "server", **bad})


def test_weights_travel_in_buckets_of_bytes_and_come_back_whole():
    """Every dtype (bfloat16 too, which gloo has not) through the byte buckets; a tensor above the bucket size alone."""
    weights = {"a": torch.randn(3, 5), "b": torch.randn(70).to(torch.bfloat16), "c": torch.arange(6).reshape(2, 3),
               "d": torch.randn(2, 2, dtype=torch.float16)}
    layout = tensor_layout(weights)
    plan = buckets(layout, 100)
    assert plan == [[0], [1], [2, 3]]  # 60 bytes, 140 alone, then 48 + 8
    out = {}
    for indices in plan:
        out.update(unpack(pack([weights[layout[i][0]] for i in indices]), [layout[i] for i in indices]))
    assert out.keys() == weights.keys()
    for name, value in weights.items():
        assert out[name].dtype == value.dtype and torch.equal(out[name], value)


@pytest.mark.parametrize("args,match", [
    (["--backend", "server"], r"argument --backend: invalid choice: 'server'"),
    (["--set", "bogus=1"], r"--backend hf --set bogus=1 --device auto: .*unexpected keyword argument 'bogus'"),
    (["--threads", "0"], r"--threads must be >= 1"),
    (["--device", "cuda"], r"--device cuda: torch \S+ sees no CUDA device"),
])
def test_polopt_serve_names_a_bad_argument(args, match):
    import subprocess
    import sys

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    proc = subprocess.run([sys.executable, "-m", "polopt_lightning.serve", "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.search(match, proc.stderr), proc.stderr[-2000:]


@pytest.mark.parametrize("servers", [1], indirect=True)
def test_a_second_trainer_takes_the_server_over_and_the_first_is_told(servers):
    """One trainer a server: the first trainer's next request is refused, naming why, instead of sampling with the
    second one's weights; a port already in use is named at the server's start."""
    import subprocess
    import sys

    addresses, _ = servers
    model, tok = build_tiny_model(hidden_size=64, num_layers=2, seed=0)
    ids, mask = prompts(tok)
    greedy = SamplingConfig(max_new_tokens=4, temperature=0.0)
    first, second = (build_engine({"name": "server", "servers": addresses, "timeout_s": 30}) for _ in range(2))
    first.generate(model, ids, mask, 2, greedy, tok.eos_token_id, tok.pad_token_id)
    second.generate(model, ids, mask, 2, greedy, tok.eos_token_id, tok.pad_token_id)
    with pytest.raises(ServerError, match=r"rollout\.servers\[0\].*failed /generate: .*serves another trainer"):
        first.generate(model, ids, mask, 2, greedy, tok.eos_token_id, tok.pad_token_id)
    port = addresses[0].rsplit(":", 1)[1]
    proc = subprocess.run([sys.executable, "-m", "polopt_lightning.serve", "--port", port], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr, proc.stderr[-2000:]
