"""The embedded default job learns: held-out greedy accuracy rises by >= 10 points over the warm start.

Slow (about 2-3 minutes per seed on 2 CPU cores): run with `python -m pytest -m slow`.
"""

import pytest

from tests.test_cli import _set_hydra, compose_with


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_default_job_raises_held_out_accuracy(seed, tmp_path):
    from polopt_lightning.cli import train

    cfg = compose_with([f"seed={seed}", "trainer.enable_progress_bar=false"], tmp_path)
    _set_hydra(cfg)
    results = train(cfg)
    gain = results["val_accuracy_after"] - results["val_accuracy_before"]
    assert gain >= 0.10, results
    assert results["wall_s"] < 600, results
