"""The objective interface's own edges (objectives/base.py): its checks and their messages, what it hands the loss
(no reference without a KL term, NaN advantages as 0, the logprobs' dtype), the clip and KL helpers at their bounds,
the registry. The objectives' values are tested in test_objectives.py and test_objectives_edges.py."""

import math
import re

import pytest
import torch

from polopt_lightning.objectives import GRPO, GSPO, base
from polopt_lightning.objectives.base import (
    LOG_RATIO_LIMIT,
    Objective,
    available_objectives,
    build_objective,
    check_clip,
    clipped_surrogate,
    k3_kl,
    kl_estimate,
    register_objective,
)


def inputs(batch=2, width=3):
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(batch, width, generator=g)
    return dict(logprobs=logprobs, old_logprobs=logprobs - 0.1, advantages=torch.tensor([1.0, -0.5]),
                mask=torch.ones(batch, width))


@pytest.mark.parametrize("change, message", [
    (dict(logprobs=torch.zeros(3)), "logprobs must be [B, T], got shape (3,)"),
    (dict(old_logprobs=torch.zeros(2, 2)), "old_logprobs must have the shape of logprobs (2, 3), got (2, 2)"),
    (dict(mask=torch.ones(2, 2)), "mask must have the shape of logprobs (2, 3), got (2, 2)"),
    (dict(advantages=torch.zeros(3)), "advantages must be [B]=2 or [B, T]=(2, 3), got shape (3,)"),
])
def test_each_input_is_checked_with_a_message_that_names_it(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        GRPO()(**{**inputs(), **change})


def test_a_sequence_level_objective_names_only_the_sequence_shape():
    with pytest.raises(ValueError, match=re.escape("advantages must be [B]=2, got shape (2, 3)")):
        GSPO()(**{**inputs(), "advantages": torch.zeros(2, 3)})


def test_a_kl_term_needs_a_reference_of_the_logprobs_shape():
    with pytest.raises(ValueError, match=re.escape("GRPO(beta=0.1) needs ref_logprobs; pass them or set beta=0")):
        GRPO(beta=0.1)(**inputs())
    with pytest.raises(ValueError, match=re.escape("ref_logprobs must have the shape of logprobs (2, 3), got (2, 2)")):
        GRPO(beta=0.1)(**inputs(), ref_logprobs=torch.zeros(2, 2))


def test_a_reference_without_a_kl_term_changes_nothing():
    plain = GRPO()(**inputs())
    given = GRPO()(**inputs(), ref_logprobs=inputs()["logprobs"] - 1.0)
    assert torch.equal(given.loss, plain.loss) and given.metrics.keys() == plain.metrics.keys()
    assert "kl" not in given.metrics


def test_a_nan_advantage_counts_as_zero_and_advantages_take_the_logprobs_dtype():
    nan = GRPO()(**{**inputs(), "advantages": torch.tensor([float("nan"), -0.5])})
    zero = GRPO()(**{**inputs(), "advantages": torch.tensor([0.0, -0.5])})
    assert torch.equal(nan.loss, zero.loss)
    wide = GRPO()(**{**inputs(), "advantages": torch.tensor([1.0, -0.5], dtype=torch.float64)})
    assert wide.loss.dtype == torch.float32


def test_the_clip_range_bounds():
    assert check_clip(0.2, 0.0) == (0.2, 0.0) and check_clip(0.0, None) == (0.0, 0.0)
    with pytest.raises(ValueError, match=re.escape("clip_low must be in [0, 1), got 1")):
        check_clip(1, None)
    with pytest.raises(ValueError, match=re.escape("clip_high must be >= 0, got -0.1")):
        check_clip(0.2, -0.1)


def test_the_clip_flags_are_strict_and_need_a_signed_advantage():
    ratio = torch.tensor([0.75, 0.5, 0.5, 1.5, 2.0, 2.0, 0.5])
    advantages = torch.tensor([-1.0, -1.0, 0.0, 1.0, 1.0, 0.0, 0.5])
    _, low, high = clipped_surrogate(ratio, advantages, 0.25, 0.5)
    assert low.tolist() == [False, True, False, False, False, False, False]
    assert high.tolist() == [False, False, False, False, True, False, False]


def test_k3_clamps_the_log_ratio_both_ways_and_is_the_default_estimator():
    lp, ref = torch.tensor([0.0, 0.0]), torch.tensor([50.0, -50.0])
    limit = LOG_RATIO_LIMIT
    torch.testing.assert_close(k3_kl(lp, ref), torch.tensor([math.exp(limit) - limit - 1, math.exp(-limit) + limit - 1]))
    lp, ref = -torch.rand(2, 3), -torch.rand(2, 3)
    assert torch.equal(kl_estimate(lp, ref), k3_kl(lp, ref))


def test_the_base_aggregate_and_repr():
    class Plain(Objective):
        def compute(self, logprobs, old_logprobs, advantages, mask, ref_logprobs):
            raise AssertionError("not called")

    plain = Plain()
    plain.beta, plain.kl_estimator = 0.5, "k1"
    assert repr(plain) == "Plain(beta=0.5, kl_estimator='k1')"
    values = torch.tensor([[1.0, 3.0, 5.0], [2.0, 0.0, 0.0], [7.0, 7.0, 7.0], [4.0, 4.0, 4.0]])
    mask = torch.tensor([[0, 0, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    assert float(plain.aggregate_tokens(values, mask)) == pytest.approx(13 / 3)  # (2 + 7 + 4) / 3: the empty row counts nowhere
    assert float(plain.normaliser(mask)) == 3.0


def test_an_objective_gets_no_reference_without_a_kl_term():
    """Whatever its own checks, ``compute`` sees the reference only when ``beta > 0``."""

    class Spy(Objective):
        def compute(self, logprobs, old_logprobs, advantages, mask, ref_logprobs):
            self.given = ref_logprobs
            return base.ObjectiveOutput(loss=logprobs.sum())

    spy, ref = Spy(), inputs()["logprobs"] - 1.0
    spy(**inputs(), ref_logprobs=ref)
    assert spy.given is None
    spy.beta = 0.1
    spy(**inputs(), ref_logprobs=ref)
    assert torch.equal(spy.given, ref)


def test_the_registry_takes_a_name_once_and_names_what_it_knows():
    factory = available_objectives()[0]
    registered = base._REGISTRY[factory]
    assert register_objective(factory)(registered) is registered  # the same factory again: accepted
    with pytest.raises(ValueError, match=re.escape(f"objective {factory!r} is already registered to {registered!r}")):
        register_objective(factory)(lambda **kw: None)
    with pytest.raises(KeyError, match=re.escape(f"unknown objective 'nope'; known objectives: "
                                                 f"{', '.join(available_objectives())}")):
        build_objective("nope")


@pytest.mark.parametrize("name, options", [
    ("grpo", {}), ("grpo", {"aggregation": "token-mean", "dual_clip": 3.0}), ("dapo", {}), ("dr_grpo", {}),
    ("gspo", {}), ("gspo", {"variant": "token"}), ("cispo", {}), ("sapo", {"tau_pos": 20.0, "tau_neg": 30.0}),
])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_the_metrics_of_two_pieces_combine_into_the_whole_batchs(name, options, beta):
    """What the micro-batched update relies on: each mean metric names how many tokens or sequences it averages
    (``counts``), the others are aggregated as the loss is (by the piece's share of ``normaliser``), ``*_max`` are
    maxima. Combined so, two pieces of uneven lengths log the whole batch's values."""
    if name == "dr_grpo":
        options = {"max_completion_length": 5}
    clips = {"sapo": {}, "gspo": {"clip_low": 0.003, "clip_high": 0.004}}.get(name, {"clip_low": 0.05, "clip_high": 0.08})
    objective = build_objective(name, beta=beta, **clips, **options)
    g = torch.Generator().manual_seed(1)
    logprobs = -torch.rand(6, 5, generator=g) * 2
    batch = dict(logprobs=logprobs, old_logprobs=logprobs + 0.3 * torch.randn(6, 5, generator=g),
                 advantages=torch.tensor([1.0, -0.5, 2.0, -1.5, 0.7, -0.2]),
                 mask=(torch.arange(5)[None] < torch.tensor([5, 1, 3, 4, 2, 5])[:, None]).float(),
                 ref_logprobs=logprobs + 0.2 * torch.randn(6, 5, generator=g))
    whole = objective(**batch)
    pieces = [objective(**{k: v[rows] for k, v in batch.items()}) for rows in (slice(0, 2), slice(2, 6))]
    shares = [objective.normaliser(batch["mask"][rows]) / objective.normaliser(batch["mask"]) for rows in
              (slice(0, 2), slice(2, 6))]
    assert set(whole.counts) <= set(whole.metrics) and whole.counts
    assert not any(key.endswith("_max") or (key == "kl") for key in whole.counts)
    for key, value in whole.metrics.items():
        if key.endswith("_max"):
            combined = torch.maximum(*(p.metrics[key] for p in pieces))
        elif key in whole.counts:
            combined = sum(p.metrics[key] * p.counts[key] for p in pieces) / sum(p.counts[key] for p in pieces)
        else:
            combined = sum(p.metrics[key] * share for p, share in zip(pieces, shares))
        torch.testing.assert_close(combined, value, msg=f"{name} {options}: {key}")
    assert 0 < float(whole.metrics["clip_frac"]) < 1  # some tokens clipped, not all: the means are not trivial
    torch.testing.assert_close(sum(p.loss.detach() * s for p, s in zip(pieces, shares)), whole.loss.detach())


@pytest.mark.parametrize("name, options", [("grpo", {}), ("grpo", {"aggregation": "token-mean"}),
                                           ("dr_grpo", {"max_completion_length": 7}), ("gspo", {})])
def test_the_normaliser_and_the_token_aggregate_are_the_losss_own(name, options):
    """What the micro-batched update and the entropy bonus take from an objective: ``aggregate_tokens`` reduces
    per-token values as the loss is reduced, which is that sum divided by ``normaliser``."""
    objective = build_objective(name, **options)
    mask = (torch.arange(5)[None] < torch.tensor([5, 2, 0, 3])[:, None]).float()
    values = torch.arange(20.0).view(4, 5) / 7
    tokens, sequences = float(mask.sum()), float(mask.bool().any(-1).sum())
    normaliser = float(objective.normaliser(mask))
    expected = {"grpo": sequences, "gspo": sequences, "dr_grpo": sequences}[name]
    if options.get("aggregation") == "token-mean":
        expected = tokens
    assert normaliser == expected
    if name == "gspo":
        return  # GSPO takes the base's aggregate (tested above)
    per_row = [float((values[i] * mask[i]).sum() / mask[i].sum()) for i in range(4) if mask[i].any()]
    want = {"seq-mean-token-mean": sum(per_row) / sequences, "token-mean": float((values * mask).sum()) / tokens,
            "seq-mean-token-sum-norm": float((values * mask).sum()) / 7 / sequences}[objective.aggregation]
    assert float(objective.aggregate_tokens(values, mask)) == pytest.approx(want, rel=1e-6)
