"""Token balancing between processes (update.balance_tokens, polopt_lightning.step.balance): how groups are dealt.
The exchange itself, under DDP and FSDP2, is in test_distributed (the balanced update equals the unbalanced one and the
single process's)."""

import random

import pytest

from polopt_lightning.step.balance import assign, imbalance


def test_each_step_deals_as_many_groups_to_every_process_the_largest_first():
    costs = [100, 10, 90, 20, 50, 50, 5, 5]
    buckets = [0, 0, 0, 0, 1, 1, 1, 1]
    shares = assign(costs, buckets, 2)
    for share in shares:  # two groups of each step on each process, step by step
        assert [buckets[g] for g in share] == [0, 0, 1, 1]
    loads = [sum(costs[g] for g in share) for share in shares]
    # step 0: 100+10 / 90+20; step 1 goes to the loads so far: 50+5 / 50+5
    assert sorted(loads) == [165, 165] and imbalance(loads) == 1.0
    # unbalanced (the first half on process 0): 100+10+50+50 against 90+20+5+5
    assert imbalance([210, 120]) == pytest.approx(210 / 165)


def test_dealing_is_never_worse_than_the_processes_own_shares():
    rng = random.Random(0)
    for _ in range(200):
        world = rng.choice([2, 3, 4])
        per = rng.choice([1, 2, 4])
        costs = [rng.randint(1, 4000) for _ in range(world * per * 2)]
        buckets = [g // (world * per) for g in range(len(costs))]
        owners = [(g // per) % world for g in range(len(costs))]  # each step's groups, per of them on each process
        shares = assign(costs, buckets, world, owners)
        assert sorted(g for s in shares for g in s) == list(range(len(costs)))
        for share in shares:  # as many of each step's groups on every process, step by step
            assert [buckets[g] for g in share] == sorted(buckets[g] for g in share) == [0] * per + [1] * per
        own = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(world)]
        loads = [sum(costs[g] for g in s) for s in shares]
        dealt = [sum(costs[g] for g in s) for s in assign(costs, buckets, world)]
        assert max(loads) == min(max(own), max(dealt))
        assert max(dealt) - min(dealt) <= max(costs)  # the greedy dealing: within one group of even


def test_a_step_that_cannot_be_split_evenly_is_refused():
    with pytest.raises(ValueError, match="bucket 0 holds 3 groups, not a multiple of the 2 processes"):
        assign([1, 2, 3], [0, 0, 0], 2)
