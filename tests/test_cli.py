"""Hydra CLI: every config group value composes and builds; a short run writes metrics.csv and results.json."""

import csv
import json
import math
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from polopt_lightning.cli import MOVED_KEYS, check_config, train

from .helpers import CONF, FAST, compose_with, run_cli, set_hydra

GROUPS = ["model", "quantization", "adapter", "objective", "task", "reward", "anchor", "weights", "optimizer", "trainer",
          "strategy", "logger", "callbacks", "rollout", "experiment"]


def group_values(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,value", [(g, v) for g in GROUPS for v in group_values(g)])
def test_every_group_value_composes_and_builds(group, value, tmp_path):
    overrides = [f"{group}={value}"]
    if group == "model" and value == "pretrained":
        overrides.append(f"model.name_or_path={tmp_path}/m")
    if group == "task" and value == "jsonl":
        overrides.append(f"task.train={tmp_path}/train.jsonl")
    if group == "task" and value == "dataset":  # local JSON lines through datasets.load_dataset
        overrides += ["task.path=json", f"task.data_files={tmp_path}/train.jsonl"]
    if group == "reward" and value == "model":  # a saved causal LM loads as a classifier (a fresh score head)
        overrides.append(f"reward.functions.reward_model.model={tmp_path}/m")
    cfg = compose_with(overrides, tmp_path)
    set_hydra(cfg)
    check_config(cfg)  # every shipped value has the type what takes it asks for
    node = cfg.get(group)
    if group == "experiment":
        assert cfg.objective.name  # an experiment sets a whole recipe
        instantiate(cfg.objective)
        return
    if (group, value) in (("model", "pretrained"), ("reward", "model")):
        from polopt_lightning.models import build_tiny_model

        model, tok = build_tiny_model(hidden_size=16, num_layers=1, num_heads=2)
        model.save_pretrained(tmp_path / "m")
        tok.save_pretrained(tmp_path / "m")
    if group == "task" and value in ("jsonl", "dataset"):
        (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    if group in ("quantization", "adapter"):
        from polopt_lightning.models import as_adapter, as_quantization

        built = (as_quantization if group == "quantization" else as_adapter)(OmegaConf.to_container(node))
        assert built.enabled is (value != "none")
        return
    if group == "strategy":
        from polopt_lightning.strategies import strategy_kind

        kind = strategy_kind(OmegaConf.to_container(node))
        assert kind == ("auto" if value == "auto" else value.split("_")[0])
        if kind in ("ddp", "fsdp"):  # Lightning's strategy objects (deepspeed needs its package: tests/test_gpu.py)
            model, _ = instantiate(OmegaConf.merge(cfg.model, {"hidden_size": 16, "num_layers": 1}))
            assert instantiate(node)(model=model) is not None
        return
    if group == "optimizer":
        factory = instantiate(node)
        assert factory.keywords["name"] == value and factory.keywords["lr"] == cfg.optimizer.lr
        return
    if group == "task":  # as the CLI builds it: a mixture's reward overrides apart, its tasks built
        task_cfg = OmegaConf.to_container(node, resolve=True)
        task_cfg.pop("rewards", None)
        train_rows, _ = instantiate(task_cfg, _convert_="all").splits()
        assert train_rows and all("prompt" in r for r in train_rows)
        return
    if group == "reward" and value == "task":
        assert node.from_task
        return
    if group == "anchor":
        built = instantiate(node) if node else None
        assert (built is None) == (value == "none") and (built is None or built.schedule == value.replace("_", "-"))
        return
    if group == "weights":
        assert instantiate(node.tasks).mode == value and instantiate(node.rewards).fade == {}
        return
    if group == "rollout":  # as the CLI builds it, before anything loads
        from polopt_lightning.cli import _built_early
        from polopt_lightning.rollout import RolloutEngine
        from polopt_lightning.rollout.vllm import vllm_available

        if value == "vllm" and not vllm_available():
            with pytest.raises(ValueError, match=r"rollout=vllm needs vLLM: pip install 'polopt-lightning\[vllm\]'"):
                _built_early(cfg, group)
            return
        engine = _built_early(cfg, group)
        assert isinstance(engine, RolloutEngine) and type(engine).__name__ == node._target_.rsplit(".", 1)[1]
        if value == "tools":  # a row's environment parses the shipped format (pythonic) and runs the shipped tool
            try:
                env = engine.environment({"prompt": "12+34="})
                assert node.format == "pythonic" and env.step("[add(a=12, b=34)]").observation == "46"
            finally:
                engine.close()
        return
    if group in ("reward", "logger", "callbacks"):
        items = node.get("functions", node) if group == "reward" else node
        built = [instantiate(v) for v in items.values()]
        assert len(built) == len(items) and (value != "none" or not built)
        if group == "reward":
            assert all(callable(b) for b in built)
        elif group == "logger":  # each a Lightning logger writing under the run's folder
            from polopt_lightning.loggers import close_loggers

            close_loggers(built)
            assert all(isinstance(b, L.pytorch.loggers.Logger) for b in built)
            assert all(str(tmp_path) in str(b.save_dir) for b in built), [b.save_dir for b in built]
        else:  # each a Lightning callback of the class its entry names
            assert all(isinstance(b, L.Callback) for b in built)
            assert [type(b).__name__ for b in built] == [v._target_.rsplit(".", 1)[1] for v in items.values()]
    elif group == "trainer" and node.accelerator == "gpu" and not torch.cuda.is_available():
        # composes (inheriting the cpu defaults); building a GPU Trainer needs a GPU
        assert node.precision == "bf16-mixed" and node.max_steps == 3000 and node.num_sanity_val_steps == 0
    elif group == "trainer":  # as the CLI builds it: `auto` (not Lightning's) resolved first
        from polopt_lightning.accel.precision import auto_precision

        chosen = {"precision": auto_precision(node.accelerator)[0]} if node.precision == "auto" else {}
        trainer = instantiate(node, logger=False, enable_checkpointing=False, **chosen)
        assert trainer.max_steps == cfg.trainer.max_steps
    else:
        if group == "model" and value == "tiny":
            OmegaConf.update(cfg, "model.hidden_size", 16)
            OmegaConf.update(cfg, "model.num_layers", 1)
        assert instantiate(cfg.get(group)) is not None


def test_unknown_group_value_lists_the_known_ones():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        with pytest.raises(Exception, match="(?s)Could not find 'objective/trpo'.*gspo"):
            compose(config_name="train", overrides=["objective=trpo"])


def test_train_function_writes_results_and_metrics(tmp_path):
    cfg = compose_with(FAST + ["objective=gspo", "trainer.max_steps=4", "trainer.val_check_interval=1"], tmp_path)
    set_hydra(cfg)
    results = train(cfg)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved == results
    for key in ("objective", "steps", "wall_s", "val_accuracy_before", "val_accuracy_after"):
        assert key in saved
    assert saved["objective"] == "gspo" and saved["steps"] == 4
    rows = list(csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")))
    assert any(r.get("train/reward") not in (None, "") for r in rows)
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    # the final policy in Hugging Face format, and the best validation during RL beside the final one
    assert saved["model_dir"] == str(tmp_path / "model") and (tmp_path / "model" / "config.json").is_file()
    history = saved["val_history"]
    assert history and all(r["step"] > 0 for r in history)  # validations during RL only
    # the best ranks the start (the validation before RL, step 0) and the final policy beside them
    start = {"val/accuracy": saved["val_accuracy_before"], "step": 0}
    final = {"val/accuracy": saved["val_accuracy_after"], "step": saved["steps"]}
    best = max([start, *history, final], key=lambda r: (r["val/accuracy"], -r["step"]))
    assert saved["val_accuracy_best"] == best["val/accuracy"] and saved["val_accuracy_best_step"] == best["step"]
    assert saved["best_checkpoint"] == str(tmp_path / "checkpoints" / "best.ckpt")
    assert (tmp_path / "checkpoints" / "best.ckpt").is_file()


def test_precision_keys_reach_the_module(tmp_path):
    """`rollout.dtype` / `reference.dtype` from the command line: validation, then off-policy RL with KL."""
    cfg = compose_with(FAST + ["rollout.dtype=bfloat16", "reference.dtype=bf16", "objective.beta=0.04",
                               "update.mini_batches=2", "trainer.max_steps=4"], tmp_path)
    set_hydra(cfg)
    results = train(cfg)
    assert results["steps"] == 4 and results["val_accuracy_after"] is not None
    rows = list(csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")))
    kl = [float(r["train/kl"]) for r in rows if r.get("train/kl")]
    assert kl and all(math.isfinite(v) for v in kl)


@pytest.mark.parametrize("dtype,trained_in", [("auto", torch.float32), ("bfloat16", torch.bfloat16)])
def test_a_bf16_checkpoint_through_model_pretrained_trains_in_float32_unless_told(tmp_path, dtype, trained_in, caplog):
    """Issue 56: `model=pretrained` on a checkpoint saved in bfloat16 (what a hub model gives). With the shipped
    `model.dtype: auto` full fine-tuning casts it to float32, so the policy and AdamW's state train in float32 (in
    bfloat16 most steps at RL's learning rates round away: `experiment=gsm8k` at lr 1e-6 changed 2% of a tiny model's
    weights in 4 steps, 100% in float32); `model.dtype=bfloat16` keeps it as it is. Either way the run trains."""
    import logging

    from safetensors.torch import load_file

    from polopt_lightning.models import build_tiny_model

    model, tok = build_tiny_model(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, seed=0)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    saved = load_file(tmp_path / "m" / "model.safetensors")
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}
    fast = [o for o in FAST if not o.startswith(("model.", "warm_start."))]  # the RL step's own update, nothing before
    overrides = [] if dtype == "auto" else [f"model.dtype={dtype}"]
    cfg = compose_with(fast + ["model=pretrained", f"model.name_or_path={tmp_path}/m", "warm_start.enabled=false",
                               "experience.num_generations=4", "trainer.max_steps=4", *overrides,
                               "+reward.functions.distinct._target_=hydra.utils.get_method",
                               "+reward.functions.distinct.path=tests.helpers.distinct_chars"], tmp_path / "run")
    assert cfg.model.dtype == dtype and cfg.trainer.precision == "auto"  # float32 for this model on every CPU
    set_hydra(cfg)
    with caplog.at_level(logging.INFO, logger="polopt_lightning"):
        assert train(cfg)["steps"] == 4
    told = "model.dtype=auto: the checkpoint's bfloat16 weights train in float32" in caplog.text
    assert told is (dtype == "auto")
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    trained = {k.removeprefix("policy."): v for k, v in ckpt["state_dict"].items()}
    assert saved.keys() <= trained.keys() and {v.dtype for v in trained.values()} == {trained_in}  # + tied head
    state = ckpt["optimizer_states"][0]["state"]
    assert {s["exp_avg"].dtype for s in state.values()} == {s["exp_avg_sq"].dtype for s in state.values()} == {
        trained_in}
    rows = list(csv.DictReader(open(tmp_path / "run" / "csv" / "version_0" / "metrics.csv")))
    norms = [float(r["train/grad_norm"]) for r in rows if r.get("train/grad_norm")]
    assert norms and all(math.isfinite(n) for n in norms) and max(norms) > 0
    moved = sum(int((trained[k].to(torch.bfloat16) != saved[k]).sum()) for k in saved)
    assert moved > 0  # the steps' updates reached the weights


def test_mixed_precision_with_checkpointing_from_the_command_line(tmp_path):
    """`trainer.precision=bf16-mixed` (what `trainer=gpu` sets) with clipping, off-policy, checkpointed layers."""
    cfg = compose_with(FAST + ["trainer.precision=bf16-mixed", "update.gradient_checkpointing=true",
                               "update.mini_batches=2", "update.max_grad_norm=1.0", "trainer.max_steps=4"], tmp_path)
    set_hydra(cfg)
    results = train(cfg)
    assert results["steps"] == 4 and results["val_accuracy_after"] is not None
    rows = list(csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")))
    logged = [(float(r["train/loss"]), float(r["train/grad_norm"])) for r in rows if r.get("train/loss")]
    assert len(logged) == 2 and all(math.isfinite(v) for pair in logged for v in pair)  # one row per rollout


def test_cli_run_and_multirun(tmp_path):
    proc = run_cli(FAST + [f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "polopt-train summary" in proc.stdout
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["objective"] == "grpo" and results["steps"] == 2
    assert (tmp_path / "run" / "csv" / "version_0" / "metrics.csv").is_file()
    # the warm start was cached by the first run: a second run with the same config skips it
    proc = run_cli(FAST + [f"hydra.run.dir={tmp_path}/run2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "run2" / "results.json").read_text())["warm_start_cached"] is True
    # a sweep with a job refused by a setting: Hydra reports it and runs the others (a one-line exit would end the
    # sweep at the refused job, before gspo)
    proc = run_cli(["-m", *FAST, "objective=grpo,gspo", "trainer.precision=auto,bf16-mixd",
                    f"hydra.sweep.dir={tmp_path}/sweep"], tmp_path)
    assert proc.returncode != 0 and "trainer.precision='bf16-mixd'" in proc.stderr, proc.stderr[-3000:]
    objectives = sorted(json.loads(p.read_text())["objective"] for p in (tmp_path / "sweep").glob("*/results.json"))
    assert objectives == ["grpo", "gspo"]


def test_crash_mid_run_keeps_checkpoint_and_logs(tmp_path):
    # a reward that fails on the 3rd call: two RL steps complete, the third raises
    crash = tmp_path / "crashing_reward.py"
    crash.write_text(
        "calls = {'n': 0}\n"
        "def reward(prompts, completions, **kw):\n"
        "    calls['n'] += 1\n"
        "    if calls['n'] > 3:\n"  # 1 validation call before, then RL steps
        "        raise RuntimeError('reward server down')\n"
        "    return [0.0] * len(completions)\n"
    )
    args = FAST + ["trainer.max_steps=10", "callbacks.checkpoint.every_n_train_steps=1", "logger.csv.flush_logs_every_n_steps=1",
                   "reward=exact_match", "+reward.functions.crash._target_=hydra.utils.get_method",
                   "+reward.functions.crash.path=crashing_reward.reward", f"hydra.run.dir={tmp_path}/run"]
    proc = run_cli(args, tmp_path, {"PYTHONPATH": str(tmp_path)})
    assert proc.returncode != 0
    assert "'reward' raised on sample 0: RuntimeError: reward server down" in proc.stderr
    run = tmp_path / "run"
    assert (run / "checkpoints" / "last.ckpt").is_file()
    rows = list(csv.DictReader(open(run / "csv" / "version_0" / "metrics.csv")))
    assert len([r for r in rows if r.get("train/reward")]) >= 1


# Lightning and dependency lines that say nothing about the run (issue: a quiet, honest console)
NOISE = ["Tip:", "litlogger", "ckpt_path=None", 'ckpt_path="last"', "manual optimization", "pre-optimization state",
         "in eval mode", "LeafSpec", "Writing model shards", "fontManager"]


def test_console_prints_each_record_once_and_no_noise(tmp_path):
    """beta > 0 (a reference in eval mode), a checkpoint every step (Lightning's manual-optimisation lecture), an
    exception checkpoint (the `ckpt_path="last"` warnings) and the model saved at the end: the console stays quiet."""
    args = FAST + ["objective.beta=0.04", "trainer.max_steps=4", "callbacks.checkpoint.every_n_train_steps=1",
                   f"hydra.run.dir={tmp_path}/run"]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    messages = [line.split("] - ", 1)[-1] for line in lines]  # the record without Hydra's time stamp
    repeated = {m for m in messages if messages.count(m) > 1}
    assert not repeated, f"printed more than once: {repeated}\n" + "\n".join(lines)
    assert not [line for line in lines for n in NOISE if n in line], "\n".join(lines)
    assert "Trainer.fit` stopped: `max_steps=4` reached" in proc.stdout  # Lightning's own lines still come, once
    # without the bar (FAST turns it off) lines of progress: the first rollout's at once, then at most every 30 s, the last
    progress = [m for m in messages if re.fullmatch(r"step \d+/4, reward -?[\d.e+-]+, [\d.]+ s a step", m)]
    assert [m.split(",")[0] for m in progress] == ["step 2/4", "step 4/4"], "\n".join(lines)  # 2 a rollout
    # verbose=true brings everything back
    proc = run_cli(args[:-1] + [f"hydra.run.dir={tmp_path}/verbose", "verbose=true"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Tip:" in proc.stdout + proc.stderr


class CheckpointProbe(L.Callback):
    """Records, after each training batch, the global step stored in last.ckpt (None before the first one)."""

    seen: dict = {}
    folder: Path | None = None

    def on_train_batch_end(self, trainer, *args, **kwargs):
        last = self.folder / "checkpoints" / "last.ckpt"
        # checkpoint callbacks run after this one in the same hook: this sees what the previous batches left
        self.seen[trainer.global_step] = torch.load(last, weights_only=True)["global_step"] if last.is_file() else None


def test_last_checkpoint_is_written_every_n_optimizer_steps(tmp_path):
    """`callbacks.checkpoint.every_n_train_steps` counts optimizer steps (2 per rollout here): last.ckpt holds the
    state of the latest multiple of it while training goes on, not only at the end."""
    CheckpointProbe.seen, CheckpointProbe.folder = {}, tmp_path
    cfg = compose_with(FAST + ["trainer.max_steps=12", "callbacks.checkpoint.every_n_train_steps=4",
                               "+callbacks.probe._target_=tests.test_cli.CheckpointProbe"], tmp_path)
    set_hydra(cfg)
    train(cfg)
    assert CheckpointProbe.seen == {2: None, 4: None, 6: 4, 8: 4, 10: 8, 12: 8}, CheckpointProbe.seen


QLORA = ["quantization=nf4", "adapter=lora", "adapter.r=4", "objective.beta=0.04", "update.mini_batches=2",
         "optimizer=adamw_8bit", "callbacks.checkpoint.every_n_train_steps=2"]


def test_qlora_from_the_command_line_resumes_and_exports(tmp_path):
    """nf4 + LoRA + 8-bit AdamW through the CLI: a quiet console, the merged model, the adapter and its base in the run
    directory, and a resume from last.ckpt (bitsandbytes cannot load its own quantized weights back: they are checked
    against the rebuilt base instead)."""
    proc = run_cli(FAST + QLORA + ["trainer.max_steps=4", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    noise = NOISE + ["gemm_4bit_forward", "MatMul8bitLt", "is_gradient_checkpointing", "past_key_values"]
    assert not [line for line in lines for n in noise if n in line], "\n".join(lines)
    run = tmp_path / "run"
    results = json.loads((run / "results.json").read_text())
    assert results["adapter_dir"] == str(run / "adapter") and results["base_model"] == str(run / "base_model")
    assert (run / "adapter" / "adapter_model.safetensors").is_file() and (run / "model" / "model.safetensors").is_file()
    assert (run / "base_model" / "config.json").is_file() and (run / "base_model" / "tokenizer.json").is_file()
    proc = run_cli(FAST + QLORA + ["trainer.max_steps=6", f"ckpt_path={run}/checkpoints/last.ckpt",
                                f"hydra.run.dir={tmp_path}/resumed"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "resumed" / "results.json").read_text())["steps"] == 6
    # resuming with another base is refused, naming a weight that differs
    proc = run_cli(FAST + QLORA + ["trainer.max_steps=6", "model.seed=1", f"ckpt_path={run}/checkpoints/last.ckpt",
                                f"hydra.run.dir={tmp_path}/other"], tmp_path)
    assert proc.returncode != 0 and "differs from the quantized base this run built" in proc.stderr


@pytest.mark.parametrize("overrides,message", [
    (["quantization=nf4"], "quantization=nf4 needs an adapter"),
    (["quantization=int8", "adapter=lora", "reference.quantization=nf4", "objective.beta=0.04"],
     "reference.quantization='nf4' has nothing to act on"),
    (["adapter=lora", "optimizer=paged_adamw"], "optimizer.name=paged_adamw pages optimizer state through CUDA"),
    (["quantization.mode=int4"], "quantization.mode must be one of"),
    (["adapter=lora", "adapter.bias=some"], "adapter.bias must be none, all or lora_only"),
])
def test_impossible_combinations_from_the_command_line_name_their_keys(overrides, message, tmp_path):
    cfg = compose_with(FAST + overrides, tmp_path)
    set_hydra(cfg)
    with pytest.raises(ValueError, match=message):
        train(cfg)


def test_a_token_level_sampler_correction_for_gspo_is_refused_before_the_warm_start(tmp_path, monkeypatch):
    import polopt_lightning.cli as cli

    def warm_start(*args, **kwargs):
        raise AssertionError("the warm start ran before the check")

    monkeypatch.setattr(cli, "_warm_start", warm_start)
    cfg = compose_with(FAST + ["objective=gspo", "update.is_correction=true", "update.is_mode=token_truncate",
                               "warm_start.enabled=true"], tmp_path)
    set_hydra(cfg)
    with pytest.raises(ValueError, match="update.is_mode=token_truncate: GSPO takes one advantage a sequence; use "
                                         "update.is_mode=sequence_truncate or sequence_mask"):
        train(cfg)


def test_a_model_loaded_quantized_refuses_the_warm_start(tmp_path):
    from polopt_lightning.models import build_tiny_model

    model, tok = build_tiny_model(hidden_size=64, num_layers=1, num_heads=2)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    fast = [a for a in FAST if not a.startswith("model.")]  # the tiny model's shape keys
    cfg = compose_with(fast + ["model=pretrained", f"model.name_or_path={tmp_path}/m", "quantization=nf4",
                               "adapter=lora", "warm_start.enabled=true"], tmp_path)
    set_hydra(cfg)
    with pytest.raises(ValueError, match="warm_start.enabled=true trains every weight, but the model was loaded "
                                         "quantized .*set warm_start.enabled=false"):
        train(cfg)
    # the default (null) leaves a pretrained model's warm start off: nothing to refuse
    cfg = compose_with(fast + ["model=pretrained", f"model.name_or_path={tmp_path}/m", "quantization=nf4",
                               "adapter=lora"], tmp_path)
    set_hydra(cfg)
    results = train(cfg)
    assert results["steps"] == 2 and results["base_model"] == f"{tmp_path}/m"  # the adapter's base is the folder
    assert results["warm_start_wall_s"] == 0 and results["warm_start_steps"] is None


def test_the_warm_start_runs_by_default_on_a_model_built_from_a_config_and_not_on_a_pretrained_one(tmp_path, caplog,
                                                                                                   monkeypatch):
    """``warm_start.enabled: null`` (the default): the tiny default model, which knows nothing, is warm-started; a
    model from a hub id or folder (``model=pretrained``, the README's own-model line) goes to RL as it is, and the log
    says how to ask for it; ``true`` runs it there too."""
    import logging

    import polopt_lightning.cli as cli
    from polopt_lightning.models import build_tiny_model, load_pretrained

    built, tok = build_tiny_model(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, seed=0)
    built.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    pretrained, _ = load_pretrained(str(tmp_path / "m"))
    ran = []
    monkeypatch.setattr("polopt_lightning.warmstart.supervised_warm_start",
                        lambda model, *a, **k: ran.append(model.name_or_path) or {"wall_s": 0.1, "cached": False})
    fast = [o for o in FAST if not o.startswith(("model.", "warm_start."))]
    for overrides, model, expected in [
            ([], built, [""]), (["model=pretrained", f"model.name_or_path={tmp_path}/m"], pretrained, []),
            (["model=pretrained", f"model.name_or_path={tmp_path}/m", "warm_start.enabled=true"], pretrained,
             [f"{tmp_path}/m"])]:
        cfg = compose_with(fast + overrides, tmp_path / str(len(overrides)))
        assert cfg.warm_start.enabled is (True if "warm_start.enabled=true" in overrides else None)
        ran.clear()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="polopt_lightning"):
            warm = cli._warm_start(cfg, model, tok, _Rows(), "none", False)
        assert ran == expected and warm["ran"] is bool(expected), overrides
        assert ("warm start: off for a pretrained model" in caplog.text) is (overrides != [] and not expected)


class _Rows:
    train_rows = [{"prompt": "1+1=", "answer": "2"}]

    @staticmethod
    def prompt_text(prompt):
        return prompt


def _listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


def test_resume_takes_the_runs_own_configuration_and_refuses_before_writing(tmp_path):
    """The README's resume line without the run's overrides goes on with the run's settings; a mistyped checkpoint,
    a new run into a run's folder, or a configuration that differs from the saved one is refused before anything
    is written into the run."""
    run = tmp_path / "run"
    proc = run_cli(FAST + ["trainer.max_steps=3", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run / "results.json").read_text())["steps"] == 3  # not 4: 2 updates a rollout stop at 3
    last = run / "checkpoints" / "last.ckpt"
    before = _listing(run)
    for args, message in [
        ([f"ckpt_path={run}/checkpoints/lats.ckpt"], "ckpt_path=" + f"{run}/checkpoints/lats.ckpt: no such checkpoint"),
        (FAST + [f"hydra.run.dir={run}"], f"hydra.run.dir={run} holds a run already"),
    ]:
        proc = run_cli(args, tmp_path)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
        assert _listing(run) == before  # no on_exception.ckpt, no csv/version_1, no new .hydra files
    saved = (run / ".hydra" / "config.yaml").read_text()
    (run / ".hydra" / "config.yaml").write_text(saved.replace("top_k: 0", "top_k: 7"))  # a default that changed since
    before = _listing(run)
    proc = run_cli([f"ckpt_path={last}", "trainer.max_steps=5"], tmp_path)
    assert proc.returncode != 0 and "generation.top_k: saved 7, now 0" in proc.stderr, proc.stderr[-2000:]
    assert _listing(run) == before
    (run / ".hydra" / "config.yaml").write_text(saved)
    # the resume's configuration previewed (Hydra's flags among the overrides): printed, nothing written
    before = _listing(run)
    proc = run_cli([f"ckpt_path={last}", "--cfg", "job", "trainer.max_steps=5"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shown = OmegaConf.create(proc.stdout[proc.stdout.index("model:"):])
    assert shown.trainer.max_steps == 5 and shown.model.hidden_size == 16 and _listing(run) == before
    # no overrides but the new length: the run's own (tiny) settings, in its own folder
    proc = run_cli([f"ckpt_path={last}", "trainer.max_steps=5", "trainer.enable_progress_bar=false"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    assert f"resuming the run in {run}" in console and "given now: ckpt_path=" in console
    results = json.loads((run / "results.json").read_text())
    assert results["steps"] == 5 and results["run_dir"] == str(run)
    assert OmegaConf.load(run / ".hydra" / "config.yaml").model.hidden_size == 16
    assert (run / "csv" / "version_1").is_dir()


def test_a_run_saved_with_the_old_keys_resumes_and_old_keys_on_the_command_line_still_work(tmp_path):
    """Keys that moved (module.rollout_dtype -> rollout.dtype, module.mini_batches -> update.mini_batches, ...): a
    run saved before the move resumes with its settings, and a command line with the old names runs, saying so."""
    run = tmp_path / "run"
    old_names = ["module.onednn_linear=false", "module.rollout_dtype=float32", "module.lr=1e-3", "module.mini_batches=1",
                 "module.track_kl=true"]
    proc = run_cli(FAST + old_names + [f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("moved keys renamed: module.onednn_linear -> accel.onednn_linear, module.rollout_dtype -> rollout.dtype, "
            "module.lr -> optimizer.lr, module.mini_batches -> update.mini_batches, module.track_kl -> "
            "reference.track_kl") in proc.stderr
    saved = OmegaConf.load(run / ".hydra" / "config.yaml")
    assert saved.accel.onednn_linear is False and saved.rollout.dtype == "float32" and saved.optimizer.lr == 1e-3
    assert saved["update"].mini_batches == 1 and saved.reference.track_kl is True
    # the run as it was saved before the moves: the old keys under module, no rollout/accel/update/experience group
    old = OmegaConf.to_container(saved)
    old["module"] = {"onednn_linear": False, "keep_host_memory": None, "rollout_dtype": "float32",
                     "compile_rollout": False, "lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.999],
                     "ref_dtype": None, "track_kl": True,
                     **{k: v for group in ("update", "experience") for k, v in old[group].items()
                        if f"module.{k}" in MOVED_KEYS}}  # the keys the module block held then
    old["optimizer"].update(lr="${module.lr}", weight_decay="${module.weight_decay}", betas="${module.betas}")
    old["reference"] = {"quantization": old["reference"]["quantization"]}
    for group in ("rollout", "accel", "update", "experience"):
        del old[group]
    OmegaConf.save(OmegaConf.create(old), run / ".hydra" / "config.yaml")
    back = {new: old_key for old_key, new in MOVED_KEYS.items()}
    overrides = [back.get(o.split("=", 1)[0], o.split("=", 1)[0]) + "=" + o.split("=", 1)[1]
                 for o in OmegaConf.load(run / ".hydra" / "overrides.yaml")]
    assert "module.num_generations=2" in overrides and "module.mini_batches=1" in overrides
    OmegaConf.save(OmegaConf.create(overrides), run / ".hydra" / "overrides.yaml")
    proc = run_cli([f"ckpt_path={run}/checkpoints/last.ckpt", "trainer.max_steps=4"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run / "results.json").read_text())["steps"] == 4
    resumed = OmegaConf.load(run / ".hydra" / "config.yaml")
    assert resumed.accel.onednn_linear is False and resumed.rollout.dtype == "float32" and resumed.optimizer.lr == 1e-3
    assert resumed["update"].mini_batches == 1 and resumed.experience.num_generations == 2 and resumed.reference.track_kl


def test_a_bad_module_setting_fails_before_the_warm_start_and_writes_no_checkpoint(tmp_path):
    proc = run_cli(FAST + ["optimizer.lr=-1", "warm_start.steps=50", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert proc.returncode != 0 and "optimizer.lr must be > 0, got -1" in proc.stderr, proc.stderr[-2000:]
    assert "warm start" not in proc.stdout + proc.stderr and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("max_epochs,shown", [(-1, "Epoch 0 "), (3, "Epoch 0/2")])
def test_the_progress_bar_shows_no_last_epoch_when_epochs_are_unbounded(tmp_path, tiny, arithmetic_rows, max_epochs,
                                                                       shown):
    """What the bar draws during a fit: `Epoch 0`, not rich's `Epoch 0/-2`, when epochs are unbounded."""
    import io

    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

    from polopt_lightning.callbacks import progress_bar

    from .helpers import make

    if not _RICH_AVAILABLE:
        pytest.skip("rich is not installed: Lightning's tqdm bar shows the epoch alone")
    screen = io.StringIO()
    module, dm = make(tiny, arithmetic_rows)
    L.Trainer(max_steps=1, max_epochs=max_epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
              enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
              callbacks=[progress_bar(console_kwargs={"file": screen, "force_terminal": True, "width": 100})],
              ).fit(module, datamodule=dm)
    drawn = screen.getvalue()
    assert shown in drawn and "/-2" not in drawn, drawn[-500:]


def test_the_progress_bar_counts_and_totals_rollouts(tmp_path, tiny, arithmetic_rows):
    """6 optimizer steps at 2 a rollout (update.mini_batches=2, polopt-train's default) end at `3/3`: Lightning
    totals the steps left, so the bar ended at `3/6`, as if the run had stopped halfway."""
    from polopt_lightning.callbacks import progress_bar

    from .helpers import make

    module, dm = make(tiny, arithmetic_rows, update={"mini_batches": 2})
    bar, totals = progress_bar(), []

    class Probe(L.Callback):
        def on_train_start(self, trainer, *args):
            totals.append(bar.total_train_batches)

        def on_train_batch_end(self, trainer, *args, **kwargs):
            totals.append(bar.total_train_batches)

    L.Trainer(max_steps=6, max_epochs=-1, accelerator="cpu", logger=False, enable_checkpointing=False,
              enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path, callbacks=[bar, Probe()],
              ).fit(module, datamodule=dm)
    assert module.global_step == 6 and totals == [3, 2, 1, 0]  # the rollouts, then those left after each


def test_every_process_torchrun_started_resumes_with_the_runs_overrides(tmp_path, monkeypatch):
    """Under torchrun or SLURM each process gets the user's command line: the later ones replay the run's overrides
    as the first does (else they would compose another configuration), and none refuses the run's own folder."""
    from polopt_lightning.cli import launcher_overrides, resume_overrides

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    started = ["trainer.max_steps=7", "optimizer.lr=1e-4"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        OmegaConf.save(compose(config_name="train", overrides=started), run / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create(started), run / ".hydra" / "overrides.yaml")
    command = [f"ckpt_path={run}/checkpoints/last.ckpt", "trainer.max_steps=9", f"hydra.run.dir={run}"]
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        argv = launcher_overrides(resume_overrides(command))
        assert argv[:3] == ["optimizer.lr=1e-4", *command[:2]], argv  # the run's lr, the new length
        assert ("hydra.job.name=train_ddp_process_1" in argv) == (rank == "1")
    monkeypatch.setenv("RANK", "1")  # a later process of a new run finds the first one's files: no refusal
    assert resume_overrides(["trainer.max_steps=9", f"hydra.run.dir={run}"]) == ["trainer.max_steps=9",
                                                                                  f"hydra.run.dir={run}"]
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit, match="holds a run already"):
        resume_overrides(["trainer.max_steps=9", f"hydra.run.dir={run}"])


@pytest.mark.parametrize("overrides,message", [
    (["objective.beta=abc"], "objective.beta: expected a number, got 'abc'"),
    (["objective=gspo", "objective.clip_high=wide"], "objective.clip_high: expected a number or null, got 'wide'"),
    (["generation.max_new_tokens=many"], "generation.max_new_tokens: expected an integer, got 'many'"),
    (["optimizer.lr=fast"], "optimizer.lr: expected a number, got 'fast'"),
    (["optimizer.betas=[0.9,high]"], "optimizer.betas: expected a list of numbers, got [0.9, 'high']"),
    (["experience.num_generations=two"], "experience.num_generations: expected an integer, got 'two'"),
    (["update.mini_batches=1.5"], "update.mini_batches: expected an integer, got 1.5"),
    (["update.gradient_checkpointing=maybe"], "update.gradient_checkpointing: expected true or false, got 'maybe'"),
    (["trainer.max_steps=ten"], "trainer.max_steps: expected an integer, got 'ten'"),
    (["data.batch_size=abc"], "data.batch_size: expected an integer, got 'abc'"),
    (["seed=abc"], "seed: expected an integer, got 'abc'"),
])
def test_a_wrongly_typed_value_names_its_key_and_the_type_wanted(overrides, message, tmp_path):
    """Checked against the type hints of what takes each value, before anything is built or written."""
    cfg = compose_with(FAST + overrides, tmp_path)
    set_hydra(cfg)
    with pytest.raises(ValueError, match=re.escape(message)):
        train(cfg)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("override,message", [
    ("+generation.max_new_token=3", "generation.max_new_token: no such setting; did you mean "
                                    "generation.max_new_tokens?"),
    ("+objective.bta=0.1", "objective.bta: no such setting; did you mean objective.beta?"),
    ("+callbacks.checkpoint.every_n_train_step=5", "callbacks.checkpoint.every_n_train_step: no such setting; did you "
                                                   "mean callbacks.checkpoint.every_n_train_steps?"),
])
def test_a_misspelt_key_is_named_with_the_closest_setting_before_anything_runs(override, message, tmp_path):
    """A key the object of its group does not take (Hydra's own hint for a typo is the `+key=` form) fails before the
    warm start, not minutes into the run with the constructor's "unexpected keyword argument"."""
    cfg = compose_with(FAST + [override], tmp_path)
    set_hydra(cfg)
    with pytest.raises(ValueError, match=re.escape(message)):
        train(cfg)
    assert not (tmp_path / "checkpoints").exists()


def test_a_wrongly_typed_value_on_the_command_line_says_its_key(tmp_path):
    proc = run_cli(FAST + ["objective.beta=abc", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert proc.returncode != 0 and "objective.beta: expected a number, got 'abc'" in proc.stderr, proc.stderr[-2000:]
    assert "TypeError" not in proc.stderr and not (tmp_path / "run" / "checkpoints").exists()


def test_reward_settings_name_a_function_by_its_key_under_reward_functions(tmp_path):
    """Issue 49: reward.weights, reward.accuracy and weights.rewards.fade take the key written under reward.functions
    (`fmt` here, whose function's __name__ is `distinct_chars`); the function's name works too, and is what the
    metrics are logged under; an unknown one is refused, listing the keys."""
    from polopt_lightning import PolicyOptimizationModule
    from polopt_lightning.cli import _rewards, _weight_schedulers
    from polopt_lightning.models import build_tiny_model

    fmt = ["+reward.functions.fmt._target_=hydra.utils.get_method",
           "+reward.functions.fmt.path=tests.helpers.distinct_chars"]
    model, tok = build_tiny_model(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)

    def built(overrides):
        cfg = compose_with(FAST + fmt + overrides, tmp_path)
        return cfg, PolicyOptimizationModule(model, tok, **_rewards(cfg, None, {}))

    by_key = ["+reward.weights.fmt=0.25", "reward.accuracy=fmt",
              "+weights.rewards.fade={fmt: {start: 0.5, end: 0.9, floor: 0.2}}"]
    cfg, module = built(by_key)
    assert module.rewards.keys == ["exact_match", "digit_match", "fmt"]
    assert module.rewards.names == ["exact_match", "digit_match", "distinct_chars"]
    assert module.rewards.weights.tolist() == [1.0, 0.5, 0.25] and module.accuracy_reward == "distinct_chars"
    [fade] = _weight_schedulers(cfg, None)
    assert list(fade._rule(module).fade) == ["distinct_chars"]
    _, module = built(["+reward.weights.distinct_chars=0.75", "reward.accuracy=distinct_chars"])  # by its name
    assert module.rewards.weights.tolist() == [1.0, 0.5, 0.75] and module.accuracy_reward == "distinct_chars"
    keys = r"the keys: \['exact_match', 'digit_match', 'fmt'\]"
    with pytest.raises(ValueError, match=r"reward\.weights: reward weights name unknown functions \['fmtt'\]; " + keys):
        built(["+reward.weights.fmtt=1.0"])
    with pytest.raises(ValueError, match=r"reward\.accuracy: no reward function 'fmtt'; " + keys):
        built(["reward.accuracy=fmtt"])
    # the whole run: the weight by key reaches training, the metrics go by the function's name
    cfg = compose_with(FAST + fmt + by_key + ["warm_start.enabled=false"], tmp_path / "run")
    set_hydra(cfg)
    train(cfg)
    columns = next(csv.reader(open(tmp_path / "run" / "csv" / "version_0" / "metrics.csv")))
    assert "train/rewards/distinct_chars/mean" in columns and "reward_weights/distinct_chars" in columns
    state = torch.load(tmp_path / "run" / "checkpoints" / "best.ckpt", weights_only=True)["polopt"]
    assert state["reward_weights"][:2] == [1.0, 0.5] and 0 < state["reward_weights"][2] <= 0.25


def test_help_lists_the_groups_to_choose_from_not_the_schemas(tmp_path):
    proc = run_cli(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.startswith("polopt-train: RL post-training") and "docs/configuration.md" in out
    assert "\nobjective: bnpo, cispo, dapo, dr_grpo, grpo, gspo, gspo_token, ppo, sapo\n" in out
    groups = out.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "_schema" not in groups and "UpdateConfig" not in groups and "is powered by Hydra" not in out


def test_a_refused_setting_is_one_line_naming_its_key_without_a_traceback(tmp_path):
    """A typo'd setting stops polopt-train in a second with the refusal alone (Hydra printed it inside a traceback);
    HYDRA_FULL_ERROR=1 keeps the traceback; the Python API still raises the ValueError. The refused run's folder
    (Hydra's .hydra/ and log only) does not block the corrected command in it."""
    run = tmp_path / "run"
    args = FAST + ["trainer.precision=bf16-mixd", f"hydra.run.dir={run}"]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "polopt-train: trainer.precision='bf16-mixd': not one of auto, "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr, proc.stderr[-3000:]
    proc = run_cli(args, tmp_path, {"HYDRA_FULL_ERROR": "1"})
    console = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "ConfigError: trainer.precision=" in proc.stderr
    assert f"hydra.run.dir={run} holds only the configuration and log of a run that wrote nothing else" in console
    proc = run_cli(FAST + ["trainer.precision=bf16-mixed", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run / "results.json").read_text())["steps"] == 2  # (a trained run's folder is refused:
    # test_resume_takes_the_runs_own_configuration_and_refuses_before_writing)
    cfg = compose_with(FAST + ["trainer.precision=bf16-mixd"], tmp_path / "api")
    set_hydra(cfg)
    with pytest.raises(ValueError, match="trainer.precision='bf16-mixd'"):
        train(cfg)


def test_a_mistyped_key_on_the_command_line_is_named_with_the_closest_one(tmp_path):
    """``trainer.max_step=4``: Hydra's refusal offered only ``+trainer.max_step=4`` (which adds the typo as a new key);
    the refusal names the closest key and those there, as for a mistyped ``+`` key."""
    proc = run_cli(FAST + ["trainer.max_step=4", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith("polopt-train: trainer.max_step: no such setting; did you mean trainer.max_steps? the "
                            "settings there: _target_, accelerator, "), proc.stderr[-3000:]
    assert first.endswith("(a key of your own: +trainer.max_step=4)") and "Traceback" not in proc.stderr


def test_a_callbacks_setting_is_refused_before_the_warm_start_naming_its_key(tmp_path, monkeypatch):
    """A typo'd collapse action (docs/stability.md's `callbacks.collapse.actions`): refused with the other settings,
    before the model loads and the warm start runs, as the one line of a refused setting (it came after the warm
    start, inside Hydra's instantiation error)."""
    import polopt_lightning.cli as cli

    monkeypatch.setattr(cli, "_warm_start", lambda *a, **k: (_ for _ in ()).throw(AssertionError("warm start ran")))
    cfg = compose_with(FAST + ["callbacks.collapse.actions.val_drop=rolback"], tmp_path / "run")
    set_hydra(cfg)
    with pytest.raises(cli.ConfigError, match=r"^callbacks\.collapse\.actions\.val_drop='rolback': must be one of "
                                              r"\('warn', 'stop', 'rollback'\)$"):
        train(cfg)


@pytest.mark.parametrize("task,partial", [("sort", "item_match"), ("reverse", "char_match"), ("count", "numeric_distance"),
                                          ("expression", "digit_match"), ("multiplication", "digit_match")])
def test_a_built_in_task_alone_is_scored_by_its_own_rewards_unless_a_reward_group_is_named(tmp_path, task, partial):
    """``task=sort`` had been scored by the arithmetic rewards (digit match on sorted lists) unless ``reward=task``
    was added: each built-in task's config now selects its own; a reward group on the command line still wins,
    whichever comes first; the default job keeps its arithmetic group."""
    from polopt_lightning.cli import _rewards

    def names(overrides):
        cfg = compose_with(overrides, tmp_path)
        built = instantiate(cfg.task)
        return cfg.reward.get("from_task"), _rewards(cfg, built, {})["reward_fns"].names

    assert names([f"task={task}"]) == (True, ["exact_match", partial])
    assert names([f"task={task}", "reward=task"]) == (True, ["exact_match", partial])
    for overrides in ([f"task={task}", "reward=exact_match"], ["reward=exact_match", f"task={task}"]):
        assert names(overrides) == (None, ["exact_match"])
    assert names([]) == (None, ["exact_match", "digit_match"])  # the default job: task=arithmetic reward=arithmetic


def test_a_data_row_without_its_answer_is_refused_before_the_warm_start(tmp_path, monkeypatch):
    """``task=jsonl`` with a row the reward cannot score: named (function, split, row) before the warm start's
    supervised steps, not when a batch first draws that row."""
    import polopt_lightning.cli as cli

    monkeypatch.setattr(cli, "_warm_start", lambda *a, **k: (_ for _ in ()).throw(AssertionError("warm start ran")))
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    rows[4] = {"prompt": "9+1=", "solution": "10"}
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fast = [o for o in FAST if not o.startswith("task.")]
    cfg = compose_with(fast + ["task=jsonl", f"task.train={tmp_path}/train.jsonl", "reward=numeric_match"],
                       tmp_path / "run")
    set_hydra(cfg)
    with pytest.raises(ValueError, match=r"reward function numeric_match: training row 4 \(counted from 0\) has no "
                                         r"'answer' column \(answer_column\); its columns: \['prompt', 'solution'\]"):
        train(cfg)
