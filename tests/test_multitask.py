"""Task mixtures: the built-in tasks and their rewards, the mixture's sampling and rewards, the weight schedulers on
synthetic statistics, the supervised anchor against a hand computation, and an exact resume of a mixture run."""

import copy
import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from polopt_lightning import PolicyOptimizationModule, PromptDataModule
from polopt_lightning.callbacks import (
    AnchorScheduler,
    CollapseEvent,
    CollapseMonitor,
    RewardWeights,
    RewardWeightScheduler,
    RolloutCheckpoint,
    TaskWeights,
    TaskWeightScheduler,
)
from polopt_lightning.data import (
    ArithmeticTask,
    CountTask,
    ExpressionTask,
    FileTask,
    MultiplicationTask,
    ReverseTask,
    SortTask,
    TaskMixture,
)
from polopt_lightning.data.sampling import MixtureSampler, allocate
from polopt_lightning.objectives import SupervisedAnchor
from polopt_lightning.rewards import (
    ExactMatchReward,
    MixtureRewards,
    NumericDistanceReward,
    PositionMatchReward,
    RewardComposer,
)

TASKS = [MultiplicationTask, ExpressionTask, SortTask, ReverseTask, CountTask]


# --- built-in tasks --------------------------------------------------------------------------------------------------
def _solve(prompt: str) -> str:
    """An independent solver of every built-in task's prompt."""
    body = prompt[:-1]
    if body.startswith("sort "):
        return ",".join(map(str, sorted(int(v) for v in body[5:].split(","))))
    if body.startswith("rev "):
        return body[4:][::-1]
    if body.startswith("count "):
        _, letter, word = body.split(" ")
        return str(word.count(letter))
    return str(eval(body))  # arithmetic and expressions: Python's precedence and parentheses


@pytest.mark.parametrize("cls", TASKS)
def test_task_rows_are_right_distinct_disjoint_and_seeded(cls):
    task = cls(train_size=300, val_size=50, seed=3)
    train, val = task.splits()
    assert len(train) == 300 and len(val) == 50
    prompts = [r["prompt"] for r in train + val]
    assert len(set(prompts)) == len(prompts)  # distinct, so train and validation are disjoint
    assert all(r["answer"] == _solve(r["prompt"]) for r in train + val)
    assert cls(train_size=300, val_size=50, seed=3).splits() == (train, val)
    assert cls(train_size=300, val_size=50, seed=4).splits() != (train, val)
    rewards = task.rewards()
    assert rewards.names[0] == "exact_match" and rewards.weights.tolist() == [1.0, 0.5]


def test_expressions_have_parentheses_and_several_steps():
    rows = ExpressionTask(steps=3, train_size=50, val_size=0).splits()[0]
    assert all(r["prompt"].count("(") == 2 and sum(r["prompt"].count(op) for op in "+-*") == 3 for r in rows)


