"""A rollout backend is one file and one config option: the module and the CLI take it without a change."""

import json
import textwrap

from polopt_lightning import rollout

from .helpers import FAST, make, run_cli, trainer

BACKEND = '''
import json, os
from polopt_lightning.rollout import HFRolloutEngine


class Counting(HFRolloutEngine):
    """The transformers backend, counting its rollouts and the optimizer steps it hears of into a file."""

    def __init__(self, record, **kwargs):
        super().__init__(**kwargs)
        self.record, self.counts = record, {"generate": 0, "policy_updated": 0}

    def generate(self, model, *args, **kwargs):
        self.counts["generate"] += 1
        self._save()
        return super().generate(model, *args, **kwargs)

    def policy_updated(self, model):
        self.counts["policy_updated"] += 1
        self._save()

    def _save(self):
        with open(self.record, "w") as fh:
            json.dump(self.counts, fh)
'''


def test_a_backend_in_a_file_of_its_own_runs_from_the_command_line(tmp_path):
    """`rollout=counting` from a folder on Hydra's search path (`rollout/counting.yaml`, a `_target_` at a class in
    a file of the user's): 2 optimizer steps of 1 mini-batch, 2 training rollouts, validations before and after."""
    (tmp_path / "my_backend.py").write_text(BACKEND)
    (tmp_path / "conf" / "rollout").mkdir(parents=True)
    (tmp_path / "conf" / "rollout" / "counting.yaml").write_text(textwrap.dedent(f"""\
        _target_: my_backend.Counting
        record: {tmp_path / "counts.json"}
        """))
    proc = run_cli(FAST + ["rollout=counting", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "update.mini_batches=1",
                           f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, env_extra={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads((tmp_path / "counts.json").read_text())
    # training rollouts: 2; validation batches (8 prompts, one batch) before and after: 2
    assert counts == {"generate": 4, "policy_updated": 2}


def test_a_backend_registered_by_name_reaches_the_drop_in_module(tmp_path, tiny, arithmetic_rows, monkeypatch):
    """`rollout.ENGINES` maps a name to `module:Class`, imported when chosen: the module takes it by name."""
    (tmp_path / "my_backend.py").write_text(BACKEND)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(rollout.ENGINES, "counting", "my_backend:Counting")
    module, dm = make(tiny, arithmetic_rows, rollout_engine={"name": "counting", "record": str(tmp_path / "c.json")},
                      update={"mini_batches": 2})
    assert type(module.engine).__name__ == "Counting"
    trainer(tmp_path, steps=2, limit_val_batches=0).fit(module, datamodule=dm)
    assert json.loads((tmp_path / "c.json").read_text()) == {"generate": 1, "policy_updated": 2}
