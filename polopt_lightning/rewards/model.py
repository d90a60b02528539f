"""A learned reward: a sequence classifier (``AutoModelForSequenceClassification``) that scores each prompt and
completion, as TRL's reward models and verl's / OpenRLHF's reward model paths do."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..chat import is_conversation


class RewardModel:
    """Scores completions with a reward model: a sequence classifier from a hub id or a folder (or one already
    loaded), with its own tokenizer and chat template, in batches, never trained.

    A conversation (chat prompt and completion messages) is rendered with the reward model's own chat template; a
    string prompt is joined to its completion. The score is the logit of ``label`` at the last token, in float32.
    Like any reward function it is weighted and combined with the others (``reward.functions`` /
    ``RewardComposer``); it is not a submodule of the policy's module, so it is neither trained nor saved in the
    checkpoints.

    Args:
        model: hub id or folder of a sequence-classification model, or the model itself.
        tokenizer: its tokenizer (hub id, folder, or object); ``None``: the model's folder's own.
        batch_size: completions scored per forward pass.
        device: where it runs (``"cpu"``, ``"cuda:1"``, ...); ``None``: the policy's device (moved there when
            training or validation starts).
        dtype: ``"auto"`` (the checkpoint's own), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        max_length: longer inputs are cut from the left (the completion's end is what the score reads); ``None``: kept.
        label: the output whose logit is the reward (0 for a one-output reward model).
        name: the name it is logged under (``rewards/<name>/mean``).
        trust_remote_code, revision: as for ``from_pretrained``.
    """

    def __init__(self, model: str | nn.Module, tokenizer: Any = None, batch_size: int = 8, device: str | None = None,
                 dtype: str = "auto", max_length: int | None = 1024, label: int = 0, name: str = "reward_model",
                 trust_remote_code: bool = False, revision: str | None = None) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from ..models import TOKENIZER_FILES, check_source, resolve_dtype

        if batch_size < 1:
            raise ValueError(f"{name}: batch_size must be >= 1, got {batch_size}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"{name}: max_length must be >= 1 or None, got {max_length}")
        self.__name__ = name
        if isinstance(model, str):
            check_source(model, f"{name}.model", "config.json", "a sequence-classification model's config.json")
            try:
                model = AutoModelForSequenceClassification.from_pretrained(
                    model, dtype=resolve_dtype(dtype, f"{name}.dtype"), trust_remote_code=trust_remote_code,
                    revision=revision)
            except (OSError, ValueError) as exc:  # not a classifier, or not loadable: transformers' reason, named
                raise ValueError(f"{name}.model={model!r}: could not be loaded as a sequence classifier "
                                 f"(AutoModelForSequenceClassification): {exc}") from exc
        elif dtype != "auto":
            model = model.to(resolve_dtype(dtype, f"{name}.dtype"))
        if tokenizer is None or isinstance(tokenizer, str):
            source = tokenizer or getattr(model, "name_or_path", None)
            if not source:
                raise ValueError(f"{name}: give the reward model's tokenizer (its model object has no folder to "
                                 "load one from)")
            check_source(source, f"{name}.tokenizer", TOKENIZER_FILES, "a tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, revision=revision)
        if tokenizer.pad_token is None:  # batches are padded: EOS pads, as for the policy
            tokenizer.pad_token = tokenizer.eos_token
        if getattr(model.config, "pad_token_id", None) is None:  # where the classifier finds each row's last token
            model.config.pad_token_id = tokenizer.pad_token_id
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.batch_size, self.max_length, self.label, self.fixed_device = batch_size, max_length, label, device
        if device is not None:
            self.model.to(device)

    def place(self, device: torch.device | str) -> None:
        """Run on the policy's ``device`` (called when training or validation starts), unless a device was fixed."""
        if self.fixed_device is None:
            self.model.to(device)

    def text(self, prompt: Any, completion: Any) -> str:
        """What the reward model reads: a conversation through its chat template, else prompt and completion joined."""
        if is_conversation(prompt) and is_conversation(completion):
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(f"{self.__name__}: the prompts are chat messages but the reward model's tokenizer has "
                                 "no chat template")
            return self.tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        if is_conversation(prompt) or is_conversation(completion):
            raise TypeError(f"{self.__name__}: a prompt and its completion must both be chat messages or both text")
        return str(prompt) + str(completion)

    @torch.no_grad()
    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        texts = [self.text(p, c) for p, c in zip(prompts, completions)]
        chat = bool(prompts) and is_conversation(prompts[0])  # a chat template writes its own special tokens
        device = next(self.model.parameters()).device
        scores: list[float] = []
        side = self.tokenizer.truncation_side
        self.tokenizer.truncation_side = "left"
        try:
            for start in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[start:start + self.batch_size], padding=True, return_tensors="pt",
                                     truncation=self.max_length is not None, max_length=self.max_length,
                                     add_special_tokens=not chat).to(device)
                logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
                scores += logits[:, self.label].float().cpu().tolist()
        finally:
            self.tokenizer.truncation_side = side
        return scores
