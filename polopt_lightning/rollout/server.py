"""The generation-server backend (``rollout=server``): rollouts sampled by one or more ``polopt-serve`` processes
(:mod:`polopt_lightning.serve`) on other devices, processes or machines, the trainer's prompts spread over them.

The trainer's rank 0 sends the policy's config and weights at the first rollout and pushes the weights again after
each optimizer step, before the next rollout: in buckets over a ``torch.distributed`` group of its own with the
servers (gloo on CPUs, NCCL where policy and servers are on GPUs; :mod:`~polopt_lightning.rollout.wire`). Requests and
collectives have time limits: a server that dies or stops answering is an error naming it
(``rollout.servers[i]``), and the run's checkpoints so far stay as they are.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._hf import peft_base
from ..distributed import all_reduce
from ..export import dequantized_state
from ..models import float_dtype
from .base import RolloutBatch, RolloutEngine, SamplingConfig
from .weights import adapter_layers, base_weights, four_bit, policy_weights, whole
from .wire import (
    LORA_A,
    LORA_B,
    ServerError,
    base_url,
    broadcast,
    buckets,
    call,
    gpu_id,
    open_store,
    pack,
    tensor_layout,
    wait_for_health,
    weight_group,
)

log = logging.getLogger(__name__)


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class ServerRolloutEngine(RolloutEngine):
    """Rollouts from generation servers (``polopt-serve``; docs/async.md).

    Args:
        servers: the servers' addresses (``host:port`` or URLs; one as a string, several as a list); a batch's prompts
            are split over them in order,
            each share sampled with a seed of its own drawn from the trainer's generator (the same rollouts for the
            same seed and servers).
        timeout_s: the longest a request (a rollout, a push) or a collective may take before the server is reported
            as not answering.
        connect_timeout_s: how long the first rollout waits for the servers to answer at all (they may be starting).
        group_host: the address the servers reach the trainer's weight group at (its store and gloo connections):
            127.0.0.1 where they run on this machine.
        group_port: the port of the weight group's store; 0: a free one.
        group_backend: ``gloo`` or ``nccl``; ``None``: NCCL where the policy and every server are on CUDA, gloo
            otherwise.
        bucket_mib: the weights travel in buckets of at most this many MiB (a larger tensor alone).
        adapter_only: a LoRA policy sends its base weights once and then only its adapters (the servers merge them
            into their copy of the base), instead of the merged weights at every push. ``None``: where the policy is a
            plain LoRA policy (:func:`lora_layers`); ``False``: always the merged weights; ``True``: an error where it
            is not.
    """

    corrects_sampler = True  # another process's numerics (and, with vLLM, another's kernels): corrected by default
    samples_apart = True  # a submitted rollout is sampled while the trainer trains (experience.max_staleness)

    def __init__(self, servers: Sequence[str] | str = "127.0.0.1:8000", timeout_s: float = 600.0,
                 connect_timeout_s: float = 120.0, group_host: str = "127.0.0.1", group_port: int = 0,
                 group_backend: str | None = None, bucket_mib: int = 256, adapter_only: bool | None = None) -> None:
        servers = [servers] if isinstance(servers, str) else list(servers)
        if not servers:
            raise ValueError("rollout.servers: at least one generation server (host:port)")
        for address in servers:
            port = base_url(str(address)).rsplit(":", 1)[-1].split("/")[0]
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"rollout.servers: {address!r} is not host:port (a port in 1-65535)")
        if group_backend not in (None, "gloo", "nccl"):
            raise ValueError(f"rollout.group_backend: gloo, nccl or null, got {group_backend!r}")
        for key, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s),
                           ("bucket_mib", bucket_mib)):
            if value <= 0:
                raise ValueError(f"rollout.{key} must be > 0, got {value}")
        self.urls = [base_url(s) for s in servers]
        self.names = [f"rollout.servers[{i}]" for i in range(len(servers))]
        self.timeout_s, self.connect_timeout_s = float(timeout_s), float(connect_timeout_s)
        self.group_host, self.group_port, self.group_backend = group_host, int(group_port), group_backend
        self.bucket_bytes = int(bucket_mib * 2**20)
        self.adapter_only = adapter_only
        self._base_sent = False  # whether the servers hold the LoRA policy's base (adapter-only pushes)
        self._asked = [0] * len(self.urls)  # rollouts asked of each server since the last push
        self._prefix: str | None = None  # this trainer's weight group, which the servers check requests against
        self.last_push_bytes = 0
        self.version = 0  # pushes made so far (the servers' weights' version)
        self.last_versions: list[int] = []  # the weights' version that sampled each row of the last rollout
        self._group: Any = None
        self._store: Any = None
        self._wire = "gloo"
        self._hold_quantized = False  # whether every server holds a 4-bit base as it is (the transformers backend)
        self._stale = True
        self._source: nn.Module | None = None
        # the requests of a rollout go out at once; rollouts are put together one after another, in order
        # (a push and the rollouts in flight at once: a few requests a server)
        self._start_pools()

    def _start_pools(self) -> None:
        self._requests = ThreadPoolExecutor(4 * len(self.urls) + 4, thread_name_prefix="polopt-request")
        self._collector = ThreadPoolExecutor(1, thread_name_prefix="polopt-rollout")

    # ------------------------------------------------------------------------------------------------------------
    def _wait_until_up(self) -> list[dict[str, Any]]:
        """Each server's health, waiting up to ``connect_timeout_s`` for each to answer."""
        answers = []
        for url, name in zip(self.urls, self.names):
            def said(url: str = url, name: str = name) -> None:
                log.info("rollout=server: waiting up to %g s for %s at %s (rollout.connect_timeout_s)",
                         self.connect_timeout_s, name, url)
            try:
                answers.append(wait_for_health(url, self.connect_timeout_s, name, on_wait=said))
            except ServerError as err:
                raise ServerError(f"{err}: rollout.connect_timeout_s; is `polopt-serve` running there?") from None
        return answers

    def _connect(self, model: nn.Module) -> None:
        """The weight group of this process (rank 0) and the servers."""
        health = self._wait_until_up()
        own = gpu_id(next(model.parameters()).device)  # NCCL where every server has a GPU of its own, else gloo
        gpus = [h.get("gpu") for h in health]
        separate = own is not None and all(g is not None and g != own for g in gpus) and len(set(gpus)) == len(gpus)
        self._wire = self.group_backend or ("nccl" if separate else "gloo")
        self._hold_quantized = all(h.get("can_hold_4bit") for h in health)  # transformers servers with bitsandbytes
        world = len(self.urls) + 1
        self._group = self._store = None  # an earlier group's store released first (its port may be the same)
        self._store = open_store(self.group_host, self.group_port, world, True, self.timeout_s)
        prefix = f"polopt/{uuid.uuid4().hex}"  # a new group's keys apart from an earlier one's
        for i, (url, name) in enumerate(zip(self.urls, self.names)):  # each joins in the background: answers at once
            call(url, "/join", {"host": self.group_host, "port": self._store.port, "rank": i + 1, "world_size": world,
                                "timeout_s": self.timeout_s, "backend": self._wire, "prefix": prefix},
                 self.timeout_s, name)
        self._prefix = prefix
        try:
            self._group = weight_group(self._store, 0, world, self.timeout_s, self._wire, prefix)
        except Exception as err:
            raise ServerError(f"rollout.servers: the weight group did not form within {self.timeout_s:g} s "
                              f"(rollout.timeout_s; {self._unanswered()}): {err}") from None

    def _unanswered(self) -> str:
        """Which servers answer a health check now, for an error's message."""
        states = []
        for url, name in zip(self.urls, self.names):
            try:
                health = call(url, "/health", None, 5.0, name)
                states.append(f"{name} {url} answers" + (f" ({health['join_error']})" if health.get("join_error")
                                                         else ""))
            except ServerError:
                states.append(f"{name} {url} does not answer")
        return "; ".join(states)

    def push(self, model: nn.Module) -> None:
        """The policy's weights to every server (collective under FSDP: every process gathers, rank 0 sends). A LoRA
        policy (:func:`lora_layers`, ``adapter_only``) sends its base once per weight group and then its adapters
        alone: the servers merge them into their copy of the base, or, for a 4-bit base that servers of the
        transformers backend hold as it is (packed), run them beside it as the policy does."""
        layers = adapter_layers(model, self.adapter_only)
        if layers is not None:  # the base once (while the servers hold it), the adapters every time
            weights = {} if self._base_sent else base_weights(model, keep_quantized=True)
            for name, (A, B, _) in layers.items():
                weights[f"{LORA_A}{name}"], weights[f"{LORA_B}{name}"] = whole(A), whole(B)
        else:
            weights = policy_weights(model, key="rollout=server" if self.adapter_only is None else
                                     "rollout=server with rollout.adapter_only=false (a QLoRA policy samples on servers "
                                     "with rollout.adapter_only=null, the default: its base sent once, packed to "
                                     "transformers-backend servers and dequantized to vLLM's, then its adapters)")
        self._base_sent = layers is not None  # on every process alike: gathering a sharded base is collective
        asked, self._asked = self._asked, [0] * len(self.urls)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:  # every process's rollouts
            asked = [int(n) for n in all_reduce(torch.tensor(asked, dtype=torch.long,
                                                             device=next(model.parameters()).device)).tolist()]
        if rank() != 0:
            return
        config = peft_base(model).config
        if getattr(config, "tie_word_embeddings", False):  # one tensor: the server ties them again
            weights.pop("lm_head.weight", None)
        if self._group is None:
            self._connect(model)
        # a 4-bit base goes over as it is held (packed, with its quantization state) to servers that hold it so;
        # dequantized to the others (vLLM's) and for 8-bit bases
        quantized = four_bit(weights) and self._hold_quantized
        if not quantized:  # (nothing to do for weights that were never quantized)
            weights = dequantized_state(weights, float_dtype(model))
        layout = tensor_layout(weights)
        plan = buckets(layout, self.bucket_bytes)
        settings = json.loads(config.to_json_string(use_diff=False))
        if not quantized:
            settings.pop("quantization_config", None)
        request = {"layout": layout, "buckets": plan, "config": settings,
                   "version": self.version + 1, "timeout_s": self.timeout_s, "backend": self._wire,
                   "group": self._prefix,
                   "scalings": None if layers is None else {name: float(s) for name, (_, _, s) in layers.items()}}
        tensors = list(weights.values())
        device = next(model.parameters()).device if self._wire == "nccl" else "cpu"
        # each server applies it once it has served the rollouts asked of the version before (in the trainer's order)
        answers = [self._requests.submit(call, url, "/weights", {**request, "after": asked[i]}, self.timeout_s, name)
                   for i, (url, name) in enumerate(zip(self.urls, self.names))]
        try:
            for indices in plan:
                broadcast(self._group, pack([tensors[i] for i in indices], device), self.timeout_s,
                          refused=lambda: next((f.exception() for f in answers if f.done() and f.exception()), None))
        except Exception as err:
            if isinstance(err, ServerError):  # a server refused the push (its own reason)
                self._group, self._base_sent = None, False
                raise
            self._group, self._base_sent = None, False  # broken: the next push forms a new one, the base again
            raise ServerError(f"rollout.servers: pushing the weights failed ({self._unanswered()}): "
                              f"{type(err).__name__}: {str(err).splitlines()[0]}") from None
        for future in answers:
            future.result()
        self.last_push_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.version += 1

    def policy_updated(self, model: nn.Module) -> None:
        self._stale = True

    def logprobs_match(self, model: nn.Module) -> bool:
        return False

    def close(self) -> None:
        """Leave the weight group (the servers keep running, and form a new group with the next trainer); the request
        threads end (new ones start if the engine is used again)."""
        self._group, self._store, self._stale, self._source, self._base_sent = None, None, True, None, False
        self._asked = [0] * len(self.urls)
        for pool in (self._requests, self._collector):
            pool.shutdown(wait=False, cancel_futures=True)
        self._start_pools()

    # ------------------------------------------------------------------------------------------------------------
    def generate(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, num_generations: int,
                 sampling: SamplingConfig, eos_token_id: int | list[int], pad_token_id: int,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        return self.submit(model, prompt_ids, prompt_mask, num_generations, sampling, eos_token_id, pad_token_id,
                           generator).result()

    def submit(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, num_generations: int,
               sampling: SamplingConfig, eos_token_id: int | list[int], pad_token_id: int,
               generator: torch.Generator | None = None) -> Future[RolloutBatch]:
        """The weights pushed where they moved (every process waits for it), the seeds drawn, the requests sent: the
        rollout comes back as a future while the servers sample."""
        if self._stale or model is not self._source:
            failed: Exception | None = None
            try:
                self.push(model)
            except Exception as err:
                failed = err
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                    # no process samples before the servers hold the new weights; a failure stops every process
                flag = torch.tensor(float(failed is not None), device=next(model.parameters()).device)
                if float(all_reduce(flag, "max")) and failed is None:
                    raise ServerError("rollout.servers: the first process's weight push failed (its error says why)")
            if failed is not None:
                raise failed
            self._stale, self._source = False, model
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        prompts = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids, prompt_mask)]
        shares = [s.tolist() for s in torch.arange(len(prompts)).tensor_split(len(self.urls))]
        device = generator.device if generator is not None else "cpu"
        payloads = {}
        for i, share in enumerate(shares):
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=device))
            if share:
                payloads[i] = {"prompts": [prompts[j] for j in share], "n": num_generations, "pad": pad_token_id,
                               "sampling": asdict(sampling), "eos": eos, "seed": seed, "version": self.version,
                               "timeout_s": self.timeout_s, "group": self._prefix}
                self._asked[i] += 1
        answers = [self._requests.submit(call, self.urls[i], "/generate", payload, self.timeout_s, self.names[i])
                   for i, payload in payloads.items()]
        return self._collector.submit(self._collect, answers, prompt_ids, prompt_mask, num_generations, pad_token_id,
                                      self.version)

    def _collect(self, answers: list[Future], prompt_ids: Tensor, prompt_mask: Tensor, num_generations: int,
                 pad_token_id: int, version: int) -> RolloutBatch:
        """The servers' answers, in order, as one :class:`RolloutBatch` (``versions``: the weights that sampled each
        row)."""
        answers = [a.result() for a in answers]
        tokens = [row for a in answers for row in a["tokens"]]
        logprobs = [row for a in answers for row in a["logprobs"]]
        finished = [f for a in answers for f in a["finished"]]
        N, width = len(tokens), max(1, max(len(t) for t in tokens))
        ids = torch.full((N, width), pad_token_id, dtype=torch.long)
        mask = torch.zeros(N, width, dtype=torch.long)
        lp = torch.zeros(N, width)
        for i, (row, row_lp) in enumerate(zip(tokens, logprobs)):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
            lp[i, :len(row_lp)] = torch.tensor(row_lp)
        out_device = prompt_ids.device
        batch = RolloutBatch(prompt_ids=prompt_ids.repeat_interleave(num_generations, 0),
                             prompt_mask=prompt_mask.repeat_interleave(num_generations, 0),
                             completion_ids=ids.to(out_device), completion_mask=mask.to(out_device),
                             sampling_logprobs=lp.to(out_device),
                             finished=torch.tensor(finished, dtype=torch.bool, device=out_device),
                             group_size=num_generations)
        self.last_versions = [a["version"] for a in answers for _ in a["tokens"]]
        if any(a["version"] != version for a in answers):  # never: the servers keep the trainer's order
            raise ServerError(f"rollout.servers: a rollout asked of weights version {version} was sampled by "
                              f"{sorted({a['version'] for a in answers})}")
        return batch