@pytest.mark.parametrize("make,match", [
    (lambda: SortTask(length=1, min_length=1, max_value=1, train_size=10, val_size=0), "SortTask: found only 2"),
    (lambda: ReverseTask(min_length=4, length=3), r"ReverseTask.length: need 1 <= min_length <= length"),
    (lambda: CountTask(alphabet="a b"), "CountTask.alphabet"),
    (lambda: ExpressionTask(operations=["/"]), "ExpressionTask.operations"),
    (lambda: TaskMixture({"a": SortTask()}, weights={"b": 1.0}), r"task.weights names unknown tasks \['b'\]"),
    (lambda: TaskMixture({"a": SortTask()}, weights={"a": -1.0}), "task.weights must be finite"),
    (lambda: TaskMixture({"a": object()}), "task.tasks.a is object"),
    (lambda: MultiplicationTask(digits=1), r"^task.val_size=200 takes every one of the 100 distinct problems \(1-digit "
                                           r"operands, operations \['\*'\]\), leaving none to train on"),
    (lambda: TaskMixture({"a": SortTask(), "mul": MultiplicationTask(digits=1)}),
     r"^task.tasks.mul.val_size=200 takes .* lower task.tasks.mul.val_size or widen the task \(task.tasks.mul.digits\)"),
    (lambda: TaskMixture({"s": SortTask(length=1, min_length=1, max_value=1, train_size=10, val_size=0)}),
     "^task.tasks.s: SortTask: found only 2"),
])
def test_bad_task_settings_name_the_culprit(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make().splits()


def test_partial_credit_rewards_by_hand():
    sort = PositionMatchReward(separator=",", name="item_match")
    assert sort([""] * 3, ["1,2,3", "1,3,2", "1,2"], answer=["1,2,3"] * 3) == [1.0, 1 / 3, 2 / 3]
    rev = PositionMatchReward()
    assert rev([""] * 2, ["dcba", "dcxx"], answer=["dcba", "dcba"]) == [1.0, 0.5]
    count = NumericDistanceReward()
    assert count([""] * 4, ["4", "3", "x", "9"], answer=["4", "4", "4", "4"]) == [1.0, 0.75, 0.0, 0.0]
    assert count([""], ["1"], answer=["0"]) == [0.0]


# --- the mixture's data and rewards ---------------------------------------------------------------------------------
def _mixture(**weights):
    return TaskMixture({"sort": SortTask(train_size=40, val_size=6), "reverse": ReverseTask(train_size=24, val_size=6),
                        "count": CountTask(train_size=30, val_size=6)}, weights=weights or None)


def test_mixture_tags_rows_and_normalises_weights():
    mixture = _mixture(sort=2, reverse=1, count=1)
    train, val = mixture.splits()
    assert [r["task"] for r in train] == ["sort"] * 40 + ["reverse"] * 24 + ["count"] * 30
    assert len(val) == 18 and mixture.weights == {"sort": 0.5, "reverse": 0.25, "count": 0.25}
    rows = [{"prompt": "x", "task": "other"}]
    with pytest.raises(ValueError, match="task.tasks.f: row 0 already has a column 'task'"):
        TaskMixture({"f": SimpleNamespace(splits=lambda: (rows, []))}).splits()


def test_mixture_rewards_route_rows_to_their_task():
    rewards = _mixture().rewards()
    assert rewards.names == ["sort/exact_match", "sort/item_match", "reverse/exact_match", "reverse/char_match",
                             "count/exact_match", "count/numeric_distance"]
    out = rewards(["p"] * 3, ["1,2", "cba", "2"], answer=["1,2,3", "cba", "4"], task=["sort", "reverse", "count"])
    assert out.total.tolist() == pytest.approx([0.5 * 2 / 3, 1.5, 0.25])
    assert math.isnan(out.per_function[0, 2]) and math.isnan(out.per_function[1, 0])
    assert float(out.metrics["reverse/reward"]) == 1.5 and float(out.metrics["rewards/sort/item_match/mean"]) == pytest.approx(2 / 3)
    assert rewards.accuracy(out.per_function, {"task": ["sort", "reverse", "count"]}).tolist() == [0.0, 1.0, 0.0]
    rewards.set_weights({"count/numeric_distance": 2.0})
    assert rewards.weights.tolist() == [1.0, 0.5, 1.0, 0.5, 1.0, 2.0]
    with pytest.raises(ValueError, match="sample 1 belongs to task 'mul', which has no rewards"):
        rewards(["p"] * 2, ["1", "2"], answer=["1", "2"], task=["sort", "mul"])
    with pytest.raises(ValueError, match="reward weights name unknown functions"):
        rewards.set_weights({"sort/nope": 1.0})
    with pytest.raises(ValueError, match="task 'a' is 'nope'"):
        MixtureRewards({"a": RewardComposer([ExactMatchReward()])}, accuracy={"a": "nope"})


def test_allocation_keeps_each_share_over_many_batches():
    credit = [0.0, 0.0, 0.0]
    totals = [0, 0, 0]
    for _ in range(100):
        counts = allocate([0.7, 0.25, 0.05], 8, credit)
        assert sum(counts) == 8
        totals = [a + b for a, b in zip(totals, counts)]
    assert totals == [560, 200, 40]  # a task with 0.4 prompts a batch still gets its 40 in 100 batches
    assert allocate([1, 1, 1], 8, [0.0] * 3) == [3, 3, 2]


def test_batches_follow_the_weights_and_processes_draw_disjoint_rows():
    dm = PromptDataModule(task=_mixture(sort=1, reverse=0, count=1), batch_size=4, seed=0)
    from polopt_lightning.models import char_tokenizer

    dm.set_tokenizer(char_tokenizer())
    tasks = [b["columns"]["task"] for b in dm.train_dataloader()]
    assert len(tasks) == 94 // 4 and all(t.count("sort") == 2 and t.count("count") == 2 for t in tasks)
    dm.set_task_weights({"sort": 0.0, "reverse": 1.0})
    assert dm.task_weights == pytest.approx({"sort": 0.0, "reverse": 2 / 3, "count": 1 / 3})  # count keeps its 0.5
    with pytest.raises(ValueError, match=r"unknown tasks \['mul'\]"):
        dm.set_task_weights({"mul": 1.0})
    # two processes: the same compositions, and within one pass over a task, disjoint halves of its rows
    sizes = [40, 24, 30]
    ranks = [MixtureSampler(list(range(94)), sizes, 4, [1, 0, 0], num_replicas=2, rank=r, seed=5) for r in (0, 1)]
    drawn = [list(s)[:20] for s in ranks]  # 20 = one pass over the 40 sort rows, per process
    assert sorted(drawn[0] + drawn[1]) == list(range(40))
    assert [ranks[0].counts(j) for j in range(11)] == [ranks[1].counts(j) for j in range(11)] == [[4, 0, 0]] * 11


def test_sampler_state_resumes_the_same_batches_after_prefetched_ones():
    def sampler():
        return MixtureSampler(list(range(94)), [40, 24, 30], 4, [1, 2, 1], seed=1)

    whole = sampler()
    batches, it = [], iter(whole)
    for j in range(10):
        if j == 5:
            whole.set_weights([3, 1, 1])
        batches.append([next(it) for _ in range(4)])
    # a checkpoint after 4 trained batches while batches 4 and 5 were already fetched (Lightning's prefetching)
    cut = sampler()
    it = iter(cut)
    for j in range(6):
        if j == 5:
            cut.set_weights([3, 1, 1])
        [next(it) for _ in range(4)]
    state = cut.mixture_state(4)
    assert state["pending"] == [whole.counts(4), whole.counts(5)]
    resumed = sampler()
    resumed.set_weights([3, 1, 1])  # the weights a scheduler restores: the latest ones
    resumed.load_mixture_state(state, 4)
    it = iter(resumed)
    assert [[next(it) for _ in range(4)] for _ in range(6)] == batches[4:10]


# --- schedulers on synthetic statistics -----------------------------------------------------------------------------
NAMES = ["a", "b", "c"]


def test_signal_weights_move_to_tasks_with_signal_and_keep_the_floor():
    rule = TaskWeights(NAMES, "signal", smoothing=0.5, floor=0.1)
    assert rule.weights == pytest.approx({n: 1 / 3 for n in NAMES})
    for _ in range(20):  # task a: every group has equal rewards (mastered or hopeless); c: most groups differ
        rule.observe_step({"train/a/frac_zero_std": 1.0, "train/b/frac_zero_std": 0.5, "train/c/frac_zero_std": 0.1,
                           "train/other": 3.0})
    w = rule.weights
    assert w["a"] == pytest.approx(0.1) and w["c"] > w["b"] > w["a"] and sum(w.values()) == pytest.approx(1.0)
    assert w["c"] == pytest.approx(0.1 + 0.7 * 0.9 / 1.4)
    before = dict(rule.scores)
    rule.observe_step({"train/a/frac_zero_std": float("nan")})  # a task with no prompt this step keeps its score
    assert rule.scores == before


def test_progress_weights_follow_the_change_of_validation_accuracy():
    rule = TaskWeights(NAMES, "progress", smoothing=1.0, floor=0.05)
    assert not rule.observe_validation({"val/a/accuracy": 0.5, "val/b/accuracy": 0.5, "val/c/accuracy": 0.5})
    assert rule.weights == pytest.approx({n: 1 / 3 for n in NAMES})  # one validation: no change yet
    rule.observe_validation({"val/a/accuracy": 0.5, "val/b/accuracy": 0.6, "val/c/accuracy": 0.2})
    w = rule.weights
    assert w["a"] == pytest.approx(0.05) and w["c"] > w["b"]  # forgetting (c: -0.3) counts as much as learning
    assert w["c"] == pytest.approx(0.05 + 0.85 * 0.3 / 0.4)
    assert not rule.observe_step({"train/a/frac_zero_std": 0.0})  # progress reads validations only


def test_static_weights_and_bad_settings():
    # static: the mixture's own weights as they are, a weight of 0 included (the floor is the adaptive modes')
    rule = TaskWeights(NAMES, "static", prior={"a": 2, "b": 1, "c": 1})
    rule.observe_step({"train/a/frac_zero_std": 1.0})
    assert rule.weights == pytest.approx({"a": 0.5, "b": 0.25, "c": 0.25})
    assert TaskWeights(NAMES, "static", prior={"a": 1, "b": 1, "c": 0}, floor=0.5).weights == pytest.approx(
        {"a": 0.5, "b": 0.5, "c": 0.0})
    with pytest.raises(ValueError, match=r"floor must be in \[0, 1/3\]"):
        TaskWeights(NAMES, "signal", floor=0.5)
    with pytest.raises(ValueError, match="mode must be one of"):
        TaskWeights(NAMES, "greedy")


def test_scheduler_state_round_trips_through_a_checkpoint_file(tmp_path):
    dm = SimpleNamespace(task_names=NAMES, mixture=SimpleNamespace(weights={n: 1 / 3 for n in NAMES}), applied=[])
    dm.set_task_weights = dm.applied.append
    trainer = SimpleNamespace(datamodule=dm, loggers=[], callback_metrics={"train/a/frac_zero_std": torch.tensor(0.9),
                                                                         "train/b/frac_zero_std": torch.tensor(0.2)},
                              fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=1)))
    first = TaskWeightScheduler("signal", smoothing=0.5, floor=0.1)
    first.on_train_batch_end(trainer, None)
    torch.save({"callbacks": {"tw": first.state_dict()}}, tmp_path / "c.ckpt")
    second = TaskWeightScheduler("signal", smoothing=0.5, floor=0.1)
    second.load_state_dict(torch.load(tmp_path / "c.ckpt", weights_only=True)["callbacks"]["tw"])
    module = SimpleNamespace(rewards=SimpleNamespace(tasks=NAMES))  # a mixture's rewards (MixtureRewards.tasks)
    second.on_train_start(trainer, module)
    assert dm.applied[-1] == first.rule.weights and dm.applied[-1]["b"] > dm.applied[-1]["a"]
    # adaptive weights over rewards that log no task's metrics would never move: refused as training starts
    with pytest.raises(ValueError, match=r"TaskWeightScheduler\(mode='signal'\) reads each task's metrics, which only a "
                                         r"task mixture's rewards log"):
        TaskWeightScheduler("signal").on_train_start(trainer, SimpleNamespace(rewards=RewardComposer([ExactMatchReward()])))
    TaskWeightScheduler("static").on_train_start(trainer, SimpleNamespace(rewards=RewardComposer([ExactMatchReward()])))
    # the floor against the number of tasks, checked before anything trains (the CLI calls it with the task built)
    with pytest.raises(ValueError, match=r"weights.tasks.floor must be in \[0, 1/3\]"):
        TaskWeightScheduler("signal", floor=0.5).check(NAMES, None)


