import contextlib
import copy
import logging
import re

import pytest
import torch

from polopt_lightning._hf import cache_argument, preallocated_cache
from polopt_lightning.accel import trace
from polopt_lightning.accel.lean_step import llama_like
from polopt_lightning.models import build_tiny_model, char_tokenizer, load_pretrained, prepare_tokenizer
from polopt_lightning.rollout import HFRolloutEngine, SamplingConfig
from polopt_lightning.step.logprobs import completion_logprobs, selective_log_softmax

from .helpers import one_decoding_step, run_if


def test_char_tokenizer_roundtrip():
    tok = char_tokenizer()
    text = "12+34=\nab c"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.padding_side == "left" and tok.pad_token == "<pad>" and tok.eos_token == "<eos>"


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_tiny_model_builds(architecture):
    model, tok = build_tiny_model(architecture=architecture, hidden_size=32, num_layers=1, num_heads=2)
    assert model.config.model_type == architecture
    assert model.config.vocab_size == len(tok)
    out = model(input_ids=torch.tensor([tok("1+1=")["input_ids"]]))
    assert out.logits.shape[-1] == len(tok)


def test_bad_model_config_is_named():
    with pytest.raises(ValueError, match="model.architecture"):
        build_tiny_model(architecture="gpt5")
    with pytest.raises(ValueError, match="not divisible by model.num_heads"):
        build_tiny_model(hidden_size=30, num_heads=4)


def test_load_pretrained_from_a_saved_folder(tmp_path, tiny):
    model, tok = tiny
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    loaded, loaded_tok = load_pretrained(str(tmp_path / "m"), dtype="float32", attn_implementation="sdpa")
    ids = torch.tensor([tok("7+8=")["input_ids"]])
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert loaded_tok.padding_side == "left" and loaded_tok.get_vocab() == tok.get_vocab()
    with pytest.raises(ValueError, match="model.dtype"):
        load_pretrained(str(tmp_path / "m"), dtype="float8")


def _mapped_files(tensors) -> set[str]:
    """The files (from /proc/self/maps) whose mappings hold any of ``tensors``' data."""
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if len(fields) > 5 and fields[5].startswith("/"):
                spans.append((start, end, fields[5]))
    return {path for t in tensors for start, end, path in spans if start <= t.data_ptr() < end}


