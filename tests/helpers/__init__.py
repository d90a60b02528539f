"""Helpers the test modules share: the CLI's tiniest settings and how to run it, a drop-in module and Trainer, the
decoding step's logits, closeness. Test modules import these from here, never from each other."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir

from polopt_lightning import PolicyOptimizationModule, PromptDataModule
from polopt_lightning._hf import cache_argument, preallocated_cache
from polopt_lightning.cli import config_dir
from polopt_lightning.models import build_tiny_model
from polopt_lightning.rewards import DigitMatchReward, ExactMatchReward
from polopt_lightning.rollout import HFRolloutEngine, SamplingConfig
from polopt_lightning.rollout.wire import free_port  # noqa: F401 - the server tests' ports

CONF = Path(config_dir())

# the tiniest settings that still run every stage
FAST = ["model.hidden_size=16", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=32",
        "task.digits=1", "task.train_size=40", "task.val_size=8", "data.batch_size=2", "experience.num_generations=2",
        "generation.max_new_tokens=3", "warm_start.steps=3", "warm_start.batch_size=4", "trainer.max_steps=2",
        "trainer.enable_progress_bar=false"]


def compose_with(overrides, tmp_path):
    """``conf/train.yaml`` composed with ``overrides`` and the Hydra node, its output folder ``tmp_path``."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    cfg.hydra.runtime.output_dir = str(tmp_path)
    return cfg


def set_hydra(cfg):
    """Make ``cfg`` the running Hydra configuration (what ``train`` reads its run folder from)."""
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(cfg)


