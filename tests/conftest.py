import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# one thread a worker when pytest-xdist runs the suite on every core (README's test command): the workers fill the cores
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # and one for the processes a test starts (the command line, a notebook's kernel, distributed runs): OpenMP threads
    # of one process on every core beside the other workers' spin against them (the multi-turn notebook beside one busy
    # core: 96 s with the default threads, 25 s with one)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def tiny():
    """A very small Qwen2 model with the character tokenizer (fast enough for many tests)."""
    from polopt_lightning.models import build_tiny_model

    return build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)


@pytest.fixture
def arithmetic_rows():
    from polopt_lightning.data import ArithmeticTask

    return ArithmeticTask(digits=1, train_size=40, val_size=16, seed=0).splits()


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Warm-start cache in a temporary folder: tests never read or write the user's cache."""
    monkeypatch.setenv("POLOPT_CACHE", str(tmp_path / "cache"))


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): a worker a core, at most 4 (each holds ~0.5 GiB and starts CLI and DDP
    processes of ~1.2 GiB), where the run selects no ``slow``, ``vllm`` or ``gpu`` test; otherwise one process, as
    those need: the default job's figures are compared to the digit (with the threads of one process), a vLLM engine
    takes every core, a GPU test the device."""
    from _pytest.mark.expression import Expression

    expr = Expression.compile(config.getoption("markexpr") or "True")
    if any(expr.evaluate(lambda name, marker=marker, **_: name == marker) for marker in ("slow", "vllm", "gpu")):
        return 0
    return max(1, min(4, len(os.sched_getaffinity(0))))


@pytest.hookimpl(tryfirst=True)  # before pytest's skipif (a conftest's tryfirst hook runs before the built-in one)
def pytest_runtest_setup(item):
    """Under ``-m vllm`` (``-m gpu``) a test selected by that marker fails where vLLM (CUDA) is missing instead of
    skipping: the run is in the environment made for it, so a failed install must not pass as all skipped."""
    from .helpers import failing_needs

    reasons = failing_needs(item.config.getoption("markexpr"), item)
    if reasons:
        pytest.fail(f"-m {item.config.getoption('markexpr')!r} selects this test, but {'; '.join(reasons)} "
                    "(this environment is the one made for it: fix its install instead of skipping)", pytrace=False)


_PEAK_RISES: list[tuple[float, float, str]] = []  # (rise, peak after, test) where a test raised pytest's peak


def _peak_gib(who: int) -> float:
    import resource

    return resource.getrusage(who).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    import resource

    before = _peak_gib(resource.RUSAGE_SELF)
    yield
    after = _peak_gib(resource.RUSAGE_SELF)
    if after > before + 0.05:
        _PEAK_RISES.append((after - before, after, item.nodeid))


_WORKERS: list[dict] = []  # under pytest-xdist: each worker's peaks, sent back when it finishes


def _peaks() -> dict:
    import resource

    return {"own": _peak_gib(resource.RUSAGE_SELF), "child": _peak_gib(resource.RUSAGE_CHILDREN),
            "rises": sorted(_PEAK_RISES, reverse=True)[:3]}


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: its peaks go to the controller
        session.config.workeroutput["peaks"] = _peaks()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    peaks = getattr(node, "workeroutput", {}).get("peaks")
    if peaks:
        _WORKERS.append(peaks)


def pytest_terminal_summary(terminalreporter):
    """The suite's memory at its highest, for the 2-core 24 GiB machines it must fit (no test may need most of one):
    pytest's own process (under pytest-xdist, the largest worker's), the largest process a test started (CLI runs, DDP
    workers; a forked child counts its parent's pages until it runs its program, so this is at least the parent's size
    when it started one), and the tests that raised a pytest process's peak the most."""
    everyone = _WORKERS or [_peaks()]
    own, child = max(p["own"] for p in everyone), max(p["child"] for p in everyone)
    what = f"pytest ({len(_WORKERS)} workers, the largest)" if _WORKERS else "pytest"
    terminalreporter.write_line(f"peak resident memory: {what} {own:.2f} GiB, largest process a test started "
                                f"{child:.2f} GiB")
    for rise, after, nodeid in sorted((tuple(r) for p in everyone for r in p["rises"]), reverse=True)[:3]:
        terminalreporter.write_line(f"  +{rise:.2f} GiB (to {after:.2f}): {nodeid}")
