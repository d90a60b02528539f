"""PromptDataModule: prompts (and any extra columns for the reward functions) into tokenised batches."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from ..chat import is_conversation
from .sampling import PADDING, MixtureSampler, PromptSampler, ResumableLoader, ShardSampler, allocate, process_rank
from .sources import load_rows
from .tasks import TaskMixture

log = logging.getLogger(__name__)

TRUNCATION = ("left", "error")
# chat templates by name for data.chat_template (Qwen's and many others' ChatML)
CHAT_TEMPLATES = {
    "chatml": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    # the fewest tokens for a small model's multi-turn task: messages as they are, an assistant turn ended by EOS, a
    # tool message in parentheses (ToolArithmeticTask's demonstrations)
    "plain_tools": "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
                   "{% elif m['role'] == 'tool' %}({{ m['content'] }}){% else %}{{ m['content'] }}{% endif %}"
                   "{% endfor %}",
}


class _Rows(Dataset):
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i < 0:  # ShardSampler's padding: a copy of the first row, marked to be left out of the metrics
            return {**self.rows[0], PADDING: True}
        return self.rows[i]


class PromptDataModule(L.LightningDataModule):
    """Prompts for RL training and validation.

    Args:
        train: training rows (list of dicts, JSON-lines path, or ``datasets.Dataset``).
        val: validation rows (same forms); validation decodes greedily.
        task: a built-in task with ``splits() -> (train, val)`` used when ``train`` is not given.
        tokenizer: set here or later with :meth:`set_tokenizer` (the CLI and the module do that).
        prompt_column: the column holding the prompt: a string, or a list of chat messages (``{"role", "content"}``
            dicts) rendered with the tokenizer's chat template and a generation prompt (a last assistant message is
            continued instead, as TRL does).
        chat_template: a Jinja chat template, a file holding one, or a name in :data:`CHAT_TEMPLATES` (``"chatml"``),
            set on the tokenizer (for one without a template, or to replace its own); ``None`` keeps the tokenizer's.
        tools: Python functions (typed, with a docstring) the chat template shows the model, as
            ``apply_chat_template(tools=...)`` does (for a multi-turn rollout's tools,
            :mod:`~polopt_lightning.rollout.multi_turn`); chat prompts only.
        batch_size: prompts per training step (each gets ``num_generations`` completions).
        val_batch_size: prompts per validation batch.
        max_prompt_length: longer prompts are cut from the left (``truncation="left"``, with a warning) or
            rejected (``truncation="error"``); ``None`` keeps them whole.
        shuffle: shuffle training prompts each epoch.
        num_workers: DataLoader workers.
        seed: shuffling seed.

    A batch holds ``prompts`` as the dataset holds them (strings, or message lists), ``prompt_texts`` as the model reads
    them, and every column other than the prompt in ``columns``: the reward functions receive all of them as TRL passes
    them (:meth:`~polopt_lightning.step.experience.ExperienceMaker.score`).
    """

    def __init__(
        self,
        train: Any = None,
        val: Any = None,
        task: Any = None,
        tokenizer: Any = None,
        prompt_column: str = "prompt",
        chat_template: str | None = None,
        tools: Sequence[Callable] = (),
        batch_size: int = 8,
        val_batch_size: int = 64,
        max_prompt_length: int | None = 512,
        truncation: str = "left",
        shuffle: bool = True,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        if truncation not in TRUNCATION:
            raise ValueError(f"data.truncation must be one of {TRUNCATION}, got {truncation!r}")
        if max_prompt_length is not None and max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length must be >= 1 or null, got {max_prompt_length}")
        self.mixture = task if isinstance(task, TaskMixture) else None
        if self.mixture is not None and train is not None:
            raise ValueError("data.train and a task mixture both given: the mixture brings its tasks' training rows")
        if train is None and task is not None:
            train, task_val = task.splits()
            val = task_val if val is None else val
        self.train_rows = load_rows(train, "data.train")
        self.val_rows = load_rows(val, "data.val")
        if not self.train_rows:
            raise ValueError("data.train is empty: give training prompts (a list, a JSON-lines file, a Dataset or a task)")
        for name, rows in (("data.train", self.train_rows), ("data.val", self.val_rows)):
            for i, row in enumerate(rows):
                if prompt_column not in row:
                    raise KeyError(f"{name}: row {i} has no prompt column {prompt_column!r}; its columns: {sorted(row)}")
        self.prompt_column = prompt_column
        self.batch_size, self.val_batch_size = batch_size, val_batch_size
        self.max_prompt_length, self.truncation = max_prompt_length, truncation
        self.shuffle, self.num_workers, self.seed = shuffle, num_workers, seed
        self.tokenizer = None
        self.chat_template = chat_template
        self.tools = list(tools)
        self._warned_truncation = False
        self._tools_checked = False  # whether the prompts were seen to show the tools' schemas (said once otherwise)
        # a mixture's samplers: the training loader's, and the one of dynamic sampling's extra batches
        self._train_sampler: MixtureSampler | None = None
        self._extra_sampler: MixtureSampler | None = None
        if self.mixture is not None:
            self.task_names = self.mixture.names
            column = self.mixture.column
            sizes = [sum(r[column] == name for r in self.train_rows) for name in self.task_names]
            order = [r[column] for r in self.train_rows]
            if order != [name for name, n in zip(self.task_names, sizes) for _ in range(n)]:
                raise ValueError("a task mixture's training rows must come task after task (TaskMixture.splits does)")
            self.task_sizes = sizes
            self._task_weights = [self.mixture.weights[name] for name in self.task_names]
        if tokenizer is not None:
            self.set_tokenizer(tokenizer)

    def set_tokenizer(self, tokenizer: Any) -> None:
        from ..models import prepare_tokenizer

        self.tokenizer = prepare_tokenizer(tokenizer)
        if self.chat_template is not None:
            template = CHAT_TEMPLATES.get(self.chat_template, self.chat_template)
            if "{" not in template:
                if not Path(template).is_file():
                    raise FileNotFoundError(f"data.chat_template={template!r} is neither a Jinja template, a file nor "
                                            f"a template name ({sorted(CHAT_TEMPLATES)})")
                template = Path(template).read_text()
            self.tokenizer.chat_template = template

    # ------------------------------------------------------------------------------------------------------------
    def prompt_text(self, prompt: Any) -> str:
        """The text the model reads for ``prompt``: a string as it is; chat messages through the tokenizer's chat
        template, with the generation prompt, or continuing the last message when it is the assistant's."""
        if isinstance(prompt, str):
            if self.tools and not self._tools_checked:
                self._tools_checked = True
                log.info("the prompts are strings, shown as they are: the tools' schemas (%s) reach the model only "
                         "through chat prompts whose template renders them (a warm start or the prompt itself may "
                         "teach the calls instead)", ", ".join(fn.__name__ for fn in self.tools))
            return prompt
        if not is_conversation(prompt):
            raise TypeError(f"data.prompt_column={self.prompt_column!r}: a prompt must be a string or a list of chat "
                            f"messages ({{'role': ..., 'content': ...}}), got {type(prompt).__name__}: {prompt!r:.120}")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"data.prompt_column={self.prompt_column!r} holds chat messages but the tokenizer has no "
                             "chat template: use a chat model's tokenizer, or give one with data.chat_template "
                             "(PromptDataModule(chat_template=...) in Python): a name (chatml), a Jinja template or a "
                             "file holding it")
        tools = None
        if self.tools:
            from ..rollout.multi_turn import tool_schema

            tools = [tool_schema(fn) for fn in self.tools]
            if not self._tools_checked:
                self._tools_checked = True
                probe = [{"role": "user", "content": "q"}]
                if (self.tokenizer.apply_chat_template(probe, tools=tools, tokenize=False, add_generation_prompt=True)
                        == self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)):
                    log.warning("the chat template does not render tools: the model is not shown the schemas of %s "
                                "(use a template that renders `tools`, as Qwen's and Llama 3's do, or describe the "
                                "tools in the prompts)", ", ".join(fn.__name__ for fn in self.tools))
        if prompt[-1].get("role") == "assistant":  # the assistant's turn begun: continued, not a new turn
            return self.tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False, continue_final_message=True)
        return self.tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=True)

    def collate(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        if self.tokenizer is None:
            raise RuntimeError("PromptDataModule has no tokenizer: pass tokenizer= or call set_tokenizer()")
        texts = [self.prompt_text(r[self.prompt_column]) for r in rows]
        # a chat template writes the special tokens it wants (a BOS among them) itself: none added again
        encoded = [self.tokenizer(t, add_special_tokens=isinstance(r[self.prompt_column], str))["input_ids"]
                   for t, r in zip(texts, rows)]
        limit = self.max_prompt_length
        for i, ids in enumerate(encoded):
            if limit is not None and len(ids) > limit:
                if self.truncation == "error":
                    raise ValueError(
                        f"prompt {texts[i][:60]!r}... has {len(ids)} tokens > data.max_prompt_length={limit} "
                        "(set data.truncation=left to cut it from the left)"
                    )
                if not self._warned_truncation:
                    warnings.warn(f"prompts longer than data.max_prompt_length={limit} tokens are cut from the left",
                                  stacklevel=2)
                    self._warned_truncation = True
                encoded[i] = ids[-limit:]
        width = max(len(ids) for ids in encoded)
        pad = self.tokenizer.pad_token_id
        prompt_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        prompt_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ids in enumerate(encoded):  # left padding
            if ids:
                prompt_ids[i, width - len(ids):] = torch.tensor(ids)
                prompt_mask[i, width - len(ids):] = 1
        columns = {k: [r.get(k) for r in rows] for k in rows[0] if k not in (self.prompt_column, PADDING)}
        batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "prompts": [r[self.prompt_column] for r in rows],
                 "prompt_texts": texts, "columns": columns}
        if any(PADDING in r for r in rows):
            batch["padding"] = torch.tensor([PADDING in r for r in rows])
        return batch

    # ------------------------------------------------------------------------------------------------------------
    @property
    def task_weights(self) -> dict[str, float]:
        """A task mixture's current weights (normalised): the shares of prompts its next batches draw."""
        if self.mixture is None:
            raise AttributeError("task_weights: this PromptDataModule trains on one task, not a TaskMixture")
        total = sum(self._task_weights)
        return {name: w / total for name, w in zip(self.task_names, self._task_weights)}

    def set_task_weights(self, weights: Mapping[str, float]) -> None:
        """Set a task mixture's weights (task name -> weight, normalised here; tasks not named keep theirs). The batches
        fetched from then on follow them; Lightning has already fetched the next one."""
        if self.mixture is None:
            raise ValueError("set_task_weights: this PromptDataModule trains on one task, not a TaskMixture")
        unknown = sorted(set(weights) - set(self.task_names))
        if unknown:
            raise ValueError(f"task weights name unknown tasks {unknown}; the tasks: {self.task_names}")
        new = [float(weights.get(name, w)) for name, w in zip(self.task_names, self._task_weights)]
        if any(not math.isfinite(w) or w < 0 for w in new) or sum(new) <= 0:
            raise ValueError(f"task weights must be finite, >= 0 and not all 0, got {dict(zip(self.task_names, new))}")
        self._task_weights = new
        if self._train_sampler is not None:
            self._train_sampler.set_weights(new)

    def _mixture_sampler(self, seed: int) -> MixtureSampler:
        world, rank = self._world()
        return MixtureSampler(_Rows(self.train_rows), self.task_sizes, self.batch_size, self._task_weights,
                              num_replicas=world, rank=rank, seed=seed)

    def train_dataloader(self) -> DataLoader:
        """Batches of ``batch_size`` prompts per process: each process its own share of every epoch's order.

        The loader is resumable: a checkpoint records the epoch and how many of its batches were trained on, and a
        run resumed from it continues with the next batch (same order, same split across processes). A task mixture's
        batches draw from each task by the current weights (:class:`~.sampling.MixtureSampler`).
        """
        world, rank = self._world()
        if self.mixture is not None:
            sampler = self._train_sampler = self._mixture_sampler(self.seed)
            return ResumableLoader(sampler.dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True,
                                   collate_fn=self.collate, num_workers=self.num_workers,
                                   position=partial(self._position, sampler),
                                   generator=torch.Generator().manual_seed(self.seed))
        sampler = PromptSampler(_Rows(self.train_rows), num_replicas=world, rank=rank, shuffle=self.shuffle,
                                seed=self.seed, drop_last=len(self.train_rows) >= self.batch_size * world)
        # The generator only feeds the loader's per-epoch draw of its workers' base seed (the order is the sampler's):
        # without one that draw would come from torch's global generator and shift everything else drawn from it.
        return ResumableLoader(sampler.dataset, batch_size=self.batch_size, sampler=sampler,
                               drop_last=len(sampler) >= self.batch_size, collate_fn=self.collate,
                               num_workers=self.num_workers, position=partial(self._position, sampler),
                               generator=torch.Generator().manual_seed(self.seed))

    def extra_batch(self, index: int) -> dict[str, Any]:
        """The ``index``-th extra batch of this process, for dynamic sampling: another order of the training prompts
        (seeded ``seed + 1``), split across processes as the training batches are, and a function of ``index`` alone
        (a resumed run draws the batches the uninterrupted one would).

        A task mixture's extra batch splits ``batch_size`` by the current weights and takes task ``t``'s share from
        position ``index x batch_size`` of its own stream (seeded ``seed + 1``): a function of ``index`` and the
        weights, which a resumed run restores."""
        world, rank = self._world()
        if self.mixture is not None:
            if self._extra_sampler is None:
                self._extra_sampler = self._mixture_sampler(self.seed + 1)
            extra = self._extra_sampler
            counts = allocate(self._task_weights, self.batch_size, [0.0] * len(self.task_names))
            indices = [extra._row(t, index * self.batch_size + i) for t, c in enumerate(counts) for i in range(c)]
            return self.collate([self.train_rows[i] for i in indices])
        sampler = PromptSampler(_Rows(self.train_rows), num_replicas=world, rank=rank, shuffle=self.shuffle,
                                seed=self.seed + 1, drop_last=len(self.train_rows) >= self.batch_size * world)
        per_epoch = max(len(sampler) // self.batch_size, 1)
        sampler.set_epoch(index // per_epoch)
        start = (index % per_epoch) * self.batch_size
        indices = list(sampler)[start:start + self.batch_size]
        return self.collate([self.train_rows[i] for i in indices])

    def _world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.world_size > 1:
            return trainer.world_size, trainer.global_rank
        return process_rank()

    def _position(self, sampler: PromptSampler) -> tuple[int, int]:
        """The sampler's epoch and the batches of it trained on so far (Lightning's count, not the loader's)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return sampler.epoch, 0
        return sampler.epoch, int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_rows:
            return []
        world, rank = self._world()
        rows = _Rows(self.val_rows)
        return DataLoader(rows, batch_size=self.val_batch_size, sampler=ShardSampler(rows, world, rank),
                          collate_fn=self.collate, num_workers=self.num_workers)


class ExtraPrompts:
    """More batches of prompts for dynamic sampling, one per :meth:`next`.

    From :meth:`PromptDataModule.extra_batch` when the trainer's data comes from one: the ``draws``-th extra batch of
    this process, the same after a resume (``draws`` is in the checkpoint) and another share on each process.
    Otherwise from a second pass over the training loader.
    """

    def __init__(self) -> None:
        self.draws = 0  # batches drawn from the data module so far
        self._loader: Any = None

    def next(self, trainer: Any, device: torch.device) -> dict[str, Any]:
        dm = getattr(trainer, "datamodule", None)
        if hasattr(dm, "extra_batch"):
            batch = dm.extra_batch(self.draws)
            self.draws += 1
        else:
            if self._loader is None:
                self._loader = iter(trainer.train_dataloader)
            try:
                batch = next(self._loader)
            except StopIteration:
                self._loader = None
                return self.next(trainer, device)
        return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def batch_rows(batch: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The batch's prompts as dataset rows: ``prompt`` (as the dataset holds it) and every extra column."""
    columns = batch.get("columns", {})
    return [{"prompt": prompt, **{k: v[i] for k, v in columns.items()}} for i, prompt in enumerate(batch["prompts"])]