def test_reward_weights_fade_as_the_function_is_learned():
    rule = RewardWeights({"exact_match": 1.0, "format": 0.4}, {"format": {"start": 0.5, "end": 0.9, "floor": 0.25}},
                         smoothing=1.0)
    assert rule.weights == {"exact_match": 1.0, "format": 0.4}
    rule.observe_step({"train/rewards/format/mean": 0.7})
    assert rule.weights["format"] == pytest.approx(0.4 * (1 - 0.75 * 0.5))
    rule.observe_step({"train/rewards/format/mean": 1.0})
    assert rule.weights == pytest.approx({"exact_match": 1.0, "format": 0.1})  # the floor: 0.25 x its own weight
    copy_ = RewardWeights({"exact_match": 1.0, "format": 0.4}, {"format": {"start": 0.5, "end": 0.9}})
    copy_.load_state_dict(rule.state_dict())
    assert copy_.means == rule.means
    with pytest.raises(ValueError, match=r"names unknown reward functions \['nope'\]"):
        RewardWeights({"a": 1.0}, {"nope": {"start": 0, "end": 1}})

    composer = RewardComposer([ExactMatchReward(), PositionMatchReward(name="format")], weights=[1.0, 0.4])
    scheduler = RewardWeightScheduler({"format": {"start": 0.5, "end": 0.9, "floor": 0.25}}, smoothing=1.0)
    trainer = SimpleNamespace(loggers=[], callback_metrics={"train/rewards/format/mean": torch.tensor(1.0)},
                              fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=0)))
    scheduler.on_train_batch_end(trainer, SimpleNamespace(rewards=composer))
    assert composer.weights.tolist() == pytest.approx([1.0, 0.1])