def run_cli(args, cwd, env_extra=None):
    """``python -m polopt_lightning *args`` in ``cwd``, as a user runs it; its output captured."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "polopt_lightning", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


# what a test may need of the machine: a check, and the reason a skip prints where it is missing
NEEDS = {
    "cuda": (lambda: torch.cuda.is_available(), "needs a CUDA device (run with -m gpu there)"),
    "2 cuda": (lambda: torch.cuda.device_count() >= 2, "needs 2 CUDA devices"),
    "onednn": (lambda: _cpu_linear().available(), "this PyTorch build has no oneDNN"),
    "glibc": (lambda: _host_memory().available(), "needs glibc's allocator (mallopt)"),
    "procfs": (lambda: os.path.exists("/proc/self/smaps"), "reads the process's mappings from /proc (Linux)"),
    "vllm": (lambda: _vllm_available(), "needs vLLM (its own environment: docs/vllm.md)"),
    **{package: ((lambda p=package: importlib.util.find_spec(p) is not None),
                 f"needs the {package} package (pip install 'polopt-lightning[{extra}]')")
       for package, extra in (("math_verify", "math"), ("datasets", "datasets"), ("tensorboard", "tensorboard"),
                              ("wandb", "wandb"), ("mlflow", "mlflow"))},
}


def _cpu_linear():
    from polopt_lightning.accel.cpu import linear

    return linear


def _vllm_available():
    from polopt_lightning.rollout.vllm import vllm_available

    return vllm_available()


def _host_memory():
    from polopt_lightning.accel.cpu import host_memory

    return host_memory


def run_if(*needs):
    """A mark that skips the test where the machine lacks one of ``needs`` (:data:`NEEDS`' names), printing each
    missing one's reason; as Lightning's ``RunIf``. The mark carries the missing ones' names (``missing``): where the
    run's ``-m`` selects the test by a marker whose environment is made for one of them (:data:`MARKER_NEEDS`), the
    test fails instead (tests/conftest.py)."""
    unknown = [n for n in needs if n not in NEEDS]
    if unknown:
        raise KeyError(f"run_if: unknown needs {unknown}; known: {sorted(NEEDS)}")
    missing = tuple(n for n in needs if not NEEDS[n][0]())
    return pytest.mark.skipif(bool(missing), reason="; ".join(NEEDS[n][1] for n in missing) or "all present",
                              missing=missing)


# the need that the environment of a marker's tests is made for: where the run's -m expression selects a test by that
# marker (`-m vllm` in .venv-vllm, `-m gpu` on a GPU machine: benchmarks/gpu_check.sh), its absence is a broken
# environment, so the test fails instead of skipping; elsewhere (the default run deselects both) it skips as before.
# `2 cuda` is not the gpu marker's: one GPU is a GPU machine, and the two-device tests skip there
MARKER_NEEDS = {"vllm": "vllm", "gpu": "cuda"}


def selected_by(markexpr, marks):
    """The markers of :data:`MARKER_NEEDS` by which ``-m markexpr`` selects a test carrying ``marks`` (names): the
    expression holds with the marker and not without it (``-m vllm`` selects a test by ``vllm``; ``-m commands``
    and ``-m 'not slow'`` select test_commands.py's vLLM lines by other marks, so they skip there as before)."""
    if not markexpr:
        return set()
    from _pytest.mark.expression import Expression  # what pytest's -m evaluates

    expr = Expression.compile(markexpr)
    holds = lambda names: expr.evaluate(lambda name, **kwargs: name in names and not kwargs)
    marks = set(marks)
    return {m for m in MARKER_NEEDS if m in marks and holds(marks) and not holds(marks - {m})}


def failing_needs(markexpr, item):
    """The reasons of ``item``'s missing needs (its :func:`run_if` marks) that fail it rather than skip it under
    ``-m markexpr``: those of the markers that selected it."""
    vouched = {MARKER_NEEDS[m] for m in selected_by(markexpr, {mark.name for mark in item.iter_markers()})}
    return [NEEDS[n][1] for mark in item.iter_markers("skipif") for n in mark.kwargs.get("missing", ())
            if n in vouched]


def distinct_chars(prompts, completions, **kw):
    """Varies from sample to sample even for an untrained model, so every step has a learning signal."""
    return [float(len(set(c))) for c in completions]


def make(tiny, rows, objective="grpo", **kwargs):
    """A drop-in module on ``tiny`` with three rewards (one always varies) and its data module on ``rows``."""
    model, tok = tiny
    train, val = rows
    dm = PromptDataModule(train=train, val=val, tokenizer=tok, batch_size=4, val_batch_size=16)
    defaults = dict(reward_fns=[ExactMatchReward(), DigitMatchReward(), distinct_chars],
                    experience={"num_generations": 4}, generation={"max_new_tokens": 3}, optimizer={"lr": 1e-3})
    for concern in ("experience", "optimizer"):  # a dict given for a concern adds to the defaults' settings
        if isinstance(kwargs.get(concern), dict):
            kwargs[concern] = {**defaults[concern], **kwargs[concern]}
    module = PolicyOptimizationModule(model, tok, objective=objective, **{**defaults, **kwargs})
    return module, dm


def trainer(tmp_path, steps, **kwargs):
    """A quiet CPU Trainer of ``steps`` optimizer steps that logs CSV into ``tmp_path``."""
    return L.Trainer(max_steps=steps, accelerator="cpu", logger=L.pytorch.loggers.CSVLogger(tmp_path, name="csv"),
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     log_every_n_steps=1, num_sanity_val_steps=0, **kwargs)


def one_decoding_step(model, ids, packed: bool, kernel: bool | None = None, fused: bool | None = None):
    """Logits of the lean step after a prefill of ``ids`` (its last token fed again), prepacked (``kernel``: see
    ``PackedProjections``) or on the modules."""
    from polopt_lightning import lean_step
    from polopt_lightning.accel.cpu import decode as cpu_decode

    base = lean_step.llama_like(model)
    rows, length = ids.shape
    cache = preallocated_cache(model, length + 1)
    with torch.no_grad():
        model.eval()(input_ids=ids, use_cache=True, **{cache_argument(model): cache})
    proj = cpu_decode.PackedProjections(base, rows, kernel, fused) if packed else None
    key_mask = torch.zeros(rows, 1, 1, length + 1, dtype=next(model.parameters()).dtype)
    return lean_step.decode_step(base, cache, ids[:, -1], torch.full((rows, 1), length), key_mask, proj).float()


def close(a, b, rel=1e-5):
    """``a`` within ``rel`` of ``b``'s largest value, everywhere."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max()) <= rel * float(b.abs().max())


def onednn_model():
    """A model whose attention and MLP weights are above oneDNN's threshold (hidden 512), as models users train."""
    return build_tiny_model(hidden_size=512, num_layers=1, num_heads=4, intermediate_size=640, seed=0)


def greedy_on_the_modules():
    """The model of these tests, two prompts, greedy sampling of 3 tokens and what decoding on its modules gives."""
    model, tok = onednn_model()
    ids = torch.tensor([tok("12+34=")["input_ids"]] * 2)
    mask = torch.ones_like(ids)
    sampling = SamplingConfig(max_new_tokens=3, min_new_tokens=3, temperature=0.0)
    want = HFRolloutEngine(cpu={"packed_weights": False}).generate(model, ids, mask, 2, sampling, tok.eos_token_id,
                                                          tok.pad_token_id)
    return model, tok, ids, mask, sampling, want


def start_server(port: int, *args: str, command: list[str] | None = None, timeout: float = 120.0,
                 env: dict | None = None):
    """``polopt-serve --port PORT *args`` in a process of its own (``command``: another command line for it, ``env``
    its environment), once it answers its health check; the caller kills it."""
    import socket
    import tempfile

    from polopt_lightning.rollout.wire import ServerError, wait_for_health

    with socket.socket() as probe:  # a server already on the port would answer the health check for this one
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no owner
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as err:
            raise RuntimeError(f"port {port} is taken (another test's server?): {err}") from None
    command = command or [sys.executable, "-m", "polopt_lightning.serve", "--port", str(port), *args]
    log = tempfile.TemporaryFile("w+")  # not a pipe: a server that logs much would block on a full one
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    proc.log = log
    try:
        wait_for_health(f"http://127.0.0.1:{port}", timeout, "polopt-serve", process=proc)
    except ServerError as err:
        proc.kill()
        log.seek(0)
        raise RuntimeError(f"{err}: {log.read()[-3000:]}") from None
    return proc


def quick_study(script: str, tmp_path: Path) -> tuple[list[dict], str]:
    """``benchmarks/<script>`` in its quick form (seed 0, two runs at a time) into ``tmp_path``: its results.csv rows
    and its summary.md."""
    import csv

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / script), "--out", str(tmp_path / "out"),
                           "--runs", str(tmp_path / "runs"), "--quick", "--seeds", "0", "--jobs", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return list(csv.DictReader(open(tmp_path / "out" / "results.csv"))), (tmp_path / "out" / "summary.md").read_text()
