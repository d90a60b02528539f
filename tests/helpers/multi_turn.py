"""What the multi-turn tests share (tests/test_multi_turn.py, and the vLLM one in tests/test_vllm.py)."""

import torch

from polopt_lightning.rollout.multi_turn import Environment, EnvStep

# a compact chat template for the character-level tokenizer: the tools' names first, an assistant turn ends with EOS,
# a tool message in brackets
TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{{ '\\n' }}{% endif %}"
            "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
            "{% elif m['role'] == 'tool' %}[{{ m['content'] }}]{% else %}{{ m['content'] }}{% endif %}{% endfor %}")


class AlwaysLower(Environment):
    def step(self, message):
        return EnvStep(observation="lower")


def short_answers(model, tok, steps=100):
    """A few supervised steps on "a+a=c<eos>[lower]a<eos>": the tiny model then ends its turns with EOS (an untrained
    one runs to the token limit, which ends an episode)."""
    texts = [f"{i}+{i}={2 * i % 10}<eos>[lower]{i}<eos>" for i in range(10)]
    ids = torch.tensor([tok(t)["input_ids"] for t in texts])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model
