import pytest
import torch

from polopt_lightning.callbacks.checkpoint import save_atomically
from polopt_lightning.data import ArithmeticTask
from polopt_lightning.models import build_tiny_model
from polopt_lightning.warmstart import WarmStartConfig, greedy_accuracy, supervised_warm_start


def tiny():
    return build_tiny_model(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0)


def test_warm_start_learns_and_caches(tmp_path):
    train, _ = ArithmeticTask(digits=1, train_size=60, val_size=0).splits()
    model, tok = tiny()
    before = greedy_accuracy(model, tok, train)
    cfg = WarmStartConfig(steps=150, batch_size=32, lr=3e-3, cache_dir=str(tmp_path))
    info = supervised_warm_start(model, tok, train, cfg)
    assert not info["cached"] and info["steps"] == 150 and info["final_loss"] < 2.0
    after = greedy_accuracy(model, tok, train)
    assert after > before + 0.2, (before, after)
    # same config and same initial weights: loaded from the cache, identical weights
    model2, _ = tiny()
    info2 = supervised_warm_start(model2, tok, train, cfg)
    assert info2["cached"]
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    # a changed setting is a different cache entry
    model3, _ = tiny()
    assert not supervised_warm_start(model3, tok, train, WarmStartConfig(steps=5, cache_dir=str(tmp_path)))["cached"]


def test_target_accuracy_stops_early():
    train, _ = ArithmeticTask(digits=1, train_size=30, val_size=0).splits()
    model, tok = tiny()
    info = supervised_warm_start(model, tok, train, WarmStartConfig(steps=500, target_accuracy=0.0, eval_every=10))
    # the probe (all 30 training rows here) is the stopped model's greedy exact-match share, decoded here by hand
    model.eval()
    right = 0
    with torch.no_grad():
        for row in train:
            ids = tok(row["prompt"], return_tensors="pt")["input_ids"]
            new = []
            for _ in range(len(tok(row["answer"], add_special_tokens=False)["input_ids"]) + 1):
                token = int(model(input_ids=ids).logits[0, -1].argmax())
                if token == tok.eos_token_id:
                    break
                new.append(token)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            right += tok.decode(new, skip_special_tokens=True).strip() == row["answer"]
    assert info["steps"] == 10 and info["probe_accuracy"] == pytest.approx(right / len(train))


def test_bad_rows_are_named():
    model, tok = tiny()
    with pytest.raises(KeyError, match=r"training row 0 \(counted from 0\) has no column 'answer' \(warm_start.answer_column\)"):
        supervised_warm_start(model, tok, [{"prompt": "1+1="}], WarmStartConfig(steps=1))


def test_probe_checks_finely_near_the_target(monkeypatch):
    """Coarse checks far from the target, fine ones within fine_margin of it: stops at the first fine check above."""
    import polopt_lightning.warmstart as ws

    scripted = iter([0.10, 0.30, 0.50, 0.55, 0.60, 0.70])
    monkeypatch.setattr(ws, "greedy_accuracy", lambda *args, **kwargs: next(scripted))
    train, _ = ArithmeticTask(digits=1, train_size=30, val_size=0).splits()
    model, tok = tiny()
    cfg = WarmStartConfig(steps=500, batch_size=4, target_accuracy=0.65, eval_every=20, fine_eval_every=5,
                          fine_margin=0.2)
    info = supervised_warm_start(model, tok, train, cfg)
    # checks at 20 (0.10), 40 (0.30), 60 (0.50: within 0.2), then every 5: 65, 70, 75 (0.70 >= 0.65)
    assert info["steps"] == 75 and info["probe_accuracy"] == 0.70
    with pytest.raises(ValueError, match="fine_eval_every must be >= 1"):
        WarmStartConfig(fine_eval_every=0)


def test_runs_sharing_the_cache_save_the_same_entry_together(tmp_path, monkeypatch):
    """Two runs (a study's parallel jobs) finish the same cache entry at once: both writes complete before either
    renames, which a shared temporary name turned into a FileNotFoundError for the second rename."""
    import threading

    both_written = threading.Barrier(2)
    save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f: (save(obj, f), both_written.wait()))
    path = tmp_path / "cache" / "warm_start" / "entry.pt"
    errors = []

    def run(value):
        try:
            save_atomically({"w": torch.full((3,), float(value))}, path)
        except Exception as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(v,)) for v in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert float(torch.load(path)["w"][0]) in (1.0, 2.0)
    assert sorted(p.name for p in path.parent.iterdir()) == ["entry.pt"]  # no temporary file left behind



def test_the_cache_key_covers_what_changes_the_result_and_not_the_thread_count():
    """The key hashed float sums of the weights, which round differently with the thread count: num_threads=1 and 2
    trained the same warm start twice. It hashes the weights' bytes now; a changed weight, row or setting still
    changes it."""
    from polopt_lightning.warmstart import _cache_key

    train, _ = ArithmeticTask(digits=2, train_size=400, val_size=0).splits()
    model, tok = build_tiny_model()  # the default model: sums over its 2.6M weights round with the threads
    cfg = WarmStartConfig()
    previous = torch.get_num_threads()
    try:
        keys = set()
        for threads in (1, 2):
            torch.set_num_threads(threads)
            keys.add(_cache_key(model, tok, train, cfg))
    finally:
        torch.set_num_threads(previous)
    assert len(keys) == 1
    key = keys.pop()
    assert _cache_key(model, tok, train, WarmStartConfig(target_accuracy=0.5)) != key
    assert _cache_key(model, tok, train[1:], cfg) != key
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-6  # one weight, one rounding step
    assert _cache_key(model, tok, train, cfg) != key


def test_the_warm_start_says_why_it_runs_its_pace_and_each_probe(tmp_path, caplog):
    train, _ = ArithmeticTask(digits=1, train_size=30, val_size=0).splits()
    model, tok = tiny()
    cfg = WarmStartConfig(steps=20, batch_size=8, target_accuracy=1.0, eval_every=10, fine_eval_every=None,
                          cache_dir=str(tmp_path))
    with caplog.at_level("INFO", logger="polopt_lightning.warmstart"):
        supervised_warm_start(model, tok, train, cfg)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith(f"warm start: no cached weights in {tmp_path}; a supervised warm start on 30 reference "
                               "answers first") and "up to 20 steps of 8 examples" in lines[0]
    assert "until greedy accuracy on 30 training prompts reaches 100%" in lines[0]
    assert lines[0].endswith("Its weights are cached for the next run")
    assert lines[1].startswith("warm start: ") and "a step: at most ~" in lines[1] and "for all 20 steps" in lines[1]
    probes = [line for line in lines if "probe accuracy" in line and "/20" in line]
    assert [p.split(",")[0] for p in probes] == ["warm start: step 10/20", "warm start: step 20/20"]
    assert all("(target 100%)" in p for p in probes)
    assert lines[-1].startswith("warm start: 20 steps in")
    caplog.clear()
    with caplog.at_level("INFO", logger="polopt_lightning.warmstart"):
        supervised_warm_start(tiny()[0], tok, train, cfg)  # cached: one line, no training
    assert [r.getMessage().split(" /")[0] for r in caplog.records] == ["warm start: loaded cached weights"]
    caplog.clear()
    with caplog.at_level("INFO", logger="polopt_lightning.warmstart"):  # no cache: nothing is said to be kept
        supervised_warm_start(tiny()[0], tok, train, WarmStartConfig(steps=2, batch_size=8))
    first = caplog.records[0].getMessage()
    assert first.startswith("warm start: no cache (warm_start.cache_dir=null)") and "cached" not in first
