"""The step's tests' shared start: a tiny policy (seed 1) and one rollout of 3 arithmetic prompts x 4 completions of up
to 6 tokens, scored by a reward that differs between completions."""

from polopt_lightning import PolicyOptimizationModule
from polopt_lightning.models import build_tiny_model

PROMPTS = ["12+34=", "5+6=", "100+200+3="]
ANSWERS = ["46", "11", "303"]


def varied(prompts, completions, **kw):
    """The sum of each completion's character codes mod 5: rewards that differ within a group."""
    return [float(sum(map(ord, c)) % 5) for c in completions]


def tiny_rollout(objective="grpo", transform=None, columns=None, **module_kwargs):
    """``(module, experience, metrics)``: the module (no Trainer; ``module_kwargs`` go to it over the defaults: groups
    of 4, 6 new tokens, seed 3, the ``varied`` reward) on the tiny policy (``transform(model)`` first, e.g. an adapter),
    and its experience of :data:`PROMPTS` (with ``columns``)."""
    model, tok = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=1)
    if transform is not None:
        model = transform(model)
    settings = {"reward_fns": [varied], "experience": {"num_generations": 4}, "generation": {"max_new_tokens": 6},
                "seed": 3, **module_kwargs}
    module = PolicyOptimizationModule(model, tok, objective=objective, **settings)
    enc = tok(PROMPTS, padding=True, return_tensors="pt")
    exp, metrics = module.make_experience({"prompt_ids": enc.input_ids, "prompt_mask": enc.attention_mask,
                                           "prompts": PROMPTS, "columns": columns or {}})
    return module, exp, metrics


def term_advantages(updater, exp, rows, old, mask, keep=None):
    """What the update hands its objective as the advantages of ``rows`` (``old``: their old log-probs, ``mask`` their
    completion tokens; ``keep``: the top-entropy mask's tokens, as the mask term's ``begin`` leaves them): its loss
    terms' ``advantages`` hooks in order (``advantages_for``, as ``Updater.accumulate`` calls it). Returns them and the
    terms' metrics."""
    from polopt_lightning.step.terms import MiniBatch, Piece, advantages_for

    batch = MiniBatch(exp, rows, updater.objective, 1, updater.policy, updater.loop, keep=keep)
    piece = Piece(rows, mask.shape[1], mask, logprobs=None, entropy=None, old=old, ref=None)
    return advantages_for(updater.terms, batch, piece), piece.metrics
