"""PPO's critic: its settings (:class:`CriticConfig`, the ``critic`` group), the value model (:class:`ValueModel`: a
causal LM's trunk with a scalar head), its values at the completion tokens (:func:`token_values`) and its clipped value
loss (:func:`value_loss`, the :class:`ValueLoss` term of the update). The experience's advantages come from its values
by GAE (:func:`~polopt_lightning.step.advantages.gae`, ``experience.advantage_estimator=gae``, ``objective=ppo``)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .._hf import peft_base, positions_from_mask
from ..distributed import all_reduce
from ..settings import Settings
from .advantages import get_estimator
from .terms import LossTerm, MiniBatch, Piece, register_term

if TYPE_CHECKING:
    from .experience import Experience


#: the critic's learning rate over the policy's where ``critic.lr`` is null (verl's examples: actor 1e-6, critic 1e-5)
LR_RATIO = 10.0


@dataclass
class CriticConfig(Settings):
    """The critic of PPO (the module's ``critic`` argument, ``critic.*`` in the CLI); used where the advantage
    estimator is ``gae`` (``objective=ppo`` picks it).

    Args:
        name_or_path: where the value model comes from: ``None``, a copy of the policy's trunk (its adapters and quantized
            base too: a LoRA policy's critic trains its own adapters) with a new value head; a path or hub id, that
            model's trunk (``AutoModel.from_pretrained``) with a new head. The module's ``critic_model`` argument
            gives one built already.
        share_trunk: the value head sits on the policy's own trunk instead (one model, no copy: TRL's
            ``AutoModelForCausalLMWithValueHead``): the value loss's gradient, times ``value_coef``, reaches the
            policy's trunk (its adapters) beside the policy loss's; the critic's own parameters are the head's. Not
            under FSDP (the policy's root is gathered by its own forward only).
        value_coef: the value loss's weight in the loss (TRL's ``vf_coef``: 0.1 on a shared trunk); with a separate
            critic it scales only the critic's gradient.
        lr: the critic's learning rate (its parameter group in the policy's optimizer; the schedule scales both).
            ``None``: :data:`LR_RATIO` times the policy's (verl's examples: 1e-6 and 1e-5).
        value_clip: PPO's value clipping: a new value may move at most this far from the value at sampling time in
            the loss (verl's ``cliprange_value``); ``None``: no clipping.
        warmup_steps: the first optimizer steps train the critic alone (verl's ``critic_warmup``): the policy's
            gradients are dropped before each of those steps, so its weights and optimizer state stay as they are.
        gamma: the discount of GAE over completion tokens (1: none; verl's ``algorithm.gamma``).
        lam: GAE's lambda (1: Monte-Carlo returns less the value; verl's ``algorithm.lam``).
        whiten: whiten the advantages over the step's completion tokens (every process's), as verl and OpenRLHF do.
    """

    name_or_path: str | None = None
    share_trunk: bool = False
    value_coef: float = 1.0
    lr: float | None = None
    value_clip: float | None = 0.5
    warmup_steps: int = 0
    gamma: float = 1.0
    lam: float = 1.0
    whiten: bool = True

    KEY = "critic"

    def set_lr(self, optimizer: torch.optim.Optimizer) -> None:
        """The critic's group (the optimizer's second) at :attr:`lr`, or :data:`LR_RATIO` times the policy's (its
        first)."""
        policy, critic = optimizer.param_groups[0], optimizer.param_groups[1]
        critic["lr"] = self.lr if self.lr is not None else LR_RATIO * policy["lr"]
    RULES = {
        "lr": (lambda v: v is None or v > 0, "> 0 or None"),
        "value_clip": (lambda v: v is None or v > 0, "> 0 or None"),
        "warmup_steps": (lambda v: v >= 0, ">= 0"),
        "value_coef": (lambda v: v >= 0, ">= 0"),
        "gamma": (lambda v: 0 <= v <= 1, "in [0, 1]"),
        "lam": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    }


def needs_critic(objective: Any, experience: Any) -> bool:
    """Whether ``objective`` with the :class:`~polopt_lightning.step.experience.ExperienceConfig` ``experience`` trains
    a critic (the estimator, the objective's own where unset, is ``gae``); an objective that takes one advantage a
    sequence where the settings give one a token (``gae``, ``turn_credit=turn``) is refused, naming the keys."""
    estimator = experience.estimator(getattr(objective, "advantage_estimator", None))
    per_token = getattr(objective, "accepts_token_advantages", False)
    needs = get_estimator(estimator).baseline == "critic"
    if needs and not per_token:
        raise ValueError(f"experience.advantage_estimator={estimator} gives an advantage per token, and the "
                         f"{type(objective).__name__} objective takes one per completion: use objective=ppo "
                         "(or grpo, dapo, ...), or another estimator")
    if experience.turn_credit == "turn" and not per_token:
        raise ValueError(f"experience.turn_credit=turn gives each turn's tokens their own advantage, and the "
                         f"{type(objective).__name__} objective takes one per completion: use grpo, dapo, ppo, "
                         "cispo or sapo (or gspo_token), or turn_credit=episode")
    return needs


SHARED_UNDER_FSDP = ("critic.share_trunk=true under strategy=fsdp: the value head would run the policy's sharded trunk "
                     "outside the policy's own forward; use a critic of its own (critic.share_trunk=false) or "
                     "strategy=ddp")


class ValueModel(nn.Module):
    """A value model: a causal LM's trunk (``backbone``, e.g. ``Qwen2Model``) and a linear head giving one value per
    position, started at 0 (so the first step's advantages are the returns themselves). ``forward(input_ids,
    attention_mask, position_ids)`` returns ``[B, L]`` float32 values."""

    def __init__(self, backbone: nn.Module, hidden_size: int | None = None, shared: bool = False) -> None:
        super().__init__()
        if shared:  # the policy's own trunk: not a submodule (its weights are the policy's, saved and sharded there)
            object.__setattr__(self, "backbone", backbone)
        else:
            self.backbone = backbone
        hidden = hidden_size or backbone.config.hidden_size
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def _no_split_modules(self) -> list[str]:  # FSDP shards the trunk's blocks (strategies.decoder_layer_classes)
        return list(getattr(self.backbone, "_no_split_modules", None) or [])

    @classmethod
    def from_policy(cls, policy: nn.Module) -> ValueModel:
        """A copy of ``policy``'s trunk (a peft policy's adapters and frozen, possibly quantized, base with it) and a
        new head. The copy's adapters train; its frozen base stays frozen."""
        base = peft_base(policy)
        trunk = getattr(base, "base_model", None)
        if trunk is None or trunk is base:
            raise ValueError(f"critic: cannot find the trunk of {type(base).__name__} (its base_model) to copy; give "
                             "critic.name_or_path a path or the module a critic_model")
        return cls(copy.deepcopy(trunk), base.config.hidden_size)

    @classmethod
    def from_pretrained(cls, name: str, **kwargs: Any) -> ValueModel:
        """The trunk of the model at ``name`` (a path or hub id, ``AutoModel.from_pretrained``) and a new head."""
        from transformers import AutoModel

        trunk = AutoModel.from_pretrained(name, **kwargs)
        return cls(trunk, trunk.config.hidden_size)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None) -> Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False)
        hidden = out.last_hidden_state.to(self.value_head.weight.dtype)
        # [B, L] as a tensor of its own (not a view of the head's [B, L, 1]: FSDP2 warns of a view returned)
        return (torch.matmul(hidden, self.value_head.weight[0]) + self.value_head.bias[0]).float()


