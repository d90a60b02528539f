"""Experiment loggers (TensorBoard, W&B offline, MLflow's file store) beside CSV, each read back from what it wrote,
and the completions table every N steps: in the run folder's JSON-lines file and in each logger that holds tables."""

import json

import pytest

from polopt_lightning.callbacks import CompletionsLog
from polopt_lightning.loggers import mlflow_logger, tensorboard_logger, wandb_has_key, wandb_logger

from .helpers import FAST, make, run_cli, run_if, trainer


def test_the_completions_log_writes_the_experience_rows_every_n_steps(tiny, arithmetic_rows, tmp_path):
    module, dm = make(tiny, arithmetic_rows, update={"mini_batches": 2})  # 2 optimizer steps per rollout
    log = CompletionsLog(every_n_steps=3, max_rows=5, path=str(tmp_path / "completions.jsonl"))
    t = trainer(tmp_path, steps=6, limit_val_batches=0, callbacks=[log])
    t.fit(module, datamodule=dm)
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    # steps 2, 4, 6 end the rollouts; the ones that cross 3 and 6 are logged: 4 and 6 (the last)
    assert sorted({r["step"] for r in rows}) == [4, 6] and len(rows) == 10
    assert set(rows[0]) == {"step", "prompt", "completion", "rewards/exact_match", "rewards/digit_match",
                            "rewards/distinct_chars", "advantage"}
    last = module.experience.last_samples  # the last step's rows: 4 prompts x 4 completions
    assert len(last["advantage"]) == 16 and abs(sum(last["advantage"][:4])) < 1e-5  # a group's advantages sum to 0
    assert rows[-5]["prompt"] == last["prompt"][0] and rows[-5]["completion"] == last["completion"][0]
    with pytest.raises(ValueError, match="callbacks.completions.every_n_steps must be >= 1"):
        CompletionsLog(every_n_steps=0)


def test_wandb_is_offline_without_a_key(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    monkeypatch.delenv("NETRC", raising=False)
    assert not wandb_has_key()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_has_key()


def test_a_missing_logger_package_names_its_extra(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] in ("tensorboard", "tensorboardX", "wandb",
                                                                          "mlflow") else real(name, *a))
    for make_logger, key in ((tensorboard_logger, "tensorboard"), (wandb_logger, "wandb"), (mlflow_logger, "mlflow")):
        with pytest.raises(ImportError, match=rf"logger={key} needs the {key} package: pip install "
                                              rf"'polopt-lightning\[{key}\]'"):
            make_logger(save_dir=str(tmp_path))


@run_if("tensorboard", "wandb", "mlflow")
def test_every_logger_from_the_command_line_holds_the_metrics_and_the_completions(tmp_path, monkeypatch):
    run = tmp_path / "run"
    env = {"WANDB_API_KEY": "", "WANDB_SILENT": "true", "HOME": str(tmp_path), "MLFLOW_TRACKING_URI": ""}
    proc = run_cli(FAST + ["logger=[csv,tensorboard,wandb,mlflow]", "trainer.max_steps=4",
                           "callbacks.completions.every_n_steps=2", f"hydra.run.dir={run}"], tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the JSON-lines file of the completions
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == {2, 4} and all("rewards/exact_match" in r for r in rows)

    # TensorBoard: the event file's scalars and the completions text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((run / "tensorboard").glob("version_*"))), size_guidance={"tensors": 0})
    events.Reload()
    assert len(events.Scalars("train/reward")) == 2  # one per rollout (2 optimizer steps each)
    assert "val/accuracy" in events.Tags()["scalars"]
    table = events.Tensors("completions/text_summary")
    assert [e.step for e in table] == [2, 4] and b"| step | prompt | completion |" in table[0].tensor_proto.string_val[0]

    # W&B offline: the run folder, its history and the table file
    offline = next((run / "wandb").glob("offline-run-*"))
    assert list(offline.glob("run-*.wandb"))
    tables = list((offline / "files" / "media" / "table").glob("completions_*.table.json"))
    assert len(tables) == 2
    table = json.loads(tables[0].read_text())
    assert table["columns"][:3] == ["step", "prompt", "completion"] and table["data"]

    # MLflow's file store: the metric history and the table artifacts
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when allowed

    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("polopt-lightning")
    (mlrun,) = client.search_runs([experiment.experiment_id])
    assert len(client.get_metric_history(mlrun.info.run_id, "train/reward")) == 2
    artifacts = [a.path for a in client.list_artifacts(mlrun.info.run_id, "completions")]
    assert artifacts == ["completions/step_000002.json", "completions/step_000004.json"]
