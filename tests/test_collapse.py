"""The collapse monitor: each rule on synthetic metric streams, rollback, state across resume, the CLI's events;
non-finite updates skipped; clip fractions comparable across objectives."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from polopt_lightning.callbacks import CollapseMonitor, CollapseRules
from polopt_lightning.callbacks.collapse import RULES

HEALTHY = {"train/loss": 0.01, "train/skipped_updates": 0.0, "train/entropy": 2.0, "train/kl": 0.02,
           "train/grad_norm": 1.0, "train/ratio_max": 1.2, "train/completion_len": 6.0, "train/frac_zero_std": 0.3,
           "train/reward": 0.5}


def stream(rules, steps, **changes):
    """Feed `steps` healthy steps with noise, then the same with `changes` from step 30; return the rules fired."""
    fired = []
    for step in range(steps):
        metrics = {k: v * (1 + 0.05 * math.sin(step + i)) for i, (k, v) in enumerate(HEALTHY.items())}
        if step >= 30:
            metrics.update({k: (v(step) if callable(v) else v) for k, v in changes.items()})
        fired += [(e.rule, e.step) for e in rules.observe_step(step, step, metrics)]
    return fired


def test_a_healthy_stream_raises_nothing():
    rules = CollapseRules()
    assert stream(rules, 200) == []
    assert all(not rules.observe_validation(s, s, {"val/accuracy": 0.5 + 0.001 * s}) for s in range(20))


@pytest.mark.parametrize("rule,changes", [
    ("entropy_collapse", {"train/entropy": 0.3}),
    ("kl_spike", {"train/kl": lambda s: 0.02 if s != 40 else 5.0}),
    ("grad_norm_spike", {"train/grad_norm": lambda s: 1.0 if s != 40 else 50.0}),
    ("ratio_extreme", {"train/ratio_max": lambda s: 1.2 if s != 40 else 30.0}),
    ("length_collapse", {"train/completion_len": 1.0}),
    ("length_explosion", {"train/completion_len": 30.0}),
    ("zero_signal", {"train/frac_zero_std": 1.0}),
    ("reward_drop", {"train/reward": -0.5}),
    ("nonfinite", {"train/loss": lambda s: float("nan") if s == 40 else 0.01}),
    ("nonfinite", {"train/skipped_updates": lambda s: 1.0 if s == 40 else 0.0}),
])
def test_each_rule_fires_once_on_its_signal(rule, changes):
    fired = stream(CollapseRules(), 100, **changes)
    assert [r for r, _ in fired] == [rule], fired
    assert fired[0][1] >= 30  # after the change, not before


def test_a_rule_fires_again_after_its_condition_cleared():
    rules = CollapseRules()
    fired = stream(rules, 100, **{"train/grad_norm": lambda s: 50.0 if s in (40, 70) else 1.0})
    assert fired == [("grad_norm_spike", 40), ("grad_norm_spike", 70)]


def test_steps_without_a_gradient_do_not_make_the_next_gradient_a_spike():
    """Groups whose rewards are all equal give a zero gradient: a run of them must not set the spike rule's baseline
    to 0 (a short run printed a grad_norm_spike warning at every ordinary step after one)."""
    fired = stream(CollapseRules(), 100, **{"train/grad_norm": lambda s: 0.0 if s < 70 else 2.3})
    assert fired == []
    fired = stream(CollapseRules(), 100, **{"train/grad_norm": lambda s: 0.0 if s < 70 else (50.0 if s == 90 else 1.0)})
    assert fired == [("grad_norm_spike", 90)]  # a real spike over the norms that were there still counts


def test_validation_drop_needs_patience_and_margin():
    rules = CollapseRules(val_margin=0.05, val_patience=2)
    values = [0.5, 0.7, 0.68, 0.64, 0.71, 0.6, 0.6, 0.6]  # within the margin; one below; then two below in a row
    fired = [(e.rule, s) for s, v in enumerate(values) for e in rules.observe_validation(s, s, {"val/accuracy": v})]
    assert fired == [("val_drop", 6)]


def test_bad_settings_name_their_key():
    with pytest.raises(ValueError, match="actions.entropy"):
        CollapseRules(actions={"entropy": "warn"})
    with pytest.raises(ValueError, match=r"actions.kl_spike='panic'"):
        CollapseRules(actions={"kl_spike": "panic"})
    with pytest.raises(ValueError, match="lr_scale"):
        CollapseMonitor(lr_scale=2.0)


def _trainer(module, optimizer, scheduler, step=0):
    return SimpleNamespace(optimizers=[optimizer], lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)],
                           global_step=step, loggers=[], is_global_zero=True, should_stop=False,
                           fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=step)))


def test_rollback_restores_weights_and_optimizer_exactly_and_scales_the_rate(tmp_path):
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    def train(n):
        for _ in range(n):
            module(torch.randn(2, 4)).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()

    train(3)
    monitor = CollapseMonitor(dirpath=tmp_path, lr_scale=0.5, max_rollbacks=1, actions={"val_drop": "rollback"},
                              val_patience=1)
    trainer = _trainer(module, optimizer, scheduler, step=3)
    monitor.keep_healthy(trainer, module)
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    state = {k: {n: t.clone() for n, t in v.items()} for k, v in optimizer.state_dict()["state"].items()}
    train(5)
    assert not torch.equal(module.weight, weights["weight"])
    replaced = []  # the module is told (a backend with weights of its own syncs them again)
    module.policy_replaced = lambda: replaced.append(True)
    monitor.rules.observe_validation(8, 8, {"val/accuracy": 0.9})
    monitor.handle(trainer, module, monitor.rules.observe_validation(9, 9, {"val/accuracy": 0.1}))
    assert monitor.rollbacks == 1 and not trainer.should_stop and replaced == [True]
    for k, v in module.state_dict().items():
        assert torch.equal(v, weights[k]), k
    for k, v in optimizer.state_dict()["state"].items():
        for n, t in v.items():
            assert torch.equal(t, state[k][n]), (k, n)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-3) and scheduler.base_lrs == [pytest.approx(5e-3)]
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)  # the schedule keeps the scaled rate
    # the limit: the next rollback stops the run instead
    monitor.rules.observe_validation(10, 10, {"val/accuracy": 0.9})
    monitor.handle(trainer, module, monitor.rules.observe_validation(11, 11, {"val/accuracy": 0.1}))
    assert trainer.should_stop and monitor.rollbacks == 1
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["rule"], e["action"]) for e in lines] == [("val_drop", "rollback"), ("val_drop", "stop")]


def test_monitor_state_round_trips_through_a_checkpoint(tmp_path):
    monitor = CollapseMonitor()
    stream(monitor.rules, 60, **{"train/entropy": 0.3})
    monitor.rules.observe_validation(1, 1, {"val/accuracy": 0.8})
    monitor.rollbacks, monitor.rollouts = 1, 60
    torch.save(monitor.state_dict(), tmp_path / "state.pt")
    other = CollapseMonitor()
    other.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert other.state_dict() == monitor.state_dict()
    # the restored monitor carries on as the first one would: same events on the same next steps
    steps = [dict(HEALTHY, **{"train/entropy": 2.0}) for _ in range(5)]
    assert [e.rule for s in steps for e in monitor.rules.observe_step(61, 61, s)] == \
        [e.rule for s in steps for e in other.rules.observe_step(61, 61, s)]
    assert other.rules.best_val == 0.8 and other.rules.starts == monitor.rules.starts


def test_every_rule_has_a_default_action_in_the_shipped_config():
    from polopt_lightning.confschema import option

    assert set(option("callbacks", "default").collapse.actions) == set(RULES)


# ---------------------------------------------------------------------------------------------------------------------
def test_a_non_finite_step_leaves_weights_and_optimizer_untouched(tiny, arithmetic_rows, tmp_path):
    import lightning as L

    from polopt_lightning.objectives import GRPO

    from .helpers import make

    class NaNOnSecondCall(GRPO):
        calls = 0

        def compute(self, *args):
            out = super().compute(*args)
            NaNOnSecondCall.calls += 1
            if NaNOnSecondCall.calls == 2:
                out.loss = out.loss * float("nan")
            return out

    module, dm = make(tiny, arithmetic_rows, objective=NaNOnSecondCall(), update={"mini_batches": 1, "num_iterations": 1})
    snapshots = []

    class Snapshot(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            opt = trainer.optimizers[0]
            snapshots.append(({k: v.clone() for k, v in pl_module.policy.state_dict().items()},
                              {k: {n: t.clone() for n, t in s.items() if torch.is_tensor(t)}
                               for k, s in opt.state_dict()["state"].items()},
                              float(trainer.callback_metrics["train/skipped_updates"])))

    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, callbacks=[Snapshot()], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    with pytest.warns(UserWarning, match="non-finite loss"):
        trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 3  # the skipped step still counts
    assert [s[2] for s in snapshots] == [0.0, 1.0, 0.0]
    (w1, o1, _), (w2, o2, _), (w3, _, _) = snapshots
    assert all(torch.equal(w1[k], w2[k]) for k in w1)  # step 2 changed nothing
    assert all(torch.equal(o1[k][n], o2[k][n]) for k in o1 for n in o1[k])
    assert all(torch.isfinite(v).all() for v in w3.values()) and any(not torch.equal(w2[k], w3[k]) for k in w2)


def test_clip_fraction_is_a_share_of_tokens_for_every_objective():
    """GSPO clips whole sequences; its clip_frac counts their tokens, as GRPO's does (the sequence share apart)."""
    from polopt_lightning.objectives import GSPO

    lp = torch.zeros(2, 4, requires_grad=True)
    old = torch.tensor([[-0.5] * 4, [0.0] * 4])  # sequence 0 far above 1 + clip: clipped (A > 0); sequence 1 not
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    out = GSPO()(logprobs=lp, old_logprobs=old, advantages=torch.tensor([1.0, 1.0]), mask=mask)
    assert out.metrics["clip_frac"].item() == pytest.approx(4 / 5)  # 4 of the 5 tokens
    assert out.metrics["clip_frac_seq"].item() == pytest.approx(1 / 2)  # 1 of the 2 sequences
    token = GSPO(variant="token")(logprobs=lp, old_logprobs=old, advantages=torch.tensor([1.0, 1.0]), mask=mask)
    assert token.metrics["clip_frac"].item() == pytest.approx(4 / 5)


