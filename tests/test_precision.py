"""`trainer.precision=auto`: bf16 mixed precision where the device multiplies bfloat16 natively, float32 elsewhere."""

import json

import pytest
import torch

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
    assert why == (f"the CPU has {' and '.join(have)} (no model given: its size not checked; pass model= for the "
                   "size rule)" if have else
                   "the CPU has neither amx_bf16 nor avx512_bf16: float32; bfloat16 products are emulated there, or "
                   "not measured")


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


def test_on_a_cpu_bf16_is_chosen_only_for_models_large_enough_for_it_to_pay():
    """On a CPU with bf16 arithmetic a model whose largest linear layer (the head aside) has fewer than 2^19 weights
    trains in float32 (the casts cost more than the products save), saying so; a quantized or adapted layer counts
    by its shape; a GPU has no such rule."""
    from polopt_lightning.models import Adapter, apply_adapter, build_tiny_model

    cpu = CPUINFO.format(extra="amx_bf16 avx512_bf16")
    tiny, _ = build_tiny_model(hidden_size=256, num_layers=1, intermediate_size=512, seed=0)  # the default job's
    assert precision.largest_linear(tiny) == 256 * 512
    chosen, why = precision.auto_precision("cpu", cpu, model=tiny)
    assert chosen == "32-true" and why == ("the CPU has amx_bf16 and avx512_bf16, but the model's largest linear layer "
                                           "has 131,072 weights (fewer than 524,288): bfloat16's casts would cost "
                                           "more than its products save")
    wide, _ = build_tiny_model(hidden_size=512, num_layers=1, intermediate_size=1376, seed=0)
    assert precision.auto_precision("cpu", cpu, model=wide) == (
        "bf16-mixed", "the CPU has amx_bf16 and avx512_bf16 and the model's largest linear layer has 704,512 weights "
                      "(at least 524,288)")
    assert precision.auto_precision("cpu", cpu)[1].endswith("(no model given: its size not checked; pass model= for "
                                                            "the size rule)")
    assert precision.largest_linear(apply_adapter(wide, Adapter(kind="lora", r=4))) == 512 * 1376
    assert precision.auto_precision("cpu", CPUINFO.format(extra=""), model=wide)[0] == "32-true"  # no bf16: float32


def test_on_this_machine_bf16_is_taken_only_where_its_products_measure_faster(monkeypatch):
    """Where the flags say bf16 is native but the products measure slower than float32's (an Intel core whose AMX a VM
    or kernel hides runs them through AVX512-BF16 at 0.58-0.83x; emulated in docs/performance.md), ``auto`` takes
    float32, saying so; where they measure faster it takes bf16 and says by how much. Another CPU's cpuinfo is judged
    by its flags alone (nothing measured)."""
    from polopt_lightning.models import build_tiny_model

    wide, _ = build_tiny_model(hidden_size=512, num_layers=1, intermediate_size=1376, seed=0)
    monkeypatch.setattr(precision, "cpu_flags", lambda cpuinfo=None: {"avx512_bf16", "avx512f"} if cpuinfo is None
                        else {"amx_bf16"})
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 0.75)
    assert precision.auto_precision("cpu", model=wide) == (
        "32-true", "the CPU has avx512_bf16, but its bfloat16 products measured 0.75x float32's here (fewer than 1.3x: "
                   "AMX unavailable to this process?): float32")
    assert precision.auto_precision("cpu", "flags : amx_bf16", model=wide)[0] == "bf16-mixed"  # not measured
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 2.0)
    chosen, why = precision.auto_precision("cpu", model=wide)
    assert chosen == "bf16-mixed" and why.endswith("; its bfloat16 products measured 2.00x float32's here")


def test_the_bf16_product_probe_measures_a_rate_ratio_once():
    precision.cpu_bf16_speedup.cache_clear()
    first = precision.cpu_bf16_speedup()
    assert first > 0 and precision.cpu_bf16_speedup() == first  # measured once a process