# --- the supervised anchor ------------------------------------------------------------------------------------------
def test_anchor_schedules():
    anchor = SupervisedAnchor(coef=0.2, schedule="linear-decay", final_coef=0.0, decay_steps=10)
    assert [anchor.at_step(s) for s in (0, 5, 10, 20)] == pytest.approx([0.2, 0.1, 0.0, 0.0])
    assert SupervisedAnchor(coef=0.3, schedule="linear-decay").at_step(50, total_steps=100) == pytest.approx(0.15)
    adaptive = SupervisedAnchor(coef=0.1, schedule="adaptive", raise_factor=2.0, max_coef=0.3, relax=0.5)
    assert [adaptive.observe(e) for e in (1, 1, 1, 0, 0)] == pytest.approx([0.2, 0.3, 0.3, 0.2, 0.15])
    assert adaptive.at_step(3) == pytest.approx(0.15)  # the step count does not move an adaptive lambda
    with pytest.raises(ValueError, match="anchor.schedule must be one of"):
        SupervisedAnchor(schedule="cosine")
    with pytest.raises(ValueError, match="needs anchor.decay_steps or a trainer.max_steps"):
        SupervisedAnchor(schedule="linear-decay").at_step(1)


def test_anchor_value_and_gradient_by_hand():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]], [[0.0, 1.0, 0.0], [9.0, 9.0, 9.0]]],
                          requires_grad=True)  # [B=2, T=2, V=3]
    targets = torch.tensor([[0, 2], [1, 0]])
    mask = torch.tensor([[1, 1], [1, 0]])  # the last token is padding
    logprobs = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    loss, nll = SupervisedAnchor(coef=0.5).loss(logprobs, mask)
    p = logits.detach().softmax(-1)
    expected = -(p[0, 0, 0].log() + p[0, 1, 2].log() + p[1, 0, 1].log()) / 3
    assert float(nll) == pytest.approx(float(expected)) and float(loss) == pytest.approx(0.5 * float(expected))
    loss.backward()
    onehot = torch.nn.functional.one_hot(targets, 3).float()
    grad = 0.5 * (p - onehot) / 3 * mask[..., None]  # d(-log softmax)/d logits = softmax - onehot
    assert torch.allclose(logits.grad, grad, atol=1e-6)


