"""Mutation testing as a (slow) test: the sampler correction (``terms.sampler_weights``, the ``SamplerCorrection``
term: its check, ``wanted`` and ``advantages``) and the learning-rate schedule (``lr_factor``) mutated one operator at
a time by tests/mutation.sh; every mutant is killed by the fast tests or is an equivalent survivor listed, with the
reason no input tells it apart, in tests/mutation_equivalent.txt (docs/testing.md). A change to these functions
renumbers their mutants: re-run, and list only what is truly equivalent."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("polopt_lightning.step.terms.x_sampler_weights__* polopt_lightning.step.terms.xǁSamplerCorrectionǁ* "
           "polopt_lightning.step.update.x_lr_factor__*")


def equivalents() -> dict[str, str]:
    """The listed survivors: ``name  # reason`` a line."""
    listed = {}
    for line in (ROOT / "tests" / "mutation_equivalent.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, reason = line.partition("#")
            assert reason.strip(), f"{name.strip()} is listed without the reason it is equivalent"
            listed[name.strip()] = reason.strip()
    return listed


def test_the_equivalent_survivors_are_named_with_their_reasons():
    listed = equivalents()
    assert listed and all(re.fullmatch(r"polopt_lightning\.[\w.ǁ]+__mutmut_\d+", name) for name in listed)


@pytest.mark.slow
@pytest.mark.timeout(2700)  # about 15-20 minutes on 2 cores: past pytest's default limit (600 s)
def test_every_mutant_of_the_sampler_correction_is_killed_or_listed_as_equivalent(tmp_path):
    if importlib.util.find_spec("mutmut") is None:
        pytest.skip("mutmut is not installed (the dev extra: pip install -e '.[dev]')")
    env = {**os.environ, "MUTANTS": CHECKED, "MUTATION_DIR": str(tmp_path), "PYTHON": sys.executable,
           "MUTMUT_JOBS": str(min(2, os.cpu_count() or 1))}
    proc = subprocess.run(["bash", str(ROOT / "tests" / "mutation.sh"), "update"], env=env, capture_output=True,
                          text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for module in ("update", "terms"):
        assert re.search(rf"polopt_lightning\.step\.{module}: \d+ mutants", proc.stdout), proc.stdout[-3000:]
    survivors = set(re.findall(r"^\s*(\S+__mutmut_\d+): (?:survived|no tests|suspicious)", proc.stdout, re.M))
    listed = {name for name in equivalents() if name.startswith(("polopt_lightning.step.update.",
                                                                  "polopt_lightning.step.terms."))}
    assert not survivors - listed, f"mutants no test kills (add a test that does): {sorted(survivors - listed)}"
    print(proc.stdout)
