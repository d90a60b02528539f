"""What a TRL user brings: chat prompts rendered with the tokenizer's template, reward functions written as in TRL's
documentation (both forms, ``trainer_state``, extra columns), and learned reward models scoring completions."""

import re

import pytest
import torch

from polopt_lightning import PolicyOptimizationModule, PromptDataModule
from polopt_lightning.data.datamodule import CHAT_TEMPLATES
from polopt_lightning.models import build_tiny_model, char_tokenizer
from polopt_lightning.rewards import RewardComposer, RewardModel, TrainerState

from .helpers import trainer

CHATML = CHAT_TEMPLATES["chatml"]


# --- reward functions exactly as TRL's documentation writes them (GRPOTrainer, "Using a custom reward function") ---
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


class Recorder:
    """A TRL-style reward function that keeps what it was called with."""

    __name__ = "recorder"

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, completion_ids, trainer_state, **kwargs):
        self.calls.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                           "trainer_state": trainer_state, **kwargs})
        return [float(trainer_state.global_step) for _ in completions]


def _chat_rows(n):
    return [{"prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{i}+{i}="}],
             "answer": str(2 * i), "ground_truth": str(2 * i), "level": i % 3} for i in range(n)]


def _chat_model():
    return build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0,
                            tokenizer=char_tokenizer(chat_template=CHATML))


def test_chat_prompts_are_rendered_with_the_template_and_a_generation_prompt():
    _, tok = _chat_model()
    dm = PromptDataModule(train=_chat_rows(2), tokenizer=tok, batch_size=2, shuffle=False)
    batch = dm.collate(dm.train_rows)
    assert batch["prompts"] == [r["prompt"] for r in dm.train_rows]  # as the dataset holds them
    assert batch["prompt_texts"][1] == "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n1+1=<|im_end|>\n" \
                                       "<|im_start|>assistant\n"
    ids = batch["prompt_ids"][1][batch["prompt_mask"][1].bool()].tolist()
    assert tok.decode(ids) == batch["prompt_texts"][1]
    # a prompt that ends with the assistant's begun message is continued, not answered in a new turn
    begun = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "The sum is"}]
    assert dm.prompt_text(begun).endswith("<|im_start|>assistant\nThe sum is")


def test_chat_prompts_without_a_template_fail_naming_the_fix(tiny):
    _, tok = tiny  # the character tokenizer has no chat template
    dm = PromptDataModule(train=_chat_rows(2), tokenizer=tok, batch_size=2)
    with pytest.raises(ValueError, match=r"data.prompt_column='prompt' holds chat messages but the tokenizer has no "
                                         r"chat template.*data.chat_template \(PromptDataModule\(chat_template=...\) in "
                                         r"Python\): a name \(chatml\)"):
        dm.collate(dm.train_rows)
    with_template = PromptDataModule(train=_chat_rows(2), tokenizer=char_tokenizer(), batch_size=2,
                                     chat_template="chatml")
    assert with_template.collate(with_template.train_rows)["prompt_texts"][0].startswith("<|im_start|>system")
    with pytest.raises(FileNotFoundError, match="data.chat_template='no_such_template'"):
        PromptDataModule(train=_chat_rows(2), tokenizer=char_tokenizer(), chat_template="no_such_template")