def test_module_anchor_adds_lambda_times_the_reference_nll_gradient(tiny):
    """The gradient of a step with the anchor minus the one without is lambda x the gradient of the reference
    answers' mean NLL, computed here from a plain forward of the model on prompt + answer + EOS."""
    model, tok = tiny
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "4+4=", "answer": "8"}, {"prompt": "9+9=", "answer": None}]
    dm = PromptDataModule(train=rows, tokenizer=tok, batch_size=3)
    batch = next(iter(dm.train_dataloader()))

    def grads(anchor):
        module = PolicyOptimizationModule(copy.deepcopy(model), tok, reward_fns=[ExactMatchReward()],
                                          experience={"num_generations": 2}, anchor=anchor, seed=0)
        exp, _ = module.make_experience(batch)
        metrics = module.accumulate_gradients(exp, torch.arange(exp.completion_ids.shape[0]))
        return {n: p.grad.clone() for n, p in module.policy.named_parameters()}, metrics

    without, _ = grads(None)
    with_anchor, metrics = grads(SupervisedAnchor(coef=0.5))
    reference = copy.deepcopy(model)
    total, tokens = 0.0, 0
    for row in rows[:2]:  # the row without an answer is left out
        prompt = tok(row["prompt"])["input_ids"]
        answer = tok(row["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        logits = reference(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1]
        total = total - logits.log_softmax(-1).gather(-1, torch.tensor(answer)[:, None]).sum()
        tokens += len(answer)
    (0.5 * total / tokens).backward()
    assert float(metrics["anchor_nll"]) == pytest.approx(float(total) / tokens, rel=1e-5)
    for name, param in reference.named_parameters():
        assert torch.allclose(with_anchor[name] - without[name], param.grad, atol=1e-6), name


def test_an_anchor_column_no_row_has_is_refused_as_fit_starts(tiny, tmp_path):
    """The drop-in module: ``anchor.column`` that no training row holds is refused when ``fit`` starts, before any
    rollout (it had failed at the first step); rows where it is ``None`` are left out, not refused."""
    model, tok = tiny
    rows = [{"prompt": "1+2=", "answer": "3", "solution": None}, {"prompt": "4+4=", "answer": "8"}]
    SupervisedAnchor(column="solution").check_rows([*rows, {"prompt": "p", "solution": "x"}])  # one row holds it
    module = PolicyOptimizationModule(copy.deepcopy(model), tok, reward_fns=[ExactMatchReward()],
                                      experience={"num_generations": 2}, anchor={"column": "solution"}, seed=0)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"anchor.column='solution': no training row has a value in that column \(the "
                                         r"rows' columns: \['answer', 'prompt', 'solution'\]\)"):
        trainer.fit(module, datamodule=PromptDataModule(train=rows, tokenizer=tok, batch_size=2))
    assert module.global_step == 0


def _fake_trainer(monitor=None, metrics=None, step=0):
    return SimpleNamespace(callbacks=[monitor] if monitor else [], callback_metrics=metrics or {}, global_step=step,
                           max_steps=100, loggers=[], sanity_checking=False)


def test_adaptive_anchor_rises_on_the_monitors_events_and_relaxes():
    anchor = SupervisedAnchor(coef=0.1, schedule="adaptive", relax=0.5)
    module = SimpleNamespace(anchor=anchor)
    monitor = CollapseMonitor()
    trainer = _fake_trainer(monitor)
    trainer.lightning_module = module
    scheduler = AnchorScheduler()
    scheduler.on_train_start(trainer, module)
    monitor.events.append(CollapseEvent(rule="entropy_collapse", action="warn", step=1, rollout=1, metric="x",
                                        value=0.0, threshold=1.0, message="m"))
    scheduler.on_train_batch_end(trainer, module)
    assert anchor.value == pytest.approx(0.2)
    scheduler.on_train_batch_end(trainer, module)
    assert anchor.value == pytest.approx(0.15)


def test_adaptive_anchor_without_a_monitor_runs_the_rules_itself():
    anchor = SupervisedAnchor(coef=0.1, schedule="adaptive", relax=0.0)
    module = SimpleNamespace(anchor=anchor)
    scheduler = AnchorScheduler()
    trainer = _fake_trainer()
    trainer.lightning_module = module
    scheduler.on_train_start(trainer, module)
    for step, entropy in enumerate([1.0] * 6 + [0.1] * 4):  # entropy falls below 30% of its start for 3 steps
        trainer.callback_metrics = {"train/entropy": torch.tensor(entropy)}
        trainer.global_step = step
        scheduler.on_train_batch_end(trainer, module)
    assert anchor.value == pytest.approx(0.2)  # one episode, one event


# --- a mixture run in Lightning, resumed exactly --------------------------------------------------------------------
class _Record(L.Callback):
    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        keys = ("train/reward", "train/sort/prompts", "train/reverse/prompts", "train/loss", "train/anchor_nll")
        self.steps.append((batch["prompts"], {k: float(trainer.callback_metrics[k]) for k in keys}))


def _mixture_run(tiny, tmp_path, max_steps, ckpt=None, save_every=None):
    model, tok = tiny
    mixture = TaskMixture({"sort": SortTask(train_size=30, val_size=0, length=3),
                           "reverse": ReverseTask(train_size=20, val_size=0, length=3)})
    dm = PromptDataModule(task=mixture, tokenizer=tok, batch_size=3, seed=0)
    module = PolicyOptimizationModule(copy.deepcopy(model), tok, reward_fns=mixture.rewards(), experience={"num_generations": 3},
                                      generation={"max_new_tokens": 4}, optimizer={"lr": 1e-3}, anchor={"coef": 0.1}, seed=0)
    record, weights = _Record(), TaskWeightScheduler("signal", smoothing=0.5, floor=0.1)
    callbacks = [record, weights]
    if save_every:
        callbacks.append(RolloutCheckpoint(dirpath=tmp_path, every_n_train_steps=save_every, save_top_k=-1,
                                           filename="{step}"))
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, callbacks=callbacks,
                        enable_checkpointing=bool(save_every), enable_progress_bar=False, num_sanity_val_steps=0,
                        limit_val_batches=0, enable_model_summary=False)
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt)
    return record.steps, weights.rule.weights


