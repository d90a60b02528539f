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


@pytest.fixture
def no_network(monkeypatch):
    """Every connection attempt is recorded and refused, with the hub out of offline mode (as where HF_HUB_OFFLINE
    is unset, and datasets counting downloads): only the code's own choice keeps a run off the network."""
    import socket

    import datasets
    import huggingface_hub

    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("the test refuses network connections")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)
    return attempts


def _arithmetic_rows(n):
    return [{"prompt": f"{i % 10}+{i // 10}=", "answer": str(i % 10 + i // 10)} for i in range(n)]


def _write_local(form, folder):
    """Rows in one of the local forms task.path takes; the path and the overrides that read it."""
    import datasets

    rows, data = _arithmetic_rows(30), datasets.Dataset.from_list(_arithmetic_rows(30))
    if form in ("jsonl", "json"):
        path = folder / f"train.{form}"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif form == "parquet":
        data.to_parquet(str(path := folder / "train.parquet"))
    elif form == "csv":
        data.to_csv(str(path := folder / "train.csv"), index=False)
    elif form == "saved":
        datasets.DatasetDict({"train": data, "test": data.select(range(5))}).save_to_disk(str(path := folder / "saved"))
        return path, ["task.val_split=test"]
    else:  # a folder of data files, its splits by file name
        (path := folder / "files").mkdir()
        (path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:5]))
        return path, ["task.val_split=test"]
    return path, ["task.val_size=5"]


@pytest.mark.parametrize("form", ["jsonl", "json", "parquet", "csv", "saved", "folder"])
def test_task_path_takes_a_local_file_or_folder_without_the_network(form, tmp_path, no_network):
    """task=dataset task.path=<a file or folder>, composed and built as polopt-train builds it: no hub call."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from polopt_lightning.models import char_tokenizer

    path, overrides = _write_local(form, tmp_path)
    cfg = compose_with(["task=dataset", f"task.path={path}", f"task.cache_dir={tmp_path / 'cache'}", *overrides],
                       tmp_path)
    task = instantiate(OmegaConf.to_container(cfg.task, resolve=True), _convert_="all")
    dm = PromptDataModule(task=task, tokenizer=char_tokenizer(), batch_size=4)
    assert len(dm.train_rows) == 25 if form not in ("saved", "folder") else len(dm.train_rows) == 30
    assert len(dm.val_rows) == 5 and {"prompt", "answer"} <= set(dm.train_rows[0])
    assert no_network == [], f"network attempts: {no_network}"


def test_polopt_train_on_a_local_json_lines_file_asks_no_network(tmp_path, no_network):
    from polopt_lightning.cli import train

    from .helpers import set_hydra

    path = tmp_path / "add.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in _arithmetic_rows(40)))
    args = [a for a in FAST if not a.startswith("task.")] + [
        "task=dataset", f"task.path={path}", "task.val_size=8", f"task.cache_dir={tmp_path / 'cache'}",
        "reward=exact_match", "warm_start.enabled=false"]
    cfg = compose_with(args, tmp_path)
    set_hydra(cfg)
    results = train(cfg)
    assert results["steps"] == 2 and results["val_accuracy_after"] is not None
    assert no_network == [], f"network attempts: {no_network}"


def test_local_data_errors_name_the_key_as_typed(tmp_path, no_network):
    from polopt_lightning.cli import train

    from .helpers import set_hydra

    def fails(overrides, error, message):
        cfg = compose_with([a for a in FAST if not a.startswith("task.")] + ["task=dataset", *overrides], tmp_path)
        set_hydra(cfg)
        with pytest.raises(error, match=message):
            train(cfg)

    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    missing = tmp_path / "test.jsonl"
    # the builder form: a data file that is not there is named under task.data_files, with its path
    fails(["task.path=json", f"task.data_files={{train: {tmp_path / 'train.jsonl'}, test: {missing}}}",
           "task.val_split=test"], FileNotFoundError, rf"task.data_files: no such file '{missing}' \(split test\)")
    fails([f"task.path={missing}"], FileNotFoundError, rf"task.path='{missing}': no such file or folder")
    fails(["task.path=parquet"], ValueError, "task.path='parquet' names a file format: give the files with "
                                             "task.data_files")
    fails([f"task.path={tmp_path / 'train.jsonl'}", "task.val_split=test"], ValueError,
          r"task.val_split='test': .* has the splits \['train'\]; hold rows out with task.val_size instead")
    fails([], ValueError, r"task.path: no value given, and it has no default: give it on the command line "
                          r"\(task.path=...\)")
    assert no_network == []


def test_a_hub_id_the_hub_cannot_be_asked_about_fails_at_once(tmp_path, monkeypatch, no_network):
    """Not a local path, the hub unreachable: one request, then an error naming task.path (no minute of retries);
    with HF_HUB_OFFLINE set, the datasets cache only, and the same key named."""
    import datasets

    def no_retries(*args, **kwargs):
        raise AssertionError("load_dataset was called after the hub could not be reached")

    monkeypatch.setattr(datasets, "load_dataset", no_retries)
    with pytest.raises(ConnectionError, match=r"task.path='someone/data': neither a local file or folder nor "
                                              r"reachable on the Hugging Face Hub \(.*\); a dataset already in the "
                                              r"datasets cache loads with HF_HUB_OFFLINE=1"):
        DatasetTask(path="someone/data").splits()
    assert 0 < len(no_network) <= 2  # one request (its address looked up), not retried five times with waits
    monkeypatch.undo()  # back to the suite's offline mode (conftest: HF_HUB_OFFLINE=1)
    with pytest.raises(FileNotFoundError, match=r"task.path='someone/data': neither a local file or folder nor in "
                                                r"the datasets cache \(HF_HUB_OFFLINE is set"):
        DatasetTask(path="someone/data", cache_dir=str(tmp_path / "cache")).splits()


@run_if("tensorboard")
def test_a_quiet_run_on_a_local_file_prints_no_progress_bars_and_writes_one_event_file(tmp_path, monkeypatch):
    """polopt-train task=dataset task.path=<file> logger=tensorboard, as documented: no third-party progress bar on
    the console, and one TensorBoard event file for the run (validation before, RL, validation after) holding the
    training and validation scalars. verbose=true brings datasets' bars back: the check can see them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("HF_DATASETS_DISABLE_PROGRESS_BARS", raising=False)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _arithmetic_rows(40)))
    args = [a for a in FAST if not a.startswith("task.")] + [
        "task=dataset", "task.path=train.jsonl", "task.val_size=8", "reward=exact_match", "warm_start.enabled=false",
        "logger=tensorboard"]
    proc = run_cli([*args, "task.cache_dir=cache_quiet", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    bars = [line for line in console.splitlines()
            if any(s in line for s in ("Generating", "Map", "%|", "Writing model shards", "examples/s"))]
    assert not bars, "\n".join(bars)
    files = list((tmp_path / "run").rglob("events.out.tfevents.*"))
    assert len(files) == 1, files
    events = EventAccumulator(str(files[0]))
    events.Reload()
    assert len(events.Scalars("train/reward")) == 1  # one rollout (2 optimizer steps)
    assert [e.step for e in events.Scalars("val/accuracy")] == [0, 1]  # before and after RL
    proc = run_cli([*args, "task.cache_dir=cache_verbose", "verbose=true", f"hydra.run.dir={tmp_path}/verbose"],
                   tmp_path)
    assert proc.returncode == 0 and "Generating train split" in proc.stdout + proc.stderr, proc.stderr[-3000:]
