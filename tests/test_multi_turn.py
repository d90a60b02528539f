"""Multi-turn rollouts: tools as typed Python functions (schema, calls, errors, time limit), environments, the
completion laid out turn by turn with the environment's tokens in the context but out of the loss, the sampling
log-probs equal to the training pass's on the policy's tokens, rewards that see the conversation, and training with
every kind of objective and off-policy passes."""

import sys
import time

import pytest
import torch

from polopt_lightning import PolicyOptimizationModule, PromptDataModule
from polopt_lightning.confschema import option
from polopt_lightning.models import build_tiny_model, char_tokenizer
from polopt_lightning.rollout import RolloutBatch, RolloutEngine, SamplingConfig
from polopt_lightning.rollout.environments import GuessingGame, calculator, environment_reward
from polopt_lightning.rollout.multi_turn import (
    ChatTurns,
    EnvStep,
    MultiTurnEngine,
    ToolEnvironment,
    parse_tool_calls,
    tool_schema,
)

from .helpers import trainer
from .helpers.multi_turn import TEMPLATE, AlwaysLower, short_answers

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+34"}}</tool_call>'


def tokenizer():
    return char_tokenizer(chat_template=TEMPLATE)


# --- tools ---------------------------------------------------------------------------------------------------------
def test_a_tool_is_a_typed_documented_function_and_its_calls_are_parsed():
    schema = tool_schema(calculator)
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["properties"]["expression"]["type"] == "string"

    def undocumented(x):
        return x

    with pytest.raises(ValueError, match="tool 'undocumented'"):
        tool_schema(undocumented)
    calls = parse_tool_calls(f'think {CALL} and <tool_call>{{"name": "f", "arguments": "{{\\"a\\": 1}}"}}</tool_call> '
                             '<tool_call>{not json}</tool_call>')
    assert calls[0] == {"name": "calculator", "arguments": {"expression": "12+34"}}
    assert calls[1] == {"name": "f", "arguments": {"a": 1}}  # arguments written as a JSON string
    assert "malformed tool call" in calls[2]["error"]
    assert parse_tool_calls("46") == []


def test_the_shipped_pythonic_format_parses_one_call_several_and_refuses_malformed_ones():
    """conf/rollout/tools.yaml's ``format: pythonic`` (``[add(a=1, b=2)]``): the first list of calls in the message,
    keyword arguments as literals; a list that does not parse is one error the model is told, never a raise."""
    from polopt_lightning.rollout.environments import add
    from polopt_lightning.rollout.multi_turn import TOOL_CALL_FORMATS, parse_pythonic_tool_calls

    shipped = option("rollout", "tools")
    assert TOOL_CALL_FORMATS[shipped.format] is parse_pythonic_tool_calls
    parse = parse_pythonic_tool_calls
    assert parse("so I call [add(a=12, b=34)] now") == [{"name": "add", "arguments": {"a": 12, "b": 34}}]
    assert parse('[add(a=1, b=-2), f(x="y)", z=[1, 2.5], w=None), now()] and then [add(a=3, b=4)]') == [
        {"name": "add", "arguments": {"a": 1, "b": -2}},
        {"name": "f", "arguments": {"x": "y)", "z": [1, 2.5], "w": None}}, {"name": "now", "arguments": {}}]
    assert parse("46") == parse("the answer is [1, 2]") == parse("[add(a=1, b=2)") == []  # no (complete) call
    for malformed, why in [("[add(a=1, b=)]", "invalid syntax"), ("[add(1, 2)]", "name(key=value, ...)"),
                           ("[add(a=x, b=2)]", "malformed node"), ("[add(a={[1]: 2})]", "unhashable"),
                           ("[add(a=i, b=1) for i in range(3)]", "the calls are a list"),
                           ('[add(**{"a": 1, "b": 2})]', "name(key=value, ...)"), ("[add(a=" + "-" * 5000 + "1)]", "")]:
        calls = parse(f"let me try {malformed}")
        assert len(calls) == 1 and calls[0]["error"].startswith("malformed tool call '[add(") and why in calls[0][
            "error"], (malformed, calls)
    # past the limit in force (torch.compile's tests raise it: a fixed 2000 parsed fine after them in the whole suite)
    depth = sys.getrecursionlimit() + 500
    deep = '<tool_call>{"name": "add", "arguments": {"a": ' + "[" * depth + "]" * depth + "}}</tool_call>"
    assert "malformed tool call" in parse_tool_calls(deep)[0]["error"]  # hermes too: nesting past Python's limit
    env = ToolEnvironment([add], format=shipped.format)
    assert env.step("[add(a=12, b=34), add(a=1, b=2)]").observation == "46\n3"
    assert env.step("[add(a={[1]: 2}, b=1)]").observation.startswith("error: malformed tool call")
    assert env.step("46").done