def test_the_size_rule_counts_gpt2s_conv1d_layers_and_says_where_it_found_no_linear_layer():
    """GPT-2's layers are transformers' ``Conv1D`` (a transposed linear): counted, so a small GPT-2 trains in float32
    as a small Llama does (a newcomer's find: it got bf16, its size never checked); a model with no layer the rule
    knows says its size was not checked."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cpu = CPUINFO.format(extra="amx_bf16")
    config = AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=2, vocab_size=100, n_positions=64)
    gpt2 = AutoModelForCausalLM.from_config(config)
    assert precision.largest_linear(gpt2) == 64 * 256  # the MLP's c_fc: [64, 256]
    assert precision.auto_precision("cpu", cpu, model=gpt2)[0] == "32-true"
    chosen, why = precision.auto_precision("cpu", cpu, model=torch.nn.Sequential(torch.nn.Embedding(10, 4)))
    assert chosen == "bf16-mixed" and why.endswith("(the model has no linear layer this rule knows: its size not "
                                                   "checked)")


def test_the_default_precision_is_auto_and_the_default_jobs_model_trains_in_float32_everywhere(tmp_path, monkeypatch,
                                                                                               caplog):
    """The shipped default (`trainer.precision=auto`) on a CPU with bf16 arithmetic: the default job's model shape
    in float32 (its results the same on every CPU kind's rule), a wider model in bf16-mixed."""
    import logging

    monkeypatch.setattr(precision, "cpu_flags", lambda cpuinfo=None: {"avx2", "avx512_bf16"})
    shape = ["model.hidden_size=256", "model.intermediate_size=512", "model.num_heads=4"]
    for widths, expected in ((shape, "32-true"), (["model.hidden_size=512", "model.intermediate_size=1376",
                                                    "model.num_heads=8"], "bf16-mixed")):
        cfg = compose_with(FAST + widths, tmp_path / expected)
        assert cfg.trainer.precision == "auto"
        set_hydra(cfg)
        with caplog.at_level(logging.INFO, logger="polopt_lightning"):
            results = train(cfg)
        assert results["steps"] == 2 and results["precision"] == expected, results
        assert f"trainer.precision=auto: {expected}" in caplog.text


@pytest.mark.parametrize("flags,expected", [({"avx2", "avx512_bf16"}, "bf16-mixed"), ({"avx2"}, "32-true")])
def test_auto_from_the_command_line_trains_in_what_it_chose(tmp_path, monkeypatch, caplog, flags, expected):
    """The CLI resolves `auto` before Lightning sees it (Lightning has no such value), says why, and results.json
    records what the steps computed in."""
    import logging

    monkeypatch.setattr(precision, "cpu_flags", lambda cpuinfo=None: flags)
    monkeypatch.setattr(precision, "BF16_CPU_MIN_WEIGHTS", 0)  # the tiny model too
    cfg = compose_with(FAST + ["trainer.precision=auto", "update.mini_batches=2", "trainer.max_steps=2"], tmp_path)
    set_hydra(cfg)
    with caplog.at_level(logging.INFO, logger="polopt_lightning"):
        results = train(cfg)
    assert results["steps"] == 2 and results["precision"] == expected
    assert json.loads((tmp_path / "results.json").read_text())["precision"] == expected
    assert f"trainer.precision=auto: {expected}" in caplog.text


@pytest.mark.parametrize("value,hint", [("Auto", "auto"), ("fp32", "32-true"), ("float16", "16-mixed"),
                                        (True, None), ("bf16-mix", None)])
def test_a_precision_neither_auto_nor_lightnings_is_refused_before_anything_loads(tmp_path, value, hint):
    from polopt_lightning.cli import check_config

    cfg = compose_with(FAST, tmp_path)
    set_hydra(cfg)  # the run folder's interpolation resolves while the groups are checked
    cfg.trainer.precision = value
    with pytest.raises(ValueError, match=r"trainer\.precision=.*: not one of auto, .*32-true") as err:
        check_config(cfg)
    assert (f"did you mean trainer.precision={hint}?" in str(err.value)) if hint else "did you mean" not in str(err.value)
    for fine in ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16", 32):
        cfg.trainer.precision = fine
        check_config(cfg)


def test_a_resumed_auto_run_keeps_the_precision_it_was_trained_in(tmp_path, monkeypatch, caplog):
    """The checkpoint records what the steps computed in; resumed with `auto` on a machine where the rule would
    choose otherwise, the run goes on as it was trained, and says so."""
    monkeypatch.setattr(precision, "cpu_flags", lambda cpuinfo=None: {"avx512_bf16"})
    monkeypatch.setattr(precision, "BF16_CPU_MIN_WEIGHTS", 0)  # the tiny model too
    cfg = compose_with(FAST + ["trainer.precision=auto", "trainer.max_steps=2"], tmp_path / "a")
    set_hydra(cfg)
    assert train(cfg)["precision"] == "bf16-mixed"
    ckpt = tmp_path / "a" / "checkpoints" / "last.ckpt"
    from polopt_lightning.cli import checkpoint_precision

    assert checkpoint_precision(ckpt) == "bf16-mixed"
    monkeypatch.setattr(precision, "cpu_flags", lambda cpuinfo=None: {"avx2"})  # another machine
    cfg = compose_with(FAST + ["trainer.precision=auto", "trainer.max_steps=4", f"ckpt_path={ckpt}"], tmp_path / "b")
    set_hydra(cfg)
    results = train(cfg)
    assert results["steps"] == 4 and results["precision"] == "bf16-mixed"
    assert results["precision_auto"].startswith("the checkpoint resumed was trained in bf16-mixed, kept; here auto "
                                                "would take 32-true")
    # asked for another precision outright: done as asked, and said
    import logging

    cfg = compose_with(FAST + ["trainer.precision=32-true", "trainer.max_steps=4", f"ckpt_path={ckpt}"], tmp_path / "c")
    set_hydra(cfg)
    with caplog.at_level(logging.WARNING, logger="polopt_lightning"):
        assert train(cfg)["precision"] == "32-true"
    assert ("trainer.precision=32-true: the checkpoint resumed was trained in bf16-mixed; the run goes on in 32-true "
            "as asked") in caplog.text


def test_a_gpu_trainer_without_cuda_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """`trainer=gpu` where torch sees no CUDA device: an error naming the key before the warm start, not Lightning's
    after it."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    from polopt_lightning import warmstart

    monkeypatch.setattr(warmstart, "supervised_warm_start", lambda *a, **k: pytest.fail("the warm start ran"))
    cfg = compose_with(FAST + ["trainer=gpu", "trainer.precision=auto"], tmp_path)
    set_hydra(cfg)
    with pytest.raises(ValueError, match=r"trainer\.accelerator=gpu: torch .* sees no CUDA device .*leave trainer=gpu out"):
        train(cfg)
