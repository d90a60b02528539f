"""Host memory kept for reuse while training on the CPU (glibc's mallopt): freed blocks come back without page faults,
the defaults return afterwards, and the module turns it on and off around training (also when training fails)."""

import resource

import pytest
import torch

from polopt_lightning import host_memory
from polopt_lightning.host_memory import KeepHostMemory, KeptHostMemory

from .test_module import make, trainer

pytestmark = pytest.mark.skipif(not host_memory.available(), reason="needs glibc's allocator (mallopt)")

BLOCK = 64 * 2**20  # above glibc's largest mmap threshold (32 MiB): outside the context, always a fresh mapping


def _faults_of_a_second_block() -> int:
    """Minor page faults while a block of BLOCK bytes is written, after one of the same size was written and freed."""
    first = torch.empty(BLOCK // 4)
    first.fill_(1.0)
    del first
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    second = torch.empty(BLOCK // 4)
    second.fill_(2.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del second
    return faults


def test_a_freed_block_is_reused_without_faulting_its_pages_in_again():
    pages = BLOCK // 4096
    assert _faults_of_a_second_block() > pages // 2  # glibc's default: munmap on free, every page faulted anew
    with KeptHostMemory():
        assert host_memory.active()
        _faults_of_a_second_block()  # the heap grows to hold the block once
        assert _faults_of_a_second_block() < pages // 20
    assert not host_memory.active()
    assert _faults_of_a_second_block() > pages // 2  # the defaults are back


def test_nested_entries_restore_the_defaults_once():
    with KeptHostMemory():
        with KeptHostMemory():
            pass
        assert host_memory.active()  # the outer one still holds
    assert not host_memory.active()


def test_the_module_keeps_host_memory_while_training_only(tmp_path, tiny, arithmetic_rows):
    seen = []
    module, dm = make(tiny, arithmetic_rows)
    step = module._training_step

    def spying(batch):
        seen.append(host_memory.active())
        return step(batch)

    module._training_step = spying
    trainer(tmp_path, steps=2).fit(module, datamodule=dm)
    assert seen == [True, True] and not host_memory.active()
    assert module.keeps_host_memory()


def test_a_failed_run_gives_the_defaults_back(tmp_path, tiny, arithmetic_rows):
    def broken(prompts, completions, **kw):
        raise RuntimeError("reward server down")

    module, dm = make(tiny, arithmetic_rows, reward_fns=[broken])
    with pytest.raises(Exception, match="reward server down"):
        trainer(tmp_path, steps=1).fit(module, datamodule=dm)
    assert not host_memory.active()


def test_off_and_impossible_settings(tmp_path, tiny, arithmetic_rows, monkeypatch):
    seen = []
    module, dm = make(tiny, arithmetic_rows, keep_host_memory=False)
    step = module._training_step
    module._training_step = lambda batch: (seen.append(host_memory.active()), step(batch))[1]
    t = trainer(tmp_path, steps=1)
    t.fit(module, datamodule=dm)
    assert seen == [False] and not any(isinstance(c, KeepHostMemory) for c in t.callbacks)
    monkeypatch.setattr(host_memory, "available", lambda: False)
    with pytest.raises(ValueError, match="keep_host_memory=True: .* not glibc"):
        make(tiny, arithmetic_rows, keep_host_memory=True)
    assert not make(tiny, arithmetic_rows)[0].keeps_host_memory()  # None: off where there is no glibc
