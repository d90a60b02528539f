"""The trained policy in Hugging Face format: saved by the module, by polopt-train, and from any checkpoint, loadable
by transformers in a process that never imports this package, with the same log-probs."""

import json
import shutil
import subprocess
import sys

import lightning as L
import pytest
import torch

from polopt_lightning import PolicyOptimizationModule, PromptDataModule
from polopt_lightning.data import ArithmeticTask
from polopt_lightning.export import export_checkpoint
from polopt_lightning.models import load_pretrained
from polopt_lightning.rewards import DigitMatchReward, ExactMatchReward
from tests.helpers import distinct_chars

TEXT = "12+34=46"

# runs in a fresh interpreter: transformers only, and it checks that polopt_lightning was never imported
LOAD_AND_SCORE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
tok = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tok(sys.argv[2], return_tensors="pt")["input_ids"]
with torch.no_grad():
    logits = model(ids).logits.float()
lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
assert not any(m.startswith("polopt_lightning") for m in sys.modules), "polopt_lightning was imported"
print(json.dumps({"logprobs": lp.tolist(), "ids": ids[0].tolist()}))
"""


def logprobs_in_process(model, tokenizer, text=TEXT):
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits.float()
    return torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0], ids[0].tolist()


def logprobs_elsewhere(folder, text=TEXT):
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_SCORE, str(folder), text], capture_output=True, text=True,
                          timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return torch.tensor(out["logprobs"]), out["ids"]


def trained_module(tiny, tmp_path, beta=0.04):
    model, tok = tiny
    train, val = ArithmeticTask(digits=1, train_size=40, val_size=8).splits()
    data = PromptDataModule(train=train, val=val, tokenizer=tok, batch_size=2)
    # the tiny model scores 0 on both arithmetic rewards: without a reward that varies, the weights would move only
    # by the KL term's float noise (none once the reference and training passes round alike)
    module = PolicyOptimizationModule(model, tok, objective={"name": "grpo", "beta": beta}, optimizer={"lr": 1e-3},
                                      reward_fns=[ExactMatchReward(), DigitMatchReward(), distinct_chars],
                                      experience={"num_generations": 4}, generation={"max_new_tokens": 3})
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    before = [p.detach().clone() for p in model.parameters()]
    trainer.fit(module, datamodule=data)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), "training changed nothing"
    return module, trainer


def test_module_save_pretrained_round_trips_without_this_package(tiny, tmp_path):
    module, _ = trained_module(tiny, tmp_path)
    folder = module.save_pretrained(tmp_path / "model")
    expected, ids = logprobs_in_process(module.policy, module.tokenizer)
    got, got_ids = logprobs_elsewhere(folder)
    assert got_ids == ids
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_any_checkpoint_exports_to_a_loadable_folder(tiny, tmp_path):
    module, trainer = trained_module(tiny, tmp_path)  # beta > 0: the checkpoint also holds the reference
    trainer.save_checkpoint(tmp_path / "last.ckpt", weights_only=False)
    expected, _ = logprobs_in_process(module.policy, module.tokenizer)
    # the command line, as a user runs it
    proc = subprocess.run([sys.executable, "-m", "polopt_lightning.export", str(tmp_path / "last.ckpt"),
                           str(tmp_path / "exported")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Writing model shards" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr[-3000:]
    got, _ = logprobs_elsewhere(tmp_path / "exported")
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # the reference's weights (the policy before training) were not exported instead of the policy's
    ref, _ = logprobs_in_process(module.ref_model, module.tokenizer)
    assert not torch.allclose(ref, expected, atol=1e-5)
    # and our own loader reads the folder too
    model, tok = load_pretrained(str(tmp_path / "exported"), dtype="float32")
    torch.testing.assert_close(logprobs_in_process(model, tok)[0], expected, rtol=0, atol=1e-5)
    # a run directory (as polopt-train ckpt_path=<run> takes one): its newest checkpoint, named; an older one and the
    # step-0 one beside it are not taken
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "last.ckpt", tmp_path / "run" / "checkpoints" / "last.ckpt")
    torch.save({**torch.load(tmp_path / "last.ckpt", weights_only=True), "global_step": 0},
               tmp_path / "run" / "checkpoints" / "start.ckpt")
    proc = subprocess.run([sys.executable, "-m", "polopt_lightning.export", str(tmp_path / "run"),
                           str(tmp_path / "from_run")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"last.ckpt (step {trainer.global_step}), the newest checkpoint in {tmp_path / 'run' / 'checkpoints'}" in (
        proc.stderr + proc.stdout)
    torch.testing.assert_close(logprobs_elsewhere(tmp_path / "from_run")[0], expected, rtol=0, atol=1e-5)


def test_export_refuses_a_folder_with_files_and_replaces_it_whole_when_told(tiny, tmp_path):
    module, trainer = trained_module(tiny, tmp_path)
    trainer.save_checkpoint(tmp_path / "last.ckpt", weights_only=False)
    target = tmp_path / "exported"
    target.mkdir()
    (target / "config.json").write_text("{}")  # somebody's model: a config, a shard and an index
    (target / "model-00001-of-00002.safetensors").write_bytes(b"old")
    (target / "model.safetensors.index.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    proc = subprocess.run([sys.executable, "-m", "polopt_lightning.export", str(tmp_path / "last.ckpt"), str(target)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and f"{target} is not empty" in proc.stderr and "--overwrite" in proc.stderr
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before  # untouched
    with pytest.raises(FileExistsError, match="is not empty"):
        module.save_pretrained(target)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    # told to overwrite: the folder is replaced whole, none of the old files stays beside the new ones
    proc = subprocess.run([sys.executable, "-m", "polopt_lightning.export", str(tmp_path / "last.ckpt"), str(target),
                           "--overwrite"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {p.name for p in target.iterdir()}
    assert "model-00001-of-00002.safetensors" not in names and "model.safetensors.index.json" not in names
    assert "model.safetensors" in names and json.loads((target / "config.json").read_text())["model_type"]
    expected, _ = logprobs_in_process(module.policy, module.tokenizer)
    torch.testing.assert_close(logprobs_elsewhere(target)[0], expected, rtol=0, atol=1e-5)
    module.save_pretrained(target, overwrite=True)
    assert {p.name for p in target.iterdir()} == names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".exported.")]  # no temporary folder left
    # an empty folder is taken as it is; a file is not a folder
    (tmp_path / "empty").mkdir()
    module.save_pretrained(tmp_path / "empty")
    with pytest.raises(FileExistsError, match="is a file"):
        module.save_pretrained(tmp_path / "last.ckpt", overwrite=True)


def test_export_errors_name_the_file(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "polopt_lightning.export", str(tmp_path / "missing.ckpt"),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"no checkpoint file at {tmp_path / 'missing.ckpt'}" in proc.stderr
    torch.save({"state_dict": {}}, tmp_path / "foreign.ckpt")
    with pytest.raises(ValueError, match="foreign.ckpt holds no model config"):
        export_checkpoint(tmp_path / "foreign.ckpt", tmp_path / "out")
    # the README's best.ckpt where the run wrote none (no validation split): what the folder holds instead
    with pytest.raises(FileNotFoundError, match=r"no checkpoint file at .*best\.ckpt; .* holds foreign\.ckpt \(best\.ckpt is "
                                                r"written by a run that validates"):
        export_checkpoint(tmp_path / "best.ckpt", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint file at .*; .*nowhere does not exist"):
        export_checkpoint(tmp_path / "nowhere" / "last.ckpt", tmp_path / "out")
    (tmp_path / "run" / ".hydra").mkdir(parents=True)  # a run that wrote no checkpoint
    with pytest.raises(FileNotFoundError, match=r"run is a folder, and .*run/checkpoints holds no checkpoint; give a checkpoint file"):
        export_checkpoint(tmp_path / "run", tmp_path / "out")


def test_model_path_errors_name_the_path_and_what_was_looked_for(tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model.name_or_path='\./no_such_model': no such folder"):
        load_pretrained("./no_such_model")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        load_pretrained(str(empty))
    (empty / "weights.bin").write_text("x")
    with pytest.raises(NotADirectoryError, match="weights.bin' is a file"):
        load_pretrained(str(empty / "weights.bin"))
    model, tok = tiny
    model.save_pretrained(tmp_path / "no_tokenizer")  # weights without a tokenizer
    with pytest.raises(FileNotFoundError, match=r"(?s)no_tokenizer.*has no tokenizer\.json or tokenizer_config\.json"):
        load_pretrained(str(tmp_path / "no_tokenizer"))
    tok.save_pretrained(tmp_path / "tokenizer_only")
    loaded, _ = load_pretrained(str(tmp_path / "no_tokenizer"), tokenizer_name_or_path=str(tmp_path / "tokenizer_only"))
    assert loaded.config.hidden_size == model.config.hidden_size


def test_a_loaded_policy_trains_in_training_mode(tiny, tmp_path):
    """`from_pretrained` returns eval mode; the module puts the policy in training mode (gradient checkpointing and
    dropout act only there), and sampling still runs in eval mode and gives the mode back."""
    model, tok = tiny
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    loaded, tok = load_pretrained(str(tmp_path / "m"), dtype="float32")
    assert not loaded.training  # what transformers hands over
    module = PolicyOptimizationModule(loaded, tok, reward_fns=[ExactMatchReward()], experience={"num_generations": 2},
                                      generation={"max_new_tokens": 2}, update={"gradient_checkpointing": True})
    assert all(m.training for m in module.policy.modules())
    batch = PromptDataModule(train=[{"prompt": "1+1=", "answer": "2"}], tokenizer=tok, batch_size=1).collate(
        [{"prompt": "1+1=", "answer": "2"}])
    module.rollout(batch, module.sampling, 2)
    assert all(m.training for m in module.policy.modules())


def _tree(folder):
    """Every file under ``folder`` with its bytes, by relative path."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_into_the_run_it_reads_is_refused_and_every_file_survives(tiny, tmp_path, monkeypatch, capsys):
    """Issue 49: `polopt-export run/checkpoints/best.ckpt run --overwrite` deleted the run folder, the checkpoint it
    was exporting with it. The checkpoint's folder and every folder above it are refused, naming both paths."""
    from polopt_lightning.export import main

    module, trainer = trained_module(tiny, tmp_path / "train")
    run = tmp_path / "run"
    trainer.save_checkpoint(run / "checkpoints" / "best.ckpt", weights_only=False)
    trainer.save_checkpoint(run / "checkpoints" / "last.ckpt", weights_only=False)
    (run / "results.json").write_text('{"steps": 3}')
    (run / "notes.txt").write_text("mine")
    module.save_pretrained(run / "model")
    before = _tree(run)
    monkeypatch.chdir(tmp_path)  # the command line of the issue, relative paths and all
    for out in ("run", "run/checkpoints", "."):
        for extra in (["--overwrite"], []):
            with pytest.raises(SystemExit) as exit_info:
                main(["run/checkpoints/best.ckpt", out, *extra])
            assert exit_info.value.code == 2
            err = capsys.readouterr().err
            assert f"the output folder {out} holds the checkpoint being exported (run/checkpoints/best.ckpt)" in err
            assert _tree(run) == before, (out, extra)
    with pytest.raises(SystemExit):  # the checkpoint itself as the output
        main(["run/checkpoints/best.ckpt", "run/checkpoints/best.ckpt", "--overwrite"])
    assert "is the checkpoint being exported" in capsys.readouterr().err
    # drop-in: the run folder is not an export either, so save_pretrained(overwrite=True) leaves it too
    with pytest.raises(FileExistsError, match=r"(?s)is not a previous export: it holds checkpoints/, model/, "
                                              r"notes.txt, results.json.*nothing was deleted"):
        module.save_pretrained(run, overwrite=True)
    trainer.save_checkpoint(tmp_path / "other.ckpt", weights_only=False)  # a checkpoint from elsewhere, into the run
    with pytest.raises(FileExistsError, match=f"{run} is not a previous export"):
        export_checkpoint(tmp_path / "other.ckpt", run, overwrite=True)
    assert _tree(run) == before
    # beside the run it works, and a rerun replaces its own export
    for _ in range(2):
        main(["run/checkpoints/best.ckpt", "run/model", "--overwrite"])
    assert "saved run/model" in capsys.readouterr().out
    assert {k: v for k, v in _tree(run).items() if not k.startswith("model/")} == {
        k: v for k, v in before.items() if not k.startswith("model/")}


