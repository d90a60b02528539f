"""`trainer.precision=auto`: bf16 mixed precision where the device multiplies bfloat16 natively, float32 elsewhere."""

import json

import pytest

from polopt_lightning.accel import precision
from polopt_lightning.cli import train

from .helpers import FAST, compose_with, set_hydra

CPUINFO = "processor\t: 0\nvendor_id\t: X\nflags\t\t: fpu sse2 avx2 avx512f {extra}\nbogomips\t: 1\n"


@pytest.mark.parametrize("extra,expected", [
    ("amx_tile amx_bf16 avx512_bf16", "bf16-mixed"),   # Intel Xeon with AMX
    ("avx512_bf16", "bf16-mixed"),                     # AMD EPYC (Zen 4 on), Intel Cooper Lake
    ("avx512vl avx512bw", "32-true"),                  # AVX-512 without BF16: bf16 would be emulated
    ("", "32-true"),                                   # AVX2 only
])
def test_the_rule_reads_the_cpus_bf16_flags(extra, expected):
    chosen, why = precision.auto_precision("cpu", CPUINFO.format(extra=extra))
    assert chosen == expected
    have = [flag for flag in extra.split() if flag in precision.BF16_CPU_FLAGS]
    assert why == (f"the CPU has {' and '.join(have)}" if have else
                   "the CPU has neither amx_bf16 nor avx512_bf16: float32 (bfloat16 products are emulated there, or "
                   "not measured)")


def test_arm_features_are_read_and_have_no_rule_yet():
    """aarch64 Linux names them `Features`; ARM's bf16 is not measured here: float32, saying why."""
    flags = precision.cpu_flags("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert flags == {"fp", "asimd", "bf16", "i8mm"}
    assert precision.auto_precision("cpu", "processor\t: 0\nFeatures\t: fp asimd bf16\n")[0] == "32-true"


@pytest.mark.parametrize("bf16,expected", [(True, "bf16-mixed"), (False, "32-true")])
def test_a_cuda_device_is_asked_whether_it_has_bf16_arithmetic(monkeypatch, bf16, expected):
    """`accelerator=auto` means CUDA where torch sees a device; emulated bf16 does not count."""
    import torch

    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU-X")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: asked.append(
        including_emulation) or bf16)
    for accelerator in ("auto", "gpu", "cuda"):
        chosen, why = precision.auto_precision(accelerator, CPUINFO.format(extra="avx512_bf16"))
        assert chosen == expected and "GPU-X" in why
    assert asked == [False, False, False]
    # trainer.accelerator=cpu on the same machine: the CPU's rule
    assert precision.auto_precision("cpu", CPUINFO.format(extra=""))[0] == "32-true"


def test_a_gpu_asked_for_without_cuda_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert precision.auto_precision("gpu") == ("32-true", "trainer.accelerator=gpu but torch sees no CUDA device")


def test_unreadable_cpu_features_mean_float32():
    chosen, why = precision.auto_precision("cpu", "processor\t: 0\n")
    assert chosen == "32-true" and "cannot be read" in why


@pytest.mark.parametrize("flags,expected", [({"avx2", "avx512_bf16"}, "bf16-mixed"), ({"avx2"}, "32-true")])
def test_auto_from_the_command_line_trains_in_what_it_chose(tmp_path, monkeypatch, caplog, flags, expected):
    """The CLI resolves `auto` before Lightning sees it (Lightning has no such value), says why, and results.json
    records what the steps computed in."""
    import logging

    monkeypatch.setattr(precision, "cpu_flags", lambda cpuinfo=None: flags)
    cfg = compose_with(FAST + ["trainer.precision=auto", "update.mini_batches=2", "trainer.max_steps=2"], tmp_path)
    set_hydra(cfg)
    with caplog.at_level(logging.INFO, logger="polopt_lightning"):
        results = train(cfg)
    assert results["steps"] == 2 and results["precision"] == expected
    assert json.loads((tmp_path / "results.json").read_text())["precision"] == expected
    assert f"trainer.precision=auto: {expected}" in caplog.text
