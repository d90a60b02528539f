"""Whether the few-row decoding kernel (polopt_lightning.accel.cpu.rowdot) must run on this machine, found apart from
whether it loaded: ``rowdot.load()`` gives ``None`` both where the machine cannot run it (no AVX-512, no C compiler)
and where it should have and did not (a compile error in rowdot.c, a Step layout that differs from rowdot.py's). Its
tests skip on the first, saying which, and fail on the second, with the compiler's error or the difference."""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from polopt_lightning.accel.cpu import rowdot

# what the kernel needs of the compiler: AVX-512 intrinsics and OpenMP, built as rowdot.c is (rowdot.FLAGS)
PROBE = """#include <immintrin.h>
void probe(float *x, int n) {
    #pragma omp parallel for
    for (int i = 0; i < n; i += 16)
        _mm512_storeu_ps(x + i, _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(x + i), _mm512_loadu_ps(x + i)));
}
"""


@functools.cache
def _compiler_cannot(compiler: str) -> str | None:
    """Why ``compiler`` cannot build the kernel's kind of code (a probe with rowdot's flags), or ``None``."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "probe.c"
        source.write_text(PROBE)
        try:
            done = subprocess.run([compiler, *rowdot.FLAGS, str(source), "-o", str(Path(tmp) / "probe.so")],
                                  capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as err:
            return f"the C compiler {compiler} does not run: {err}"
    if done.returncode:
        return (f"the C compiler {compiler} cannot build AVX-512/OpenMP code ({' '.join(rowdot.FLAGS)}): "
                f"{done.stderr.strip()[-500:]}")
    return None


def cannot_run_here() -> str | None:
    """Why this machine cannot run the kernel (turned off, not x86-64 Linux, the CPU has no AVX-512, no C compiler
    or one that cannot build AVX-512/OpenMP code), found without ``rowdot.load()``; ``None`` where it can."""
    if os.environ.get("POLOPT_ROWDOT", "1") == "0":
        return "turned off (POLOPT_ROWDOT=0)"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the platform: not x86-64 Linux ({platform.system()} {platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if "AVX512" not in capability:
        return f"the CPU: it has no AVX-512 (PyTorch reports {capability})"
    name = os.environ.get("CC", "cc")
    compiler = shutil.which(name)
    if compiler is None:
        return f"the compiler: no C compiler ({name!r} is not on the PATH)"
    cannot = _compiler_cannot(compiler)
    return None if cannot is None else f"the compiler: {cannot}"


def needs_kernel() -> None:
    """Skip where this machine cannot run the kernel (the reason names the platform, the CPU or the compiler); fail
    where it can and ``rowdot.load()`` gave ``None`` (rowdot.c did not compile, its Step layout differs), with
    ``rowdot.why_not()``: the compiler's error or the difference."""
    if rowdot.load() is not None:
        return
    cannot = cannot_run_here()
    if cannot is not None:
        pytest.skip(f"the few-row kernel cannot run here: {cannot}")
    pytest.fail("the few-row kernel should run here (x86-64 Linux, AVX-512, a C compiler that builds AVX-512/OpenMP "
                f"code) and did not load: {rowdot.why_not()}", pytrace=False)


def dispatched_in_lean_step(ran) -> list:
    """The torch functions that oneDNN's mode dispatched inside a lean decoding step, from an
    :func:`polopt_lightning.accel.trace.routes` record (none where the step's products are prepacked)."""
    return [detail for route, detail, within in ran.events if route == "mode_dispatch" and "lean_step" in within]
