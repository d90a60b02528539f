"""Host memory kept for reuse while training on the CPU (glibc's mallopt): freed blocks come back without page faults,
the defaults return afterwards, and the module turns it on and off around training (also when training fails)."""

import json
import subprocess
import sys

import pytest

from polopt_lightning.accel.cpu import host_memory
from polopt_lightning.accel.cpu.host_memory import KeepHostMemory, KeptHostMemory

from .helpers import make, run_if, trainer

pytestmark = run_if("glibc")

BLOCK = 64 * 2**20  # above glibc's largest mmap threshold (32 MiB): by default always a fresh mapping

# Measured in a fresh process: in this one, earlier tests' runs leave large free spaces in the heap (and a
# malloc_trim that returned their pages), which glibc may serve a block from by default too.
MEASURE = """
import json, resource, sys
import torch
from polopt_lightning.accel.cpu.host_memory import KeptHostMemory

def second_block_faults():
    first = torch.empty({n})
    first.fill_(1.0)
    del first
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    second = torch.empty({n})
    second.fill_(2.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del second
    return faults

out = {{"default": [second_block_faults() for _ in range(3)]}}
with KeptHostMemory():
    second_block_faults()  # the heap grows to hold the block once
    out["kept"] = [second_block_faults() for _ in range(3)]
out["after"] = [second_block_faults() for _ in range(3)]
print(json.dumps(out))
""".format(n=BLOCK // 4)


def test_a_freed_block_is_reused_without_faulting_its_pages_in_again():
    proc = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    faults = json.loads(proc.stdout.strip().splitlines()[-1])
    pages = BLOCK // 4096
    assert min(faults["default"]) > pages // 2, faults  # glibc's default: munmap on free, every page faulted anew
    assert max(faults["kept"]) < pages // 20, faults
    # leaving returned the kept memory to the system (malloc_trim): the next block faults its pages in again (where
    # glibc then serves it from, the old heap space or a fresh mapping, is its own choice)
    assert faults["after"][0] > pages // 2, faults


def test_nested_entries_restore_the_defaults_once():
    with KeptHostMemory():
        with KeptHostMemory():
            pass
        assert host_memory.active()  # the outer one still holds
    assert not host_memory.active()


def watching(seen):
    """A reward function that notes, at each rollout's scoring, whether freed host memory is being kept."""
    def reward(prompts, completions, **kw):
        seen.append(host_memory.active())
        return [float(len(set(c))) for c in completions]
    return reward


def test_the_module_keeps_host_memory_while_training_only(tmp_path, tiny, arithmetic_rows):
    seen = []
    module, dm = make(tiny, arithmetic_rows, reward_fns=[watching(seen)])
    trainer(tmp_path, steps=2).fit(module, datamodule=dm)
    assert seen == [True, True] and not host_memory.active()
    assert module.accel.keeps_host_memory(module.device)


def test_a_failed_run_gives_the_defaults_back(tmp_path, tiny, arithmetic_rows):
    def broken(prompts, completions, **kw):
        raise RuntimeError("reward server down")

    module, dm = make(tiny, arithmetic_rows, reward_fns=[broken])
    with pytest.raises(Exception, match="reward server down"):
        trainer(tmp_path, steps=1).fit(module, datamodule=dm)
    assert not host_memory.active()


def test_off_and_impossible_settings(tmp_path, tiny, arithmetic_rows, monkeypatch):
    seen = []
    module, dm = make(tiny, arithmetic_rows, reward_fns=[watching(seen)], accel={"keep_host_memory": False})
    t = trainer(tmp_path, steps=1)
    t.fit(module, datamodule=dm)
    assert seen == [False] and not any(isinstance(c, KeepHostMemory) for c in t.callbacks)
    monkeypatch.setattr(host_memory, "available", lambda: False)
    with pytest.raises(ValueError, match="accel.keep_host_memory=True: .* not glibc"):
        make(tiny, arithmetic_rows, accel={"keep_host_memory": True})
    module = make(tiny, arithmetic_rows)[0]
    assert not module.accel.keeps_host_memory(module.device)  # None: off where there is no glibc