def test_tool_errors_and_hangs_become_tool_messages():
    assert calculator("123456789123456789+987654321987654321") == "1111111111111111110"
    with pytest.raises(ValueError):
        calculator("__import__('os').system('true')")

    def slow(seconds: int) -> str:
        """Sleep.

        Args:
            seconds: how long.
        """
        time.sleep(seconds)
        return "done"

    env = ToolEnvironment([calculator, slow], timeout=0.2)
    assert env.step(CALL).observation == "46"
    assert env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
                    ).observation.startswith("error: ValueError")
    assert "unknown tool 'search'" in env.step('<tool_call>{"name": "search", "arguments": {}}</tool_call>').observation
    assert "malformed tool call" in env.step("<tool_call>{oops</tool_call>").observation
    start = time.perf_counter()
    assert env.step('<tool_call>{"name": "slow", "arguments": {"seconds": 3}}</tool_call>').observation == \
        "error: the tool timed out after 0.2 s"
    assert time.perf_counter() - start < 2
    assert env.step("the answer is 46").done and env.calls == 5
    # counted for train/tool_error_frac and train/tool_timeouts: all but the first call failed, one by its timeout
    assert (env.errors, env.timeouts) == (4, 1) and env.first_error.startswith("error: ValueError")


def test_a_result_that_cannot_come_back_or_is_not_json_is_an_error_naming_the_tool():
    def numbers():
        return {1, 2}

    def lines():
        return (line for line in ["a"])

    env = ToolEnvironment([numbers, lines], format="pythonic")
    first, second = env.step("[numbers(), lines()]").observation.split("\n")
    assert first.startswith("error: tool 'numbers' returned a set, which is not JSON")
    assert second.startswith("error: tool 'lines' returned a generator, which cannot be sent back from its process")
    assert env.errors == 2 and env.first_error == first


def test_guessing_game_answers_each_guess_and_rewards_finding_it():
    game = GuessingGame(penalty=0.25)
    game.reset({"answer": 7})
    assert game.step("5").observation == "higher" and game.step("I guess 9").observation == "lower"
    last = game.step("7")
    assert last.observation == "correct" and last.done and last.reward == pytest.approx(0.5)
    game.reset({"answer": 3})
    assert game.step("no idea") == EnvStep(reward=0.0, done=True)
    with pytest.raises(KeyError, match="no 'answer' column"):
        GuessingGame().reset({"prompt": "x"})
    assert environment_reward([], ["a", "b"], env_reward=[1, 0.5]) == [1.0, 0.5]
    assert environment_reward([], ["a"]) == [None]


def test_the_environments_tokens_come_from_the_chat_template():
    tok = tokenizer()
    turns = ChatTurns(tok, [calculator])
    assert tok.decode(turns.observation_ids("46")) == "[46]"
    assert turns.render([{"role": "user", "content": "2+2="}], True).startswith("tools: calculator\n")
    with pytest.raises(ValueError, match="data.chat_template"):
        ChatTurns(char_tokenizer())
    # ChatML, as Qwen's tokenizers write it (EOS <|im_end|>): the policy's turn stops at <|im_end|>, so the newline
    # after it, the tool message and the next assistant prompt are the environment's tokens
    from polopt_lightning.data.datamodule import CHAT_TEMPLATES

    chatml = ChatTurns(char_tokenizer(chat_template=CHAT_TEMPLATES["chatml"]))
    chatml.eos = "<|im_end|>"
    assert tok.decode(chatml.observation_ids("46")) == "\n<|im_start|>tool\n46<|im_end|>\n<|im_start|>assistant\n"


