"""``polopt-serve``: a generation server in a process of its own (another device, another machine), which a trainer
samples from with ``rollout=server`` (:class:`~polopt_lightning.rollout.server.ServerRolloutEngine`).

The server starts bare: the trainer sends the policy's config and weights at its first rollout and pushes the weights
again after its optimizer steps, over a ``torch.distributed`` group of its own (:mod:`~polopt_lightning.rollout.wire`).
Sampling runs on a rollout backend of this package (``--backend hf``: transformers, the default; ``--backend vllm``:
vLLM, in its environment, docs/vllm.md), so the completions are the ones that backend gives in the trainer's process.
The server binds to 127.0.0.1 unless ``--host`` says otherwise: it runs whatever weights it is sent.

    polopt-serve --port 8000 [--backend vllm] [--set dtype=bfloat16 ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from torch import nn

from . import accel
from .rollout import SamplingConfig, build_engine
from .rollout.wire import LORA_A, LORA_B, broadcast, gpu_id, nbytes, open_store, unpack, weight_group

log = logging.getLogger("polopt_lightning.serve")


class GenerationServer:
    """The server's state: the backend, the model the trainer sent (``None`` before the first push), the weight
    group, and the version of the weights it holds (the trainer's count of pushes). One request works on the model
    at a time: a push waits for the rollout in progress and the next rollout for the push."""

    def __init__(self, backend: str = "hf", device: str = "auto", **backend_args: Any) -> None:
        self.backend = backend
        self.engine = build_engine({"name": backend, **backend_args}, key="--backend")
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   "cpu" if device == "auto" else device)
        if self.device.type == "cuda":  # NCCL's communicator and the model on the device asked for
            if not torch.cuda.is_available():
                raise ValueError(f"--device {device}: torch {torch.__version__} sees no CUDA device")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.group_id: str | None = None  # the trainer the weight group is with (its prefix)
        self.model: nn.Module | None = None
        self.config: dict[str, Any] | None = None
        self.pristine: dict[str, torch.Tensor] = {}  # a LoRA policy's base of the weights its adapters change
        self.quantization: str | None = None  # a 4-bit base held as the trainer holds it (nf4, fp4), adapters beside
        self.version = -1
        # one request works on the model at a time, in the trainer's order: a rollout waits for the weights version it
        # was asked of, a push for the rollouts the trainer asked of the version before (served: count per version)
        self.turn = threading.Condition()
        self.served: dict[int, int] = {}
        self.group: Any = None
        self._store: Any = None
        self._joining: threading.Thread | None = None
        self._join_error: str | None = None
        self._fast_path = accel.training(None)

    # -- requests ----------------------------------------------------------------------------------------------
    def health(self, _: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"ok": True, "backend": self.backend, "device": str(self.device), "gpu": gpu_id(self.device),
                "version": self.version, "group": self.group is not None, "join_error": self._join_error,
                "can_hold_4bit": self.backend == "hf" and can_hold_4bit(), "quantization": self.quantization}

    def join(self, request: dict[str, Any]) -> dict[str, Any]:
        """Join the trainer's weight group (in the background: the group forms once every server has joined)."""
        def run() -> None:
            try:
                world, timeout = request["world_size"], request["timeout_s"]
                self._store = open_store(request["host"], request["port"], world, False, timeout)
                self.group = weight_group(self._store, request["rank"], world, timeout, request.get("backend", "gloo"),
                                          request.get("prefix", "polopt"))
                self._join_error = None
            except Exception as err:  # the trainer's health check reports it
                self._join_error = f"{type(err).__name__}: {err}"
                log.error("joining the weight group failed: %s", self._join_error)

        if self.group_id is not None and self.group_id != request.get("prefix"):
            log.warning("a trainer joins (another, or one resumed): requests of the weight group before are refused "
                        "now")
        self.group, self._join_error, self.group_id = None, None, request.get("prefix")
        self._joining = threading.Thread(target=run, daemon=True)
        self._joining.start()
        return {"ok": True}

    def weights(self, request: dict[str, Any]) -> dict[str, Any]:
        """Receive a push: ``layout`` (``[name, dtype, shape]`` each), ``buckets`` (indices into it, broadcast one
        after another), ``config`` (the policy's, to build the model from; ``None``: the model held) and
        ``version``."""
        self.check_trainer(request)
        if self._joining is not None:
            self._joining.join(request["timeout_s"])
        if self.group is None:
            raise RuntimeError(f"no weight group to receive on ({self._join_error or 'not joined'})")
        started = time.perf_counter()
        with self.turn:
            layout, timeout = request["layout"], request["timeout_s"]
            before, due = int(request["version"]) - 1, int(request.get("after", 0))
            if not self.turn.wait_for(lambda: self.served.get(before, 0) >= due, timeout):
                raise RuntimeError(f"weights version {before + 1}: {due} rollouts of version {before} were asked, "
                                   f"{self.served.get(before, 0)} arrived within {timeout:g} s")
            received: dict[str, torch.Tensor] = {}
            wire_device = self.device if request.get("backend") == "nccl" else "cpu"
            for indices in request["buckets"]:
                entries = [layout[i] for i in indices]
                size = sum(nbytes(e) for e in entries)
                buffer = torch.empty(size, dtype=torch.uint8, device=wire_device)
                broadcast(self.group, buffer, timeout)
                received.update(unpack(buffer, entries))
            adapters = {name: received.pop(name) for name in list(received) if name.startswith((LORA_A, LORA_B))}
            scalings = request.get("scalings")
            config = request.get("config")
            if received and config is not None and (self.model is None or config != self.config
                                                    or "quantization_config" in config):  # a 4-bit base: built anew
                self.quantization = (config.get("quantization_config") or {}).get("bnb_4bit_quant_type")
                if self.quantization is None:
                    self.model = build_model(config, received, self.device)
                else:  # the 4-bit base as the trainer holds it; the adapters stay apart (a 4-bit weight has no sum)
                    self.model = add_adapters(build_model_4bit(config, received, self.device), adapters,
                                              scalings or {})
                self.config = config
            elif self.model is None:
                raise RuntimeError("the first push carries no config and no base: nothing to build the model from")
            else:
                load_weights(self.model, received)
            if self.quantization is not None:
                set_adapters(self.model, adapters)
            elif scalings:
                self.merge(received, adapters, scalings)
            else:
                self.pristine = {}
            self.engine.policy_updated(self.model)
            self.version = int(request["version"])
            self.served = {v: n for v, n in self.served.items() if v >= before}
            self.turn.notify_all()
        log.info("weights version %d received (%d tensors, %.1f MiB) in %.2f s", self.version, len(layout),
                 sum(nbytes(e) for e in layout) / 2**20, time.perf_counter() - started)
        return {"ok": True, "version": self.version}

    def check_trainer(self, request: dict[str, Any]) -> None:
        """Refuse a trainer that is not the one the weight group is with: another joined since (one trainer a
        server); its rollouts would come from the other's weights."""
        if request.get("group") is not None and request["group"] != self.group_id:
            raise RuntimeError("this server now serves another trainer (a second trainer joined it since): one "
                               "trainer a server; start a server for each run")

    def merge(self, base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scalings: dict[str, float]
              ) -> None:
        """A LoRA policy's adapters merged into the model: each adapted weight ``base + scaling x B @ A`` (in float32),
        from the copy of the base kept since the push that carried it (``base`` holds it on that push)."""
        if base:
            self.pristine = {name: base[name].clone() for name in scalings}
        missing = sorted(set(scalings) - set(self.pristine))
        if missing:
            raise RuntimeError(f"an adapter-only push for weights whose base this server has not received: {missing[:3]}")
        own = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, scaling in scalings.items():
                A, B, W = adapters[LORA_A + name].float(), adapters[LORA_B + name].float(), self.pristine[name]
                own[name].copy_((W.float() + scaling * (B @ A)).to(own[name].dtype))

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """``prompts`` (token id lists), ``n`` completions each, ``sampling`` (SamplingConfig's fields), ``eos``,
        ``pad`` and ``seed``: each completion's tokens, sampling log-probs and whether it ended with EOS, and the
        version of the weights that sampled them."""
        self.check_trainer(request)
        if self.model is None:
            raise RuntimeError("no policy yet: the trainer pushes its weights before its first rollout")
        prompts, pad = request["prompts"], int(request["pad"])
        width = max(1, max(len(p) for p in prompts))
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, prompt in enumerate(prompts):  # left-padded, as the trainer's batches are
            if prompt:
                ids[i, width - len(prompt):] = torch.tensor(prompt)
                mask[i, width - len(prompt):] = 1
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int(request["seed"]))
        wanted = request.get("version")
        with self.turn:
            if wanted is not None and not self.turn.wait_for(lambda: self.version >= wanted, request["timeout_s"]):
                raise RuntimeError(f"asked to sample with weights version {wanted}, which did not arrive within "
                                   f"{request['timeout_s']:g} s (holding {self.version})")
            if wanted is not None and self.version != wanted:  # the trainer's order broken: never sample stale
                raise RuntimeError(f"asked to sample with weights version {wanted}, holding {self.version}")
            started, version = time.perf_counter(), self.version
            try:
                with self._fast_path.compute(self.model, self.device):
                    batch = self.engine.generate(self.model, ids.to(self.device), mask.to(self.device),
                                                 int(request["n"]), SamplingConfig(**request["sampling"]),
                                                 list(request["eos"]), pad, generator=generator)
            finally:  # served, failed or not: the next push does not wait for it
                self.served[version] = self.served.get(version, 0) + 1
                self.turn.notify_all()
            seconds = time.perf_counter() - started
        log.info("sampled %d x %d completions with weights version %d in %.2f s", len(prompts), int(request["n"]),
                 version, seconds)
        lengths = batch.completion_mask.sum(-1).tolist()
        tokens = batch.completion_ids.tolist()
        logprobs = batch.sampling_logprobs.float().tolist()
        return {"tokens": [row[:n] for row, n in zip(tokens, lengths)],
                "logprobs": [row[:n] for row, n in zip(logprobs, lengths)],
                "finished": batch.finished.tolist(), "version": version, "seconds": seconds}


