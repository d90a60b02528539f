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

from .helpers import FAST

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