# --- the rollout -----------------------------------------------------------------------------------------------------
class Scripted(RolloutEngine):
    """Replies by a script from the context so far (a tool call first, then the answer); log-prob -0.5 a token."""

    def __init__(self, tok, reply):
        self.tok, self.reply, self.contexts = tok, reply, []

    def generate(self, model, prompt_ids, prompt_mask, num_generations, sampling, eos_token_id, pad_token_id,
                 generator=None) -> RolloutBatch:
        rows, finished = [], []
        for ids, mask in zip(prompt_ids, prompt_mask):
            context = self.tok.decode(ids[mask.bool()].tolist())
            self.contexts.append(context)
            for g in range(num_generations):
                row = self.tok(self.reply(context, g), add_special_tokens=False)["input_ids"] + [eos_token_id]
                finished.append(len(row) <= sampling.max_new_tokens)
                rows.append(row[:sampling.max_new_tokens])
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_token_id)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        return RolloutBatch(prompt_ids=prompt_ids.repeat_interleave(num_generations, 0),
                            prompt_mask=prompt_mask.repeat_interleave(num_generations, 0), completion_ids=ids,
                            completion_mask=mask, sampling_logprobs=-0.5 * mask.float(),
                            finished=torch.tensor(finished), group_size=num_generations)


def tool_then_answer(context, g):
    return CALL if "[" not in context else "it is 46"


def test_a_tool_call_turn_then_the_answer_laid_out_with_masks_and_the_conversation():
    tok = tokenizer()
    script = Scripted(tok, tool_then_answer)
    engine = MultiTurnEngine("tools", tools=[calculator], tokenizer=tok, base=script)
    enc = tok(["12+34=", "1+1="], padding=True, return_tensors="pt")
    out = engine.generate(None, enc.input_ids, enc.attention_mask, 2, SamplingConfig(max_new_tokens=100),
                          tok.eos_token_id, tok.pad_token_id, rows=[{"answer": "46"}, {"answer": "2"}])
    call, result, answer = tok(CALL)["input_ids"] + [1], tok("[46]")["input_ids"], tok("it is 46")["input_ids"] + [1]
    row = out.completion_ids[1, :len(call) + len(result) + len(answer)].tolist()
    assert row == call + result + answer  # prompt 0, completion 1: the call, the tool's result, the answer
    policy = [1] * len(call) + [0] * len(result) + [1] * len(answer)
    assert out.completion_mask[1, :len(policy)].tolist() == policy and out.completion_mask[1, len(policy):].sum() == 0
    assert out.context_mask[1].sum() == len(policy) and out.attention_mask is out.context_mask
    assert torch.equal(out.sampling_logprobs[1, :len(policy)], -0.5 * torch.tensor(policy, dtype=torch.float32))
    assert out.finished.all() and out.extras["tool_calls"] == [1, 1, 1, 1]
    assert out.extras["turn_rewards"] == [[None, None]] * 4  # tools give no reward; one entry per policy turn
    assert out.conversations[1] == [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "46"},
                                    {"role": "assistant", "content": "it is 46"}]
    # the second turn samples one continuation per episode from its context: the prompt, the call (with its EOS)
    # and the result, as the template renders them
    assert script.contexts[-1] == "1+1=" + CALL + "<eos>[46]" and len(script.contexts) == 2 + 4
    # a budget of one turn ends each episode at its call (the environment still answers the last message, for its
    # reward; the result is not shown); a token budget cuts the answer (not finished)
    one = MultiTurnEngine("tools", tools=[calculator], tokenizer=tok, base=Scripted(tok, tool_then_answer),
                          max_turns=1).generate(None, enc.input_ids, enc.attention_mask, 2,
                                                SamplingConfig(max_new_tokens=100), 1, 0)
    assert one.context_mask.sum(-1).tolist() == [len(call)] * 4 and one.extras["tool_calls"] == [1] * 4
    short = MultiTurnEngine("tools", tools=[calculator], tokenizer=tok, base=Scripted(tok, tool_then_answer),
                            max_tokens=len(call) + len(result) + 3).generate(
        None, enc.input_ids, enc.attention_mask, 2, SamplingConfig(max_new_tokens=100), 1, 0)
    assert short.context_mask.sum(-1).tolist() == [len(call) + len(result) + 3] * 4 and not short.finished.any()


