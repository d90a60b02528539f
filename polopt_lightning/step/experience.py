"""Making experience: the rollout's completions scored, grouped and turned into advantages, as one typed
:class:`Experience` the update reads. :class:`ExperienceMaker` holds the settings (group size, dynamic sampling,
advantage scale, overlong filtering, the anchor's targets) and runs the draws; the module gives it the sampler."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..chat import completion_like
from ..distributed import all_gather_rows, all_reduce, world_size
from ..objectives.base import kl_estimate
from ..rewards import MixtureRewards, RewardComposer, RewardOutput
from ..rollout import Completions, RolloutBatch
from ..sandbox import usage as sandbox_usage
from ..settings import Settings
from .advantages import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_SCALES,
    batch_values,
    batch_weights,
    estimate_advantages,
    gae,
    get_estimator,
    masked_moments,
    masked_whiten,
    outcome_token_rewards,
    spread_turns,
    turn_index,
    turn_returns,
    turn_token_rewards,
    zero_std_groups,
)

log = logging.getLogger(__name__)
# rollouts in this process where most tool calls failed (ExperienceMaker.turn_metrics says the first and every 50th)
_FAILING_ROLLOUTS = [0]

WHITENINGS = ("completion", "token")
TURN_CREDITS = ("episode", "turn")

@dataclass
class ExperienceConfig(Settings):
    """How a step's experience is drawn and scored (the module's ``experience`` argument, ``experience.*`` in the CLI).

    Args:
        num_generations: completions per prompt (``G >= 2``: a group of one has no relative signal).
        advantage_estimator: how rewards become advantages: ``"grpo"`` (group mean), ``"rloo"`` (leave-one-out),
            ``"reinforce_pp"`` (batch-whitened), ``"reinforce_pp_baseline"`` (group mean, then batch-whitened),
            ``"remax"`` (the reward of the prompt's greedy completion, drawn each step, as the baseline), ``"pass_at_k"``
            (each group's best completion against its second best), ``"gae"`` (per token, from a critic's values:
            PPO, the ``critic`` settings); see :data:`~polopt_lightning.step.advantages.ADVANTAGE_ESTIMATORS`.
            ``None``: the objective's own (``gae`` for ``ppo``, ``grpo`` for the others).
        advantage_scale: ``"group"``, ``"batch"`` or ``"none"``; ``None``: the estimator's own (GRPO's: the
            objective's, Dr. GRPO none; RLOO none; REINFORCE++ batch).
        whitening: what REINFORCE++'s batch whitening (``reinforce_pp``, ``reinforce_pp_baseline`` with the batch
            scale) averages over: ``"completion"``, each completion's value once; ``"token"``, once per completion
            token (the paper's and verl's, which whiten the per-token advantages: long completions weigh more in the
            mean and deviation). Each completion keeps one advantage for all its tokens either way.
        dynamic_sampling: DAPO's dynamic sampling: drop groups whose rewards are all equal and draw more prompts
            until the batch is full again, at most ``max_extra_draws`` extra batches per step.
        mask_truncated_completions: DAPO's overlong filtering: completions cut by ``max_new_tokens`` do not count.
        turn_credit: how a multi-turn episode's credit reaches its turns: ``"episode"``, one advantage for every
            policy token of the completion (its reward's); ``"turn"``, each turn its own: the environment's reward
            for the turn (``turn_rewards``) and the completion's reward on its last turn, discounted back to each turn
            by ``turn_discount`` (``R_k = sum_{j >= k} turn_discount^(j-k) r_j``), each turn's return then measured by
            the estimator against the same turn of its group's other completions (those that reached it); with the
            critic (``gae``) each turn's reward sits on its last token and GAE carries it back (``critic.gamma``,
            ``critic.lam``). The objective then takes an advantage per token (GRPO and its variants, PPO, CISPO,
            SAPO). The completion's reward should not also count the environment's rewards (e.g.
            ``environment_reward`` among the reward functions): they would count twice.
        turn_discount: ``gamma`` over turns of ``turn_credit="turn"`` without a critic (1: every later turn's reward
            counts fully).
        max_staleness: the asynchronous pipeline (:mod:`~polopt_lightning.step.pipeline`): each rollout is submitted
            this many training steps before the update that trains on it, so a backend that samples apart from the
            trainer (``rollout=server``) samples the next rollouts while the current one trains; a rollout then comes
            from a policy this many rollouts' updates old, which the sampler correction weighs. 0: sample, then train
            (synchronous).
    """

    num_generations: int = 8
    advantage_estimator: str | None = None
    advantage_scale: str | None = None
    whitening: str = "completion"
    dynamic_sampling: bool = False
    max_extra_draws: int = 4
    mask_truncated_completions: bool = False
    max_staleness: int = 0
    turn_credit: str = "episode"
    turn_discount: float = 1.0

    KEY = "experience"
    RULES = {
        "num_generations": (lambda v: v >= 2, ">= 2 (a group of one has no relative advantage)"),
        "advantage_estimator": (lambda v: v is None or v in ADVANTAGE_ESTIMATORS,
                                f"one of {sorted(ADVANTAGE_ESTIMATORS)} or None"),
        "advantage_scale": (lambda v: v is None or v in ADVANTAGE_SCALES, f"one of {ADVANTAGE_SCALES} or None"),
        "whitening": (lambda v: v in WHITENINGS, f"one of {WHITENINGS}"),
        "max_extra_draws": (lambda v: v >= 0, ">= 0"),
        "max_staleness": (lambda v: v >= 0, ">= 0 (0: synchronous)"),
        "turn_credit": (lambda v: v in TURN_CREDITS, f"one of {TURN_CREDITS}"),
        "turn_discount": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    }

    def estimator(self, objective_estimator: str | None = None) -> str:
        """The advantage estimator a step uses: ``advantage_estimator``, else the objective's
        (``objective_estimator``: PPO's ``gae``), else ``grpo``."""
        return self.advantage_estimator or objective_estimator or "grpo"

    def scale(self, objective_scale: str | None = None, objective_estimator: str | None = None) -> str | None:
        """The advantage scale a step uses, settled here alone: ``advantage_scale``, else the estimator's own
        (``rloo``: none, ``reinforce_pp``: batch), else the objective's (``objective_scale``: GRPO group, Dr. GRPO
        none)."""
        own = get_estimator(self.estimator(objective_estimator)).default_scale
        return self.advantage_scale or own or objective_scale

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.whitening == "token":
            scale = self.scale()
            if not get_estimator(self.estimator()).whiten or scale != "batch":
                raise ValueError(f"experience.whitening=token weighs REINFORCE++'s batch whitening by tokens, and "
                                 f"experience.advantage_estimator={self.estimator()} with advantage_scale="
                                 f"{scale} does not whiten: use reinforce_pp or reinforce_pp_baseline (advantage_scale "
                                 "batch or null), or whitening=completion")


@dataclass
class Experience(Completions):
    """One step's rollout, ready for the update: :class:`~polopt_lightning.rollout.base.Completions`' fields (the
    completion mask is 0 on a truncated completion under overlong filtering), then:

    Attributes:
        group_index: ``[N]`` the group (prompt) of each row, ``0..P-1``.
        advantages: ``[N]`` group-relative advantages.
        anchor_ids, anchor_mask: ``[P, Ta]`` each prompt's reference answer (``answer + EOS``) for the supervised
            anchor; ``None`` without one.
        old_logprobs: ``[N, T]`` the policy's log-probs before the step's first update (off-policy updates);
            ``None`` on-policy.
        ref_logprobs: ``[N, T]`` the KL reference's log-probs; ``None`` when no KL is computed or watched.
        entropies: ``[N, T]`` the sampling policy's entropy at each completion token, for the top-entropy mask;
            ``None`` without one.
        values, returns: ``[N, T]`` the critic's values at sampling time and GAE's returns (its targets) with the
            ``gae`` estimator (PPO; ``advantages`` are then ``[N, T]`` too); ``None`` otherwise.
    """

    group_index: Tensor
    advantages: Tensor
    anchor_ids: Tensor | None = None
    anchor_mask: Tensor | None = None
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    entropies: Tensor | None = None
    values: Tensor | None = None
    returns: Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.completion_ids.shape[0]


# the Completions fields a rollout carries into the experience, and the side their padding goes on (None: [N])
ROLLOUT_FIELDS = {"prompt_ids": "left", "prompt_mask": "left", "completion_ids": "right", "completion_mask": "right",
                  "sampling_logprobs": "right", "finished": None, "context_mask": "right"}


class ExperienceMaker:
    """Draws, scores and groups one step's completions (see :meth:`make`).

    Args:
        tokenizer: decodes completions for the reward functions and encodes the anchor's answers.
        rewards: a :class:`~polopt_lightning.rewards.RewardComposer` or a task mixture's
            :class:`~polopt_lightning.rewards.MixtureRewards`.
        config: an :class:`ExperienceConfig` (or a dict of its fields).
        anchor: the supervised anchor (its ``column`` names the reference answers), or ``None``.
        advantage_scale: the scale used when ``config.advantage_scale`` is ``None`` (the objective's own).
        reference: the :class:`~polopt_lightning.step.reference.ReferenceConfig` whose ``kl_in_reward`` (and
            ``reward_kl_estimator``) make the KL a reward penalty; ``None``: no penalty.
        advantage_estimator: the estimator used when ``config.advantage_estimator`` is ``None`` (the objective's own).
        critic: the :class:`~polopt_lightning.step.critic.CriticConfig` (GAE's ``gamma``, ``lam``, ``whiten``) where
            the estimator is ``gae``.
    """

    def __init__(self, tokenizer: Any, rewards: RewardComposer | MixtureRewards,
                 config: ExperienceConfig | Mapping[str, Any] | None = None, anchor: Any = None,
                 advantage_scale: str = "group", reference: Any = None, advantage_estimator: str | None = None,
                 critic: Any = None) -> None:
        self.config = config = ExperienceConfig.of(config)
        self.tokenizer, self.rewards, self.num_generations = tokenizer, rewards, config.num_generations
        self.estimator = config.estimator(advantage_estimator)
        self.advantage_scale = config.scale(advantage_scale, advantage_estimator)
        self.baseline = get_estimator(self.estimator).baseline
        self.critic = critic
        if self.baseline == "critic" and critic is None:
            raise ValueError(f"experience.advantage_estimator={self.estimator} measures each token against a critic's "
                             "value: the module needs a critic (its critic settings, critic_model)")
        if self.baseline != "critic":  # validates the names now
            estimate_advantages(torch.zeros(2), 2, self.estimator, self.advantage_scale, baselines=torch.zeros(2))
        self.per_turn = config.turn_credit == "turn"
        if self.per_turn and self.baseline == "greedy":
            raise ValueError(f"experience.turn_credit=turn: the {self.estimator} estimator's baseline is the greedy "
                             "completion's reward, which has no turns to compare with; use grpo, rloo, gae, ...")
        if self.baseline == "greedy" and rewards.aggregation != "sum":
            raise ValueError(f"experience.advantage_estimator={self.estimator} compares each reward with the greedy "
                             f"completion's, which has no group to be normalised in: reward.aggregation="
                             f"{rewards.aggregation} does not apply (use sum)")
        self.dynamic_sampling, self.max_extra_draws = config.dynamic_sampling, config.max_extra_draws
        self.mask_truncated_completions = config.mask_truncated_completions
        self.anchor = anchor
        self.kl_in_reward = float(getattr(reference, "kl_in_reward", 0.0))
        self.reward_kl_estimator = getattr(reference, "reward_kl_estimator", "k1")
        self.tasks = list(rewards.tasks) if isinstance(rewards, MixtureRewards) else []
        # the last scored draw (prompt and completion texts, rewards per function), and what the last step's
        # experience rows are made of (:attr:`last_samples` builds them only when a completions log asks)
        self.last_scored: dict[str, Any] | None = None
        self._last_step: tuple[list, list, Tensor] | None = None
        self._sandbox_seen = sandbox_usage().snapshot()  # executions before this step maker's first step: not its own

    def score(self, batch: Mapping[str, Any], rollout: RolloutBatch, trainer_state: Any = None) -> RewardOutput:
        """Decode the completions and run the reward functions as TRL calls them: ``prompts`` as the dataset holds
        them and ``completions`` in the same form (a conversation's completion is ``[{"role": "assistant", "content":
        text}]``, a string prompt's the text), ``completion_ids``, every extra column (repeated for the G
        completions) and ``trainer_state`` when given."""
        G = rollout.group_size
        # the whole completion as the model reads it (a multi-turn rollout's tool results too)
        ids = [row[mask.bool()].tolist() for row, mask in zip(rollout.completion_ids, rollout.attention_mask)]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        prompts = [p for p in batch["prompts"] for _ in range(G)]
        if rollout.conversations is not None:  # multi-turn: TRL's form, the completion's messages (a string prompt's:
            # the model's last message, its answer; the whole conversation is the `conversation` column)
            completions = [conv if not isinstance(p, str) else last_message(conv)
                           for p, conv in zip(prompts, rollout.conversations)]
        else:
            completions = [completion_like(p, t) for p, t in zip(prompts, texts)]
        columns = {k: [v for v in col for _ in range(G)] for k, col in batch.get("columns", {}).items()}
        if rollout.conversations is not None:  # the whole conversation and per-turn information, by row
            columns.update(conversation=rollout.conversations, **(rollout.extras or {}))
        if trainer_state is not None:
            columns["trainer_state"] = trainer_state
        out = self.rewards(prompts, completions, group_size=G, completion_ids=ids, **columns)
        shown = batch.get("prompt_texts") or [str(p) for p in batch["prompts"]]
        self.last_scored = {"prompt": [p for p in shown for _ in range(G)], "completion": texts,
                            "rewards": out.per_function}
        return out

    def make(self, batch: Mapping[str, Any], sample: Callable[[Mapping[str, Any]], RolloutBatch],
             next_prompts: Callable[[], Mapping[str, Any]], device: torch.device,
             trainer_state: Any = None, reference: Callable[[Experience], Tensor] | None = None,
             greedy: Callable[[Mapping[str, Any]], RolloutBatch] | None = None,
             values: Callable[[Experience], Tensor] | None = None) -> tuple[Experience, dict]:
        """The step's experience and its metrics: ``sample`` draws a rollout of a prompt batch; with dynamic
        sampling, ``next_prompts`` gives more prompts until the batch's groups are filled again. Metrics are over
        every process (collective: every process calls this once per step). ``trainer_state`` reaches the reward
        functions; ``reference`` gives the rows' reference log-probs ``[N, T]`` for a KL reward penalty
        (``kl_in_reward``; they are kept in ``ref_logprobs`` for the update). ``greedy`` draws one greedy completion
        of each prompt (ReMax's baseline); ``values`` gives the critic's values ``[N, T]`` of the rows (GAE)."""
        if self.baseline == "greedy" and greedy is None:
            raise ValueError(f"experience.advantage_estimator={self.estimator} needs the greedy completions: pass "
                             "make(..., greedy=...)")
        if self.baseline == "critic" and values is None:
            raise ValueError(f"experience.advantage_estimator={self.estimator} needs the critic's values: pass "
                             "make(..., values=...)")
        G = self.num_generations
        num_prompts = batch["prompt_ids"].shape[0]
        parts, scored, kept_groups, dropped, draws = [], [], 0, 0, 0
        metrics: dict[str, Tensor] = {}
        while True:
            rollout = sample(batch)
            rewards = self.score(batch, rollout, trainer_state)
            if not parts:  # the first draw is what the step's reward metrics describe
                metrics.update({f"train/{k}": v for k, v in self.batch_reward_metrics(rewards, device).items()})
                zero = zero_std_groups(rewards.total, G).float()
                metrics["train/frac_zero_std"] = all_reduce(zero.sum().to(device)) / all_reduce(
                    torch.tensor(float(zero.numel()), device=device))
                if self.tasks:
                    metrics.update(self.task_signal(batch, zero.bool(), device))
                if rollout.extras:  # a multi-turn rollout: tool calls and environment turns per completion
                    metrics.update(self.turn_metrics(rollout, device))
            keep = torch.ones(num_prompts, dtype=torch.bool)
            if self.dynamic_sampling:
                keep = ~zero_std_groups(rewards.total, G)
                dropped += int((~keep).sum())
            # each row's reward, then its prompt's greedy completion's (ReMax), then its turns' environment rewards
            total = rewards.total[:, None]
            if self.baseline == "greedy":
                total = torch.cat([total, self.greedy_rewards(batch, greedy, trainer_state).repeat_interleave(G)[:, None]],
                                  -1)
            if self.per_turn:  # the reward functions' per-turn parts go to their turns, not to the outcome
                if rewards.turns is not None and self.rewards.aggregation != "sum":
                    raise ValueError("a reward function gave per-turn rewards, which reward.aggregation="
                                     f"{self.rewards.aggregation} cannot normalise in their groups: use sum")
                matrix, given = turn_reward_matrix(rollout, rewards.turns)
                total = torch.cat([total - given[:, None], matrix], -1)
            parts.append((rollout, total, keep, self.anchor_targets(batch, device)))
            scored.append(self.last_scored)
            kept_groups += int(keep.sum())
            if not self.dynamic_sampling or kept_groups >= num_prompts or draws >= self.max_extra_draws:
                break
            batch = next_prompts()
            draws += 1
        if self.dynamic_sampling:  # totals over the processes
            metrics["train/dynamic_sampling/dropped_groups"] = all_reduce(torch.tensor(float(dropped), device=device))
            metrics["train/dynamic_sampling/extra_draws"] = all_reduce(torch.tensor(float(draws), device=device))
            if kept_groups == 0:  # nothing learnable after every draw: train on the last draw (advantages are 0)
                parts[-1] = (parts[-1][0], parts[-1][1], torch.ones_like(parts[-1][2]), parts[-1][3])
        width = max(part[1].shape[1] for part in parts)  # as many turn columns in every draw
        parts = [(r, nn.functional.pad(t, (0, width - t.shape[1]), value=float("nan")), k, a) for r, t, k, a in parts]
        fields, columns, picked = concat_groups(parts, G, num_prompts if self.dynamic_sampling else None)
        rewards, baselines, turn_rewards = columns[:, 0], None, None
        if self.per_turn:
            turn_rewards = columns[:, 2 if self.baseline == "greedy" else 1:]
        if self.baseline == "greedy":
            baselines = columns[:, 1]
            metrics["train/greedy_reward"] = all_reduce(baselines.nansum().to(device)) / all_reduce(
                torch.isfinite(baselines).sum().float().to(device)).clamp(min=1)
        exp = Experience(advantages=rewards.new_zeros(rewards.shape).to(device), **fields)
        if self.kl_in_reward > 0:
            if reference is None:
                raise ValueError(f"reference.kl_in_reward={self.kl_in_reward} needs the reference's log-probs: "
                                 "pass make(..., reference=...)")
            exp.ref_logprobs = reference(exp).detach()  # a target: no graph is kept over the rollout
        if self.baseline == "critic":  # per token from the critic's values, the KL penalty per token
            self.token_advantages(exp, rewards, values, metrics, device, turn_rewards)
        else:
            if self.kl_in_reward > 0:
                penalty = self.kl_penalty(exp)
                rewards = rewards - penalty.to(rewards)
                metrics["train/kl_reward_penalty"] = all_reduce(penalty.sum()) / all_reduce(
                    torch.tensor(float(penalty.numel()), device=penalty.device))
            if self.per_turn:
                exp.advantages = self.turn_advantages(exp, rewards, turn_rewards, device)
            else:
                # per-token whitening: each completion's value counts once per completion token
                tokens = exp.completion_mask.sum(-1).to(rewards.device) if self.config.whitening == "token" else None
                moments = (self.batch_moments(batch_values(rewards, G, self.estimator), device,
                                              batch_weights(rewards, tokens))
                           if self.advantage_scale == "batch" else (None, None))
                exp.advantages = estimate_advantages(rewards, G, self.estimator, self.advantage_scale, *moments,
                                                     token_counts=tokens, baselines=baselines).to(device)
        self._last_step = (scored, picked, exp.advantages if exp.advantages.dim() == 1
                           else row_means(exp.advantages, exp.completion_mask))
        metrics.update(self.sandbox_metrics(device))
        if self.mask_truncated_completions:
            exp.completion_mask = exp.completion_mask * exp.finished[:, None].long()
        return exp, metrics

    def greedy_rewards(self, batch: Mapping[str, Any], greedy: Callable[[Mapping[str, Any]], RolloutBatch],
                       trainer_state: Any) -> Tensor:
        """``[P]`` the rewards of one greedy completion of each prompt of ``batch`` (ReMax's baselines; NaN where none
        was given), scored as the sampled ones are; the completions log keeps the sampled ones."""
        sampled = self.last_scored
        try:
            return self.score(batch, greedy(batch), trainer_state).total.float()
        finally:
            self.last_scored = sampled

    def turn_advantages(self, exp: Experience, rewards: Tensor, turn_rewards: Tensor, device: torch.device) -> Tensor:
        """``[N, T]`` per-turn advantages (``turn_credit="turn"`` without a critic): each turn's discounted return
        (:func:`~polopt_lightning.step.advantages.turn_returns`) through the estimator, turn index by turn index over
        the group's completions that reached it (a completion without that turn left out), on that turn's tokens."""
        G, mask = self.num_generations, exp.completion_mask
        index = turn_index(mask)
        turns = (index.amax(-1) + 1).cpu()
        # as many turn columns on every process (the collectives below run once a column), before anything can fail
        K = int(all_reduce(torch.tensor(max(turn_rewards.shape[1], int(turns.max()) if turns.numel() else 0),
                                        device=device), "max"))
        returns = turn_returns(rewards.cpu(), turn_rewards.cpu(), turns, self.config.turn_discount)
        advantages = torch.zeros((returns.shape[0], max(K, 1)))
        for k in range(K):
            column = returns[:, k] if k < returns.shape[1] else torch.full_like(rewards.cpu(), float("nan"))
            moments = (self.batch_moments(batch_values(column, G, self.estimator), device)
                       if self.advantage_scale == "batch" else (None, None))
            advantages[:, k] = estimate_advantages(column, G, self.estimator, self.advantage_scale, *moments)
        return spread_turns(advantages.to(device), index.clamp(max=advantages.shape[1] - 1).to(device)
                            if K else torch.full_like(index, -1)).float()

    def token_advantages(self, exp: Experience, rewards: Tensor, values: Callable[[Experience], Tensor],
                         metrics: dict[str, Tensor], device: torch.device, turn_rewards: Tensor | None = None) -> None:
        """GAE (:func:`~polopt_lightning.step.advantages.gae`) over the completion tokens from the critic's values:
        ``exp.values``, ``exp.returns`` and per-token ``exp.advantages``, whitened over every process's tokens (the
        critic settings' ``whiten``). The reward sits on each completion's last policy token; a KL reward penalty is
        taken token by token (verl's ``compute_rewards``). A completion without a reward (None) gets advantage 0 and
        its values as its targets."""
        critic = self.critic
        mask = exp.completion_mask.bool()
        with torch.no_grad():
            exp.values = values(exp).detach().float()
        token_rewards = (outcome_token_rewards(rewards.to(device), mask) if turn_rewards is None
                         else turn_token_rewards(rewards.to(device), turn_rewards.to(device), mask))
        if self.kl_in_reward > 0:
            zero = torch.zeros_like(exp.sampling_logprobs)
            kl = kl_estimate(torch.where(mask, exp.sampling_logprobs, zero), torch.where(mask, exp.ref_logprobs, zero),
                             self.reward_kl_estimator)
            penalty = self.kl_in_reward * kl * mask
            token_rewards = token_rewards - penalty.float()
            metrics["train/kl_reward_penalty"] = all_reduce(penalty.sum()) / all_reduce(
                torch.tensor(float(mask.shape[0]), device=device))
        advantages, returns = gae(token_rewards, exp.values, mask, critic.gamma, critic.lam)
        scored = mask & torch.isfinite(rewards.to(device))[:, None]
        if critic.whiten:
            advantages = masked_whiten(advantages, scored, all_reduce(masked_moments(advantages, scored)))
        exp.advantages = torch.where(scored, advantages, torch.zeros_like(advantages))
        exp.returns = torch.where(scored, returns, exp.values)

    def kl_penalty(self, exp: Experience) -> Tensor:
        """Each row's KL reward penalty ``[N]``: ``kl_in_reward x sum_t KL_t`` over its completion tokens, the sampler's
        log-probs against the reference's (verl subtracts the per-token penalty from the token rewards; its outcome
        estimators, GRPO's and RLOO's, then sum them as here)."""
        valid = exp.completion_mask.bool()
        zero = torch.zeros_like(exp.sampling_logprobs)
        kl = kl_estimate(torch.where(valid, exp.sampling_logprobs, zero), torch.where(valid, exp.ref_logprobs, zero),
                         self.reward_kl_estimator)
        return self.kl_in_reward * (kl * valid).sum(-1)

    @property
    def last_samples(self) -> dict[str, list] | None:
        """The last step's experience rows as columns (:meth:`samples`), built when asked (not on every step);
        ``None`` before the first step."""
        return None if self._last_step is None else self.samples(*self._last_step)

    def samples(self, scored: Sequence[dict[str, Any]], picked: Sequence[Tensor], advantages: Tensor) -> dict[str, list]:
        """The experience's rows as columns: ``prompt`` and ``completion`` texts, ``rewards/<function>`` (None where a
        function gave none) and ``advantage``, from each draw's scored rows that the experience kept."""
        out: dict[str, list] = {"prompt": [], "completion": [], **{f"rewards/{n}": [] for n in self.rewards.names},
                                "advantage": [float(a) for a in advantages.float().cpu()]}
        for draw, rows in zip(scored, picked):
            for i in rows.tolist():
                out["prompt"].append(draw["prompt"][i])
                out["completion"].append(draw["completion"][i])
                for j, name in enumerate(self.rewards.names):
                    value = float(draw["rewards"][i, j])
                    out[f"rewards/{name}"].append(value if value == value else None)  # NaN: no reward
        return out

    def task_signal(self, batch: Mapping[str, Any], zero: Tensor, device: torch.device) -> dict[str, Tensor]:
        """A mixture's per-task prompts in the step and share of their groups with equal rewards (no gradient), over
        every process: ``train/<task>/prompts`` and ``train/<task>/frac_zero_std`` (NaN for a task with no prompt)."""
        ids = self.rewards.task_ids(batch["columns"], zero.numel())
        counts = torch.stack([torch.stack([(ids == t).sum(), ((ids == t) & zero.cpu()).sum()])
                              for t in range(len(self.tasks))]).float().to(device)
        counts = all_reduce(counts)
        metrics = {}
        for t, task in enumerate(self.tasks):
            prompts, zero_groups = counts[t]
            metrics[f"train/{task}/prompts"] = prompts
            metrics[f"train/{task}/frac_zero_std"] = (zero_groups / prompts if prompts > 0
                                                      else torch.tensor(float("nan"), device=device))
        return metrics

    def sandbox_metrics(self, device: torch.device) -> dict[str, Tensor]:
        """This process's sandbox executions since the last step (the code reward's, untrusted tools'; docs/
        sandbox.md): ``train/sandbox_runs``, ``train/sandbox_s`` (their seconds, summed: executions run at once each
        count) and ``train/sandbox_timeouts``; nothing before the first execution."""
        runs, seconds, timeouts = sandbox_usage().snapshot()
        seen_runs, seen_seconds, seen_timeouts = self._sandbox_seen
        self._sandbox_seen = (runs, seconds, timeouts)
        if runs == seen_runs == 0:
            return {}
        return {"train/sandbox_runs": torch.tensor(float(runs - seen_runs), device=device),
                "train/sandbox_s": torch.tensor(seconds - seen_seconds, device=device),
                "train/sandbox_timeouts": torch.tensor(float(timeouts - seen_timeouts), device=device)}

    @staticmethod
    def turn_metrics(rollout: RolloutBatch, device: torch.device) -> dict[str, Tensor]:
        """A multi-turn rollout's means per completion over every process: ``train/tool_calls``, ``train/turns`` (the
        policy's), ``train/env_reward``; of the tool calls, the share that came back as an error
        (``train/tool_error_frac``: malformed, unknown tool, raised, timed out, no JSON; NaN without calls) and the
        timed out per completion (``train/tool_timeouts``). Where most of a rollout's calls failed, a warning with the
        first error's message (the model sees it as the tool's answer, so the run goes on)."""
        n = len(rollout.conversations or [])
        extras = rollout.extras
        sums = torch.tensor([float(sum(extras.get("tool_calls", [0] * n))),
                             float(sum(sum(m["role"] == "assistant" for m in c) for c in rollout.conversations or [])),
                             float(sum(extras.get("env_reward", [0.0] * n))), float(n),
                             float(sum(extras.get("tool_errors", [0] * n))),
                             float(sum(extras.get("tool_timeouts", [0] * n)))], device=device)
        calls, turns, reward, count, errors, timeouts = all_reduce(sums).unbind()
        count = count.clamp(min=1)
        if calls > 0 and errors > calls / 2:
            _FAILING_ROLLOUTS[0] += 1
            if _FAILING_ROLLOUTS[0] % 50 == 1:  # the first, then every 50th such rollout: a broken tool is said, not
                first = next((e for e in extras.get("tool_error", []) if e), "(on another process)")  # every step
                log.warning("%d of this rollout's %d tool calls came back as an error, e.g. %s (rollouts where most "
                            "calls failed so far: %d; said again every 50)", int(errors), int(calls), first[:300],
                            _FAILING_ROLLOUTS[0])
        return {"train/tool_calls": calls / count, "train/turns": turns / count, "train/env_reward": reward / count,
                "train/tool_error_frac": errors / calls if calls > 0 else torch.full_like(calls, float("nan")),
                "train/tool_timeouts": timeouts / count}

    def anchor_targets(self, batch: Mapping[str, Any], device: torch.device) -> dict[str, Tensor]:
        """Each prompt's reference answer as ``answer + EOS`` token ids ``[P, Ta]`` with their mask (zero where the
        answer is None), for the supervised anchor; empty without one."""
        if self.anchor is None:
            return {}
        column = self.anchor.column
        columns = batch.get("columns", {})
        if column not in columns:
            raise KeyError(f"anchor.column={column!r}: the batch has no such column (its columns: {sorted(columns)})")
        eos = self.tokenizer.eos_token_id
        encoded = [[] if a is None else self.tokenizer(str(a), add_special_tokens=False)["input_ids"] + [eos]
                   for a in columns[column]]
        width = max(max(len(ids) for ids in encoded), 1)
        ids = torch.full((len(encoded), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for i, row in enumerate(encoded):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        return {"anchor_ids": ids.to(device), "anchor_mask": mask.to(device)}

    def batch_reward_metrics(self, rewards: RewardOutput, device: torch.device) -> dict[str, Tensor]:
        """The reward metrics of the whole batch: over every process's completions (gathered), not a mean of means."""
        if world_size() == 1:
            return rewards.metrics
        per_function = all_gather_rows(rewards.per_function.to(device)).cpu()
        errors = torch.stack([rewards.metrics[f"reward_errors/{name}"] for name in self.rewards.names])
        return self.rewards.summarize(per_function, all_reduce(errors.to(device)).cpu())

    @staticmethod
    def batch_moments(values: Tensor, device: torch.device, weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The mean and standard deviation of ``values`` (:func:`~polopt_lightning.step.advantages.batch_values`: the step's
        valid rewards, or what a whitening estimator whitens) over all processes (``advantage_scale="batch"``), each
        value counted ``weights`` times (:func:`~polopt_lightning.step.advantages.batch_weights`; ``None``: once)."""
        valid = values.double()
        if weights is None:
            sums = [valid.new_tensor(float(valid.numel())), valid.sum(), (valid ** 2).sum()]
        else:
            w = weights.double().to(valid.device)
            sums = [w.sum(), (w * valid).sum(), (w * valid ** 2).sum()]
        moments = all_reduce(torch.stack(sums).to(device)).cpu()
        count, total, squares = moments.unbind()
        mean = (total / count.clamp(min=1)).float()
        if count < 2:
            return mean, torch.zeros(())
        return mean, ((squares - total ** 2 / count) / (count - 1)).clamp(min=0).sqrt().float()


def turn_reward_matrix(rollout: RolloutBatch, functions: Sequence[Sequence[float] | None] | None = None
                       ) -> tuple[Tensor, Tensor]:
    """``[N, K]`` each completion's reward per policy turn: the environment's (a multi-turn rollout's
    ``turn_rewards``) plus the reward functions' per-turn parts (``functions``, weighted: :attr:`RewardOutput.turns`),
    NaN where neither gave one; and ``[N]`` the sum of the functions' parts (already in the completion's reward)."""
    n = rollout.completion_ids.shape[0]
    per_row = (rollout.extras or {}).get("turn_rewards") or [[] for _ in range(n)]
    functions = functions or [None] * n
    width = max([len(r) for r in per_row] + [len(f or []) for f in functions] + [0])
    out = torch.full((n, width), float("nan"))
    given = torch.zeros(n)
    for i, (row, parts) in enumerate(zip(per_row, functions)):
        for k, value in enumerate(row):
            if value is not None:
                out[i, k] = float(value)
        for k, value in enumerate(parts or []):
            out[i, k] = value + (0.0 if torch.isnan(out[i, k]) else float(out[i, k]))
            given[i] += value
    return out, given


def row_means(values: Tensor, mask: Tensor) -> Tensor:
    """``[N]`` each row's mean of ``values`` ``[N, T]`` over its ``mask`` (per-token advantages, as the completions log
    shows one a row)."""
    m = mask.to(values.dtype)
    return (values * m).sum(-1) / m.sum(-1).clamp(min=1)


def last_message(conversation: Sequence[Mapping[str, str]]) -> str:
    """The content of a conversation's last assistant message ("" without one)."""
    return next((m["content"] for m in reversed(conversation) if m["role"] == "assistant"), "")


def pad_cat(tensors: Sequence[Tensor], value: int | float, left: bool = False) -> Tensor:
    """Concatenate ``[n_i, w_i]`` tensors along rows, padded with ``value`` to the widest (on the left or right)."""
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        extra = width - t.shape[1]
        pad = (extra, 0) if left else (0, extra)
        padded.append(nn.functional.pad(t, pad, value=value))
    return torch.cat(padded)


def concat_groups(parts, G: int, limit: int | None) -> tuple[dict[str, Tensor], Tensor, list[Tensor]]:
    """Join the kept groups of one or more draws (dynamic sampling), at most ``limit`` groups: the experience's fields
    (but advantages), the rows' rewards, and each draw's rows taken (in order). Each part is ``(rollout, rewards, keep,
    per_prompt)``; ``per_prompt`` holds tensors ``[P, ...]`` (the anchor's targets), joined by group and
    right-padded."""
    fields: dict[str, list[Tensor]] = {k: [] for k in (*ROLLOUT_FIELDS, "rewards", "group_index")}
    per_group: dict[str, list[Tensor]] = {}
    kept, picked = 0, []
    for rollout, rewards, keep, group_fields in parts:
        idx = torch.nonzero(keep).flatten()
        if limit is not None:
            idx = idx[: max(0, limit - kept)]
        rows = (idx[:, None] * G + torch.arange(G)).flatten()
        picked.append(rows)
        dev_rows = rows.to(rollout.completion_ids.device)
        for name in ROLLOUT_FIELDS:
            value = getattr(rollout, name)
            if name == "context_mask" and value is None:  # one turn: the context is the completion
                value = rollout.completion_mask
            fields[name].append(value[dev_rows])
        for name, value in group_fields.items():
            per_group.setdefault(name, []).append(value[idx.to(value.device)])
        fields["rewards"].append(rewards[rows])
        fields["group_index"].append(kept + torch.arange(len(idx)).repeat_interleave(G))
        kept += len(idx)
    out = {name: torch.cat(fields[name]) if side is None else pad_cat(fields[name], 0, left=side == "left")
           for name, side in ROLLOUT_FIELDS.items()}
    if all(part[0].context_mask is None for part in parts):
        out["context_mask"] = None
    out.update({name: pad_cat(values, 0) for name, values in per_group.items()})
    out["group_index"] = torch.cat(fields["group_index"]).to(out["completion_ids"].device)
    return out, torch.cat(fields["rewards"]), picked