@run_if("procfs")
def test_load_pretrained_copies_the_weights_out_of_the_mapped_file_into_aligned_memory(tmp_path, tiny):
    from transformers import AutoModelForCausalLM

    model, tok = tiny
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    # what from_pretrained leaves: views into the mapped safetensors file, at the file's (8-byte) alignment
    assert any(path.endswith("model.safetensors") for path in _mapped_files(plain.parameters()))
    loaded, _ = load_pretrained(str(tmp_path / "m"), dtype="float32")
    weights = [*loaded.parameters(), *loaded.buffers()]
    assert _mapped_files(weights) == set()
    assert all(t.data_ptr() % 64 == 0 for t in weights if t.dtype.is_floating_point and t.numel())
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight  # still tied
    ids = torch.tensor([tok("7+8=")["input_ids"]])
    torch.testing.assert_close(loaded(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=0, atol=0)


def _resident_kib(path_suffix: str) -> int:
    """Resident KiB of this process's mappings of the file ending in ``path_suffix`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if re.match(r"[0-9a-f]+-[0-9a-f]+$", fields[0]):  # a mapping's first line: its range, ..., its path
                inside = len(fields) > 5 and fields[5].endswith(path_suffix)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@run_if("procfs")
def test_copied_weights_hand_their_file_pages_back_at_once(tmp_path):
    from transformers import AutoModelForCausalLM

    from polopt_lightning.accel.cpu.weights import release_weight_files
    from polopt_lightning.models import build_tiny_model

    # weights of many whole pages each (the tiny fixture's fit in a page or two): 2.2 MB in all
    model, _ = build_tiny_model(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=512, seed=0)
    model.save_pretrained(tmp_path / "m")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    old = {name: p.data for name, p in plain.named_parameters()}  # keeps the mapping alive past the copies
    assert sum(float(t.sum()) for t in old.values()) != 0  # every page of the weights read: resident
    file_kib = (tmp_path / "m" / "model.safetensors").stat().st_size // 1024
    assert _resident_kib("model.safetensors") > 0.9 * file_kib
    release_weight_files(plain)
    # each copied tensor's whole pages left the process as soon as it was copied: the file no longer doubles the
    # weights' memory while a model loads (only pages shared by two tensors' edges may stay)
    assert _resident_kib("model.safetensors") < 0.1 * file_kib
    for name, p in plain.named_parameters():  # the copies hold the values, and the file still reads them back
        assert p.data_ptr() != old[name].data_ptr() and torch.equal(p, old[name]), name


def test_tokenizer_without_pad_uses_eos_and_says_so(caplog):
    tok = char_tokenizer()
    tok.pad_token = None
    with caplog.at_level(logging.WARNING, logger="polopt_lightning.models"):
        prepare_tokenizer(tok)
    assert tok.pad_token == "<eos>" and "no pad token" in caplog.text


def test_selective_log_softmax_matches_full_and_chunks():
    logits = torch.randn(3, 5, 11, requires_grad=True)
    index = torch.randint(0, 11, (3, 5))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, index[..., None]).squeeze(-1)
    got, entropy = selective_log_softmax(logits, index, temperature=0.7, chunk_rows=4, with_entropy=True)
    torch.testing.assert_close(got, expected)
    p = torch.softmax(logits / 0.7, -1)
    torch.testing.assert_close(entropy, -(p * torch.log(p)).sum(-1).detach())
    got.sum().backward()
    assert logits.grad is not None


def _prompts(tok, texts):
    enc = tok(texts, padding=True, return_tensors="pt")
    return enc.input_ids, enc.attention_mask


@pytest.mark.parametrize("sampling", [
    SamplingConfig(max_new_tokens=8, temperature=1.0),
    SamplingConfig(max_new_tokens=8, temperature=0.7, top_k=10, top_p=0.9),
])
def test_sampling_logprobs_agree_with_a_fresh_forward(tiny, sampling):
    model, tok = tiny
    ids, mask = _prompts(tok, ["12+34=", "5+6=", "1+100+2="])
    model.train()
    batch = HFRolloutEngine().generate(model, ids, mask, 4, sampling, tok.eos_token_id, tok.pad_token_id,
                                       torch.Generator().manual_seed(0))
    assert model.training, "the policy must return to train mode after sampling"
    assert batch.completion_ids.shape[0] == 12 and batch.group_size == 4
    model.eval()
    with torch.no_grad():
        fresh, _ = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                       batch.completion_mask, sampling.temperature)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(fresh[m], batch.sampling_logprobs[m], atol=1e-4, rtol=1e-4)
    assert (batch.sampling_logprobs[~m] == 0).all()


def test_eos_mask_finish_reason_and_min_tokens(tiny):
    model, tok = tiny
    ids, mask = _prompts(tok, ["1+1=", "2+2="])
    eos = tok.eos_token_id
    # make EOS overwhelmingly likely: every completion is exactly [EOS]
    bias_hook = model.lm_head.register_forward_hook(lambda m, i, o: o.index_fill(-1, torch.tensor([eos]), 50.0))
    out = HFRolloutEngine().generate(model, ids, mask, 2, SamplingConfig(max_new_tokens=5), eos, tok.pad_token_id)
    assert out.completion_ids.shape[1] == 1 and out.finished.all() and (out.completion_mask == 1).all()
    # min_new_tokens forbids EOS until then: full length, truncated, never finished
    out = HFRolloutEngine().generate(model, ids, mask, 2, SamplingConfig(max_new_tokens=5, min_new_tokens=5), eos,
                                     tok.pad_token_id)
    assert out.completion_ids.shape[1] == 5 and not out.finished.any() and (out.completion_mask == 1).all()
    # EOS likelier (not certain) from the 4th token: rows end at different lengths or not at all (the decoding steps
    # on the model's forward, which runs the hook; drawn from a fixed seed); the mask covers the EOS, pad after
    bias_hook.remove()
    bias_hook = model.lm_head.register_forward_hook(
        lambda m, i, o: o.index_add(-1, torch.tensor([eos]), torch.full((*o.shape[:-1], 1), 5.0)))
    out = HFRolloutEngine(fast_decode=False).generate(model, ids, mask, 4, SamplingConfig(
        max_new_tokens=6, min_new_tokens=3), eos, tok.pad_token_id, torch.Generator().manual_seed(0))
    bias_hook.remove()
    lengths = out.completion_mask.sum(-1)
    # both branches below run, and some finished row is followed by padding
    assert out.finished.any() and not out.finished.all() and (lengths[out.finished] < 6).any(), lengths
    for row, m, fin in zip(out.completion_ids, out.completion_mask, out.finished):
        n = int(m.sum())
        assert (m[:n] == 1).all() and (row[:n - 1] != eos).all()  # the mask is the tokens up to the first EOS
        if fin:
            assert 4 <= n <= 6 and row[n - 1] == eos and (row[n:] == tok.pad_token_id).all()
        else:
            assert n == 6 and row[-1] != eos


def test_left_padding_does_not_change_greedy_output(tiny):
    model, tok = tiny
    greedy = SamplingConfig(max_new_tokens=6, temperature=0)
    alone = HFRolloutEngine().generate(model, *_prompts(tok, ["3+4="]), 1, greedy, tok.eos_token_id, tok.pad_token_id)
    padded = HFRolloutEngine().generate(model, *_prompts(tok, ["3+4=", "123+456+789="]), 1, greedy,
                                        tok.eos_token_id, tok.pad_token_id)
    n = int(alone.completion_mask[0].sum())
    assert alone.completion_ids[0, :n].tolist() == padded.completion_ids[0, :n].tolist()
    torch.testing.assert_close(alone.sampling_logprobs[0, :n], padded.sampling_logprobs[0, :n], atol=1e-5, rtol=1e-5)


def test_sampling_config_validation():
    with pytest.raises(ValueError, match="generation.top_p"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="generation.min_new_tokens"):
        SamplingConfig(max_new_tokens=2, min_new_tokens=3)


@pytest.mark.parametrize("shared_prompt_kv", [True, False], ids=["shared-prompt-kv", "per-sample-kv"])
@pytest.mark.parametrize("architecture,heads,kv_heads", [("qwen2", 2, 2), ("llama", 2, 1), ("llama", 4, 2)])
def test_fast_decode_matches_the_model_forward(architecture, heads, kv_heads, shared_prompt_kv):
    """The lean decoding step (preallocated cache, grouped-query attention, prompt keys/values per group or per
    sample) against the full transformers forward: same sampled log-probs as a fresh forward, and the same tokens as
    the slow path."""
    model, tok = build_tiny_model(architecture=architecture, hidden_size=32, num_layers=2, num_heads=heads,
                                  num_kv_heads=kv_heads, intermediate_size=64, seed=5)
    ids, mask = _prompts(tok, ["12+34=", "5+6=", "1+100+2="])  # left padding: the prompt bias must close it
    sampling = SamplingConfig(max_new_tokens=7, min_new_tokens=7)
    out = {}
    for fast in (True, False):
        engine = HFRolloutEngine(fast_decode=fast, shared_prompt_kv=shared_prompt_kv)
        out[fast] = engine.generate(model, ids, mask, 3, sampling, tok.eos_token_id, tok.pad_token_id,
                                    torch.Generator().manual_seed(1))
    assert torch.equal(out[True].completion_ids, out[False].completion_ids)
    torch.testing.assert_close(out[True].sampling_logprobs, out[False].sampling_logprobs, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        fresh, _ = completion_logprobs(model.eval(), out[True].prompt_ids, out[True].prompt_mask,
                                       out[True].completion_ids, out[True].completion_mask)
    torch.testing.assert_close(fresh, out[True].sampling_logprobs, atol=1e-5, rtol=1e-5)


def _decoded_rows(model):
    """A list that collects the number of rows each forward of ``model``'s embedding takes (the prefill's and every
    decoding step's, on any path: the model's forward, the lean step, the fused C step), and the hook's handle."""
    rows = []
    return rows, model.model.embed_tokens.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))