def nap(seconds: float, label: str) -> str:
    """Sleep, then say when.

    Args:
        seconds: how long.
        label: said first.
    """
    start = time.time()
    time.sleep(seconds)
    return f"{label} {start:.3f} {time.time():.3f}"


def test_a_turns_tool_calls_run_at_once_across_the_batch_and_a_hung_one_is_killed():
    tok = tokenizer()

    def reply(context, g):  # two calls a message, the long one first; one completion's call hangs
        if "<eos>" in context:
            return "done"
        if context == "1+1=" and g == 1:
            return '[nap(seconds=60, label="hang")]'
        return '[nap(seconds=1, label="long"), nap(seconds=0.1, label="short")]'

    engine = MultiTurnEngine("tools", tools=[nap], format="pythonic", timeout=1.5, tool_workers=8, tokenizer=tok,
                             base=Scripted(tok, reply))
    enc = tok(["12+34=", "1+1="], padding=True, return_tensors="pt")
    start = time.perf_counter()
    out = engine.generate(None, enc.input_ids, enc.attention_mask, 2, SamplingConfig(max_new_tokens=100),
                          tok.eos_token_id, tok.pad_token_id)
    wall = time.perf_counter() - start
    results = [c[1]["content"] for c in out.conversations]
    assert results[3] == "error: the tool timed out after 1.5 s" and out.extras["tool_calls"] == [2, 2, 2, 1]
    assert out.extras["tool_errors"] == out.extras["tool_timeouts"] == [0, 0, 0, 1]
    assert out.extras["tool_error"] == [None, None, None, "error: the tool timed out after 1.5 s"]
    calls = [[line.split() for line in r.split("\n")] for r in results[:3]]
    assert all([label for label, _, _ in c] == ["long", "short"] for c in calls)  # the calls' order, not the ends'
    longs = [c[0] for c in calls]
    assert max(float(s) for _, s, _ in longs) < min(float(e) for _, _, e in longs)  # the completions' calls overlap
    assert wall < 4.0, wall  # each completion's calls after the last's: 3 x 1 s + 1.5 s
    assert all(c[-1] == {"role": "assistant", "content": "done"} for c in out.conversations)


def chat_rows(n):
    return [{"prompt": [{"role": "user", "content": f"{i}+{i}="}], "answer": str(2 * i)} for i in range(n)]


def test_real_sampling_three_turns_log_probs_match_the_training_pass_on_the_policys_tokens():
    model, _ = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=1)
    tok = tokenizer()
    short_answers(model, tok)
    engine = MultiTurnEngine(AlwaysLower, max_turns=3, max_tokens=40)  # the module gives its tokenizer
    module = PolicyOptimizationModule(model, tok, reward_fns=[environment_reward], rollout_engine=engine,
                                      experience={"num_generations": 2}, generation={"max_new_tokens": 8}, seed=0)
    dm = PromptDataModule(train=chat_rows(3), tokenizer=tok, batch_size=3)
    batch = dm.collate(dm.train_rows)
    exp, _ = module.make_experience(batch)
    policy, context = exp.completion_mask.bool(), exp.context_mask.bool()
    assert (context.sum(-1) - policy.sum(-1) >= len("[lower]")).all()  # the environment's tokens in the context ...
    assert (policy & ~context).sum() == 0
    with torch.no_grad():
        lp = module.scorer.logprobs(module.policy, exp, slice(None))[0]
    # ... attended to by the training pass: its log-probs on the policy's tokens are the sampler's (ratios of 1)
    torch.testing.assert_close(lp[policy], exp.sampling_logprobs[policy], atol=1e-5, rtol=1e-5)
    assert (exp.sampling_logprobs[context & ~policy] == 0).all()
    # without the environment's tokens in the context the later turns' log-probs would differ (the unpacked pass: the
    # packed one attends to every token before a completion's end whatever the mask)
    exp.context_mask = None
    module.update_config.pack_groups = False
    with torch.no_grad():
        lp_without = module.scorer.logprobs(module.policy, exp, slice(None))[0]
    assert not torch.allclose(lp_without[policy], lp[policy], atol=1e-3)