def test_mixture_run_resumes_exactly_with_its_weights(tmp_path, tiny):
    # 50 rows in batches of 3: 16 batches an epoch; 20 steps cross an epoch, the checkpoint at 9 falls mid-epoch
    whole, whole_weights = _mixture_run(tiny, tmp_path, 20, save_every=9)
    assert any(m["train/sort/prompts"] != m["train/reverse/prompts"] for _, m in whole)  # the weights moved
    resumed, resumed_weights = _mixture_run(tiny, tmp_path / "r", 20, ckpt=tmp_path / "step=9.ckpt")
    assert len(resumed) == 11
    for (prompts, metrics), (want_prompts, want) in zip(resumed, whole[9:]):
        assert prompts == want_prompts and metrics == pytest.approx(want, rel=1e-5)
    assert resumed_weights == pytest.approx(whole_weights)


def test_file_tasks_mix_in_with_their_own_rewards(tmp_path, tiny):
    (tmp_path / "t.jsonl").write_text("".join(f'{{"prompt": "say {c}=", "answer": "{c}"}}\n' for c in "abcdef"))
    mixture = TaskMixture({"say": FileTask(str(tmp_path / "t.jsonl")), "add": ArithmeticTask(train_size=8, val_size=2)})
    with pytest.raises(ValueError, match=r"task.tasks.say \(FileTask\) has no built-in rewards"):
        mixture.rewards()
    rewards = mixture.rewards({"say": RewardComposer([ExactMatchReward()])})
    assert rewards.names == ["say/exact_match", "add/exact_match", "add/digit_match"]
    with pytest.raises(ValueError, match=r"rewards given for unknown tasks \['sya'\]; the tasks: \['say', 'add'\]"):
        mixture.rewards({"say": RewardComposer([ExactMatchReward()]), "sya": RewardComposer([ExactMatchReward()])})


