"""The asynchronous pipeline (``experience.max_staleness``): each rollout is submitted that many training steps before it
is trained on, never older; the batches are trained in their order; the sampler correction sees the staleness; a run
resumed from a checkpoint with rollouts in flight ends with the uninterrupted run's weights."""

from __future__ import annotations

from concurrent.futures import Future

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from polopt_lightning import PolicyOptimizationModule, PromptDataModule
from polopt_lightning.callbacks import RolloutCheckpoint
from polopt_lightning.data import ArithmeticTask
from polopt_lightning.models import build_tiny_model
from polopt_lightning.rewards import ExactMatchReward
from polopt_lightning.rollout import build_engine
from polopt_lightning.step.experience import ExperienceConfig
from polopt_lightning.step.pipeline import RolloutPipeline

from .helpers import distinct_chars, free_port, start_server


def done(value):
    future = Future()
    future.set_result(value)
    return future


def test_the_pipeline_gives_each_rollout_back_after_exactly_max_staleness_updates():
    pipeline = RolloutPipeline(2)
    taken = []
    for step in range(7):
        pipeline.put({"step": step}, done(step))
        if pipeline.ready():
            item, staleness = pipeline.take()
            taken.append((item.batch["step"], item.rollout.result(), staleness))
            pipeline.trained()
    # in order; the first were sampled by the starting policy (0 and 1 updates before), then always 2
    assert taken == [(k, k, min(k, 2)) for k in range(5)]
    pipeline.version += 1  # an update the pipeline was not told of in order: the oldest is now too old
    pipeline.put({"step": 7}, done(7))
    with pytest.raises(RuntimeError, match=r"3 policy versions old.*experience\.max_staleness=2"):
        pipeline.take()
    with pytest.raises(ValueError, match=r"experience\.max_staleness"):
        ExperienceConfig(max_staleness=-1)


def test_a_failed_step_leaves_the_pipeline_as_before_and_a_lost_rollout_is_saved_to_be_sampled_again():
    from polopt_lightning.rollout import RolloutBatch

    pipeline = RolloutPipeline(1)
    rows = torch.zeros(2, 3, dtype=torch.long)
    sampled = RolloutBatch(prompt_ids=rows, prompt_mask=rows, completion_ids=rows, completion_mask=rows,
                           sampling_logprobs=rows.float(), finished=torch.zeros(2, dtype=torch.bool), group_size=2)
    pipeline.put({"step": 0, "ids": rows}, done(sampled))
    lost = Future()
    lost.set_exception(RuntimeError("the server died"))
    pipeline.put({"step": 1, "ids": rows}, lost)
    due, _ = pipeline.take()
    pipeline.undo(due)  # the step that took step 0's rollout (and put step 1's) failed
    assert [item.batch["step"] for item in pipeline.queue] == [0] and pipeline.version == 0
    pipeline.put({"step": 1, "ids": rows}, lost)
    state = pipeline.state_dict()
    assert state["max_staleness"] == 1 and [r["rollout"] is None for r in state["in_flight"]] == [False, True]
    again = RolloutPipeline(1)
    again.load_state_dict(state, torch.device("cpu"))
    assert again.queue[1].rollout is None and torch.equal(again.queue[0].rollout.result().completion_ids, rows)


class Recorder:
    """A reward that records the prompts it scores, in order."""

    __name__ = "recorder"

    def __init__(self):
        self.seen = []

    def __call__(self, prompts, completions, **kwargs):
        self.seen.append(list(dict.fromkeys(prompts)))
        return distinct_chars(prompts, completions)


def fit(tmp_path, steps, engine, staleness, recorder=None, callbacks=(), ckpt_path=None, seed=0):
    model, tok = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    rewards = [ExactMatchReward(), distinct_chars] if recorder is None else [recorder]
    module = PolicyOptimizationModule(model, tok, reward_fns=rewards, experience={"num_generations": 4,
                                      "max_staleness": staleness}, generation={"max_new_tokens": 4},
                                      optimizer={"lr": 1e-3}, rollout_engine=engine, seed=seed)
    dm = PromptDataModule(task=ArithmeticTask(digits=1, train_size=40, val_size=4, seed=0), tokenizer=tok,
                          batch_size=2, seed=0)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=CSVLogger(tmp_path, name="csv"),
                        callbacks=list(callbacks), enable_checkpointing=bool(callbacks), enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1, limit_val_batches=0)
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return module, dm, trainer


def logged(trainer, key):
    import csv

    path = trainer.logger.log_dir + "/metrics.csv"
    return [float(r[key]) for r in csv.DictReader(open(path)) if r.get(key)]