@pytest.mark.parametrize("path", ["fused", "modules", "forward", "greedy-small-vocab"])
def test_finished_rows_leave_the_decoding_batch_with_the_same_completions(path):
    """``drop_finished`` (on by default from 128 new tokens): rows stop being decoded once a quarter of the batch has
    ended, and the completions, their log-probs and ``finished`` are those of the full batch: a large vocabulary's
    inverse-CDF draw takes the same uniform numbers for the rows left (a wrong index or draw changes the tokens), and
    left-padded prompts of several lengths keep their own masks and positions. On the fused path the C step takes over
    once the batch fits it, its row block rebuilt as the batch shrinks."""
    from polopt_lightning.accel.cpu import decode as cpu_decode
    from polopt_lightning.accel.cpu.linear import OneDNNLinear

    from .helpers.kernel import needs_kernel

    if path == "fused":
        needs_kernel()

    vocab = 128 if path == "greedy-small-vocab" else 40_000
    model, tok = build_tiny_model(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                                  vocab_size=vocab, seed=3)
    greedy = path == "greedy-small-vocab"  # 24 prompts, one completion each: greedy rows of a group would be alike
    ids = torch.randint(10, vocab, (24 if greedy else 2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1::2, :2] = 0  # every other prompt left-padded by two
    ids = ids.masked_fill(mask == 0, 0)
    eos = list(range(vocab - 32, vocab)) if greedy else list(range(100, 500))  # 1% of the large vocabulary
    sampling = SamplingConfig(max_new_tokens=160, temperature=0.0 if greedy else 1.0)
    settings = {"fast_decode": path != "forward", "cpu": {"packed_weights": path == "fused"}}
    out, decoded, fused = {}, {}, []
    step = cpu_decode.FusedStep.__call__

    def counted(self, token, *args, **kwargs):
        fused.append((token.shape[0], self.M))
        return step(self, token, *args, **kwargs)

    cpu_decode.FusedStep.__call__ = counted
    try:
        for drop in (None, False):
            rows, hook = _decoded_rows(model)
            with OneDNNLinear(model) if path == "fused" else contextlib.nullcontext():
                out[drop] = HFRolloutEngine(drop_finished=drop, **settings).generate(
                    model, ids, mask, 1 if greedy else 12, sampling, eos, 0, torch.Generator().manual_seed(1))
            hook.remove()
            decoded[drop] = rows[1:]  # the decoding steps' rows
    finally:
        cpu_decode.FusedStep.__call__ = step
    lengths = out[False].completion_mask.sum(1)
    assert lengths.min() < lengths.max() == out[False].completion_ids.shape[1]  # rows ended at different steps
    assert torch.equal(out[None].completion_ids, out[False].completion_ids)
    assert torch.equal(out[None].finished, out[False].finished)
    torch.testing.assert_close(out[None].sampling_logprobs, out[False].sampling_logprobs, atol=1e-5, rtol=1e-5)
    assert set(decoded[False]) == {24}
    assert decoded[None][0] <= 24 and decoded[None][-1] < 16 and decoded[None] == sorted(decoded[None], reverse=True)
    # every row still decoding is one whose completion goes on: at most a quarter of a batch is already done
    still = [int((lengths > t + 1).sum()) for t in range(len(decoded[None]))]
    assert all(s <= n < max(s + 1, 4 * s / 3 + 1) for s, n in zip(still, decoded[None]))
    if path == "fused":  # 24 rows on oneDNN's products (no C step), then the C step in blocks of the rows left
        assert len(fused) == sum(n <= cpu_decode.KERNEL_MAX_ROWS for n in decoded[None]) > 0
        assert all(M == -(-n // 8) * 8 for n, M in fused), fused


def test_finished_rows_stay_below_128_tokens_and_on_the_shared_prompt_path():
    """The rule: no dropping below 128 new tokens (the default job's completions decode as before) nor with
    ``shared_prompt_kv=True`` (rows go in whole groups); ``shared_prompt_kv=None`` leaves the shared path off where
    rows drop; a batch shrinking to the few-row kernel's size gets its products built afresh."""
    from polopt_lightning.accel.cpu import decode as cpu_decode

    model, tok = build_tiny_model(hidden_size=64, num_layers=1, num_heads=2, intermediate_size=64, seed=1)
    ids = torch.randint(3, len(tok), (3, 4), generator=torch.Generator().manual_seed(0))
    eos = list(range(3, len(tok), 4))  # a quarter of the vocabulary: rows end within a few tokens
    for engine, new_tokens, full in ((HFRolloutEngine(), 127, True), (HFRolloutEngine(shared_prompt_kv=True), 128, True),
                                     (HFRolloutEngine(drop_finished=True, compile=False), 8, False)):
        rows, hook = _decoded_rows(model)
        engine.generate(model, ids, torch.ones_like(ids), 4, SamplingConfig(max_new_tokens=new_tokens), eos, 0,
                        torch.Generator().manual_seed(2))
        hook.remove()
        assert (set(rows[1:]) == {12}) is full, (new_tokens, rows)
    assert HFRolloutEngine()._share_prompt_kv(None, 0, 0, drop=True) is False
    assert HFRolloutEngine(shared_prompt_kv=True)._share_prompt_kv(None, 0, 0, drop=True) is True

    # no rebuild where the kernel cannot take the rows (here: outside oneDNN's mode, or the kernel off)
    kept, big = object(), cpu_decode.KERNEL_MAX_ROWS + 1
    base = llama_like(model)
    assert cpu_decode.CPUDecoding().fewer_rows(kept, base, big, 4) is kept
    assert cpu_decode.CPUDecoding(decode_kernel=False).fewer_rows(kept, base, big, 4) is kept


def test_a_shrinking_batch_gets_the_few_row_kernel_also_for_lora():
    """Where the batch shrinks into the kernel's rows (or by a row block), the products are built afresh, for a LoRA
    policy too (whose products above 16 rows are its modules'); not where rows stay within the block."""
    from peft import LoraConfig, get_peft_model

    from polopt_lightning.accel.cpu import decode as cpu_decode
    from polopt_lightning.accel.cpu.linear import OneDNNLinear

    from .helpers.kernel import needs_kernel

    needs_kernel()  # a head of 40k x 64 weights: oneDNN's mode takes the model (a weight >= 2**18 elements)
    model, _ = build_tiny_model(hidden_size=64, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=40_000,
                                seed=1)
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules="all-linear")).eval()  # as it samples
    decoding, kept, big = cpu_decode.CPUDecoding(), object(), cpu_decode.KERNEL_MAX_ROWS + 8
    with OneDNNLinear(model), OneDNNLinear(lora):
        base = llama_like(model)
        assert decoding.fewer_rows(kept, base, 8, 5) is kept  # one row block either way
        assert decoding.fewer_rows(kept, base, big, big) is kept
        for before, after in ((big, 12), (16, 8)):
            got = decoding.fewer_rows(kept, base, before, after)
            assert isinstance(got, cpu_decode.PackedProjections) and got.kernel and got.fused.M == -(-after // 8) * 8
        lora_base = llama_like(lora)
        assert decoding.projections(lora_base, big) is None  # its modules' products above the kernel's rows
        got = decoding.fewer_rows(None, lora_base, big, 12)
        assert isinstance(got, cpu_decode.AdapterProjections) and got.fused is not None


def test_shared_prompt_kv_is_chosen_where_it_measured_faster():
    """Auto: on for fp32 on the CPU when per-sample copies would re-read >= 1 MiB of prompt keys/values per layer."""

    def decide(prompt_len, dtype, G=8):
        model, tok = build_tiny_model(hidden_size=64, num_layers=1, num_heads=2, intermediate_size=64)
        model = model.to(dtype)
        cache = preallocated_cache(model, prompt_len + 4)
        model(input_ids=torch.ones(2, prompt_len, dtype=torch.long), use_cache=True, **{cache_argument(model): cache})
        return HFRolloutEngine()._share_prompt_kv(cache, 2 * G, prompt_len)

    # re-read bytes = (N - P) x kv_heads x Lp x head_dim x 4 bytes x 2 (keys and values)
    assert decide(300, torch.float32) is True  # 14 x 2 x 300 x 32 x 8 = 2.1 MiB
    assert decide(100, torch.float32) is False  # 0.7 MiB
    assert decide(300, torch.bfloat16) is False
    assert HFRolloutEngine(shared_prompt_kv=True)._share_prompt_kv(None, 0, 0) is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-mkl", "bf16-onednn"])
@pytest.mark.parametrize("architecture,heads,kv_heads", [("qwen2", 2, 2), ("llama", 4, 2)])
def test_packed_decode_weights_give_the_modules_results(architecture, heads, kv_heads, dtype):
    """Prepacked products (q/k/v and gate/up fused; Qwen2's q/k/v biases concatenated) against the modules' own."""
    from polopt_lightning.accel.cpu import decode as cpu_decode

    model, tok = build_tiny_model(architecture=architecture, hidden_size=32, num_layers=2, num_heads=heads,
                                  num_kv_heads=kv_heads, intermediate_size=64, seed=5)
    model = model.to(dtype)
    if not cpu_decode.PackedProjections.supported(model):
        pytest.skip(f"this PyTorch build or CPU cannot prepack {dtype} weights (MKL / oneDNN bf16 missing)")
    ids, mask = _prompts(tok, ["12+34=", "5+6=", "1+100+2="])
    sampling = SamplingConfig(max_new_tokens=6, min_new_tokens=6)
    with trace.routes() as ran:
        out = {packed: HFRolloutEngine(shared_prompt_kv=False, cpu={"packed_weights": packed}).generate(
            model, ids, mask, 3, sampling, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(1))
            for packed in (True, False)}
    # 5 decoding steps x (2 layers x 4 products + head): the packed path ran (and only with packed_weights)
    assert len(ran["prepacked_product"]) == 5 * (2 * 4 + 1)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.05)
    if dtype == torch.float32:
        assert torch.equal(out[True].completion_ids, out[False].completion_ids)
        torch.testing.assert_close(out[True].sampling_logprobs, out[False].sampling_logprobs, **tol)
    # one decoding step's logits from the same cache, packed and not
    torch.testing.assert_close(one_decoding_step(model, ids, packed=True), one_decoding_step(model, ids, packed=False),
                               **tol)


def test_packed_decode_weights_step_aside_where_they_cannot_apply(tiny):
    """A Linear subclass (how quantized and LoRA layers look) or autocast: the modules run, with the same results."""
    from polopt_lightning.accel.cpu.decode import PackedProjections

    model, tok = tiny
    model = copy.deepcopy(model)
    if not PackedProjections.supported(model):
        pytest.skip("this PyTorch build cannot prepack float32 weights (no MKL)")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not PackedProjections.supported(model)

    class Wrapped(torch.nn.Linear):
        pass

    q = model.model.layers[0].self_attn.q_proj
    wrapped = Wrapped(q.in_features, q.out_features, bias=q.bias is not None)
    wrapped.load_state_dict(q.state_dict())
    model.model.layers[0].self_attn.q_proj = wrapped
    assert not PackedProjections.supported(model)
    ids, mask = _prompts(tok, ["12+34=", "5+6="])
    sampling = SamplingConfig(max_new_tokens=5, min_new_tokens=5)
    a, b = (HFRolloutEngine(cpu={"packed_weights": p}).generate(model, ids, mask, 2, sampling, tok.eos_token_id,
                                                       tok.pad_token_id, torch.Generator().manual_seed(3))
            for p in (True, False))
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.sampling_logprobs, b.sampling_logprobs)