def build_model(config: dict[str, Any], weights: dict[str, torch.Tensor], device: torch.device) -> nn.Module:
    """A ``transformers`` causal LM of the trainer's config, holding ``weights`` (every one of them), on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(config)
    model_type = settings.pop("model_type")
    model_config = AutoConfig.for_model(model_type, **settings)
    floating = [t.dtype for t in weights.values() if t.is_floating_point()]
    dtype = max(set(floating), key=floating.count) if floating else torch.float32
    model = AutoModelForCausalLM.from_config(model_config, dtype=dtype).to(device)
    load_weights(model, weights, strict=True)
    model.eval()
    return model


def can_hold_4bit() -> bool:
    """Whether this server can hold a 4-bit base as the trainer does (bitsandbytes importable)."""
    import importlib.util

    return importlib.util.find_spec("bitsandbytes") is not None


def build_model_4bit(config: dict[str, Any], weights: dict[str, torch.Tensor], device: torch.device) -> nn.Module:
    """A ``transformers`` causal LM whose linear layers hold the trainer's 4-bit (bitsandbytes) weights as they are
    (packed, with their quantization state: ``config``'s ``quantization_config``), loaded as a saved 4-bit model is,
    through a temporary folder; bitsandbytes' CPU inference repacking off, as on the trainer (the same numerics)."""
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from .models import prepare_quantized

    settings = dict(config)
    model_type = settings.pop("model_type")
    floating = [t.dtype for k, t in weights.items() if t.is_floating_point() and ".weight." not in k]
    dtype = max(set(floating), key=floating.count) if floating else torch.float32
    with tempfile.TemporaryDirectory(prefix="polopt_serve_") as folder:
        AutoConfig.for_model(model_type, **settings).save_pretrained(folder)
        save_file({k: v.clone() for k, v in weights.items()}, f"{folder}/model.safetensors", metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map={"": str(device)})
        accel.loaded(model)  # its weights out of the folder's mapped file before the folder goes
    return prepare_quantized(model).eval()


def add_adapters(model: nn.Module, adapters: dict[str, torch.Tensor], scalings: dict[str, float]) -> nn.Module:
    """``model`` with a peft LoRA adapter on each weight ``scalings`` names (rank from the pushed ``A``, alpha
    giving the pushed scaling), as the trainer's policy has them; their values come with each push
    (:func:`set_adapters`)."""
    import re

    from peft import LoraConfig, get_peft_model

    if not scalings:
        raise RuntimeError("a 4-bit base was pushed without adapters: a quantized policy samples on a server only "
                           "with its LoRA adapters (rollout.adapter_only)")
    ranks = {name.removesuffix(".weight"): adapters[LORA_A + name].shape[0] for name in scalings}
    alphas = {name.removesuffix(".weight"): scaling * ranks[name.removesuffix(".weight")]
              for name, scaling in scalings.items()}
    r, alpha = max(set(ranks.values()), key=list(ranks.values()).count), next(iter(alphas.values()))
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(ranks), lora_dropout=0.0, bias="none",
                        rank_pattern={re.escape(k): v for k, v in ranks.items() if v != r},
                        alpha_pattern={re.escape(k): v for k, v in alphas.items() if v != alpha})
    return get_peft_model(model, config).eval()