def test_track_kl_logs_the_kl_without_training_on_it(tiny, arithmetic_rows, tmp_path):
    import lightning as L

    from .helpers import make

    module, dm = make(tiny, arithmetic_rows, reference={"track_kl": True})
    assert module.ref_model is not None and module.objective.beta == 0
    L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0).fit(module, datamodule=dm)
    kl = float(module.trainer.callback_metrics["train/kl"])
    assert math.isfinite(kl) and kl > 0  # the policy moved away from its start


def test_protect_rolls_back_then_stops_from_the_command_line(tmp_path):
    """A val_drop that always holds (negative margin): rollback at the second validation, then the limit stops."""
    from .helpers import FAST, run_cli

    run = tmp_path / "run"
    proc = run_cli(FAST + ["callbacks=protect", "callbacks.collapse.val_margin=-1", "callbacks.collapse.max_rollbacks=1",
                        "callbacks.collapse.val_patience=1", "trainer.max_steps=20", "trainer.val_check_interval=2",
                        "logger.csv.flush_logs_every_n_steps=1", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [(e["rule"], e["action"]) for e in events] == [("val_drop", "rollback"), ("val_drop", "stop")]
    results = json.loads((run / "results.json").read_text())
    assert results["steps"] < 20  # stopped early, results and model written
    assert (results["collapse_events"], results["collapse_rollbacks"], results["collapse_stopped"]) == (2, 1, True)
    import csv

    rows = list(csv.DictReader(open(run / "csv" / "version_0" / "metrics.csv")))
    assert any(r.get("collapse/val_drop") == "1.0" for r in rows)
    assert max(float(r["collapse/rollbacks"]) for r in rows if r.get("collapse/rollbacks")) == 1.0


def test_the_validation_before_training_is_the_first_best():
    """Accuracy that falls below the starting model's is a collapse even if it never rose."""
    from lightning.pytorch.trainer.states import TrainerFn

    monitor = CollapseMonitor(val_patience=2)

    def validation(fn, step, accuracy):
        trainer = SimpleNamespace(sanity_checking=False, state=SimpleNamespace(fn=fn), global_step=step,
                                  callback_metrics={"val/accuracy": torch.tensor(accuracy)}, loggers=[],
                                  is_global_zero=True, should_stop=False, optimizers=[], lr_scheduler_configs=[],
                                  fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=step)))
        monitor.on_validation_end(trainer, torch.nn.Linear(1, 1))

    validation(TrainerFn.VALIDATING, 0, 0.30)  # polopt-train's validation before RL
    validation(TrainerFn.FITTING, 25, 0.05)
    validation(TrainerFn.FITTING, 50, 0.04)
    assert [(e.rule, e.step) for e in monitor.events] == [("val_drop", 50)]
    validation(TrainerFn.VALIDATING, 60, 0.99)  # a validation after training is not part of the stream
    assert monitor.rules.best_val == pytest.approx(0.30)