@pytest.mark.parametrize("objective", ["grpo", "gspo", "cispo"])
def test_training_on_multi_turn_rollouts_with_off_policy_passes(objective, tmp_path):
    model, _ = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=1)
    tok = tokenizer()
    short_answers(model, tok)
    seen = []

    def sees_the_conversation(prompts, completions, conversation, env_reward, turn_rewards, tool_calls, answer, **kw):
        seen.append((completions[0], conversation[0], env_reward[0], tool_calls[0], answer[0]))
        assert all(len(t) == sum(m["role"] == "assistant" for m in c) for t, c in zip(turn_rewards, conversation))
        return [float(len(c)) for c in conversation]  # more turns, more reward: some learning signal

    engine = MultiTurnEngine("polopt_lightning.rollout.environments.GuessingGame", max_turns=3, max_tokens=30)
    module = PolicyOptimizationModule(model, tok, objective=objective, reward_fns=[sees_the_conversation],
                                      rollout_engine=engine, experience={"num_generations": 4},
                                      generation={"max_new_tokens": 6}, update={"mini_batches": 2},
                                      optimizer={"lr": 1e-3}, seed=0)
    dm = PromptDataModule(train=chat_rows(8), tokenizer=tok, batch_size=2, shuffle=False)
    before = [p.detach().clone() for p in module.policy.parameters()]
    t = trainer(tmp_path, steps=2, limit_val_batches=0)
    t.fit(module, datamodule=dm)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))
    assert torch.isfinite(t.logged_metrics["train/loss"])
    completion, conversation, env_reward, tool_calls, answer = seen[0]
    assert completion == conversation and conversation[0]["role"] == "assistant"  # TRL's conversational form
    assert isinstance(env_reward, float) and tool_calls == 0 and answer in {"0", "2"}


