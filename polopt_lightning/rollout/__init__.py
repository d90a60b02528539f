"""Rollout engines: prompts in, G completions per prompt with sampling log-probs out."""

from .engine import HFRolloutEngine, RolloutBatch, RolloutEngine, SamplingConfig, filter_logits

__all__ = ["HFRolloutEngine", "RolloutBatch", "RolloutEngine", "SamplingConfig", "filter_logits"]