def test_a_mixture_task_whose_rows_lack_its_rewards_column_is_named(tmp_path):
    """In a batch that mixes tasks, a column one task lacks is filled with ``None`` from another's rows, and its
    reward scored against ``"None"``: each task's rows are checked against its own composer before training."""
    from polopt_lightning.rewards.composer import check_reward_rows

    (tmp_path / "t.jsonl").write_text("".join(f'{{"prompt": "say {c}=", "target": "{c}"}}\n' for c in "abcdef"))
    mixture = TaskMixture({"add": ArithmeticTask(train_size=8, val_size=2), "say": FileTask(str(tmp_path / "t.jsonl"))})
    train, val = mixture.splits()
    data = SimpleNamespace(train_rows=train, val_rows=val)
    with pytest.raises(ValueError, match=r"reward function exact_match: task.tasks.say's training row 0 \(counted from "
                                         r"0\) has no 'answer' column \(answer_column\); its columns: \['prompt', "
                                         r"'target', 'task'\]"):
        check_reward_rows(mixture.rewards({"say": RewardComposer([ExactMatchReward()])}), data)
    check_reward_rows(mixture.rewards({"say": RewardComposer([ExactMatchReward(answer_column="target")])}), data)



def test_a_mixture_task_without_validation_rows_is_said_and_results_json_stays_json(tmp_path, caplog):
    """A task with no validation rows has no accuracy: said when the rows are made (it is left out of val/accuracy
    and best.ckpt, and weights=progress cannot weigh it), and results.json holds null for it, not NaN (no JSON)."""
    import json
    import logging

    from polopt_lightning.cli import _finite_or_null

    (tmp_path / "t.jsonl").write_text("".join(f'{{"prompt": "say {c}=", "answer": "{c}"}}\n' for c in "abcdef"))
    mixture = TaskMixture({"add": ArithmeticTask(train_size=8, val_size=2), "say": FileTask(str(tmp_path / "t.jsonl"))})
    with caplog.at_level(logging.WARNING, logger="polopt_lightning"):
        mixture.splits()
    assert "task.tasks.say has no validation rows" in caplog.text and "task.tasks.add" not in caplog.text
    text = json.dumps(_finite_or_null({"after": {"say": float("nan"), "add": 0.5}, "history": [float("inf"), 1]}),
                      allow_nan=False)
    assert json.loads(text) == {"after": {"say": None, "add": 0.5}, "history": [None, 1]}

# --- the CLI --------------------------------------------------------------------------------------------------------
MIXTURE_FAST = ["model.hidden_size=16", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=32",
                "experiment=multitask", "data.batch_size=3", "experience.num_generations=2", "generation.max_new_tokens=4",
                "warm_start.steps=3", "warm_start.batch_size=4", "trainer.max_steps=8", "trainer.val_check_interval=2",
                "trainer.enable_progress_bar=false",
                *(f"task.tasks.{t}.{k}={n}" for t in ("sort", "reverse", "count")
                  for k, n in (("train_size", 12), ("val_size", 4)))]