@pytest.mark.slow
def test_the_tool_task_learns_to_call_the_tool_and_beats_the_no_tool_baseline(tmp_path):
    """`experiment=tool_arithmetic` on a small budget (20 rollouts) against the same run without the tool: the policy
    calls the tool, and its held-out accuracy after RL is far above the baseline's (3 seeds, the full budget:
    benchmarks/tool_task.py, docs/multi_turn.md). About 4 minutes on 2 cores (the warm start; cached for the second
    run)."""
    import csv
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "POLOPT_CACHE": str(tmp_path / "cache")}
    results = {}
    for setting, extra in (("tool", []), ("no_tool", ["rollout=hf"])):
        run_dir = tmp_path / setting
        proc = subprocess.run([sys.executable, "-m", "polopt_lightning", "experiment=tool_arithmetic", *extra,
                               "trainer.max_steps=40", "trainer.val_check_interval=10", "task.val_size=100",
                               "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"],
                              env=env, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[setting] = json.loads((run_dir / "results.json").read_text())
        if setting == "tool":
            calls = [float(r["train/tool_calls"]) for r in csv.DictReader(open(run_dir / "csv" / "version_0" /
                                                                               "metrics.csv")) if r.get("train/tool_calls")]
            assert calls and min(calls) > 0.2 and calls[-1] >= calls[0]  # it calls the tool, and more as it learns
    tool, none = results["tool"]["val_accuracy_after"], results["no_tool"]["val_accuracy_after"]
    print(f"tool task, seed 0, 20 rollouts: with the tool {results['tool']['val_accuracy_before']:.3f} -> {tool:.3f}, "
          f"without {results['no_tool']['val_accuracy_before']:.3f} -> {none:.3f}")
    assert tool > results["tool"]["val_accuracy_before"] and tool > none + 0.3


def test_a_rollouts_tool_errors_are_counted_and_most_of_them_failing_is_said(caplog, monkeypatch):
    """``train/tool_error_frac`` (of the calls) and ``train/tool_timeouts`` (per completion): a tool that fails on every
    call had trained silently (its errors reach the model as tool messages, the run goes on); where most of a rollout's
    calls failed, a warning quotes the first error."""
    import logging

    from polopt_lightning.step import experience
    from polopt_lightning.step.experience import ExperienceMaker

    def rollout(errors, timeouts, first):
        conversations = [[{"role": "assistant", "content": "[add()]"}, {"role": "tool", "content": "x"}]] * 2
        return RolloutBatch(prompt_ids=torch.zeros(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1),
                            completion_ids=torch.zeros(2, 1, dtype=torch.long), completion_mask=torch.ones(2, 1),
                            sampling_logprobs=torch.zeros(2, 1), finished=torch.ones(2, dtype=torch.bool), group_size=2,
                            conversations=conversations,
                            extras={"tool_calls": [2, 2], "env_reward": [0.0, 0.0], "tool_errors": errors,
                                    "tool_timeouts": timeouts, "tool_error": first})

    monkeypatch.setattr(experience, "_FAILING_ROLLOUTS", [0])
    with caplog.at_level(logging.WARNING, logger="polopt_lightning"):
        metrics = ExperienceMaker.turn_metrics(rollout([2, 1], [1, 0], ["error: RuntimeError: boom", None]), "cpu")
    assert float(metrics["train/tool_error_frac"]) == 0.75 and float(metrics["train/tool_timeouts"]) == 0.5
    assert "3 of this rollout's 4 tool calls came back as an error, e.g. error: RuntimeError: boom" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="polopt_lightning"):  # said again at the 51st such rollout only
        for _ in range(50):
            ExperienceMaker.turn_metrics(rollout([2, 1], [1, 0], ["error: b", None]), "cpu")
    assert caplog.text.count("came back as an error") == 1 and "so far: 51" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="polopt_lightning"):
        metrics = ExperienceMaker.turn_metrics(rollout([1, 1], [0, 0], ["error: x", "error: y"]), "cpu")
    assert float(metrics["train/tool_error_frac"]) == 0.5 and not caplog.text  # half: not most


def test_the_command_line_shows_the_tools_schemas_in_chat_prompts(tmp_path, monkeypatch, caplog):
    """``polopt-train rollout=tools rollout.tools=[...]`` with chat prompts: the template renders the tools for the
    model (the data module had been built without them, so a chat model never saw their schemas); a template that
    renders no tools is said."""
    import json
    import logging

    from polopt_lightning import cli

    from .helpers import FAST, compose_with, set_hydra

    seen = {}

    def stop(cfg, model, tokenizer, datamodule, *args):
        seen["tools"] = [fn.__name__ for fn in datamodule.tools]
        seen["prompt"] = datamodule.prompt_text(datamodule.train_rows[0]["prompt"])
        raise KeyboardInterrupt  # enough: the warm start is where the rows are first used

    monkeypatch.setattr(cli, "_warm_start", stop)
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+{i}="}],
                                                          "answer": str(2 * i)}) + "\n" for i in range(6)))
    fast = [o for o in FAST if not o.startswith("task.")]
    for template, shown in ((TEMPLATE, True), ("chatml", False)):
        (tmp_path / "tpl.jinja").write_text(template)
        template_arg = f"data.chat_template={tmp_path / 'tpl.jinja'}" if shown else "data.chat_template=chatml"
        cfg = compose_with(fast + ["task=jsonl", f"task.train={tmp_path}/t.jsonl", "reward=exact_match", "rollout=tools",
                                   "rollout.tools=[polopt_lightning.rollout.environments.add]", template_arg],
                           tmp_path / f"run_{shown}")
        set_hydra(cfg)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="polopt_lightning"), pytest.raises(KeyboardInterrupt):
            cli.train(cfg)
        assert seen["tools"] == ["add"]
        assert seen["prompt"].startswith("tools: add\n0+0=") == shown
        assert ("the chat template does not render tools: the model is not shown the schemas of add" in caplog.text) \
            == (not shown)