def test_packing_that_fails_falls_back_to_the_modules_with_a_warning(tiny, monkeypatch):
    from polopt_lightning.accel.cpu import decode as cpu_decode

    model, tok = tiny
    if not cpu_decode.PackedProjections.supported(model):
        pytest.skip("this PyTorch build cannot prepack float32 weights (no MKL)")

    def refuse(self, base, rows, kernel=None, fused=None):
        raise RuntimeError("reorder refused")

    monkeypatch.setattr(cpu_decode.PackedProjections, "__init__", refuse)
    ids, mask = _prompts(tok, ["12+34="])
    sampling = SamplingConfig(max_new_tokens=4, min_new_tokens=4)
    engine = HFRolloutEngine()
    with pytest.warns(RuntimeWarning, match="rollout.cpu.packed_weights=True.*reorder refused"):
        a = engine.generate(model, ids, mask, 2, sampling, tok.eos_token_id, tok.pad_token_id,
                            torch.Generator().manual_seed(0))
    assert engine.cpu.packed_weights is False  # asked once, not at every rollout
    b = HFRolloutEngine(cpu={"packed_weights": False}).generate(model, ids, mask, 2, sampling, tok.eos_token_id,
                                                       tok.pad_token_id, torch.Generator().manual_seed(0))
    assert torch.equal(a.completion_ids, b.completion_ids)


