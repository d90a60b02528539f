"""Datasets by name or path (task=dataset): local parquet and JSON files written here, loaded through the real
``datasets.load_dataset`` call, with column renames, splits, held-out rows, chat prompts and shuffling by seed."""

import json

import pytest

from polopt_lightning.data import DatasetTask, PromptDataModule

from .helpers import FAST, compose_with, run_cli, run_if

pytestmark = run_if("datasets")


def _gsm8k_rows(n, offset=0):
    return [{"question": f"Tom has {i} apples and buys {i + 1} more. How many apples?",
             "answer": f"He has {i} + {i + 1} = {2 * i + 1} apples.\n#### {2 * i + 1}", "id": offset + i}
            for i in range(n)]


@pytest.fixture
def parquet_files(tmp_path):
    import datasets

    datasets.Dataset.from_list(_gsm8k_rows(20)).to_parquet(str(tmp_path / "train.parquet"))
    datasets.Dataset.from_list(_gsm8k_rows(6, offset=100)).to_parquet(str(tmp_path / "test.parquet"))
    return {"train": str(tmp_path / "train.parquet"), "test": str(tmp_path / "test.parquet")}


def test_parquet_splits_with_renames_answers_and_chat_prompts(parquet_files):
    task = DatasetTask(path="parquet", data_files=parquet_files, val_split="test", columns={"question": "prompt"},
                       answer_after="####", system_prompt="Answer with a number.", seed=3)
    train, val = task.splits()
    assert len(train) == 20 and len(val) == 6
    assert {r["id"] for r in val} == set(range(100, 106))
    row = next(r for r in train if r["id"] == 4)
    assert row["answer"] == "9" and "question" not in row
    assert row["prompt"] == [{"role": "system", "content": "Answer with a number."},
                             {"role": "user", "content": "Tom has 4 apples and buys 5 more. How many apples?"}]
    # shuffled by the seed: the same order for the same seed, another for another
    assert [r["id"] for r in train] == [r["id"] for r in DatasetTask(**{**task.__dict__}).splits()[0]]
    assert [r["id"] for r in train] != [r["id"] for r in DatasetTask(**{**task.__dict__, "seed": 4}).splits()[0]]
    assert sorted(r["id"] for r in train) == list(range(20))


def test_json_lines_with_held_out_rows_and_limits(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(30)))
    train, val = DatasetTask(path="json", data_files=str(path), val_size=0.2, train_limit=10).splits()
    assert len(val) == 6 and len(train) == 10
    assert not {r["prompt"] for r in val} & {r["prompt"] for r in train}
    train, val = DatasetTask(path="json", data_files=str(path), shuffle=False, chat=True).splits()
    assert val == [] and train[0]["prompt"] == [{"role": "user", "content": "0+1="}]


def test_a_saved_dataset_folder_loads_by_path(tmp_path):
    import datasets

    folder = tmp_path / "my_dataset"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_gsm8k_rows(5)),
                          "validation": datasets.Dataset.from_list(_gsm8k_rows(2))}).save_to_disk(str(folder))
    # a folder save_to_disk wrote is read with load_from_disk
    train, val = DatasetTask(path=str(folder), val_split="validation", columns={"question": "prompt"}).splits()
    assert len(train) == 5 and len(val) == 2


def test_bad_settings_name_their_key(parquet_files, tmp_path):
    with pytest.raises(KeyError, match=r"task.columns names \['query'\], which the task.split rows lack"):
        DatasetTask(path="parquet", data_files=parquet_files, columns={"query": "prompt"}).splits()
    with pytest.raises(KeyError, match=r"task.split row 0 has no prompt column 'prompt' \(rename one with "
                                       r"task.columns"):
        DatasetTask(path="parquet", data_files=parquet_files).splits()
    with pytest.raises(ValueError, match=r"task.val_split='dev'"):
        DatasetTask(path="parquet", data_files=parquet_files, val_split="dev",
                    columns={"question": "prompt"}).splits()
    with pytest.raises(FileNotFoundError, match=r"task.path='.*nowhere'"):
        DatasetTask(path=str(tmp_path / "nowhere")).splits()
    with pytest.raises(ValueError, match="task.val_split and task.val_size are both set"):
        DatasetTask(path="parquet", val_split="test", val_size=3)
    with pytest.raises(ValueError, match="nothing would be left to train on"):
        DatasetTask(path="parquet", data_files=parquet_files, columns={"question": "prompt"}, val_size=20).splits()


def test_without_datasets_the_task_names_the_extra(monkeypatch, parquet_files):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(ImportError, match=r"task=dataset needs the datasets package: pip install "
                                          r"'polopt-lightning\[datasets\]'"):
        DatasetTask(path="parquet", data_files=parquet_files).splits()


def test_task_dataset_composes_and_feeds_the_data_module(parquet_files, tmp_path):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = compose_with(["task=dataset", "task.path=parquet", f"task.data_files={{train: {parquet_files['train']}}}",
                        "task.columns={question: prompt}", "task.answer_after='####'", "task.val_size=4"], tmp_path)
    task = instantiate(OmegaConf.to_container(cfg.task, resolve=True), _convert_="all")
    from polopt_lightning.models import char_tokenizer

    dm = PromptDataModule(task=task, tokenizer=char_tokenizer(), batch_size=4)
    assert len(dm.train_rows) == 16 and len(dm.val_rows) == 4
    batch = next(iter(dm.train_dataloader()))
    assert batch["prompts"][0].startswith("Tom has") and batch["columns"]["answer"][0].isdigit()


def test_polopt_train_on_a_local_parquet_dataset(parquet_files, tmp_path):
    run = tmp_path / "run"
    args = [a for a in FAST if not a.startswith("task.")] + [
        "task=dataset", "task.path=parquet", f"task.data_files={{train: {parquet_files['train']}, "
        f"test: {parquet_files['test']}}}", "task.val_split=test", "task.columns={question: prompt}",
        "task.answer_after='####'", "reward=numeric_match", "warm_start.enabled=false",
        "generation.max_new_tokens=3", f"hydra.run.dir={run}"]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run / "results.json").read_text())
    assert results["steps"] == 2 and results["val_accuracy_after"] is not None and results["val_reward_after"] is not None
