"""Exact resume: a CLI run killed with SIGKILL after a checkpoint and resumed logs what the uninterrupted run logs.

Also: the data position, every random state and the callbacks' state are in the checkpoint, and a checkpoint file is
never left half-written.
"""

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from polopt_lightning.callbacks import AtomicCheckpointIO

from .helpers import FAST, run_cli

# a reward that takes a little time, so the run is still going when the test kills it after the first checkpoint
SLOW_REWARD = (
    "import time\n"
    "def reward(prompts, completions, **kw):\n"
    "    time.sleep(0.15)\n"
    "    return [float(len(c) % 3) for c in completions]\n"
)
RUN = FAST + [
    "trainer.max_steps=24", "data.batch_size=3", "task.train_size=16", "experience.num_generations=3",
    "callbacks.checkpoint.every_n_train_steps=4", "trainer.val_check_interval=3", "logger.csv.flush_logs_every_n_steps=1",
    "num_threads=1", "+reward.functions.slow._target_=hydra.utils.get_method",
    "+reward.functions.slow.path=slow_reward.reward", "optimizer.lr=1e-3",
]


def _popen(args, cwd):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(cwd)}
    return subprocess.Popen([sys.executable, "-m", "polopt_lightning", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rows(path: Path) -> dict[tuple[int, str], dict[str, float]]:
    """Logged rows by (step, kind): kind "train" for a training step's metrics, "val" for a validation's."""
    out = {}
    for row in csv.DictReader(open(path)):
        values = {k: float(v) for k, v in row.items() if v not in ("", None) and k not in ("epoch", "step")}
        if not values:
            continue
        kind = "train" if any(k.startswith("train/") for k in values) else "val"
        out[(int(row["step"]), kind)] = values
    return out


def test_killed_and_resumed_run_logs_the_uninterrupted_runs_metrics(tmp_path):
    (tmp_path / "slow_reward.py").write_text(SLOW_REWARD)
    # 24 optimizer steps = 12 rollouts of 3 prompts; 16 prompts make 5 batches an epoch: the run crosses epochs
    whole = _popen(RUN + [f"hydra.run.dir={tmp_path}/whole"], tmp_path)
    killed = _popen(RUN + [f"hydra.run.dir={tmp_path}/killed"], tmp_path)
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    deadline = time.time() + 240
    while not last.is_file() and killed.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert killed.poll() is None, "the run ended before the test could kill it: make it longer"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    # the CSV's step column counts rollouts (Lightning's batches that stepped): 2 optimizer steps each here
    step = torch.load(last, map_location="cpu", weights_only=True)["global_step"] // 2
    assert 0 < step < 12
    out, err = whole.communicate(timeout=300)
    assert whole.returncode == 0, err[-3000:]

    resumed = _popen(RUN + [f"hydra.run.dir={tmp_path}/killed", f"ckpt_path={last}"], tmp_path)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert "not resumable" not in err  # Lightning's warning for a loader that restarts its epoch
    assert "warm start: skipped, the run resumes from" in out + err  # what follows holds without the warm start

    expected = _rows(tmp_path / "whole" / "csv" / "version_0" / "metrics.csv")
    before = _rows(tmp_path / "killed" / "csv" / "version_0" / "metrics.csv")
    assert (step - 1, "train") in before  # the killed run's own log is still there (rollouts 0 .. step-1 done)
    got = _rows(tmp_path / "killed" / "csv" / "version_1" / "metrics.csv")
    resumed_keys = sorted(got)  # the resumed run logs its own steps only (no validation "before" on a resume)
    assert len([k for k in resumed_keys if k[1] == "train"]) == 12 - step  # one row per rollout
    assert any(k[1] == "val" for k in resumed_keys)
    for key in resumed_keys:
        assert key in expected, f"the resumed run logged {key}, the uninterrupted one did not"
        assert got[key].keys() == expected[key].keys(), key
        for name, value in got[key].items():
            assert math.isclose(value, expected[key][name], rel_tol=1e-6, abs_tol=1e-7), (key, name, value,
                                                                                        expected[key][name])
    # same final policy, same results (the best validation too: the history came back with the checkpoint)
    a = json.loads((tmp_path / "whole" / "results.json").read_text())
    b = json.loads((tmp_path / "killed" / "results.json").read_text())
    for key in ("steps", "val_accuracy_before", "val_accuracy_after", "val_accuracy_best", "val_accuracy_best_step",
                "val_history"):
        assert a[key] == b[key], key
    from safetensors.torch import load_file

    wa = load_file(tmp_path / "whole" / "model" / "model.safetensors")
    wb = load_file(tmp_path / "killed" / "model" / "model.safetensors")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-6


class _WatchedIO(AtomicCheckpointIO):
    """Records, each time a checkpoint file appears, its step and the training steps the CSV on disk holds then."""

    def __init__(self, csv_path):
        super().__init__()
        self.csv_path, self.seen = csv_path, []

    def _appeared(self, target):
        rows = _rows(self.csv_path) if self.csv_path.is_file() else {}
        steps = sorted(step for step, kind in rows if kind == "train")
        self.seen.append((target.name, torch.load(target, weights_only=True)["global_step"], steps))

    def release(self):
        held = self.held
        super().release()
        for target in held:
            self._appeared(target)

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        super().save_checkpoint(checkpoint, path, storage_options)
        if not self.holding:
            self._appeared(Path(path))


def test_a_checkpoint_appears_only_once_the_log_holds_every_step_it_covers(tmp_path, tiny, arithmetic_rows):
    """Lightning saves at a step's end before it logs the step: the file waits until the step's row is on disk."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from polopt_lightning import PolicyOptimizationModule, PromptDataModule
    from polopt_lightning.callbacks import RolloutCheckpoint
    from polopt_lightning.data import ArithmeticTask
    from polopt_lightning.rewards import ExactMatchReward

    model, tok = tiny
    logger = CSVLogger(tmp_path, name="csv", version=0, flush_logs_every_n_steps=100)  # never flushed by itself here
    io = _WatchedIO(tmp_path / "csv" / "version_0" / "metrics.csv")
    checkpoint = RolloutCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=2, monitor="step",
                                   mode="max", filename="{step}", save_last=True)
    module = PolicyOptimizationModule(model, tok, reward_fns=[ExactMatchReward()], experience={"num_generations": 2},
                                      generation={"max_new_tokens": 3}, optimizer={"lr": 1e-3}, seed=0)
    dm = PromptDataModule(task=ArithmeticTask(digits=1, train_size=40, val_size=4, seed=0), tokenizer=tok,
                          batch_size=2, seed=0)
    every_step = RolloutCheckpoint(dirpath=tmp_path / "all", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(max_steps=7, accelerator="cpu", logger=logger, callbacks=[every_step, checkpoint], plugins=[io],
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        val_check_interval=3, log_every_n_steps=1)
    trainer.fit(module, datamodule=dm)
    # one optimizer step per training step: the checkpoints at steps 2, 4, 6 (as top-k files and as last.ckpt)
    assert sorted({(name, step) for name, step, _ in io.seen}) == sorted(
        [("last.ckpt", 2), ("last.ckpt", 4), ("last.ckpt", 6), ("step=2.ckpt", 2), ("step=4.ckpt", 4),
         ("step=6.ckpt", 6)] + [(f"step={k}.ckpt", k) for k in (1, 3, 5, 7)])  # and the other callback's, every step
    for name, step, logged in io.seen:  # the CSV's step column counts training steps from 0
        assert logged == list(range(step)), (name, step, logged)
    # top-2: the step-2 file went once the step-6 one was in place
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["last.ckpt", "step=4.ckpt", "step=6.ckpt"]
    assert len(list((tmp_path / "all").iterdir())) == 7


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("killed while saving")


def test_a_failed_save_leaves_the_previous_checkpoint_whole(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"global_step": 4, "w": torch.ones(3)}, path)
    with pytest.raises(RuntimeError, match="killed while saving"):
        io.save_checkpoint({"global_step": 8, "w": torch.zeros(3), "bad": _Unpicklable()}, path)
    assert torch.load(path, weights_only=True)["global_step"] == 4
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no temporary file left behind


def test_no_exception_checkpoint_under_several_processes(tmp_path, caplog):
    """Saving is collective: one process that raised cannot save alone (it would wait for the others forever)."""
    from types import SimpleNamespace

    from polopt_lightning.callbacks import ExceptionCheckpoint

    saved = []
    trainer = SimpleNamespace(world_size=2, global_step=4, save_checkpoint=saved.append)
    with caplog.at_level("INFO"):
        ExceptionCheckpoint(tmp_path).on_exception(trainer, None, RuntimeError("boom"))
    assert saved == [] and "last.ckpt is the resume point" in caplog.text
    ExceptionCheckpoint(tmp_path).on_exception(SimpleNamespace(world_size=1, global_step=4, save_checkpoint=saved.append),
                                               None, RuntimeError("boom"))
    assert saved == [str(tmp_path / "on_exception.ckpt")]
    # before the first optimizer step there is nothing to save (and an earlier failure's file stays)
    with caplog.at_level("INFO"):
        ExceptionCheckpoint(tmp_path).on_exception(SimpleNamespace(world_size=1, global_step=0,
                                                                   save_checkpoint=saved.append), None, ValueError())
    assert saved == [str(tmp_path / "on_exception.ckpt")] and "before its first optimizer step" in caplog.text


# Ctrl-C at the start of the rollout after optimizer step INTERRUPT_AT (set in the environment of the first run only:
# a resume replays the run's overrides, this callback's among them)
INTERRUPT = (
    "import os, signal\n"
    "import lightning as L\n"
    "class InterruptAt(L.Callback):\n"
    "    def on_train_batch_start(self, trainer, *args, **kwargs):\n"
    "        at = os.environ.get('INTERRUPT_AT')\n"
    "        if at and trainer.global_step >= int(at):\n"
    "            if os.environ.get('INTERRUPT_SIGNAL') == 'TERM':  # as a scheduler stops a job\n"
    "                os.environ.pop('INTERRUPT_AT')\n"
    "                os.kill(os.getpid(), signal.SIGTERM)\n"
    "            else:\n"
    "                raise KeyboardInterrupt\n"
)


def test_a_sigterm_stops_the_run_with_a_failing_exit_and_says_how_to_resume(tmp_path):
    """A scheduler's SIGTERM: on_exception.ckpt saved, the resume command printed, and a non-zero exit (Lightning's
    SIGTERMException is a SystemExit with code 0, which made `polopt-train ... && polopt-export ...` go on)."""
    (tmp_path / "interrupt_cb.py").write_text(INTERRUPT)
    run = tmp_path / "run"
    proc = run_cli(FAST + ["trainer.max_steps=8", "+callbacks.interrupt._target_=interrupt_cb.InterruptAt",
                           f"hydra.run.dir={run}"], tmp_path,
                   {"PYTHONPATH": str(tmp_path), "INTERRUPT_AT": "2", "INTERRUPT_SIGNAL": "TERM"})
    console = proc.stdout + proc.stderr
    assert proc.returncode == 143, (proc.returncode, console[-3000:])
    assert f"Resume with: polopt-train ckpt_path={run}" in console, console[-3000:]
    assert (run / "checkpoints" / "on_exception.ckpt").is_file() and not (run / "results.json").exists()


def test_periodic_checkpoints_come_whenever_the_step_crosses_their_period(tmp_path):
    """A rollout makes several optimizer steps (2 here), so `global_step % every_n_train_steps` can skip every save
    (every 5 steps: 2, 4, 6, 8 never land on 5; after a resume mid-rollout the steps are odd and never land on an even
    period): a save comes at the first step past each multiple."""
    (tmp_path / "interrupt_cb.py").write_text(INTERRUPT)
    run = tmp_path / "run"
    proc = run_cli(FAST + ["trainer.max_steps=12", "callbacks.checkpoint.every_n_train_steps=5",
                           "+callbacks.interrupt._target_=interrupt_cb.InterruptAt", f"hydra.run.dir={run}"],
                   tmp_path, {"PYTHONPATH": str(tmp_path), "INTERRUPT_AT": "8"})
    assert proc.returncode != 0, proc.stderr[-3000:]  # stopped at step 8, before the end's own save
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6  # past 5


def _listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


def test_an_interrupted_run_resumes_by_its_folder_from_its_newest_checkpoint(tmp_path):
    """Issue 49: Ctrl-C before the first last.ckpt leaves on_exception.ckpt and best.ckpt; the interrupt names the
    command that resumes, `ckpt_path=<run>` resumes from on_exception.ckpt at its step, and the README's former
    `ckpt_path=<run>/checkpoints/last.ckpt` is refused listing what is there, writing nothing."""
    (tmp_path / "interrupt_cb.py").write_text(INTERRUPT)
    run = tmp_path / "run"
    env = {"PYTHONPATH": str(tmp_path)}
    proc = run_cli(FAST + ["trainer.max_steps=8", "logger.csv.flush_logs_every_n_steps=1",
                           "+callbacks.interrupt._target_=interrupt_cb.InterruptAt", f"hydra.run.dir={run}"],
                   tmp_path, {**env, "INTERRUPT_AT": "4"})
    console = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Detected KeyboardInterrupt" in console, console[-3000:]
    folder = run / "checkpoints"
    steps = {p.name: torch.load(p, weights_only=True)["global_step"] for p in folder.glob("*.ckpt")}
    assert steps == {"on_exception.ckpt": 4, "best.ckpt": 0}, steps  # no last.ckpt: it comes every 50 steps
    assert f"the newest checkpoint is {folder / 'on_exception.ckpt'} (step 4). Resume with: polopt-train " \
           f"ckpt_path={run}" in console, console[-3000:]

    before = _listing(run)
    proc = run_cli([f"ckpt_path={folder / 'last.ckpt'}"], tmp_path, env)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert (f"ckpt_path={folder / 'last.ckpt'}: no such checkpoint; {folder} holds on_exception.ckpt (step 4), "
            f"best.ckpt (step 0); resume from the newest (on_exception.ckpt) with ckpt_path={run}") in proc.stderr
    assert _listing(run) == before

    proc = run_cli([f"ckpt_path={run}"], tmp_path, env)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-3000:]
    assert f"ckpt_path={run}: resuming from {folder / 'on_exception.ckpt'} (step 4)" in console, console[-3000:]
    assert json.loads((run / "results.json").read_text())["steps"] == 8
    # the CSV's step counts rollouts of 2 optimizer steps: the first run logged rollouts 0, 1; the resumed one 2, 3
    first = _rows(run / "csv" / "version_0" / "metrics.csv")
    resumed = _rows(run / "csv" / "version_1" / "metrics.csv")
    assert sorted(step for step, kind in first if kind == "train") == [0, 1]
    assert sorted(step for step, kind in resumed if kind == "train") == [2, 3]


def _fake_checkpoint(path: Path, step: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "state_dict": {"w": torch.zeros(2)}}, path)


def test_a_run_folder_means_its_newest_checkpoint_by_step(tmp_path):
    """The rule: the highest stored global_step; on a tie any file before best.ckpt, then the newest file; step 0
    (the starting policy) never; temporary files never. Its checkpoints/ folder means the same."""
    from polopt_lightning.cli import checkpoints_in, resume_overrides, resume_point

    folder = tmp_path / "run" / "checkpoints"
    _fake_checkpoint(folder / "best.ckpt", 0)
    assert resume_point(folder) is None
    with pytest.raises(SystemExit, match=r"no checkpoint to resume from: .* holds best.ckpt \(step 0\); none is past "
                                         r"step 0"):
        resume_overrides([f"ckpt_path={tmp_path / 'run'}"])
    _fake_checkpoint(folder / "on_exception.ckpt", 6)
    _fake_checkpoint(folder / "last.ckpt", 4)  # written after on_exception.ckpt, but at an earlier step
    _fake_checkpoint(folder / ".last.ckpt.x1y2.tmp", 99)  # a save cut short
    assert resume_point(folder) == (folder / "on_exception.ckpt", 6)
    _fake_checkpoint(folder / "best.ckpt", 6)  # as new as on_exception.ckpt, and written later: still not chosen
    _fake_checkpoint(folder / "step=8.ckpt", 8)
    assert [(p.name, s) for p, s in checkpoints_in(folder)] == [("step=8.ckpt", 8), ("on_exception.ckpt", 6),
                                                                 ("best.ckpt", 6), ("last.ckpt", 4)]
    for given in (tmp_path / "run", folder):  # not inside a run (no .hydra): the command line's own configuration
        argv = resume_overrides([f"ckpt_path={given}", "trainer.max_steps=9"])
        assert argv == [f"ckpt_path={folder / 'step=8.ckpt'}", "trainer.max_steps=9"], argv


def test_a_resume_skips_the_warm_start_and_a_refused_one_leaves_the_runs_configuration(tmp_path):
    """A resumed full fine-tuning run does not run the warm start again (its cache gone, it would train it anew):
    the checkpoint holds every weight it shapes. That the resumed run still ends as the uninterrupted one is
    test_killed_and_resumed_run_logs_the_uninterrupted_runs_metrics (its resume skips the warm start too).
    Before it, a resume refused by a setting: Hydra had written the composed configuration into the run's .hydra/,
    and the refusal puts the run's files back, so the corrected command resumes (it replayed the typo before)."""
    split, cache = tmp_path / "split", tmp_path / "cache"
    proc = run_cli(FAST + ["trainer.val_check_interval=100", "validate_before=false", "trainer.max_steps=2",
                           f"warm_start.cache_dir={cache}", f"hydra.run.dir={split}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "a supervised warm start on" in proc.stdout + proc.stderr
    saved = {f.name: f.read_bytes() for f in (split / ".hydra").glob("*.yaml")}
    proc = run_cli([f"ckpt_path={split}", "trainer.max_steps=4", "trainer.precision=bf16-mixd"], tmp_path)
    assert proc.returncode == 1 and "polopt-train: trainer.precision='bf16-mixd'" in proc.stderr, proc.stderr[-3000:]
    assert {f.name: f.read_bytes() for f in (split / ".hydra").glob("*.yaml")} == saved
    for entry in cache.iterdir():  # the cache is gone
        entry.unlink()
    proc = run_cli([f"ckpt_path={split}", "trainer.max_steps=4"], tmp_path)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-3000:]
    assert f"warm start: skipped, the run resumes from {split / 'checkpoints'}" in console, console[-3000:]
    assert "a supervised warm start on" not in console and not any(cache.iterdir())
    results = json.loads((split / "results.json").read_text())
    assert results["steps"] == 4 and results["warm_start_skipped"] is True
    # the finished run resumed again: nothing left to train, and the log says how to train on
    proc = run_cli([f"ckpt_path={split}"], tmp_path)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-3000:]
    assert ("the checkpoint is at step 4 and trainer.max_steps=4: nothing is left to train; trainer.max_steps=N "
            "(N > 4) trains on from it") in console, console[-3000:]


def test_which_resumes_skip_the_warm_start(tmp_path):
    """Only a resume from a checkpoint file skips it: not Lightning's keywords (``last`` with no checkpoint starts
    afresh), not under an adapter (its warm-started base is written first), not with a quantized reference (checked
    against the copy built from the warm-started weights)."""
    from omegaconf import OmegaConf

    from polopt_lightning.cli import _skips_warm_start

    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"")

    def skips(adapted=False, **cfg):
        return _skips_warm_start(OmegaConf.create(cfg), adapted)

    assert skips(ckpt_path=str(ckpt), reference={"quantization": "none"})
    assert not skips(ckpt_path=None)
    assert not skips(ckpt_path="last") and not skips(ckpt_path="best")
    assert not skips(ckpt_path=str(tmp_path / "missing.ckpt"))
    assert not skips(adapted=True, ckpt_path=str(ckpt))
    assert not skips(ckpt_path=str(ckpt), reference={"quantization": "nf4"})