def test_trl_reward_functions_receive_conversations_columns_and_trainer_state(tmp_path):
    model, tok = _chat_model()
    recorder = Recorder()
    module = PolicyOptimizationModule(model, tok, reward_fns=[recorder, format_reward_func],
                                      experience={"num_generations": 2}, generation={"max_new_tokens": 4},
                                      optimizer={"lr": 1e-3}, update={"mini_batches": 1})
    dm = PromptDataModule(train=_chat_rows(8), val=_chat_rows(2), tokenizer=tok, batch_size=2, val_batch_size=2)
    t = trainer(tmp_path, steps=2, limit_val_batches=1, val_check_interval=2)
    t.fit(module, datamodule=dm)
    train_calls = [c for c in recorder.calls if c["trainer_state"].stage == "train"]
    assert [c["trainer_state"].global_step for c in train_calls] == [0, 1]
    assert all(c["trainer_state"].max_steps == 2 and c["trainer_state"].is_world_process_zero for c in train_calls)
    call = train_calls[0]
    assert len(call["prompts"]) == len(call["completions"]) == 4  # 2 prompts x 2 completions
    assert call["prompts"][0] == call["prompts"][1] and call["prompts"][0][1]["role"] == "user"  # messages
    for completion, ids in zip(call["completions"], call["completion_ids"]):
        assert completion == [{"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)}]
    # every extra column, repeated for each completion of its prompt
    assert call["answer"][0] == call["answer"][1] and call["level"][0] in (0, 1, 2)
    assert set(call) >= {"answer", "ground_truth", "level"}
    assert [c["trainer_state"].stage for c in recorder.calls][-1] == "validate"
    # the logged rewards are those functions' (the step reward is global_step, 0 and 1)
    assert float(t.logged_metrics["train/rewards/recorder/mean"]) == 1.0


def test_string_prompts_give_string_completions():
    _, tok = _chat_model()
    seen = {}

    def check(prompts, completions, trainer_state, **kwargs):
        seen.update(prompts=prompts, completions=completions, state=trainer_state)
        return reward_len(completions)

    module = PolicyOptimizationModule(build_tiny_model(hidden_size=32, num_layers=1, num_heads=2,
                                                       intermediate_size=64)[0], tok, reward_fns=[check, reward_func],
                                      experience={"num_generations": 2}, generation={"max_new_tokens": 3})
    dm = PromptDataModule(train=[{"prompt": "1+1=", "ground_truth": "2"}], tokenizer=tok, batch_size=1)
    batch = dm.collate(dm.train_rows)
    rollout = module.rollout(batch, module.sampling, 2)
    out = module.score(batch, rollout)
    assert seen["prompts"] == ["1+1=", "1+1="] and all(isinstance(c, str) for c in seen["completions"])
    assert seen["state"] == TrainerState(stage="none")  # outside a Trainer
    assert out.per_function.shape == (2, 2)


# --- reward models -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A small sequence classifier (Qwen2 shape, one output) with a chat-templated tokenizer, saved as a user's
    reward model folder is."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    tok = char_tokenizer(chat_template=CHATML)
    tok.padding_side = "right"
    config = AutoConfig.for_model("qwen2", vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2, intermediate_size=64, num_labels=1,
                                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    folder = tmp_path_factory.mktemp("rm") / "reward_model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _one_score(folder, text):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        return float(model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0])


def test_a_reward_model_scores_each_conversation_with_its_own_template_in_batches(reward_model_dir):
    rm = RewardModel(str(reward_model_dir), batch_size=2)
    prompts = [[{"role": "user", "content": "1+1="}]] * 3
    completions = [[{"role": "assistant", "content": c}] for c in ("2", "11", "two, I think")]
    scores = rm(prompts, completions)
    for prompt, completion, score in zip(prompts, completions, scores):
        text = rm.tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        assert abs(score - _one_score(reward_model_dir, text)) < 1e-4  # batched and padded: the same score
    assert len(set(scores)) == 3
    # string data: prompt and completion joined
    assert abs(rm(["1+1="], ["2"])[0] - _one_score(reward_model_dir, "1+1=2")) < 1e-4
    assert not any(p.requires_grad for p in rm.model.parameters()) and not rm.model.training


def test_a_reward_model_is_weighted_with_other_rewards_and_never_trained(reward_model_dir, tmp_path):
    model, tok = _chat_model()
    rm = RewardModel(str(reward_model_dir), batch_size=4)
    before = {k: v.clone() for k, v in rm.model.state_dict().items()}
    composer = RewardComposer([rm, format_reward_func], weights={"reward_model": 0.5, "format_reward_func": 1.0})
    module = PolicyOptimizationModule(model, tok, reward_fns=composer, experience={"num_generations": 2},
                                      generation={"max_new_tokens": 3}, optimizer={"lr": 1e-2},
                                      update={"mini_batches": 1})
    dm = PromptDataModule(train=_chat_rows(8), tokenizer=tok, batch_size=2)
    t = trainer(tmp_path, steps=2, limit_val_batches=0)
    t.fit(module, datamodule=dm)
    assert all(torch.equal(before[k], v) for k, v in rm.model.state_dict().items())
    assert not any(k.startswith("reward") for k in module.state_dict())  # not part of the policy's checkpoint
    logged = t.logged_metrics
    assert torch.isfinite(logged["train/rewards/reward_model/mean"]) and float(logged["train/rewards/reward_model/std"]) > 0
    # the total is the weighted sum
    out = module.experience.last_scored
    per = out["rewards"]
    torch.testing.assert_close(composer.combine(per), 0.5 * per[:, 0] + per[:, 1])


def test_reward_model_errors_name_the_culprit(reward_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"reward_model.model='.*nowhere'"):
        RewardModel(str(tmp_path / "nowhere"))
    causal = tmp_path / "causal"
    model, tok = build_tiny_model(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    model.save_pretrained(causal)
    tok.save_pretrained(causal)
    rm = RewardModel(str(causal))  # transformers adds a fresh classification head to a causal LM: it loads...
    assert rm(["a"], ["b"])[0] == rm(["a"], ["b"])[0]  # ...and scores deterministically
    plain = RewardModel(str(reward_model_dir), tokenizer=str(causal))  # a tokenizer without a chat template
    with pytest.raises(ValueError, match="reward_model: the prompts are chat messages but the reward model's "
                                         "tokenizer has no chat template"):
        plain([[{"role": "user", "content": "a"}]], [[{"role": "assistant", "content": "b"}]])
    with pytest.raises(ValueError, match="reward_model: batch_size must be >= 1"):
        RewardModel(str(reward_model_dir), batch_size=0)


def test_reward_model_from_the_command_line(reward_model_dir, tmp_path):
    import json

    from .helpers import FAST, run_cli

    run = tmp_path / "run"
    proc = run_cli(FAST + ["reward=model", f"reward.functions.reward_model.model={reward_model_dir}",
                           "+reward.functions.exact._target_=polopt_lightning.rewards.ExactMatchReward",
                           "reward.weights={exact_match: 1.0, reward_model: 0.1}",
                           f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run / "results.json").read_text())
    assert results["steps"] == 2
    import csv

    rows = [r for r in csv.DictReader(open(run / "csv" / "version_0" / "metrics.csv"))
            if r.get("train/rewards/reward_model/mean")]
    assert rows and all(r.get("train/rewards/exact_match/mean") for r in rows)


def test_a_reward_model_follows_the_policy_device_unless_fixed_and_keeps_its_dtype(reward_model_dir):
    follows = RewardModel(str(reward_model_dir), dtype="bfloat16")
    assert next(follows.model.parameters()).dtype == torch.bfloat16
    score = follows(["1+1="], ["2"])[0]
    assert isinstance(score, float)  # scored in bfloat16, returned as a float
    follows.place("meta")  # what the module does at fit and validation start with the policy's device
    assert next(follows.model.parameters()).device.type == "meta"
    fixed = RewardModel(str(reward_model_dir), device="cpu")
    fixed.place("meta")
    assert next(fixed.model.parameters()).device.type == "cpu"
    other = RewardModel(str(reward_model_dir))
    RewardComposer([fixed, other, reward_len]).place("meta")  # told to every function that has `place`
    assert next(other.model.parameters()).device.type == "meta"
    assert next(fixed.model.parameters()).device.type == "cpu"