def test_packed_decode_weights_carry_every_bias():
    """Llama with attention and MLP biases (o_proj, gate/up and down biased too): packed logits equal the modules'."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from polopt_lightning.accel.cpu import decode as cpu_decode

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    for name, p in model.named_parameters():  # biases start at zero: make them count
        if name.endswith("bias"):
            torch.nn.init.normal_(p, std=0.5)
    if not cpu_decode.PackedProjections.supported(model):
        pytest.skip("this PyTorch build cannot prepack float32 weights (no MKL)")
    ids = torch.randint(3, 40, (3, 5))
    torch.testing.assert_close(one_decoding_step(model, ids, packed=True), one_decoding_step(model, ids, packed=False),
                               atol=1e-5, rtol=1e-5)


def test_inference_mode_sampling_gives_the_same_rollout_as_ordinary_tensors(tiny):
    """Sampling under inference mode (chosen for a plain model) draws what no_grad draws, and hands back tensors a
    training pass can use: a backward through an embedding of the sampled ids fails on inference tensors."""
    model, tok = tiny
    ids, mask = _prompts(tok, ["12+34=", "5+6="])
    sampling = SamplingConfig(max_new_tokens=6, min_new_tokens=6)
    modes = []
    hook = model.model.embed_tokens.register_forward_hook(lambda *_: modes.append(torch.is_inference_mode_enabled()))
    batches = [HFRolloutEngine(inference_mode=m).generate(model, ids, mask, 3, sampling, tok.eos_token_id,
                                                          tok.pad_token_id, torch.Generator().manual_seed(1))
               for m in (None, False)]
    hook.remove()
    assert modes[0] and not modes[-1], "auto must pick inference mode for a plain model, False must not"
    auto, plain = batches
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampling_logprobs", "finished"):
        assert not getattr(auto, name).is_inference(), name
        assert torch.equal(getattr(auto, name), getattr(plain, name)), name
    model.train()
    logprobs, _ = completion_logprobs(model, auto.prompt_ids, auto.prompt_mask, auto.completion_ids,
                                      auto.completion_mask)
    (logprobs * auto.sampling_logprobs).sum().backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_inference_mode_is_left_off_for_quantized_or_adapter_layers(tiny):
    from polopt_lightning.rollout.hf import _stateless

    model, _ = tiny
    assert _stateless(model)
    model = copy.deepcopy(model)

    class Quantized(torch.nn.Linear):  # bitsandbytes' layers subclass nn.Linear and keep state built in forward
        pass

    mlp = model.model.layers[1].mlp
    mlp.up_proj = Quantized(mlp.up_proj.in_features, mlp.up_proj.out_features, bias=False)
    assert not _stateless(model)
    model.peft_config = {}
    assert not _stateless(model)


def test_the_module_stops_at_the_generation_configs_eos_tokens_too(tiny):
    """The tokens that end a completion are the tokenizer's EOS and the model's generation config's (TRL's and vLLM's
    rule: Qwen2.5-Instruct's config adds <|endoftext|> to <|im_end|>), in every rollout the module runs."""
    from polopt_lightning import PolicyOptimizationModule
    from polopt_lightning._hf import stop_token_ids

    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    eos = tok.eos_token_id
    model.generation_config.eos_token_id = None
    assert stop_token_ids(tok, model) == [eos]
    model.generation_config.eos_token_id = [7, eos, 7]
    assert stop_token_ids(tok, model) == [eos, 7]  # the tokenizer's first, each once
    module = PolicyOptimizationModule(model, tok, objective="grpo", reward_fns=[lambda completions, **kw: [0.0]])
    ids, mask = _prompts(tok, ["1+1=", "2+2="])
    greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
    model.generation_config.eos_token_id = eos
    free = module.rollout({"prompt_ids": ids, "prompt_mask": mask}, greedy, 1)
    first = int(free.completion_ids[0, 0])
    assert first != eos and free.completion_mask[0].sum() > 1
    model.generation_config.eos_token_id = [first]  # the greedy first token now ends the completion
    out = module.rollout({"prompt_ids": ids, "prompt_mask": mask}, greedy, 1)
    assert out.completion_mask[0].sum() == 1 and bool(out.finished[0])
    assert torch.equal(out.completion_ids[0, :1], free.completion_ids[0, :1])