def check_critic_source(config: CriticConfig) -> None:
    """Before anything loads: ``share_trunk`` and ``name_or_path`` not both, and ``name_or_path`` a folder with a
    model's config or a hub id (:func:`~polopt_lightning.models.check_source`, naming ``critic.name_or_path``)."""
    from ..models import MODEL_FILES_HINT, check_source

    if config.name_or_path is None:
        return
    if config.share_trunk:
        raise ValueError(f"critic.share_trunk=true puts the value head on the policy's trunk, and critic.name_or_path="
                         f"{config.name_or_path!r} names another model: set one of them")
    check_source(config.name_or_path, "critic.name_or_path", "config.json", MODEL_FILES_HINT)


def build_critic(policy: nn.Module, config: CriticConfig) -> ValueModel:
    """The critic ``config`` asks for: a value head on ``policy``'s own trunk (``share_trunk``), or on a copy of it
    (``name_or_path=None``) or on a pretrained model's trunk, in the policy's floating dtype."""
    check_critic_source(config)
    if config.share_trunk:
        base = peft_base(policy)
        return ValueModel(base.base_model, base.config.hidden_size, shared=True)
    try:
        critic = (ValueModel.from_policy(policy) if config.name_or_path is None
                  else ValueModel.from_pretrained(config.name_or_path))
    except OSError as exc:  # a hub id neither cached nor reachable, or a folder without weights
        raise OSError(f"critic.name_or_path={config.name_or_path!r}: could not be loaded ({exc})") from exc
    dtype = next((p.dtype for p in policy.parameters() if p.is_floating_point()), torch.float32)
    if config.name_or_path is not None:
        critic.backbone.to(dtype)
    return critic


def own_parameters(critic: nn.Module, policy: nn.Module) -> list[nn.Parameter]:
    """The critic's trainable parameters that are not the policy's (a shared trunk's head alone)."""
    shared = {id(p) for p in policy.parameters()}
    return [p for p in critic.parameters() if p.requires_grad and id(p) not in shared]


