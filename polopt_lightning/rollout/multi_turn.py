"""Multi-turn rollouts: the policy generates, an environment answers (tool results, or the feedback of a task with
several steps), and the policy continues, until it answers without a tool call, the environment says it is done, or a
turn or token budget ends.

- **Tools** are typed Python functions: their signature and docstring are the schema the chat template shows the
  model (``transformers.utils.get_json_schema``, as ``apply_chat_template(tools=...)`` takes them). A tool that raises
  gives a tool message with the error; one that runs past ``timeout`` seconds is killed, with a tool message saying
  so. The calls of a turn, every completion's, run at once, each in a process of its own by default
  (:mod:`~polopt_lightning.rollout.tool_runner`); other environments step in this process (their state persists).
- **Environments** implement :class:`Environment`: ``reset(row)`` with the dataset row (its columns) and ``step(text)``
  with the model's message, returning an :class:`EnvStep` (observation, reward, done). :class:`ToolEnvironment` is
  the environment of tool calls.
- :class:`MultiTurnEngine` runs the turns on any backend (the transformers one by default): each turn is a rollout of
  the context so far. The environment's tokens (rendered with the tokenizer's chat template, as the role ``tool``
  message between two assistant turns) are part of the context the policy attends to, and are masked out of the
  loss, the importance ratios and the sampling log-probs: the completion's ``completion_mask`` is 1 on the policy's
  tokens only, its ``context_mask`` on every token.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .base import RolloutBatch, RolloutEngine, SamplingConfig
from .tool_runner import ToolCall, ToolResult, ToolRunner, is_untrusted

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class EnvStep:
    """What an environment answers to one message of the model.

    Attributes:
        observation: the text the model sees next (a tool's result, feedback); ``None``: nothing to add.
        reward: a reward for this step (summed over the episode into the ``env_reward`` column); ``None``: none.
        done: the episode ends here (the model's message was its answer).
    """

    observation: str | None = None
    reward: float | None = None
    done: bool = False


class Environment(ABC):
    """A multi-turn task: one instance per completion, made by the engine's ``environment`` factory."""

    def reset(self, row: Mapping[str, Any]) -> str | None:
        """Start an episode for the dataset ``row`` (its columns: ``answer``, ...); an observation to show first, or
        ``None``."""
        return None

    @abstractmethod
    def step(self, message: str) -> EnvStep:
        """The model's message (its turn's text); what the environment answers."""


def tool_schema(fn: Callable) -> dict[str, Any]:
    """The JSON schema of a typed, documented Python function, as chat templates take ``tools`` (transformers'
    ``get_json_schema``: type hints for every argument, a Google-style docstring with an ``Args:`` section)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:  # transformers' own error says what is missing; name the tool
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: {err}") from err


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """The tool calls in a message, in the Hermes/Qwen format the common chat templates use:
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (several allowed). A call whose JSON does not parse
    is returned as ``{"error": ...}`` (the model is told, not the run stopped)."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError("a tool call is an object with a 'name' and 'arguments'")
            arguments = call.get("arguments", {})
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                arguments = json.loads(arguments)
            if not isinstance(arguments, dict):
                raise ValueError("'arguments' must be an object")
            calls.append({"name": call["name"], "arguments": arguments})
        except (ValueError, TypeError, RecursionError) as err:  # RecursionError: nesting past Python's limit
            calls.append({"error": f"malformed tool call {body[:200]!r}: {err}"})
    return calls


def parse_pythonic_tool_calls(text: str) -> list[dict[str, Any]]:
    """Tool calls written as a Python list of calls with keyword arguments, ``[add(a=1, b=2), f(x="y")]`` (vLLM's
    ``pythonic`` format, Llama 3.2's and 4's): the first such list in the message; arguments are literals. A list that
    does not parse is returned as one ``{"error": ...}``."""
    import ast

    match = re.search(r"\[\s*[A-Za-z_][\w.]*\(.*?\)\s*\]", text, re.DOTALL)
    if match is None:
        return []
    try:
        node = ast.parse(match.group(0), mode="eval").body
        if not isinstance(node, ast.List):  # [f(a=i) for i in x] is a comprehension, not a list of calls
            raise ValueError("the calls are a list, [f(a=1), g(b=2)]")
        calls = []
        for call in node.elts:
            if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
                raise ValueError("each call must be name(key=value, ...)")
            name = ast.unparse(call.func)
            calls.append({"name": name, "arguments": {k.arg: ast.literal_eval(k.value) for k in call.keywords}})
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError) as err:  # TypeError: {[1]: 2}'s unhashable key
        return [{"error": f"malformed tool call {match.group(0)[:200]!r}: {err}"}]


#: tool-call formats by name: ``hermes`` (``<tool_call>{json}</tool_call>``: Qwen, Hermes and most chat templates) and
#: ``pythonic`` (``[f(a=1)]``)
TOOL_CALL_FORMATS: dict[str, Callable[[str], list[dict[str, Any]]]] = {
    "hermes": parse_tool_calls, "pythonic": parse_pythonic_tool_calls}


def tool_message(result: ToolResult) -> str:
    """A call's result as the tool message the model sees: a string as it is, another value as JSON, an error (a
    raise, a timeout, a result that could not come back) as ``error: ...``."""
    if result.error is not None:
        return f"error: {result.error}"
    if isinstance(result.value, str):
        return result.value
    try:
        return json.dumps(result.value)
    except (TypeError, ValueError) as err:
        return f"error: tool {result.name!r} returned a {type(result.value).__name__}, which is not JSON: {err}"


def call_with_timeout(fn: Callable, arguments: Mapping[str, Any], timeout: float | None,
                      runner: ToolRunner | None = None) -> str:
    """``fn(**arguments)`` as a tool message (:func:`tool_message`), run by ``runner`` (default: a process of its
    own, killed past ``timeout`` seconds); an exception or a run past the limit becomes an error message."""
    return tool_message((runner or ToolRunner()).run([ToolCall(fn, arguments, timeout)])[0])


class ToolEnvironment(Environment):
    """Tool calls: each message's calls (:func:`parse_tool_calls`) run, their results are the next observation (one
    line per call, in order); a message without a call ends the episode. :meth:`step` runs one message's calls at
    once; :class:`MultiTurnEngine` runs a turn's calls of every completion at once (:func:`step_environments`).

    Args:
        tools: the Python functions the model may call, by their ``__name__``.
        timeout: seconds a call may run (``None``: no limit).
        format: how the model writes its calls: a name in :data:`TOOL_CALL_FORMATS` or a parser (text -> calls).
        runner: what runs the calls (default: a :class:`~polopt_lightning.rollout.tool_runner.ToolRunner`, a
            process per call, as many at once as there are CPUs).
    """

    def __init__(self, tools: Sequence[Callable], timeout: float | None = 5.0,
                 format: str | Callable[[str], list[dict[str, Any]]] = "hermes", runner: ToolRunner | None = None,
                 ) -> None:
        self.tools = {fn.__name__: fn for fn in tools}
        self.timeout = timeout
        if isinstance(format, str) and format not in TOOL_CALL_FORMATS:
            raise ValueError(f"rollout.format must be one of {sorted(TOOL_CALL_FORMATS)} or a parser, got {format!r}")
        self.parse = TOOL_CALL_FORMATS[format] if isinstance(format, str) else format
        self.runner = runner if runner is not None else ToolRunner()
        # this episode's calls, those that came back as an error (malformed, unknown, raised, timed out, no JSON), the
        # timed out among them, and the first error's message (logged: train/tool_errors, the rollout's warning)
        self.calls, self.errors, self.timeouts, self.first_error = 0, 0, 0, None

    def _error(self, message: str) -> str:
        self.errors += 1
        self.first_error = self.first_error or message
        return message

    def plan(self, message: str) -> list[str | ToolCall] | None:
        """The message's calls, each a :class:`ToolCall` to run or, when it cannot run (malformed, an unknown tool),
        its tool message already; ``None`` when it has none (the episode ends)."""
        calls = self.parse(message)
        if not calls:
            return None
        planned: list[str | ToolCall] = []
        for call in calls:
            self.calls += 1
            if "error" in call:
                planned.append(self._error(f"error: {call['error']}"))
            elif call["name"] not in self.tools:
                planned.append(self._error(f"error: unknown tool {call['name']!r}; tools: "
                                           f"{', '.join(sorted(self.tools))}"))
            else:
                planned.append(ToolCall(self.tools[call["name"]], call["arguments"], self.timeout, call["name"]))
        return planned

    def answer(self, planned: list[str | ToolCall], results: Sequence[ToolResult]) -> EnvStep:
        """The observation of a :meth:`plan`: its calls' results (``results``, one per :class:`ToolCall` in it, in
        order) and its ready messages, one line per call in the message's order."""
        ran = iter(results)
        return EnvStep(observation="\n".join(p if isinstance(p, str) else self._message(next(ran)) for p in planned))

    def _message(self, result: ToolResult) -> str:
        """A call's tool message, counted as an error where it is one (a raise, a timeout, a value with no JSON)."""
        message = tool_message(result)
        self.timeouts += int(result.timed_out)
        failed = not result.ok or (not isinstance(result.value, str) and message.startswith("error: "))
        return self._error(message) if failed else message

    def step(self, message: str) -> EnvStep:
        planned = self.plan(message)
        if planned is None:
            return EnvStep(done=True)
        return self.answer(planned, self.runner.run([p for p in planned if isinstance(p, ToolCall)]))


def step_environments(envs: Sequence[Environment], messages: Sequence[str]) -> list[EnvStep]:
    """Each environment's step on its message, in order. The tool calls of every :class:`ToolEnvironment` (whose
    ``step`` is not overridden) run in one batch per runner, all at once up to its ``max_workers``; any other
    environment steps in this process, one after another (its state persists from step to step)."""
    steps: list[EnvStep | None] = [None] * len(envs)
    batches: dict[int, tuple[ToolRunner, list[tuple[int, ToolEnvironment, list[str | ToolCall]]]]] = {}
    for j, (env, message) in enumerate(zip(envs, messages, strict=True)):
        if isinstance(env, ToolEnvironment) and type(env).step is ToolEnvironment.step:
            planned = env.plan(message)
            if planned is None:
                steps[j] = EnvStep(done=True)
            else:
                batches.setdefault(id(env.runner), (env.runner, []))[1].append((j, env, planned))
        else:
            step = env.step(message)
            if not isinstance(step, EnvStep):
                raise TypeError(f"{type(env).__name__}.step returned {type(step).__name__}, not an EnvStep (its "
                                 "observation, reward and done)")
            steps[j] = step
    for runner, batch in batches.values():
        results = iter(runner.run([p for _, _, planned in batch for p in planned if isinstance(p, ToolCall)]))
        for j, env, planned in batch:
            steps[j] = env.answer(planned, [next(results) for p in planned if isinstance(p, ToolCall)])
    return steps  # type: ignore[return-value]


@dataclass
class Episode:
    """One completion's turns as they are built: token ids and whose they are, the sampling log-probs of the policy's,
    the messages (TRL's conversational completion), and what the environment said."""

    env: Environment
    ids: list[int] = field(default_factory=list)
    policy: list[int] = field(default_factory=list)  # 1: the policy's token, 0: the environment's
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    reward: float = 0.0
    turn_rewards: list[float | None] = field(default_factory=list)  # each policy turn's reward from the environment
    tool_calls: int = 0
    tool_errors: int = 0  # calls that came back as an error
    tool_timeouts: int = 0
    tool_error: str | None = None  # the first error's message
    done: bool = False
    finished: bool = False  # its last turn ended with EOS

    def add(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        self.ids += list(ids)
        self.policy += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)


class ChatTurns:
    """The tokens of an environment's message between two assistant turns, from the tokenizer's chat template: what
    the template writes after an assistant message (from the end of its EOS token on) for a ``role`` message and the
    next generation prompt. The policy's turn ends with EOS (generation stops there), so what the template adds after
    it (ChatML's newline) belongs to the environment's tokens."""

    def __init__(self, tokenizer: Any, tools: Sequence[Callable] = (), role: str = "tool") -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("a multi-turn rollout renders the environment's messages with the tokenizer's chat "
                             "template, and this tokenizer has none: set data.chat_template (or tokenizer.chat_template)")
        self.tokenizer, self.role = tokenizer, role
        self.tools = [tool_schema(fn) for fn in tools] or None
        self.eos = tokenizer.eos_token or ""

    def render(self, messages: list[dict[str, str]], generation: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation)

    def observation_ids(self, text: str) -> list[int]:
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        before = self.render(base, generation=False)
        after = self.render(base + [{"role": self.role, "content": text}], generation=True)
        if not after.startswith(before):
            raise ValueError("the chat template does not render a conversation as a prefix of its continuation: "
                             "multi-turn rollouts need one that does")
        end = before.rfind(self.eos) if self.eos else -1
        cut = end + len(self.eos) if end >= 0 else len(before)  # a template without EOS: the turn ends where it ends
        return self.tokenizer(after[cut:], add_special_tokens=False)["input_ids"]


def resolve(spec: Any, key: str) -> Any:
    """An object given as itself or as an import path ``"package.module.name"`` (what a config file can hold)."""
    if not isinstance(spec, str):
        return spec
    import importlib

    module, _, name = spec.rpartition(".")
    if not module:
        raise ValueError(f"{key}: {spec!r} is no import path of an object in a module (package.module.name)")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{key}: cannot import {spec!r}: {err}") from None


class MultiTurnEngine(RolloutEngine):
    """Multi-turn rollouts on a backend: each completion is an episode of an :class:`Environment` (one per
    completion), its turns sampled by ``base`` from the context so far.

    Args:
        environment: each completion's environment: ``"tools"`` (a :class:`ToolEnvironment` of ``tools``), an
            :class:`Environment` class (made without arguments; ``reset`` gets the row) or its import path, or a
            callable that makes one from the dataset row.
        tools: the functions the model may call (or their import paths); the chat template shows their schemas.
        format: how the model writes tool calls (:data:`TOOL_CALL_FORMATS`: ``hermes``, ``pythonic``).
        timeout: seconds a tool call may run.
        max_turns: the policy's turns at most.
        max_tokens: the completion's tokens at most (the policy's and the environment's); a turn gets what is left,
            at most ``generation.max_new_tokens``.
        base: the backend that samples each turn: a :class:`RolloutEngine`, a backend name or its settings (default:
            the transformers backend).
        tokenizer: the policy's tokenizer, whose chat template renders the environment's messages (the module gives
            its own when this is ``None``).
        role: the role of the environment's messages in the chat template.
        tool_runner: how tool calls run: ``"process"`` (each in a forked process of its own, killed past
            ``timeout``; the tools must not use torch), ``"thread"`` (in this process; a call past ``timeout`` is
            abandoned and runs on), or a :class:`~polopt_lightning.rollout.tool_runner.ToolRunner`. A turn's calls,
            every completion's, run at once.
        tool_workers: tool calls running at once at most (``None``: the CPUs this process may use); ignored when
            ``tool_runner`` is a runner.
        sandbox: where untrusted tools run (the ``python`` tool, functions marked
            :func:`~polopt_lightning.sandbox.tools.untrusted`): a :class:`~polopt_lightning.sandbox.Sandbox` or its
            settings (``conf/sandbox``); built now when a tool needs it, so a machine that cannot isolate code is
            named before the run starts. Ignored when ``tool_runner`` is a runner.
    """

    takes_rows = True  # the module passes the batch's rows (their columns) to generate

    def __init__(self, environment: Any = "tools", tools: Sequence[Callable | str] = (), format: str = "hermes",
                 timeout: float | None = 5.0, max_turns: int = 4, max_tokens: int = 256,
                 base: RolloutEngine | str | Mapping[str, Any] | None = None, tokenizer: Any = None,
                 role: str = "tool", tool_runner: str | ToolRunner = "process", tool_workers: int | None = None,
                 sandbox: Any = None) -> None:
        from . import build_engine

        if max_turns < 1 or max_tokens < 1:
            raise ValueError(f"rollout.max_turns and rollout.max_tokens must be >= 1, got {max_turns}, {max_tokens}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"rollout.timeout must be > 0 seconds or null (no limit), got {timeout}")
        self.tools = [resolve(fn, "rollout.tools") for fn in tools]
        for fn in self.tools:
            tool_schema(fn)  # a tool without types or docstring fails now, naming it
        names = [fn.__name__ for fn in self.tools]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"rollout.tools: the model calls a tool by its name, and {twice} name more than one")
        self.runner = (tool_runner if isinstance(tool_runner, ToolRunner)
                       else ToolRunner(tool_runner, tool_workers, sandbox=sandbox))
        if any(is_untrusted(fn) for fn in self.tools):
            self.runner.sandbox  # noqa: B018 - built now: refused here, naming what is missing, not mid-run
        if environment == "tools":
            if not self.tools:
                raise ValueError("rollout.environment=tools needs rollout.tools (the functions the model may call)")
            ToolEnvironment(self.tools, timeout, format, self.runner)  # checks the format now
            self.environment = lambda row: ToolEnvironment(self.tools, timeout, format, self.runner)
        else:
            made = resolve(environment, "rollout.environment")
            if isinstance(made, type) and issubclass(made, Environment):
                self.environment = lambda row, cls=made: cls()
            elif callable(made):
                self.environment = made
            else:
                raise ValueError(f"rollout.environment must be 'tools', an Environment class or a callable, got "
                                 f"{environment!r}")
        self.max_turns, self.max_tokens, self.role = max_turns, max_tokens, role
        self.base = build_engine(base, "rollout.base")
        self.corrects_sampler = self.base.corrects_sampler
        self.tokenizer, self.turns = None, None
        if tokenizer is not None:
            self.set_tokenizer(tokenizer)

    def set_tokenizer(self, tokenizer: Any) -> None:
        """The policy's tokenizer: its chat template renders the environment's messages (and shows the tools)."""
        self.tokenizer, self.turns = tokenizer, ChatTurns(tokenizer, self.tools, self.role)

    def logprobs_match(self, model: nn.Module) -> bool:
        return self.base.logprobs_match(model)

    def policy_updated(self, model: nn.Module) -> None:
        self.base.policy_updated(model)

    def close(self) -> None:
        self.base.close()

    def take_turn(self, episode: Episode, out: RolloutBatch, k: int, left: int) -> str | None:
        """Row ``k`` of a turn's rollout added to ``episode`` (at most ``left`` tokens); its text for the environment
        to answer, or ``None`` when a token budget cut it (the episode ends with it)."""
        sampled = int(out.completion_mask[k].sum())
        n = min(sampled, left)
        tokens = out.completion_ids[k, :n].tolist()
        episode.add(tokens, out.sampling_logprobs[k, :n].tolist())
        episode.finished = bool(out.finished[k]) and n == sampled
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        episode.messages.append({"role": "assistant", "content": text})
        return text if episode.finished else None

    def answer_turn(self, episode: Episode, step: EnvStep, turn: int) -> bool:
        """The environment's answer (``step``) to the episode's last turn, added to it; whether it goes on."""
        episode.turn_rewards.append(step.reward)
        if step.reward is not None:
            episode.reward += float(step.reward)
        if step.done or step.observation is None or turn == self.max_turns - 1:
            episode.done = True
            return False
        episode.messages.append({"role": self.turns.role, "content": step.observation})
        episode.add(self.turns.observation_ids(step.observation)[: max(self.max_tokens - len(episode.ids), 0)], None)
        return len(episode.ids) < self.max_tokens

    def generate(self, model, prompt_ids, prompt_mask, num_generations, sampling, eos_token_id, pad_token_id,
                 generator=None, rows: Sequence[Mapping[str, Any]] | None = None) -> RolloutBatch:
        if self.turns is None:
            raise RuntimeError("MultiTurnEngine has no tokenizer: pass tokenizer= or call set_tokenizer()")
        G, P = num_generations, prompt_ids.shape[0]
        rows = list(rows) if rows is not None else [{} for _ in range(P)]
        episodes = [Episode(self.environment(rows[i // G])) for i in range(P * G)]
        for i, episode in enumerate(episodes):
            first = episode.env.reset(rows[i // G])
            if first is not None:
                episode.messages.append({"role": self.turns.role, "content": first})
                episode.add(self.turns.observation_ids(first), None)
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        plain_start = not any(e.ids for e in episodes)  # no first observation: turn 1 samples G per prompt at once
        active = list(range(P * G))
        for turn in range(self.max_turns):
            left = {i: self.max_tokens - len(episodes[i].ids) for i in active}
            active = [i for i in active if left[i] > 0]
            if not active:
                break
            budget = min(sampling.max_new_tokens, max(left[i] for i in active))
            settings = SamplingConfig(max_new_tokens=budget, min_new_tokens=min(sampling.min_new_tokens, budget),
                                      temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
            if turn == 0 and plain_start:  # every row, in order: row i is prompt i // G's completion i % G
                out = self.base.generate(model, prompt_ids, prompt_mask, G, settings, eos_token_id, pad_token_id,
                                         generator=generator)
            else:  # each episode's context so far is the prompt of its next turn
                ids, mask = left_pad([prompts[i // G] + episodes[i].ids for i in active], pad_token_id,
                                     prompt_ids.device)
                out = self.base.generate(model, ids, mask, 1, settings, eos_token_id, pad_token_id,
                                         generator=generator)
            texts = {i: self.take_turn(episodes[i], out, k, left[i]) for k, i in enumerate(active)}
            answered = [i for i in active if texts[i] is not None]
            # the environments answer the turn together: every completion's tool calls at once
            steps = step_environments([episodes[i].env for i in answered], [texts[i] for i in answered])
            active = [i for i, step in zip(answered, steps) if self.answer_turn(episodes[i], step, turn)]
        for episode in episodes:
            episode.tool_calls = getattr(episode.env, "calls", 0)
            episode.tool_errors = getattr(episode.env, "errors", 0)
            episode.tool_timeouts = getattr(episode.env, "timeouts", 0)
            episode.tool_error = getattr(episode.env, "first_error", None)
        return assemble(episodes, prompt_ids, prompt_mask, G, pad_token_id)


def left_pad(rows: list[list[int]], pad: int, device: torch.device) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


def assemble(episodes: list[Episode], prompt_ids: Tensor, prompt_mask: Tensor, G: int, pad: int) -> RolloutBatch:
    """The episodes as one rollout: each completion is its turns' tokens in order; ``completion_mask`` on the
    policy's, ``context_mask`` on all; the sampling log-probs 0 on the environment's tokens."""
    device = prompt_ids.device
    width = max(max(len(e.ids) for e in episodes), 1)
    N = len(episodes)
    ids = torch.full((N, width), pad, dtype=torch.long)
    policy = torch.zeros((N, width), dtype=torch.long)
    context = torch.zeros((N, width), dtype=torch.long)
    logprobs = torch.zeros((N, width), dtype=torch.float32)
    for i, e in enumerate(episodes):
        n = len(e.ids)
        ids[i, :n] = torch.tensor(e.ids, dtype=torch.long)
        policy[i, :n] = torch.tensor(e.policy, dtype=torch.long)
        context[i, :n] = 1
        logprobs[i, :n] = torch.tensor(e.logprobs, dtype=torch.float32)
    return RolloutBatch(
        prompt_ids=prompt_ids.repeat_interleave(G, 0), prompt_mask=prompt_mask.repeat_interleave(G, 0),
        completion_ids=ids.to(device), completion_mask=policy.to(device), sampling_logprobs=logprobs.to(device),
        finished=torch.tensor([e.done and e.finished for e in episodes], device=device), group_size=G,
        context_mask=context.to(device), conversations=[e.messages for e in episodes],
        extras={"env_reward": [e.reward for e in episodes], "turn_rewards": [e.turn_rewards for e in episodes],
                "tool_calls": [e.tool_calls for e in episodes], "tool_errors": [e.tool_errors for e in episodes],
                "tool_timeouts": [e.tool_timeouts for e in episodes], "tool_error": [e.tool_error for e in episodes]})
