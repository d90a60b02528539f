import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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


def pytest_terminal_summary(terminalreporter):
    """The suite's memory at its highest, for the 2-core 24 GiB machines it must fit (no test may need most of one):
    pytest's own process, the largest process a test started (CLI runs, DDP workers; a forked child counts pytest's
    pages until it runs its program, so this is at least pytest's size when it started one), and the tests that
    raised pytest's peak the most."""
    import resource

    own, child = _peak_gib(resource.RUSAGE_SELF), _peak_gib(resource.RUSAGE_CHILDREN)
    terminalreporter.write_line(f"peak resident memory: pytest {own:.2f} GiB, largest process a test started "
                                f"{child:.2f} GiB")
    for rise, after, nodeid in sorted(_PEAK_RISES, reverse=True)[:3]:
        terminalreporter.write_line(f"  +{rise:.2f} GiB (to {after:.2f}): {nodeid}")
