"""One training step of the module under Lightning, in 1 process or under DDP on CPU processes (gloo).

``python tests/helpers/ddp_update.py OUT WORLD OBJECTIVE [key=value ...]`` (``strategy=fsdp``: FSDP2 instead of DDP;
``anchor=COEF``: with the supervised anchor; ``advantage_estimator=NAME``; ``kl_estimator=NAME``; ``kl_in_reward=C``;
``entropy_coef=C``; ``top_entropy_quantile=Q``; ``fused_head=true|false``; ``padding_free=true``; ``width=W``: a model W
wide, whose weights from 512 on are large enough for the oneDNN linear layers; ``max_grad_norm=C``: clipping by global
norm, none by default; ``optimizer=adamw``: the shipped conf/optimizer/adamw.yaml instead of plain SGD;
``sampler_noise=S``: the sampler's log-probs off the trainer's by S x a normal draw a token (seeded by the prompt), so
the trainer computes the old log-probs and logs their gap; ``critic_lr=LR``: PPO's critic at this learning rate (its
weights saved beside the policy's, as ``critic.*``); ``balance_tokens=true|false``: token balancing between the processes always or never (default: where the passes
follow the real tokens); ``skew=true``: process 0's prompts (those of even
index) complete in ``max_new_tokens`` tokens (default 4), process 1's in one; ``mini_batches=M``: M optimizer steps on the rollout, none of its rows twice, split in each process's row order so that
1 and 2 processes put the same prompts in each step): rank 0 writes ``OUT`` (torch.save) with the policy's weights after
the step, the step's logged metrics, and every prompt's advantages. The prompts' completions do not depend on the number
of processes (each prompt samples with a generator seeded by its own tokens), so a run with 1 process and ``4 * B``
prompts and one with 2 processes and ``2 * B`` prompts each train on the same rollouts.
Lightning relaunches this script for rank 1 (its ``popen`` launcher), as it does the CLI.
"""

import sys
import zlib
from functools import partial

import lightning as L
import torch
from hydra.utils import instantiate

from polopt_lightning import PolicyOptimizationModule, PromptDataModule
from polopt_lightning import update as update_module
from polopt_lightning.accel.cpu.linear import OneDNNLinear
from polopt_lightning.confschema import option
from polopt_lightning.data import ArithmeticTask
from polopt_lightning.distributed import all_gather_objects, close_process_group
from polopt_lightning.models import build_tiny_model
from polopt_lightning.rewards.builtin import ExactMatchReward
from polopt_lightning.rollout import HFRolloutEngine, RolloutBatch
from polopt_lightning.step.experience import pad_cat

PROMPTS = 4  # in all, over the processes
SKEW = False  # skew=true: long completions on process 0, one token on process 1
NOISE = 0.0  # sampler_noise=S: the sampler's log-probs off the trainer's


class PerPromptEngine(HFRolloutEngine):
    """Samples each prompt's group with a generator seeded by that prompt's tokens."""

    def generate(self, model, prompt_ids, prompt_mask, num_generations, sampling, eos, pad, generator=None):
        parts = []
        for ids, mask in zip(prompt_ids, prompt_mask):
            key = zlib.crc32(bytes(ids[mask.bool()].tolist()))
            part = super().generate(model, ids[None], mask[None], num_generations, sampling, eos, pad,
                                    generator=torch.Generator().manual_seed(key))
            # lengths that differ between prompts and processes: a token-level mean is then not a mean of means
            keep = 1 + (key + torch.arange(num_generations)) % sampling.max_new_tokens
            if SKEW:  # the prompts of even index (all of process 0's, the sampler deals r, r + 2, ...) run long
                rank, world = ((torch.distributed.get_rank(), torch.distributed.get_world_size())
                               if torch.distributed.is_initialized() else (0, 1))
                keep = torch.full_like(keep, sampling.max_new_tokens if (len(parts) * world + rank) % 2 == 0 else 1)
            cut = torch.arange(part.completion_mask.shape[1])[None] >= keep[:, None]
            part.completion_mask[cut] = 0
            part.completion_ids[cut] = pad
            if NOISE:  # a sampler of other numerics, the same on 1 and 2 processes
                draw = torch.randn(part.sampling_logprobs.shape, generator=torch.Generator().manual_seed(key))
                part.sampling_logprobs = part.sampling_logprobs + NOISE * draw * part.completion_mask
            parts.append(part)
        fields = {}
        for name, side in (("prompt_ids", "left"), ("prompt_mask", "left"), ("completion_ids", "right"),
                           ("completion_mask", "right"), ("sampling_logprobs", "right")):
            fields[name] = pad_cat([getattr(p, name) for p in parts], 0, left=side == "left")
        fields["finished"] = torch.cat([p.finished for p in parts])
        return RolloutBatch(group_size=num_generations, **fields)

    def logprobs_match(self, model):
        return not NOISE and super().logprobs_match(model)


