"""Supervised warm start: a short teacher-forced run on reference answers before RL, cached on disk.

RL sharpens what a model can already sometimes do; a randomly initialised model never samples a right answer and
so never gets a reward. The built-in default job therefore first fits the task's reference answers for a few
hundred steps. The result is cached under a key made from everything that shapes it (model config, tokenizer,
data, settings), so a second run loads it and any change to those trains a new one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._cache import cache_root
from ._hf import stop_token_ids
from .callbacks.checkpoint import save_atomically

log = logging.getLogger(__name__)
ESTIMATE_AFTER = 5  # steps timed before the warm start says how long it may take


@dataclass
class WarmStartConfig:
    """Settings of the supervised warm start.

    Attributes:
        steps: optimizer steps.
        batch_size: examples per step.
        lr: peak AdamW learning rate (cosine decay to 10% after 5% warm-up).
        weight_decay: AdamW weight decay.
        seed: example order.
        prompt_column, answer_column: dataset columns.
        cache_dir: where trained weights are kept; ``None`` disables the cache.
        target_accuracy: stop as soon as greedy exact-match accuracy on a probe of training prompts reaches this
            (``None``: run all ``steps``). The supervised curve of a small model is steep, so a fixed step count
            lands anywhere from 15% to 60% depending on the seed; a target lands where RL has room and signal.
        eval_every: steps between probe evaluations while the probe is far below the target.
        fine_eval_every: steps between probe evaluations once the probe is within ``fine_margin`` of the target
            (``None``: always ``eval_every``). The curve is steep near the target: a coarse check overshoots it by a
            seed- and machine-dependent amount, and checking finely all along costs a probe every few steps.
        fine_margin: how close to the target (in accuracy) the fine checks start.
        probe_size: training prompts in the probe (the validation set is never used here).
    """

    steps: int = 500
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    cache_dir: str | None = None
    target_accuracy: float | None = None
    eval_every: int = 50
    fine_eval_every: int | None = None
    fine_margin: float = 0.2
    probe_size: int = 256

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"warm_start needs steps >= 0, batch_size >= 1, lr > 0; got {self}")
        if self.eval_every < 1 or (self.fine_eval_every is not None and self.fine_eval_every < 1):
            raise ValueError(f"warm_start.eval_every and warm_start.fine_eval_every must be >= 1, got "
                             f"{self.eval_every} and {self.fine_eval_every}")


def default_cache_dir() -> Path:
    return cache_root() / "warm_start"


def _cache_key(model: nn.Module, tokenizer: Any, rows: Sequence[dict], cfg: WarmStartConfig) -> str:
    h = hashlib.sha256()
    settings = {k: v for k, v in asdict(cfg).items() if k != "cache_dir"}
    h.update(json.dumps(settings, sort_keys=True).encode())
    h.update(model.config.to_json_string(use_diff=False).encode() if hasattr(model, "config") else b"")
    h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    # the initial weights matter too: every tensor's bytes (a float sum rounds differently with the thread count)
    for name, p in sorted(model.state_dict().items()):
        h.update(f"{name}:{p.dtype}:{tuple(p.shape)}".encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())  # hashed in place, no bytes copy
    h.update(json.dumps([[r[cfg.prompt_column], r[cfg.answer_column]] for r in rows]).encode())
    return h.hexdigest()[:20]


def _encode(tokenizer: Any, prompt: str, answer: str) -> tuple[list[int], int]:
    p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p + a, len(p)


def supervised_warm_start(model: nn.Module, tokenizer: Any, rows: Sequence[dict[str, Any]],
                          cfg: WarmStartConfig | None = None) -> dict[str, Any]:
    """Teacher-force ``answer + EOS`` after each prompt; loss on answer tokens only. Uses the cache when set.

    Returns ``{"cached": bool, "wall_s": float, "final_loss": float | None, "path": str | None}``.
    """
    cfg = cfg or WarmStartConfig()
    if cfg.steps == 0:
        return {"cached": False, "wall_s": 0.0, "final_loss": None, "path": None, "steps": 0}
    for i, row in enumerate(rows):
        for key, col in (("prompt_column", cfg.prompt_column), ("answer_column", cfg.answer_column)):
            if col not in row:
                raise KeyError(f"warm_start: training row {i} (counted from 0) has no column {col!r} "
                               f"(warm_start.{key}); its columns: {sorted(row)}")
    path = None
    if cfg.cache_dir is not None:
        path = Path(cfg.cache_dir) / f"{_cache_key(model, tokenizer, rows, cfg)}.pt"
        if path.is_file():
            model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            log.info("warm start: loaded cached weights %s", path)
            return {"cached": True, "wall_s": 0.0, "final_loss": None, "path": str(path), "steps": None,
                    "probe_accuracy": None}

    log.info("warm start: %s; a supervised warm start on %d reference answers first (the model must sometimes answer "
             "right before RL can reward it): up to %d steps of %d examples%s.%s",
             f"no cached weights in {cfg.cache_dir}" if path is not None else "no cache (warm_start.cache_dir=null)",
             len(rows), cfg.steps, cfg.batch_size,
             f", until greedy accuracy on {min(cfg.probe_size, len(rows))} training prompts reaches "
             f"{cfg.target_accuracy:.0%}" if cfg.target_accuracy is not None else "",
             " Its weights are cached for the next run" if path is not None else "")
    start = time.perf_counter()
    device = next(model.parameters()).device
    examples = [_encode(tokenizer, str(r[cfg.prompt_column]), str(r[cfg.answer_column])) for r in rows]
    rng = random.Random(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    warmup = max(1, cfg.steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, cfg.steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    was_training = model.training
    model.train()
    order: list[int] = []
    loss_value = None
    probe = [rows[i] for i in random.Random(cfg.seed + 1).sample(range(len(rows)), min(cfg.probe_size, len(rows)))]
    accuracy, steps_done = None, 0
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:
            extra = list(range(len(examples)))
            rng.shuffle(extra)
            order += extra
        batch = [examples[i] for i in order[: cfg.batch_size]]
        del order[: cfg.batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (ids, n_prompt) in enumerate(batch):  # right padding: positions start at 0 for every row
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
            attention[i, : len(ids)] = 1
        out = model(input_ids=input_ids.to(device), attention_mask=attention.to(device), labels=labels.to(device))
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        loss_value = float(out.loss.detach())
        steps_done = step + 1
        if steps_done == min(ESTIMATE_AFTER, cfg.steps):  # the pace of the steps (probes come on top)
            per_step = (time.perf_counter() - start) / steps_done
            log.info("warm start: %.2f s a step: at most ~%s for all %d steps%s", per_step,
                     _duration(per_step * cfg.steps), cfg.steps,
                     "; the probe's target usually stops it earlier" if cfg.target_accuracy is not None else "")
        near = (cfg.fine_eval_every is not None and accuracy is not None
                and accuracy >= cfg.target_accuracy - cfg.fine_margin)
        if cfg.target_accuracy is not None and steps_done % (cfg.fine_eval_every if near else cfg.eval_every) == 0:
            accuracy = greedy_accuracy(model, tokenizer, probe, cfg.prompt_column, cfg.answer_column)
            model.train()
            log.info("warm start: step %d/%d, loss %.4f, probe accuracy %.1f%% (target %.0f%%), %s", steps_done,
                     cfg.steps, loss_value, 100 * accuracy, 100 * cfg.target_accuracy,
                     _duration(time.perf_counter() - start))
            if accuracy >= cfg.target_accuracy:
                break
        elif cfg.target_accuracy is None and steps_done % cfg.eval_every == 0:
            log.info("warm start: step %d/%d, loss %.4f, %s", steps_done, cfg.steps, loss_value,
                     _duration(time.perf_counter() - start))
    model.train(was_training)
    wall = time.perf_counter() - start
    if path is not None:  # parallel runs sharing the cache may finish one entry together: each writes its own file
        save_atomically(model.state_dict(), path)
    log.info("warm start: %d steps in %.1fs, final loss %.4f%s", steps_done, wall, loss_value,
             "" if accuracy is None else f", probe accuracy {accuracy:.1%}")
    return {"cached": False, "wall_s": wall, "final_loss": loss_value, "path": str(path) if path else None,
            "steps": steps_done, "probe_accuracy": accuracy}


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


@torch.no_grad()
def greedy_accuracy(model: nn.Module, tokenizer: Any, rows: Sequence[dict[str, Any]], prompt_column: str = "prompt",
                    answer_column: str = "answer", max_new_tokens: int | None = None, batch_size: int = 256) -> float:
    """Share of ``rows`` whose greedy completion equals the answer exactly (white space stripped)."""
    from .rollout import HFRolloutEngine, SamplingConfig

    if not rows:
        return float("nan")
    device = next(model.parameters()).device
    longest = max(len(tokenizer(str(r[answer_column]), add_special_tokens=False)["input_ids"]) for r in rows)
    sampling = SamplingConfig(max_new_tokens=max_new_tokens or longest + 1, temperature=0.0)
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    right = 0
    try:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            enc = tokenizer([str(r[prompt_column]) for r in chunk], padding=True, return_tensors="pt").to(device)
            out = HFRolloutEngine().generate(model, enc["input_ids"], enc["attention_mask"], 1, sampling,
                                             stop_token_ids(tokenizer, model), tokenizer.pad_token_id)
            ids = [r[m.bool()].tolist() for r, m in zip(out.completion_ids, out.completion_mask)]
            texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
            right += sum(t.strip() == str(r[answer_column]).strip() for t, r in zip(texts, chunk))
    finally:
        tokenizer.padding_side = padding_side
    return right / len(rows)