@pytest.mark.parametrize("staleness", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2: in -m slow
def test_with_a_server_each_rollout_is_trained_max_staleness_updates_later_in_the_batches_order(tmp_path, staleness):
    port = free_port()
    proc = start_server(port, "--threads", "1")
    try:
        recorder = Recorder()
        engine = {"name": "server", "servers": f"127.0.0.1:{port}", "timeout_s": 60}
        module, dm, trainer = fit(tmp_path, 5, engine, staleness, recorder)
    finally:
        proc.kill()
        proc.wait()
    assert trainer.global_step == 5
    # each trained rollout was sampled `staleness` updates before (the first ones: by the starting policy, fewer)
    assert logged(trainer, "train/staleness") == [float(min(k, staleness)) for k in range(5)]
    assert len(logged(trainer, "train/is_weight_mean")) == 5  # the sampler correction on (rollout=server's default)
    # the rollouts trained on are the loader's batches, in order, none skipped
    loader = iter(dm.train_dataloader())
    batches = [next(loader)["prompts"] for _ in range(5)]
    assert recorder.seen == batches
    # the pipeline still holds the last `staleness` rollouts, submitted and never trained on
    assert len(module.pipeline.queue) == staleness and module.pipeline.version == 5


def test_an_in_process_backend_is_told_it_does_not_overlap_and_still_keeps_the_bound(tmp_path):
    with pytest.warns(UserWarning, match=r"experience\.max_staleness=1: the HFRolloutEngine backend samples in the "
                                         r"training process"):
        module, _, trainer = fit(tmp_path, 3, None, 1)
    assert logged(trainer, "train/staleness") == [0.0, 1.0, 1.0]
    # a rollback (the weights replaced outside an optimizer step): the rollouts in flight, sampled by the weights
    # replaced, are dropped, and a backend with weights of its own is told to push again
    assert len(module.pipeline.queue) == 1
    module.engine = build_engine({"name": "server", "servers": "127.0.0.1:1"})
    module.engine._stale = False
    module.policy_replaced()
    assert not module.pipeline.queue and module.engine._stale


def test_a_run_resumed_with_rollouts_in_flight_ends_with_the_uninterrupted_runs_weights(tmp_path):
    whole, _, _ = fit(tmp_path / "whole", 6, None, 2)
    saves = RolloutCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, filename="{step}")
    first, _, _ = fit(tmp_path / "first", 3, None, 2, callbacks=[saves])
    assert len(first.pipeline.queue) == 2  # two rollouts in flight at the checkpoint
    state = torch.load(tmp_path / "ckpt" / "step=3.ckpt", map_location="cpu", weights_only=True)
    saved = state["polopt"]["pipeline"][0]
    assert saved["version"] == 3 and [r["version"] for r in saved["in_flight"]] == [1, 2]
    resumed, _, trainer = fit(tmp_path / "resumed", 6, None, 2, ckpt_path=tmp_path / "ckpt" / "step=3.ckpt")
    assert trainer.global_step == 6
    for (name, a), b in zip(whole.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), name
    # resumed with another bound: refused, naming the key (the rollouts in flight would be of the wrong age)
    with pytest.raises(ValueError, match=r"experience\.max_staleness=2; resume with the same experience\."
                                         r"max_staleness and processes \(this run: 1, 1\)"):
        fit(tmp_path / "other", 6, None, 1, ckpt_path=tmp_path / "ckpt" / "step=3.ckpt")


def test_a_run_with_a_server_resumed_with_rollouts_in_flight_ends_with_the_uninterrupted_runs_weights(tmp_path):
    # the server samples each request with a seed the trainer draws from its own (checkpointed) generator, and a
    # resumed trainer sends the server its weights again: the server's own state is never needed for an exact resume
    port = free_port()
    proc = start_server(port, "--threads", "1")
    try:
        engine = {"name": "server", "servers": f"127.0.0.1:{port}", "timeout_s": 60}
        whole, _, _ = fit(tmp_path / "whole", 5, engine, 1)
        saves = RolloutCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
        first, _, _ = fit(tmp_path / "first", 2, engine, 1, callbacks=[saves])
        assert len(first.pipeline.queue) == 1  # a rollout in flight at the checkpoint, sampled by the server
        resumed, _, trainer = fit(tmp_path / "resumed", 5, engine, 1, ckpt_path=tmp_path / "ckpt" / "step=2.ckpt")
    finally:
        proc.kill()
        proc.wait()
    assert trainer.global_step == 5
    assert logged(trainer, "train/staleness") == [1.0, 1.0, 1.0]
    for (name, a), b in zip(whole.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), name