def test_overwrite_replaces_a_previous_export_whole_and_refuses_a_folder_with_anything_else(tiny, tmp_path):
    module, trainer = trained_module(tiny, tmp_path)
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt, weights_only=False)
    out = export_checkpoint(ckpt, tmp_path / "exported")
    marker = json.loads((out / "polopt_export.json").read_text())
    written = sorted(p.name for p in out.iterdir())
    assert marker["files"] == [n for n in written if n != "polopt_export.json"] and "model.safetensors" in written
    assert marker["source"] == str(ckpt)
    # a stale shard and index of an older, sharded export (its marker lists them): replaced whole, none left
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old")
    (out / "model.safetensors.index.json").write_text("{}")
    stale = {**marker, "files": marker["files"] + ["model-00001-of-00002.safetensors", "model.safetensors.index.json"]}
    (out / "polopt_export.json").write_text(json.dumps(stale))
    export_checkpoint(ckpt, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == written
    # an export from before the marker: Hugging Face's file names are all it may hold
    (out / "polopt_export.json").unlink()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old")
    export_checkpoint(ckpt, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == written
    module.save_pretrained(out, overwrite=True)  # the module's own export is one too
    assert sorted(p.name for p in out.iterdir()) == written
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".exported.")]  # no temporary folder left
    # anything an export did not write: refused, listed, kept
    # (a README.md or vocab.txt of the user's too: a marked export may hold only the files its marker lists)
    for foreign in ("notes.txt", "results.json", "eval/scores.csv", "README.md", "vocab.txt"):
        (out / foreign).parent.mkdir(exist_ok=True)
        (out / foreign).write_text("mine")
        before = _tree(out)
        shown = foreign.split("/")[0] + ("/" if "/" in foreign else "")
        for call in (lambda: export_checkpoint(ckpt, out, overwrite=True),
                     lambda: module.save_pretrained(out, overwrite=True)):
            with pytest.raises(FileExistsError, match=f"{out} is not a previous export: it holds {shown}"):
                call()
            assert _tree(out) == before
        proc = subprocess.run([sys.executable, "-m", "polopt_lightning.export", str(ckpt), str(out), "--overwrite"],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and f"it holds {shown}, which no export wrote" in proc.stderr, proc.stderr[-2000:]
        assert _tree(out) == before
        (out / foreign).unlink()
        if "/" in foreign:
            (out / foreign).parent.rmdir()
    export_checkpoint(ckpt, out, overwrite=True)  # an export again once they are gone
    assert sorted(p.name for p in out.iterdir()) == written