def token_values(critic: nn.Module, exp: Experience, rows: Tensor | slice, width: int | None = None) -> Tensor:
    """The critic's values ``[n, width]`` at the completions ``rows``: at token ``t`` the value of the state before
    it (the position that predicts it, as the log-probs are taken), the prompt left-padded and the context (a
    multi-turn rollout's tool results too) attended to."""
    width = exp.completion_ids.shape[1] if width is None else width
    prompt_ids, prompt_mask = exp.prompt_ids[rows], exp.prompt_mask[rows]
    input_ids = torch.cat([prompt_ids, exp.completion_ids[rows, :width]], dim=1)
    attention_mask = torch.cat([prompt_mask, exp.attention_mask[rows, :width].to(prompt_mask.dtype)], dim=1)
    values = critic(input_ids, attention_mask, positions_from_mask(attention_mask))
    start = prompt_ids.shape[1] - 1
    return values[:, start:start + width]


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None
               ) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss per token: ``0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)`` (verl's
    ``compute_value_loss`` before its aggregation; unclipped without ``clip``), and where the clipped term was larger
    (its clip fraction). Both ``[B, T]``, 0 outside ``mask``."""
    mask = mask.bool()
    unclipped = (values - returns) ** 2
    if clip is None:
        clipped = unclipped
    else:
        clipped = (torch.clamp(values, old_values - clip, old_values + clip) - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped)
    return torch.where(mask, loss, torch.zeros_like(loss)), mask & (clipped > unclipped)


@register_term("value_loss")
class ValueLoss(LossTerm):
    """The critic's clipped value loss (:func:`value_loss`), a mean over the mini-batch's completion tokens (every
    process's), times ``critic.value_coef``, added to each piece's loss: its graph reaches only the critic (and a shared
    trunk), so one backward trains both. Logs ``critic/value_loss``, ``critic/clip_frac``, ``critic/values`` (the
    critic's values in the update, before its step), ``critic/returns`` (their targets) and
    ``critic/explained_variance`` (``1 - Var(R - V_old) / Var(R)`` over the mini-batch, with the values at sampling
    time; NaN where the returns do not vary). In the update of every module with a critic."""

    def __init__(self, critic: nn.Module, clip: float | None, coef: float = 1.0) -> None:
        self.critic, self.clip, self.coef = critic, clip, coef

    @classmethod
    def build(cls, updater: Any) -> ValueLoss | None:
        critic = getattr(updater, "critic", None)
        config = updater.critic_config
        return None if critic is None else cls(critic, config.value_clip, config.value_coef)

    def begin(self, batch: MiniBatch) -> dict[str, Tensor]:
        if batch.exp.returns is None:
            raise ValueError("the update has a critic, but the experience has no returns: use the gae advantage "
                             "estimator (experience.advantage_estimator=gae)")
        mask = batch.exp.completion_mask[batch.rows].bool()
        self._tokens = all_reduce(mask.sum().to(torch.float64))
        self._sums = torch.zeros(7, dtype=torch.float64, device=self._tokens.device)  # the metrics' sums, piece by piece
        return {}

    def loss(self, batch: MiniBatch, piece: Piece, out: Any) -> Tensor:
        exp = batch.exp
        values = token_values(self.critic, exp, piece.rows, piece.width)
        old, returns = exp.values[piece.rows, :piece.width], exp.returns[piece.rows, :piece.width]
        per_token, clipped = value_loss(values, old, returns, piece.mask, self.clip)
        mask = piece.mask.bool()
        residual = torch.where(mask, returns - old, torch.zeros_like(old)).double()
        target = torch.where(mask, returns, torch.zeros_like(returns)).double()
        sums = torch.stack([per_token.detach().sum().double(), clipped.sum().double(),
                            torch.where(mask, values.detach(), torch.zeros_like(values)).sum().double(),
                            target.sum(), residual.sum(), (residual ** 2).sum(), (target ** 2).sum()])
        self._sums = self._sums + sums.to(self._sums.device)
        return self.coef * per_token.sum() / self._tokens.clamp(min=1).to(per_token) * batch.world

    def end(self, batch: MiniBatch) -> dict[str, Tensor]:
        loss, clipped, values, returns, res, res_sq, ret_sq = all_reduce(self._sums).unbind()
        n = self._tokens.clamp(min=1)
        var_returns = ret_sq / n - (returns / n) ** 2
        var_residual = res_sq / n - (res / n) ** 2
        explained = (1 - var_residual / var_returns if float(var_returns) > 1e-12  # nothing to explain: NaN, not 0
                     else torch.full((), float("nan"), dtype=n.dtype))
        return {"critic/value_loss": (loss / n).float(), "critic/clip_frac": (clipped / n).float(),
                "critic/values": (values / n).float(), "critic/returns": (returns / n).float(),
                "critic/explained_variance": explained.float()}