def set_adapters(model: nn.Module, adapters: dict[str, torch.Tensor]) -> None:
    """The pushed LoRA ``A`` and ``B`` of each adapted weight copied into ``model``'s adapters (built by
    :func:`add_adapters`)."""
    base = model.get_base_model()
    with torch.no_grad():
        for key, value in adapters.items():
            which, name = ("lora_A", key[len(LORA_A):]) if key.startswith(LORA_A) else ("lora_B", key[len(LORA_B):])
            layer = getattr(base.get_submodule(name.removesuffix(".weight")), which)
            layer[next(iter(layer))].weight.copy_(value)


def load_weights(model: nn.Module, weights: dict[str, torch.Tensor], strict: bool = False) -> None:
    """``weights`` copied into ``model``'s tensors of the same names; a name the model lacks is an error (a push of
    another architecture), and with ``strict`` so is a parameter of the model's left without a value (tied ones named
    once; buffers come from the config)."""
    own = model.state_dict(keep_vars=True)
    unknown = sorted(set(weights) - set(own))
    if unknown:
        raise RuntimeError(f"the pushed weights name tensors this model lacks: {unknown[:5]}")
    missing = sorted({name for name, _ in model.named_parameters()} - set(weights))  # tied weights named once
    if strict and missing:
        raise RuntimeError(f"the pushed weights lack {missing[:5]}")
    with torch.no_grad():
        for name, value in weights.items():
            own[name].copy_(value)


