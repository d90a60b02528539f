import json

import pytest
import torch

from polopt_lightning.data import ArithmeticTask, FileTask, PromptDataModule
from polopt_lightning.models import char_tokenizer


def test_arithmetic_is_deterministic_and_disjoint():
    task = ArithmeticTask(digits=2, operations=["+", "*"], train_size=500, val_size=100, seed=3)
    train, val = task.splits()
    assert (train, val) == ArithmeticTask(digits=2, operations=["+", "*"], train_size=500, val_size=100, seed=3).splits()
    assert len(train) == 500 and len(val) == 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    for r in train[:50]:
        a, op, b = r["prompt"][:-1].partition("+") if "+" in r["prompt"] else r["prompt"][:-1].partition("*")
        assert r["answer"] == str(int(a) + int(b) if op == "+" else int(a) * int(b))
    assert ArithmeticTask(seed=4).splits()[1] != val
    with pytest.raises(ValueError, match="task.operations"):
        ArithmeticTask(operations=["/"])


def test_sources_list_jsonl_dataset(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2", "level": 1}, {"prompt": "2+2=", "answer": "4", "level": 2}]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    import datasets

    for source in (rows, str(path), datasets.Dataset.from_list(rows)):
        dm = PromptDataModule(train=source, tokenizer=char_tokenizer(), batch_size=2, shuffle=False)
        batch = next(iter(dm.train_dataloader()))
        assert batch["prompts"] == ["1+1=", "2+2="]
        assert batch["columns"] == {"answer": ["2", "4"], "level": [1, 2]}
        assert batch["prompt_ids"].shape == (2, 4) and batch["prompt_mask"].all()
    assert FileTask(train=str(path)).splits() == (rows, [])


def test_left_padding_and_truncation():
    rows = [{"prompt": "1+1="}, {"prompt": "123456789+1="}]
    tok = char_tokenizer()
    dm = PromptDataModule(train=rows, tokenizer=tok, batch_size=2, shuffle=False, max_prompt_length=6)
    with pytest.warns(UserWarning, match="cut from the left"):
        batch = next(iter(dm.train_dataloader()))
    assert tok.decode(batch["prompt_ids"][1]) == "789+1="
    assert batch["prompt_mask"][0].tolist() == [0, 0, 1, 1, 1, 1]
    dm = PromptDataModule(train=rows, tokenizer=tok, batch_size=2, shuffle=False, max_prompt_length=6,
                          truncation="error")
    with pytest.raises(ValueError, match="max_prompt_length=6"):
        next(iter(dm.train_dataloader()))


def test_chat_template_is_applied_to_messages():
    tok = char_tokenizer(chat_template="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                                       "{% if add_generation_prompt %}<assistant>{% endif %}")
    rows = [{"prompt": [{"role": "user", "content": "3+4="}], "answer": "7"}]
    batch = next(iter(PromptDataModule(train=rows, tokenizer=tok, batch_size=1).train_dataloader()))
    assert batch["prompt_texts"] == ["<user>3+4=<assistant>"] and batch["prompts"] == [rows[0]["prompt"]]


def test_bad_data_is_named(tmp_path):
    with pytest.raises(ValueError, match="data.train is empty"):
        PromptDataModule(train=[])
    with pytest.raises(KeyError, match="row 1 has no prompt column 'prompt'; its columns: \\['question'\\]"):
        PromptDataModule(train=[{"prompt": "a"}, {"question": "b"}])
    with pytest.raises(FileNotFoundError, match="no JSON-lines file"):
        PromptDataModule(train=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2 is not valid JSON") as err:
        PromptDataModule(train=str(bad))
    # the place is the file's line and a character in it; the decoder's own "line 1 column 2" is left out
    assert "at character 2 of that line" in str(err.value) and "column" not in str(err.value)
    with pytest.raises(ValueError, match="data.batch_size"):
        PromptDataModule(train=[{"prompt": "a"}], batch_size=0)


def test_collate_needs_a_tokenizer():
    dm = PromptDataModule(train=[{"prompt": "a"}])
    with pytest.raises(RuntimeError, match="no tokenizer"):
        dm.collate([{"prompt": "a"}])
    dm.set_tokenizer(char_tokenizer())
    assert torch.equal(dm.collate([{"prompt": "a"}])["prompt_mask"], torch.ones(1, 1, dtype=torch.long))
