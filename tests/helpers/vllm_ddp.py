"""Two optimizer steps with rollout=vllm under DDP or FSDP2 on 2 CPU processes (gloo): each process has its own vLLM
engine (vLLM's external launcher on the processes' group), and after the steps each engine's greedy tokens equal the
transformers backend's on that process's policy.

``python tests/helpers/vllm_ddp.py OUT ddp|fsdp``: rank 0 writes ``OUT`` (JSON) with, per process, whether the
greedy tokens matched, whether the policy moved, and the engine's backend. Lightning relaunches this script for rank 1.
"""

import json
import sys

import lightning as L
import torch

from polopt_lightning import PolicyOptimizationModule, PromptDataModule
from polopt_lightning.data import ArithmeticTask
from polopt_lightning.distributed import all_gather_objects, close_process_group
from polopt_lightning.models import build_tiny_model
from polopt_lightning.rewards import DigitMatchReward, ExactMatchReward
from polopt_lightning.rollout import HFRolloutEngine, SamplingConfig
from polopt_lightning.strategies import gathered_for_sampling


def distinct_chars(prompts, completions, **kwargs):
    """Varies inside every group even for an untrained model: every step moves the policy."""
    return [float(len(set(c))) for c in completions]


def main() -> None:
    out, kind = sys.argv[1:]
    model, tok = build_tiny_model(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256, seed=7)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    data = PromptDataModule(task=ArithmeticTask(digits=1, train_size=16, val_size=4, seed=0), tokenizer=tok,
                            batch_size=2)
    module = PolicyOptimizationModule(
        model, tok, reward_fns=[ExactMatchReward(), DigitMatchReward(), distinct_chars], generation={"max_new_tokens": 4},
        experience={"num_generations": 4}, update={"mini_batches": 1}, optimizer={"lr": 5e-2},
        rollout_engine={"name": "vllm", "kv_cache_gib": 1})
    if kind == "fsdp":
        from polopt_lightning.strategies import fsdp

        strategy = fsdp(model, process_group_backend="gloo")
    else:
        strategy = L.pytorch.strategies.DDPStrategy(process_group_backend="gloo")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    enc = tok(["12+34=", "5+6=", "7+1="], padding=True, return_tensors="pt")
    greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
    with gathered_for_sampling(module.policy, trainer.strategy):  # FSDP2: the whole policy on each process
        policy = module.policy
        ours = module.engine.generate(policy, enc.input_ids, enc.attention_mask, 1, greedy, tok.eos_token_id,
                                      tok.pad_token_id)
        ref = HFRolloutEngine().generate(policy, enc.input_ids, enc.attention_mask, 1, greedy, tok.eos_token_id,
                                         tok.pad_token_id)
        weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in policy.state_dict().items()}
        moved = any(not torch.equal(v.detach().cpu(), start[k]) for k, v in weights.items() if k in start)
    width = ours.completion_ids.shape[1]
    same = torch.equal(ours.completion_ids * ours.completion_mask,
                       (ref.completion_ids * ref.completion_mask)[:, :width])
    from vllm.distributed.parallel_state import get_tp_group

    report = {"rank": trainer.global_rank, "same": same, "moved": moved, "tokens": int(ours.completion_mask.sum()),
              "backend": module.engine.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend,
              "tp_group": get_tp_group().ranks, "steps": trainer.global_step}
    reports = all_gather_objects(report)
    if trainer.is_global_zero:
        with open(out, "w") as fh:
            json.dump(reports, fh)


if __name__ == "__main__":
    main()
    close_process_group()  # a process that ends with its Gloo group open can abort at exit
