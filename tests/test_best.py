"""The best checkpoint and the best validation rank the starting policy (validated before fit) and the final one
(validated after fit), not only the validations inside fit."""

import lightning as L
import torch

from polopt_lightning import PolicyOptimizationModule, PromptDataModule
from polopt_lightning.callbacks import RolloutCheckpoint, ValidationHistory
from polopt_lightning.export import POLICY_PREFIX


class FadingAccuracy:
    """An accuracy that is 1 for the first validation's completions and 0 ever after: the policy only gets worse."""

    __name__ = "fading"

    def __init__(self, first_calls: int) -> None:
        self.calls, self.first_calls = 0, first_calls

    def __call__(self, prompts, completions, **kw):
        self.calls += 1
        return [1.0 if self.calls <= self.first_calls else 0.0] * len(completions)


def _fit(tiny, arithmetic_rows, tmp_path, val_check_interval):
    model, tok = tiny
    train, val = arithmetic_rows
    data = PromptDataModule(train=train, val=val, tokenizer=tok, batch_size=2, val_batch_size=len(val))
    def length(prompts, completions, **kw):  # what training follows (the accuracy is weighted 0)
        return [float(len(c)) for c in completions]

    module = PolicyOptimizationModule(model, tok, reward_fns=[FadingAccuracy(first_calls=1), length],
                                      reward_weights=[0.0, 1.0], experience={"num_generations": 4},
                                      generation={"max_new_tokens": 4}, optimizer={"lr": 1e-2})
    start = {k: v.clone() for k, v in module.policy.state_dict().items()}
    best = RolloutCheckpoint(dirpath=tmp_path, filename="best", monitor="val/accuracy", mode="max", save_top_k=1,
                             enable_version_counter=False, auto_insert_metric_name=False)
    history = ValidationHistory()
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[best, history], num_sanity_val_steps=0,
                        val_check_interval=val_check_interval, check_val_every_n_epoch=None,
                        default_root_dir=str(tmp_path))
    trainer.validate(module, datamodule=data, verbose=False)  # the start: accuracy 1
    trainer.fit(module, datamodule=data)
    trainer.validate(module, datamodule=data, verbose=False)  # the final policy: accuracy 0
    return module, start, history


def test_a_run_that_only_gets_worse_keeps_its_start_as_best(tiny, arithmetic_rows, tmp_path):
    module, start, history = _fit(tiny, arithmetic_rows, tmp_path, val_check_interval=1)
    assert [r["val/accuracy"] for r in history.records] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert history.best()["step"] == 0 and history.best()["val/accuracy"] == 1.0
    saved = torch.load(tmp_path / "best.ckpt", weights_only=True)
    assert saved["global_step"] == 0
    policy = {k[len(POLICY_PREFIX):]: v for k, v in saved["state_dict"].items() if k.startswith(POLICY_PREFIX)}
    assert all(torch.equal(policy[k], v) for k, v in start.items())  # the starting weights
    trained = module.policy.state_dict()
    assert any(not torch.equal(trained[k], v) for k, v in start.items())  # while training did change them


def test_a_run_with_no_validation_inside_fit_still_has_a_best_checkpoint(tiny, arithmetic_rows, tmp_path):
    _, _, history = _fit(tiny, arithmetic_rows, tmp_path, val_check_interval=1000)
    assert [r["fitting"] for r in history.records] == [False, False]
    assert (tmp_path / "best.ckpt").is_file() and history.best()["step"] == 0
