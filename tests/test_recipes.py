"""The GSM8K recipe (experiment=gsm8k) end to end on the CPU: a small chat-templated model saved as a hub model is,
GSM8K-format parquet files written here, the math-verify and format rewards, the completions table."""

import csv
import json

from .helpers import run_cli, run_if


def _gsm8k_rows(n, offset=0):
    return [{"question": f"Tom has {i} apples and buys {i + 1} more. How many apples does he have?",
             "answer": f"Tom has {i} + {i + 1} = {2 * i + 1} apples.\n#### {2 * i + 1}"} for i in range(offset, offset + n)]


@run_if("datasets", "math_verify")
def test_the_gsm8k_recipe_runs_on_a_local_chat_model_and_gsm8k_files(tmp_path):
    import datasets

    from polopt_lightning.data.datamodule import CHAT_TEMPLATES
    from polopt_lightning.models import build_tiny_model, char_tokenizer

    model, tok = build_tiny_model(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                  max_position_embeddings=1024, tokenizer=char_tokenizer(
                                      chat_template=CHAT_TEMPLATES["chatml"]))
    model.save_pretrained(tmp_path / "chat_model")
    tok.save_pretrained(tmp_path / "chat_model")
    datasets.Dataset.from_list(_gsm8k_rows(24)).to_parquet(str(tmp_path / "train.parquet"))
    datasets.Dataset.from_list(_gsm8k_rows(4, offset=50)).to_parquet(str(tmp_path / "test.parquet"))
    run = tmp_path / "run"
    proc = run_cli(["experiment=gsm8k", "trainer=cpu", f"model.name_or_path={tmp_path / 'chat_model'}",
                    "task.path=parquet", f"task.data_files={{train: {tmp_path / 'train.parquet'}, "
                    f"test: {tmp_path / 'test.parquet'}}}", "data.batch_size=2", "experience.num_generations=2",
                    "generation.max_new_tokens=8", "trainer.max_steps=2", "trainer.val_check_interval=2",
                    "callbacks.completions.every_n_steps=1", "trainer.enable_progress_bar=false",
                    f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run / "results.json").read_text())
    assert results["steps"] == 2
    metrics = list(csv.DictReader(open(run / "csv" / "version_0" / "metrics.csv")))
    train = [r for r in metrics if r.get("train/reward")]
    assert train and all(r["train/rewards/math_accuracy/mean"] and r["train/rewards/format/mean"] for r in train)
    assert any(r.get("val/accuracy") for r in metrics)
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    # the prompts as the model read them: the system prompt and the question in the chat template
    assert rows[0]["prompt"].startswith("<|im_start|>system\nThink the problem through step by step")
    assert rows[0]["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert {"rewards/math_accuracy", "rewards/format", "advantage"} <= set(rows[0])