def test_cli_mixture_run_logs_per_task_metrics_weights_and_the_anchor(tmp_path):
    import csv
    import json

    from polopt_lightning.cli import train

    from .helpers import compose_with, set_hydra

    cfg = compose_with(MIXTURE_FAST + ["weights=progress", "anchor=linear_decay",
                                       "+weights.rewards.fade={sort/item_match: {start: 0.0, end: 0.5}}"], tmp_path)
    set_hydra(cfg)
    results = train(cfg)
    rows = list(csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")))

    def logged(key):
        return [float(r[key]) for r in rows if r.get(key) not in (None, "")]

    for task in ("sort", "reverse", "count"):
        assert len(logged(f"train/{task}/reward")) == len(logged(f"train/{task}/prompts")) == 4
        assert len(logged(f"val/{task}/accuracy")) == 4  # before, every 2 of the 4 rollouts, after
        assert len(logged(f"weights/{task}")) == 4  # every step
    assert all(sum(w) == pytest.approx(1.0) for w in zip(*(logged(f"weights/{t}") for t in ("sort", "reverse", "count"))))
    assert sum(sum(p) for p in zip(*(logged(f"train/{t}/prompts") for t in ("sort", "reverse", "count")))) == 12
    coef = logged("train/anchor_coef")  # linear decay from 0.1 over the 8 optimizer steps (2 per rollout)
    assert coef == pytest.approx([0.1, 0.075, 0.05, 0.025]) and len(logged("train/anchor_nll")) == 4
    assert len(logged("reward_weights/sort/item_match")) == 4
    assert set(results["val_task_accuracy_before"]) == {"sort", "reverse", "count"}
    # the weights the run ended with, as the logger recorded them at the last step (not results.json against the dict
    # it was written from), and the file holds them
    final = {t: logged(f"weights/{t}")[-1] for t in ("sort", "reverse", "count")}
    assert results["task_weights_final"] == pytest.approx(final)
    assert json.loads((tmp_path / "results.json").read_text())["task_weights_final"] == pytest.approx(final)


def test_cli_mixture_names_bad_task_rewards(tmp_path, monkeypatch):
    from polopt_lightning.cli import train

    from .helpers import compose_with, set_hydra

    cfg = compose_with(MIXTURE_FAST + ["+task.rewards.mul.functions={}"], tmp_path)
    set_hydra(cfg)
    with pytest.raises(ValueError, match=r"task.rewards names unknown tasks \['mul'\]"):
        train(cfg)
    # settings that depend on the tasks and their rows: refused as the one line naming the key, before the warm start
    # (they had failed after it: the floor at the first batch, the anchor's column at the first step)
    import polopt_lightning.cli as cli

    monkeypatch.setattr(cli, "_warm_start", lambda *a, **k: (_ for _ in ()).throw(AssertionError("warm start ran")))
    for overrides, message in ((["weights=signal", "weights.tasks.floor=0.5"],
                                r"^weights.tasks.floor must be in \[0, 1/3\] for 3 tasks, got 0.5$"),
                               (["anchor=constant", "anchor.column=solution"],
                                r"^anchor.column='solution': no training row has a value in that column")):
        cfg = compose_with(MIXTURE_FAST + overrides, tmp_path / overrides[0])
        set_hydra(cfg)
        with pytest.raises(cli.ConfigError, match=message):
            train(cfg)
    # a file task whose rows lack the column its reward reads: named before the warm start (the other tasks' rows
    # would have lent it None in mixed batches)
    (tmp_path / "t.jsonl").write_text("".join(f'{{"prompt": "say {c}=", "target": "{c}"}}\n' for c in "abcdef"))
    cfg = compose_with(MIXTURE_FAST + [f"+task.tasks.say={{_target_: polopt_lightning.data.FileTask, train: "
                                       f"{tmp_path}/t.jsonl}}", "+task.rewards.say={functions: {exact_match: "
                                       "{_target_: polopt_lightning.rewards.ExactMatchReward}}}"], tmp_path / "b")
    set_hydra(cfg)
    with pytest.raises(ValueError, match=r"exact_match: task.tasks.say's training row 0 \(counted from 0\) has no "
                                         r"'answer' column"):
        train(cfg)


@pytest.mark.distributed
def test_two_process_mixture_run_splits_every_task_and_reduces_its_metrics(tmp_path):
    import csv
    import json

    from .helpers import run_cli

    run = tmp_path / "run"
    proc = run_cli(MIXTURE_FAST + ["strategy=ddp_cpu", "weights=signal", "anchor=adaptive", "num_threads=1",
                                f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run / "results.json").read_text())
    assert results["world_size"] == 2 and set(results["task_weights_final"]) == {"sort", "reverse", "count"}
    rows = [r for r in csv.DictReader(open(run / "csv" / "version_0" / "metrics.csv")) if r.get("train/reward")]
    assert len(rows) == 4
    for r in rows:  # the prompts of both processes (3 each) in the per-task counts
        assert sum(float(r[f"train/{t}/prompts"]) for t in ("sort", "reverse", "count")) == 6
        assert float(r["train/anchor_coef"]) >= 0.05


def test_adaptive_anchor_lambda_travels_in_the_checkpoint(tiny):
    model, tok = tiny

    def make():
        return PolicyOptimizationModule(copy.deepcopy(model), tok, reward_fns=[ExactMatchReward()], experience={"num_generations": 2},
                                        anchor={"coef": 0.1, "schedule": "adaptive"})

    first = make()
    first.anchor.observe(1)
    first.anchor.observe(1)
    checkpoint = {}
    first.on_save_checkpoint(checkpoint)
    second = make()
    second.on_load_checkpoint(checkpoint)
    assert second.anchor.value == pytest.approx(0.4) and second.hparams["anchor"]["schedule"] == "adaptive"