def digit_share(prompts, completions, **kwargs):
    """Share of a completion's characters that are digits: a reward that varies inside every group."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


class Recording(PolicyOptimizationModule):
    def make_experience(self, batch):
        exp, metrics = super().make_experience(batch)
        G = self.experience.num_generations
        rows = exp.advantages if exp.advantages.dim() == 1 else [  # per token (GAE): each completion's own tokens
            a[m.bool()] for a, m in zip(exp.advantages, exp.completion_mask)]
        local = {p: [float(v) for r in rows[i * G:(i + 1) * G] for v in r.reshape(-1)]
                 for i, p in enumerate(batch["prompts"])}
        self.advantages = {k: v for part in all_gather_objects(local) for k, v in part.items()}
        return exp, metrics


def model_shape(width: str | None = None) -> dict:
    hidden = int(width or 32)
    return dict(hidden_size=hidden, num_layers=2, num_heads=2, intermediate_size=2 * hidden + (128 if width else 0))


def main() -> None:
    out, world, objective, *extra = sys.argv[1:]
    world = int(world)
    options = dict(kv.split("=", 1) for kv in extra)
    global SKEW, NOISE
    SKEW = options.get("skew") == "true"
    NOISE = float(options.get("sampler_noise", 0.0))
    mini_batches = int(options.get("mini_batches", 1))
    if mini_batches > 1:
        # each process draws its own random split of its rows, so 1 and 2 processes would step on different prompts;
        # in row order instead, step k takes every process's k-th prompts (process r samples prompts r, r + 2, ...),
        # which one process with all 4 prompts in order takes too
        update_module.mini_batch_order = lambda group_index, seed, share_prompt: torch.arange(group_index.numel())
    if options.get("optimizer") == "adamw":  # the shipped optimizer (AdamW, torch's fused kernel) and its settings
        optimizer = instantiate(option("optimizer", "adamw"))
    else:  # plain SGD: the update is the gradient itself (Adam's first step would hide a wrong gradient scale)
        optimizer = partial(torch.optim.SGD, lr=0.5)
    torch.manual_seed(0)
    model, tok = build_tiny_model(**model_shape(options.get("width")), seed=0)
    data = PromptDataModule(task=ArithmeticTask(digits=1, train_size=16, val_size=4, seed=0), tokenizer=tok,
                            batch_size=PROMPTS // world, shuffle=False)
    spec = {"name": objective, "beta": float(options.get("beta", 0.0)), "kl_estimator": options.get("kl_estimator", "k3")}
    if objective == "dr_grpo":  # a constant normaliser: the completion length cap
        spec["max_completion_length"] = 4
    module = Recording(
        model, tok, objective=spec, reward_fns=[digit_share, ExactMatchReward()], generation={"max_new_tokens": int(options.get("max_new_tokens", 4))},
        experience={"num_generations": 4, "advantage_scale": options.get("advantage_scale"),
                    "advantage_estimator": options.get("advantage_estimator")},
        critic={"lr": float(options.get("critic_lr", 1e-5))},
        update={"mini_batches": mini_batches,
                "max_grad_norm": float(options["max_grad_norm"]) if "max_grad_norm" in options else None,
                "micro_batch_tokens": int(options["micro_batch_tokens"]) if "micro_batch_tokens" in options else None,
                "entropy_coef": float(options.get("entropy_coef", 0.0)),
                "top_entropy_quantile": float(options.get("top_entropy_quantile", 1.0)),
                "fused_head": {"true": True, "false": False}.get(options.get("fused_head")),
                "padding_free": options.get("padding_free") == "true",
                "balance_tokens": {"true": True, "false": False}.get(options.get("balance_tokens"))},
        reference={"kl_in_reward": float(options.get("kl_in_reward", 0.0))},
        optimizer=optimizer, rollout_engine=PerPromptEngine(),
        # the supervised anchor on the arithmetic answers: its NLL a token mean over every process's prompts
        anchor={"coef": float(options["anchor"])} if "anchor" in options else None)
    if options.get("strategy") == "fsdp":
        from polopt_lightning.strategies import fsdp

        strategy = fsdp(model, process_group_backend="gloo")
    else:
        strategy = L.pytorch.strategies.DDPStrategy(process_group_backend="gloo") if world > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=mini_batches, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    weights = module.policy.state_dict()
    if module.critic is not None:
        weights.update({f"critic.{k}": v for k, v in module.critic.state_dict().items()})
    if any(hasattr(v, "full_tensor") for v in weights.values()):  # FSDP2 shards: gathered (collective)
        weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in weights.items()}
    if trainer.is_global_zero:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
        torch.save({"weights": {k: v.detach().clone() for k, v in weights.items()},
                    "metrics": metrics, "advantages": module.advantages, "world": trainer.world_size,
                    "onednn": isinstance(module.accel.compute(module.policy, module.device), OneDNNLinear)}, out)


if __name__ == "__main__":
    main()
    close_process_group()  # a process that ends with its Gloo group open can abort at exit