def test_polopt_train_imports_a_tool_module_beside_the_command(tmp_path):
    """``polopt-train`` (the console script) finds ``mytools`` in the folder it runs in, as ``python -m
    polopt_lightning`` does: it had said "No module named 'mytools'". Here the tool then fails its schema check (no
    docstring), which only an imported function can."""
    import subprocess
    from pathlib import Path

    (tmp_path / "mytools.py").write_text("def add(a, b):\n    return a + b\n")
    script = Path(sys.executable).parent / "polopt-train"
    proc = subprocess.run([str(script), "rollout=tools", "rollout.tools=[mytools.add]", f"hydra.run.dir={tmp_path}/run"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "No module named" not in proc.stderr, proc.stderr[-2000:]
    assert "tool 'add': Cannot generate JSON schema for add because it has no docstring" in proc.stderr, proc.stderr[-2000:]


def test_bad_multi_turn_settings_and_environments_name_the_culprit():
    """A timeout of 0 or less (every call had timed out, or the sandbox refused mid-run under another key), two tools
    of one name (one had shadowed the other), a module where a function is meant, an environment whose step returns
    something else than an EnvStep."""
    from polopt_lightning.rollout.environments import add
    from polopt_lightning.rollout.multi_turn import resolve, step_environments

    tok = tokenizer()
    for timeout in (0, -1):
        with pytest.raises(ValueError, match=rf"rollout.timeout must be > 0 seconds or null \(no limit\), got {timeout}"):
            MultiTurnEngine("tools", tools=[add], timeout=timeout, tokenizer=tok)

    def other(a: int, b: int) -> int:
        """Add otherwise.

        Args:
            a: one.
            b: the other.
        """
        return a + b

    other.__name__ = "add"
    with pytest.raises(ValueError, match=r"rollout.tools: the model calls a tool by its name, and \['add'\] name more"):
        MultiTurnEngine("tools", tools=[add, other], tokenizer=tok)
    with pytest.raises(ValueError, match=r"rollout.tools: 'mytools' is no import path of an object in a module"):
        resolve("mytools", "rollout.tools")

    class Silent(AlwaysLower):
        def step(self, message):
            return None

    with pytest.raises(TypeError, match=r"Silent.step returned NoneType, not an EnvStep"):
        step_environments([Silent()], ["hello"])


def test_a_multi_turn_run_without_a_chat_template_is_refused_before_the_warm_start(tmp_path, monkeypatch):
    """The tiny default tokenizer has no chat template; a multi-turn rollout needs one: the one line naming the key,
    before the warm start's supervised steps (it came after them, inside a traceback)."""
    from polopt_lightning import cli

    from .helpers import FAST, compose_with, set_hydra

    monkeypatch.setattr(cli, "_warm_start", lambda *a, **k: (_ for _ in ()).throw(AssertionError("warm start ran")))
    cfg = compose_with(FAST + ["rollout=tools", "rollout.environment=polopt_lightning.rollout.environments.GuessingGame"],
                       tmp_path)
    set_hydra(cfg)
    with pytest.raises(cli.ConfigError, match=r"^a multi-turn rollout renders the environment's messages with the "
                                              r"tokenizer's chat template, and this tokenizer has none: set "
                                              r"data.chat_template"):
        cli.train(cfg)