class Handler(BaseHTTPRequestHandler):
    """Routes ``GET /health`` and ``POST /join``, ``/weights``, ``/generate`` to the server; an exception is a 500
    answer whose ``error`` the trainer raises with the server's name."""

    server_state: GenerationServer
    routes = {"/join": "join", "/weights": "weights", "/generate": "generate"}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/health":
            self._answer(200, self.server_state.health())
        else:
            self._answer(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        method = self.routes.get(self.path)
        if method is None:
            self._answer(404, {"error": f"no route {self.path}"})
            return
        try:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            self._answer(200, getattr(self.server_state, method)(request))
        except Exception as err:
            log.exception("%s failed", self.path)
            self._answer(500, {"error": f"{type(err).__name__}: {err}"})

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # requests at debug level, not on stderr
        log.debug(format, *args)


def parse_settings(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` pairs as the backend's arguments (values read as YAML: ``dtype=bfloat16``, ``compile=true``)."""
    import yaml

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"polopt-serve: --set expects key=value, got {pair!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def make_server(host: str, port: int, state: GenerationServer) -> ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"server_state": state})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None, default_backend: str = "hf") -> None:
    parser = argparse.ArgumentParser(prog="polopt-serve", description=(
        "A generation server: samples rollouts for a trainer run with rollout=server (docs/async.md), which sends it "
        "the policy and pushes its weights. One trainer a server."))
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--backend", default=default_backend, choices=["hf", "vllm"],
                        help=f"rollout backend that samples (default {default_backend})")
    parser.add_argument("--device", default="auto", help="where the policy samples: auto (cuda if present) | cpu | "
                        "cuda[:N]")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a backend argument, as in conf/rollout/<backend>.yaml (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    try:
        state = GenerationServer(args.backend, args.device, **parse_settings(args.set))
    except (TypeError, ValueError, ImportError) as err:  # a --set key the backend lacks, a bad value, no vLLM
        parser.error(f"--backend {args.backend} --set {' '.join(args.set) or '(none)'} --device {args.device}: {err}")
    try:
        server = make_server(args.host, args.port, state)
    except OSError as err:
        parser.error(f"cannot listen on {args.host}:{args.port}: {err.strerror or err} (another server there? pick "
                     "another --port and give it to the trainer as rollout.servers)")
    log.info("polopt-serve: backend %s on %s, listening on http://%s:%d", args.backend, state.device,
             *server.server_address[:2])
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        state.engine.close()


def vllm_main() -> None:
    """``polopt-vllm-serve``: ``polopt-serve --backend vllm``."""
    main(default_backend="vllm")


if __name__ == "__main__":
    main()
