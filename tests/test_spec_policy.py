"""Speculation sized by measured costs (spec_policy.py, scheduler/trees.py): the choice among tree
shapes from a cost table and the accept lengths seen, and outputs unchanged whichever shape each
call takes."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec import Generator, SamplingParams
from jaxspec.drafters.device import cut_drafts
from jaxspec.drafters.eagle import DraftHead, EagleDrafter, HeadConfig
from jaxspec.drafters.eagle_step import TreeShape, select_tree
from jaxspec.pallas.accept import accept_tree_ref
from jaxspec.scheduler.request import Request
from jaxspec import spec_policy
from jaxspec.spec_policy import StepCosts, SpecPolicy
from jaxspec.verify import cut_counts

from conftest import TINY

SMALL, BIG = TreeShape(1, 1, 2), TreeShape(3, 2, 6)
ROWS = spec_policy.LEVEL_ROW_STEPS  # a call's row-steps where the level's comparisons are tested: it moves half way


def test_each_shape_runs_a_few_calls_before_any_is_preferred():
    policy = SpecPolicy(StepCosts(), {1: [SMALL, BIG]})
    picks = []
    for _ in range(2 * spec_policy.EXPLORE_CALLS):
        picks.append(policy.choose(1))
        policy.verified(picks[-1], [1])
    assert picks == [SMALL] * spec_policy.EXPLORE_CALLS + [BIG] * spec_policy.EXPLORE_CALLS


def test_the_choice_follows_tokens_per_millisecond(monkeypatch):
    monkeypatch.setattr(spec_policy, "EXPLORE_CALLS", 1)
    costs = StepCosts({("decode", 1, None): 1.0, ("verify", 1, "1:1:2"): 1.2, ("verify", 1, "3:2:6"): 1.5,
                       ("decode", 8, None): 1.0, ("verify", 8, "1:1:2"): 1.3, ("verify", 8, "3:2:6"): 3.0})
    # plain averages (level_rate=0): the big tree's drafts stop paying on the same requests
    policy = SpecPolicy(costs, {1: [SMALL, BIG], 8: [SMALL, BIG], 16: []}, probe_every=8, level_rate=0)
    assert policy.choose(1) == SMALL  # nothing seen: each shape once, to learn what it accepts
    policy.verified(SMALL, [2, 1, 2, 2])
    assert policy.choose(8) == BIG  # the estimates are pooled over buckets: SMALL is known
    policy.verified(BIG, [3, 4, 2, 3])
    # batch 1: 3 tokens / 1.5 ms beats 1.75 / 1.2; batch 8: 1.75 / 1.3 beats 3 / 3.0
    assert [policy.choose(1) for _ in range(8)] == [BIG] * 7 + [SMALL]  # the 8th call starts a probe of the other
    assert [policy.choose(8) for _ in range(8)] == [SMALL] * 7 + [BIG]
    assert policy.choose(16) is None  # no program at this bucket
    for _ in range(30):  # the big tree's drafts stop paying: the average forgets
        policy.verified(BIG, [1, 2])
    # the probe's two more calls (of the shape it began), then 1.75 / 1.2 beats 1.75 (its own floor) / 1.5
    assert [policy.choose(1) for _ in range(5)] == [SMALL] * 5
    assert [policy.choose(8) for _ in range(3)] == [BIG, BIG, SMALL]  # the probe's two more calls
    summary = policy.summary()
    assert summary["accept_histogram"]["3:2:6"][3] == 2 and summary["chosen"]["8"] == {"1:1:2": 8, "3:2:6": 4}
    assert "3:2:6" in costs.table() and "1.500" in costs.table()


def test_a_nested_shape_costing_nearly_as_much_replaces_the_smaller_one():
    chain, t16, t24 = TreeShape(3, 1, 4), TreeShape(6, 4, 16), TreeShape(6, 4, 24)
    costs = StepCosts({("verify", 1, "3:1:4"): 1.30, ("verify", 1, "6:4:16"): 1.45, ("verify", 1, "6:4:24"): 1.48,
                       ("verify", 8, "3:1:4"): 1.9, ("verify", 8, "6:4:16"): 2.0, ("verify", 8, "6:4:24"): 2.3})
    policy = SpecPolicy(costs, {1: [chain, t16, t24], 8: [chain, t16, t24]})
    picks = []
    for _ in range(3 * spec_policy.EXPLORE_CALLS):
        picks.append(policy.choose(1))
        policy.verified(picks[-1], [2])
    # 6:4:24 drafts all of 6:4:16's nodes for 2% more a step at batch 1: 6:4:16 is never verified there; the
    # chain is not nested in it (another depth and branching)
    assert t16 not in picks and picks.count(t24) > 0 and picks[:spec_policy.EXPLORE_CALLS] == [chain] * spec_policy.EXPLORE_CALLS
    assert policy.choose(8) == t16  # 15% more at batch 8: both stay, and 6:4:16 was never seen


def test_a_shape_moved_to_is_held_for_some_calls_then_the_fastest_is_taken(monkeypatch):
    monkeypatch.setattr(spec_policy, "EXPLORE_CALLS", 1)
    a, b = TreeShape(2, 2, 4), TreeShape(3, 1, 4)  # neither nested in the other
    costs = StepCosts({("verify", 1, "2:2:4"): 1.0, ("verify", 1, "3:1:4"): 1.0})
    policy = SpecPolicy(costs, {1: [a, b]}, probe_every=1000, level_rate=0)  # plain averages
    policy.verified(a, [3] * 100)
    policy.verified(b, [2] * 100)
    assert policy.choose(1) == a
    policy.verified(b, [4] * 106)  # b now expected to emit 3.03: 1% faster, under the old 5% margin
    assert [policy.choose(1) for _ in range(spec_policy.HOLD_CALLS)] == [a] * (spec_policy.HOLD_CALLS - 1) + [b]
    policy.verified(a, [4] * 100)  # a is ahead again (3.5): b is held as long
    assert [policy.choose(1) for _ in range(spec_policy.HOLD_CALLS)] == [b] * (spec_policy.HOLD_CALLS - 1) + [a]


def test_probes_that_move_nothing_come_less_often(monkeypatch):
    monkeypatch.setattr(spec_policy, "EXPLORE_CALLS", 1)
    a, b = TreeShape(2, 2, 4), TreeShape(3, 1, 4)
    policy = SpecPolicy(StepCosts({("verify", 1, "2:2:4"): 1.0, ("verify", 1, "3:1:4"): 1.0}), {1: [a, b]}, probe_every=4)
    policy.verified(a, [3] * 100)
    policy.verified(b, [2] * 100)
    probed = [n for n in range(1, 41) if policy.choose(1) == b]
    # probes of 3 calls after 4, then 8, then 16 calls: each left the bucket on a
    assert probed == [4, 5, 6, 15, 16, 17, 34, 35, 36]
    policy.verified(b, [5] * 300)  # b pulls ahead: the bucket moves at once, and probes come after 4 calls again
    assert [policy.choose(1) for _ in range(41, 51)] == [b] * 4 + [a] * 3 + [b] * 3


def test_a_shape_not_verified_for_long_is_probed_however_far_behind(monkeypatch):
    """c's first calls looked poor (far outside the 25% that rivals the best): it is still probed
    once the bucket has not verified it for STALE_PROBES probe intervals, so that what it accepts
    and costs follows the requests and the batch."""
    monkeypatch.setattr(spec_policy, "EXPLORE_CALLS", 1)
    a, b, c = TreeShape(2, 2, 4), TreeShape(3, 1, 4), TreeShape(1, 1, 2)
    costs = StepCosts({("verify", 1, t.label): 1.0 for t in (a, b, c)})
    policy = SpecPolicy(costs, {1: [a, b, c]}, probe_every=4, level_rate=0)
    for t, emitted in ((a, 3), (b, 2.8), (c, 1.2)):
        assert policy.choose(1) == t  # explored once each
        policy.verified(t, [emitted] * 100)
    picks = [policy.choose(1) for _ in range(40)]
    c_calls = [n for n, t in enumerate(picks) if t == c]
    assert picks.count(b) >= 3 and len(c_calls) == spec_policy.PROBE_CALLS
    assert c_calls == list(range(c_calls[0], c_calls[0] + spec_policy.PROBE_CALLS))  # one probe, calls in a row
    why = policy.summary()["why"]["1"]  # each call's reason, as /server_info and the benches report it
    assert sum(why.values()) == 43 and why[f"{c.label}: stale probe"] == spec_policy.PROBE_CALLS
    assert why[f"{b.label}: probe"] == picks.count(b) and why[f"{a.label}: explore"] == 1
    assert why[f"{a.label}: fastest"] + why.get(f"{a.label}: held", 0) == picks.count(a)


def test_shapes_whose_expectation_the_held_tree_counts_are_not_probed_when_far_behind(monkeypatch):
    """A cut of the held tree (its link counted on every call of it) goes stale in nothing: it is not
    probed as stale, nor as a far-behind runner-up, while a bigger tree is. Plain decoding (one token
    a step) is never probed, even near the tree. At batch 1 on an H200 such probes took auto to
    0.91x / 0.94x fixed 6:4:24 on MT-bench / HumanEval (spec-policy-drafts-NVIDIA-H200.json): plain
    calls, and the verify call after each, emit a fraction of the tree's tokens."""
    from jaxspec.spec_policy import PLAIN_CHOICE
    monkeypatch.setattr(spec_policy, "EXPLORE_CALLS", 1)
    small, held, big = TreeShape(2, 2, 4), TreeShape(3, 2, 6), TreeShape(3, 4, 12)
    costs = StepCosts({("decode", 1, None): 1.0, ("verify", 1, "2:2:4"): 1.0, ("verify", 1, "3:2:6"): 1.0,
                       ("verify", 1, "3:4:12"): 1.0})

    def run(shapes, held_emits=(5,) * ROWS, calls=200):
        policy = SpecPolicy(costs, {1: shapes}, probe_every=4)
        picks = []
        for _ in range(calls):
            pick = policy.choose(1)
            picks.append(pick)
            if pick is held:  # by default 4 drafts a step, and its cut to small 1: small is far behind
                policy.verified(held, list(held_emits), cut=((small,), np.array([[e, min(e, 2)] for e in held_emits])))
            elif pick is not None:
                policy.verified(pick, [2] * ROWS, cut=((small,), np.array([[2, 2]] * ROWS)) if pick is big else None)
        return picks[10:]

    picks = run([small, held, PLAIN_CHOICE])
    assert picks.count(held) == len(picks)
    picks = run([small, held, big, PLAIN_CHOICE])  # big is neither: its probes go on, far behind as it is
    assert picks.count(big) >= spec_policy.PROBE_CALLS and small not in picks and None not in picks
    picks = run([held, PLAIN_CHOICE], held_emits=(2,) + (1,) * (ROWS - 1))  # 1.125 tokens a ms against plain's 1
    assert picks.count(held) == len(picks)


def test_costs_seen_while_serving_replace_and_scale_the_table(monkeypatch):
    monkeypatch.setattr(spec_policy, "EXPLORE_CALLS", 1)
    costs = StepCosts({("decode", 8, None): 1.0, ("verify", 8, "1:1:2"): 1.3, ("verify", 8, "3:2:6"): 3.0,
                       ("decode", 1, None): 1.0, ("verify", 1, "3:2:6"): 1.5})
    policy = SpecPolicy(costs, {8: [SMALL, BIG]})
    assert policy.cost(8, "1:1:2") == 1.3 and policy.cost(8, "3:2:6") == 3.0
    policy.verified(SMALL, [2])
    policy.verified(BIG, [4])
    assert policy.choose(8) == SMALL  # 2 / 1.3 against 4 / 3.0
    policy.timed(8, "1:1:2", 2.6 * 16, 16)  # verify calls take twice the table's time
    # one call seen against PRIOR_CALLS = 4 of the table's cost scaled by 2: 2.6
    assert policy.cost(8, "1:1:2") == pytest.approx(2.6) and policy.cost(8, "3:2:6") == pytest.approx(6.0)
    assert policy.cost(1, "3:2:6") == pytest.approx(3.0)
    for _ in range(3):
        policy.timed(8, "3:2:6", 1.0 * 4, 4)  # a step takes 1 ms: the scale is the median of 2 and 1/3
    assert policy.cost(8, "3:2:6") == pytest.approx((3 * 1.0 + 4 * 3.0 * (2 + 1 / 3) / 2) / 7)
    assert policy.cost(16, "3:2:6") is None
    # the bucket moved to SMALL one call ago: it holds it HOLD_CALLS calls
    assert [policy.choose(8) for _ in range(spec_policy.HOLD_CALLS)][-2:] == [SMALL, BIG]
    assert policy.summary()["observed_ms"] == {"8": {"1:1:2": 2.6, "3:2:6": 1.0}}
    policy.timed(8, "3:2:6", 40.0, 4)  # a stalled call (10 ms a step) leaves the median where it was
    assert policy.cost(8, "3:2:6") == pytest.approx(1.0 * 4 / 8 + 4 * 3.0 * policy.scale / 8)
    for _ in range(spec_policy.RECENT_CALLS):  # the median is of the last RECENT_CALLS calls: the old fade
        policy.timed(8, "1:1:2", 1.3 * 16, 16)
    assert policy.cost(8, "1:1:2") == pytest.approx(1.3 * (1 - 4 / 68) + 1.3 * policy.scale * 4 / 68)


def test_a_tree_is_expected_to_accept_what_a_shape_it_contains_did():
    policy = SpecPolicy(StepCosts(), {1: [SMALL, BIG]}, level_rate=0)  # plain averages
    policy.verified(SMALL, [3, 3])
    policy.verified(BIG, [1, 2])  # one unlucky call
    assert policy.expected(BIG) == 3.0 and policy.expected(SMALL) == 3.0
    policy.verified(BIG, [6, 6])  # the first calls' plain mean: (1.5 + 6) / 2
    assert policy.expected(BIG) == 3.75 and policy.expected(SMALL) == 3.0
    assert policy.expected(TreeShape(2, 1, 3)) is None  # never seen


def test_a_draft_of_another_shape_is_cut_to_the_programs_depth():
    head = DraftHead(HeadConfig.for_target(TINY, "eagle3"), rngs=nnx.Rngs(0))
    drafter = EagleDrafter(head, BIG)
    req = Request(0, [1], SamplingParams(), 0)
    #           node: 0  1  2  3  4  5  6   (depths 0 1 1 2 3 2 4)
    req.draft = ([9, 10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 3, 2, 4])
    assert drafter.propose(req, 7) == ([10, 11, 12, 13, 14, 15], [0, 0, 1, 3, 2, 4])
    assert drafter.propose(req, 7, max_depth=2) == ([10, 11, 12, 14], [0, 0, 1, 2])  # parents renumbered
    assert drafter.propose(req, 4, max_depth=2) == ([10, 11, 12], [0, 0, 1])
    assert drafter.propose(req, 3, max_depth=1) == ([10, 11], [0, 0])
    assert drafter.with_tree(SMALL).num_nodes == 2 and drafter.num_nodes == 6


def test_a_device_drafters_shapes_are_compared_on_the_same_requests():
    """One shape held over easy and hard requests, the other probed on a hard one, where it accepts
    1.5x the drafts: against the requests' level the probed shape is ahead; plain averages put it
    behind (the held shape's average is mostly of easy requests)."""
    a, b = TreeShape(2, 2, 4), TreeShape(3, 1, 4)  # neither nested in the other
    wide = TreeShape(3, 2, 6)  # contains both
    expect = {}
    for rate in (spec_policy.LEVEL_RATE, 0):
        policy = SpecPolicy(StepCosts(), {1: [a, b, wide]}, level_rate=rate)
        for call in range(20):
            policy.verified(a, [5 if call < 10 else 2] * ROWS)  # ten calls of an easy request, ten of a hard one
        for _ in range(spec_policy.PROBE_CALLS):
            policy.verified(b, [2, 3] * (ROWS // 2))  # on the hard request: 2.5
        for _ in range(10):
            policy.verified(a, [2] * ROWS)
        expect[rate] = policy.expected(a), policy.expected(b)
        assert policy.expected(wide) is None  # never verified
        policy.verified(wide, [1] * ROWS)  # an unlucky first call: still expected to accept what b did
        assert policy.expected(wide) >= policy.expected(b)
    (level_a, level_b), (plain_a, plain_b) = expect[spec_policy.LEVEL_RATE], expect[0]
    assert level_a == pytest.approx(2.0, abs=0.01) and level_b == pytest.approx(2.5, abs=0.01)
    assert plain_a == pytest.approx(3.0) and plain_b == 2.5


def test_a_shape_accepts_a_multiple_of_what_another_does():
    """A gap in drafts accepted seen on easy requests shrinks on hard ones (a difference in tokens
    would carry it whole: b's 2 fewer drafts than a's 4 would leave it none on a's 1), and a tree is
    never expected to accept more drafts than it is deep."""
    a, b = TreeShape(6, 4, 24), TreeShape(3, 1, 4)
    policy = SpecPolicy(StepCosts(), {1: [a, b]})
    for drafts_a, drafts_b in ((4, 2), (2, 1.9)):
        for _ in range(4):
            policy.verified(a, [1 + drafts_a] * ROWS)
        for _ in range(spec_policy.PROBE_CALLS):
            policy.verified(b, [1 + drafts_b] * ROWS)
        for _ in range(4):
            policy.verified(a, [1 + drafts_a] * ROWS)
        if drafts_a == 4:  # then the requests get hard: a accepts 1 draft a step
            for _ in range(20):
                policy.verified(a, [2] * ROWS)
            assert policy.expected(a) == pytest.approx(2.0, abs=0.01)
            assert policy.expected(b) == pytest.approx(1.5, abs=0.01)
    for _ in range(20):
        policy.verified(a, [6] * ROWS)  # easy requests: b's multiple of a's 5 drafts would pass its depth
    assert policy.expected(b) == 4.0
    policy.verified(b, [1] * ROWS)  # a call that accepts nothing: still the token every step emits
    assert policy.expected(b) >= 1.0


def test_a_first_run_is_not_compared_with_itself():
    """DFLASH at batch 1: its block's tree (no cut of its chains) explored first, then the chain of 16,
    whose cuts link it to the chains of 4 and 8 (the level's unit from then on). Compared with its own
    first calls the tree read a zero difference, and against the linked level it was expected to
    accept what a chain of 4 does: the policy held the chain for half of the first MT-bench pass
    (spec-dflash-cuts-NVIDIA-H200.json: 74 chain calls, 56 tree calls; 3 and 114 in the second)."""
    c4, c8, c16, tree = TreeShape(15, 1, 4), TreeShape(15, 1, 8), TreeShape(15, 1, 16), TreeShape(15, 4, 32)
    costs = StepCosts({("verify", 1, "15:1:4"): 1.25, ("verify", 1, "15:1:8"): 1.25, ("verify", 1, "15:1:16"): 1.26,
                       ("verify", 1, "15:4:32"): 1.40})
    policy = SpecPolicy(costs, {1: [tree, c16, c8, c4]})
    for _ in range(spec_policy.EXPLORE_CALLS):
        assert policy.choose(1) is tree
        policy.verified(tree, [3, 4] * (ROWS // 2), cut=((), np.zeros((ROWS, 1))))
    cut = ((c4, c8), np.array([[2, 1, 2], [2, 2, 2]] * (ROWS // 2)))  # the chain's steps: 2, 1.5 and 2 tokens
    for _ in range(spec_policy.EXPLORE_CALLS):
        assert policy.choose(1) is c16
        policy.verified(c16, [2] * ROWS, cut=cut)
    assert policy.expected(c16) == pytest.approx(2.0, abs=0.01)
    assert policy.expected(tree) == pytest.approx(3.5)  # its own calls' average until a run is placed by the level
    assert policy.choose(1) is tree  # 3.5 tokens / 1.40 ms against 2 / 1.26
    for _ in range(spec_policy.PROBE_CALLS):
        policy.verified(tree, [3, 4] * (ROWS // 2))
    assert policy.expected(tree) == pytest.approx(3.5, abs=0.05)  # the level's comparison agrees


def test_a_level_of_a_few_row_steps_places_no_run():
    """DFLASH at batch 64 (spec-dflash-s85-): a call of one row-step that accepted nothing (its other
    rows' first steps verified another shape's drafts) restarted the level at its floor; the tree's
    run after it read 30x the level's drafts, and once chains brought the level back the tree was
    expected the 16 tokens its depth allows where it accepted ~2.4 (7.5-11 in the bench). A level of
    fewer than TRUSTED_LEVEL_ROW_STEPS row-steps places no run, and a run is compared over that many
    row-steps at least, not only its first calls (three tiny ones that accepted nothing made a
    shape's difference the floor's, and its next calls pushed the level up 20x)."""
    c4, c8, c16, tree = TreeShape(15, 1, 4), TreeShape(15, 1, 8), TreeShape(15, 1, 16), TreeShape(15, 4, 32)
    policy = SpecPolicy(StepCosts(), {64: [c4, c8, c16, tree]})
    policy.verified(c8, [1], cut=((c4,), np.array([[1, 1]])))  # links known: the level restarts, here at its floor
    policy.verified(tree, [3, 2] * 32)
    policy.verified(tree, [2, 2, 1, 2, 2])
    policy.verified(c4, [2, 3, 2, 2] * 62)  # 1.25 drafts a step, on 248 row-steps
    assert policy.expected(tree) == pytest.approx(2.42, abs=0.25)  # its own calls averaged 2.42 tokens a step
    policy = SpecPolicy(StepCosts(), {64: [c4, c8, c16, tree]})
    for _ in range(4):
        policy.verified(c4, [2] * 64)
    for emitted in ([1], [1] * 5, [1]):  # a run of the tree opens on three tiny calls that accept nothing
        policy.verified(tree, emitted)
    for _ in range(3):
        policy.verified(tree, [3, 2] * 32)
    assert policy.level < 0.5  # (the tree drafts 1.5 a step where c4 drafts 1: log 1.5 = 0.41)
    assert policy.expected(tree) < 3.0


def test_a_shape_whose_calls_vary_is_compared_by_its_drafts_not_their_logs():
    """A probed shape's calls vary far more at batch 1 (a few steps each) than the level does: an
    average of its calls' logs against the level's fell below what it accepted (DFLASH's tree at
    HumanEval batch 1 expected 1.12x the chain's drafts where it accepted 1.36x: spec-dflash-first-run-).
    Its drafts are summed against the level's at each call."""
    a, b = TreeShape(2, 2, 4), TreeShape(3, 1, 4)  # neither nested in the other
    policy = SpecPolicy(StepCosts(), {1: [a, b]}, level_rate=0.001)  # (a level that b's calls hardly move)
    for _ in range(20):
        policy.verified(a, [2] * 10)  # one draft a step
    for emitted in ([1] * 8 + [2] * 2, [2] * 2 + [3] * 8, [2] * 10):  # 0.2, 1.8 and 1 drafts a step: 1 on average
        policy.verified(b, emitted)
    assert policy.expected(a) == pytest.approx(2.0, abs=0.01)
    assert policy.expected(b) == pytest.approx(2.0, abs=0.01)  # the average of logs said 1.71


def test_cuts_compare_shapes_on_the_very_same_steps():
    """The level's comparison of a probe with the shape held before it takes requests as they come:
    a big tree probed three calls on an easy request, after a small one held on hard ones, looks far
    better than it is. Its cut counts (what the small tree would have emitted on the same steps) say
    the difference itself; the level then carries it to the requests of the moment."""
    small, big = TreeShape(2, 2, 4), TreeShape(3, 2, 6)
    expect = {}
    for with_cuts in (False, True):
        policy = SpecPolicy(StepCosts(), {1: [small, big]})
        for _ in range(10):
            policy.verified(small, [2] * ROWS)  # hard requests: 1 draft a step
        for _ in range(spec_policy.PROBE_CALLS):  # an easy one: 5 drafts a step, where small's cut accepts 4
            counts = np.array([[6, 5]] * ROWS)
            policy.verified(big, [6] * 4, cut=((small,), counts) if with_cuts else None)
        for _ in range(10):
            policy.verified(small, [2] * ROWS)  # hard again
        expect[with_cuts] = policy.expected(small), policy.expected(big)
    assert expect[True][0] == pytest.approx(2.0, abs=0.01)
    assert expect[True][1] == pytest.approx(1 + 5 / 4, abs=0.01)  # 1.25x the drafts on the same steps
    assert expect[False][1] == 4.0  # the level's comparison: 5x the drafts, capped at its depth (3)
    assert policy.summary()["linked_expected"] == {"2:2:4": pytest.approx(2.0, abs=0.01), "3:2:6": pytest.approx(2.25, abs=0.01)}
    policy.verified(big, [2] * 4, cut=((small,), np.zeros((0, 2))))  # no steps to compare: nothing changes
    assert policy.links[(small, big)][1] == ROWS * spec_policy.PROBE_CALLS


def test_the_device_cut_of_drafts_is_the_hosts():
    """cut_drafts (a chained change of shape) gives propose's tree for each row of a batch of random
    parent-first trees, at every node count and depth, padded as the host pads."""
    drafter = EagleDrafter(DraftHead(HeadConfig.for_target(TINY, "eagle3"), rngs=nnx.Rngs(0)), BIG)
    rng = np.random.default_rng(0)
    rows, n = 6, 24
    parents = np.stack([[-1] + [int(rng.integers(0, i)) for i in range(1, n)] for _ in range(rows)]).astype(np.int32)
    parents[0, 1:] = np.arange(n - 1)  # a chain
    parents[1, 1:] = 0  # a star
    tokens = rng.integers(1, 1000, (rows, n)).astype(np.int32)
    for nodes, depth in [(4, 3), (8, 2), (16, 5), (24, 6), (24, 23), (5, 1), (1, 4)]:
        width = max(nodes, 2)
        got = [np.asarray(x) for x in cut_drafts(tokens, parents, max_nodes=nodes, max_depth=depth, width=width)]
        for r in range(rows):
            req = Request(0, [1], SamplingParams(), 0)
            req.draft = (tokens[r].tolist(), parents[r].tolist())
            d_tok, d_par = drafter.propose(req, nodes, max_depth=depth)
            m = 1 + len(d_tok)
            assert got[2][r] == m, (nodes, depth, r)
            assert got[0][r].tolist() == [tokens[r, 0]] + d_tok + [0] * (width - m)
            assert got[1][r].tolist() == [-1] + d_par + [-1] * (width - m)


def test_drafted_nodes_come_best_first_so_a_cut_keeps_the_best():
    """select_tree orders the chosen candidates by score, parents first: cutting the first m nodes
    (a smaller shape's tree, as cut_drafts and cut_counts take it) keeps the m best."""
    f = lambda *x: jnp.array([x])
    cands = ([f(-0.1, -0.5), f(-0.2, -0.9, -0.6, -1.0)], [f(10, 11), f(20, 21, 22, 23)], [f(-1, -1), f(0, 0, 1, 1)])
    tokens, parents = select_tree(cands, 5)
    assert tokens.tolist() == [[10, 20, 11, 22]] and parents.tolist() == [[0, 1, 0, 3]]


def test_a_cuts_count_is_what_verifying_the_cut_alone_emits():
    """cut_counts (the policy's statistics of the shapes within a verified tree) against verifying
    each cut tree itself (cut_drafts, then accept_tree_ref) on the same target tokens: random trees
    whose drafts often match, rows with fewer nodes, and a row that verified nothing."""
    rng = np.random.default_rng(1)
    rows, n = 8, 16
    parents = np.stack([[-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, n)] for _ in range(rows)])
    parents = parents.astype(np.int32)
    target = rng.integers(1, 4, (rows, n)).astype(np.int32)  # few distinct tokens: long accepted paths
    tokens = np.zeros((rows, n), np.int32)
    for r in range(rows):  # siblings distinct, as drafters make them
        for j in range(1, n):
            used = {int(tokens[r, k]) for k in range(1, j) if parents[r, k] == parents[r, j]}
            tokens[r, j] = min(set(range(1, 8)) - used)
    num_nodes = np.array([n, n, 9, n, 12, n, 1, 0], np.int32)
    path, accepted = accept_tree_ref(tokens, parents, target, num_nodes)
    count = np.where(num_nodes > 0, accepted + 1, 0).astype(np.int32)
    cuts = ((1, 3), (2, 4), (3, 8), (6, 6), (9, 16))
    got = np.asarray(cut_counts(parents, num_nodes, path, count, cuts))
    assert got.shape == (rows, len(cuts)) and (got[:, -1] == count).all() and got[-1].tolist() == [0] * len(cuts)
    assert (got[:, 2] > 2).any()  # paths that some cuts keep whole and others cut short
    for j, (depth, nodes) in enumerate(cuts):
        live = np.arange(n)[None] < num_nodes[:, None]
        c_tok, c_par, c_num = cut_drafts(tokens, np.where(live, parents, -1), max_nodes=nodes, max_depth=depth, width=n)
        c_num = np.minimum(np.asarray(c_num), num_nodes)
        c_target = np.zeros_like(target)  # the target's token after each node of the cut: its node's in the tree
        for r in range(rows):
            depth_of = [0] * n
            for i in range(1, n):
                depth_of[i] = depth_of[parents[r, i]] + 1
            kept = [i for i in range(num_nodes[r]) if depth_of[i] <= depth][:nodes]
            c_target[r, :len(kept)] = target[r, kept]
        _, c_acc = accept_tree_ref(np.asarray(c_tok), np.asarray(c_par), c_target, c_num)
        assert got[:, j].tolist() == np.where(num_nodes > 0, c_acc + 1, 0).tolist(), (depth, nodes)


def _plain_and_auto(tiny, seed, n, max_tokens, max_batch, temperatures=(0.0,)):
    """n random prompts, a list of (params, plain outputs) at each temperature, and an EAGLE-3
    engine (random head) choosing among two shapes, warmed up (its step costs timed)."""
    head = DraftHead(HeadConfig.for_target(TINY, "eagle3"), rngs=nnx.Rngs(1))
    rng = np.random.default_rng(seed)
    prompts = [list(map(int, rng.integers(0, 62, int(rng.integers(3, 20))))) for _ in range(n)]
    kw = dict(max_batch=max_batch, max_seq_len=128, num_pages=300)  # the pages of test_eagle.py's KW: shared programs
    plain_gen, runs = Generator(tiny, None, **kw), []
    for temperature in temperatures:
        params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, seed=i)
                  for i in range(n)]
        runs.append((params, [c.token_ids for c in plain_gen.generate(prompts, params)]))
    gen = Generator(tiny, None, drafter=EagleDrafter(head, BIG), spec_policy="auto", spec_trees=(SMALL, BIG),
                    warmup=True, **kw)
    return (prompts, *runs[0], gen) if len(runs) == 1 else (prompts, runs, gen)


def test_outputs_are_plain_decodings_whichever_shape_each_call_takes(tiny):
    """Greedy: token-identical to plain. Sampled: each position draws with the key plain sampling
    uses there, so the same seeds give plain sampling's tokens. Calls alternate between the two
    shapes and plain decoding, one step a call and several (one engine for both passes)."""
    prompts, runs, gen = _plain_and_auto(tiny, 0, 5, 32, 4, temperatures=(0.0, 1.0))
    sched = gen.scheduler
    assert set(sched.spec_costs.ms) == {(kind, rows, tree) for rows in (1, 2, 4) for kind, tree in
                                        (("decode", None), ("verify", "1:1:2"), ("verify", "3:2:6"))}
    assert all(ms > 0 for ms in sched.spec_costs.ms.values())
    turns = iter([SMALL, BIG, BIG, SMALL, SMALL, None] * 200)
    sched.spec_policy.choose = lambda rows, keys=None: next(turns)
    for params, plain in runs:
        out = gen.generate(prompts, params)
        assert [c.token_ids for c in out] == plain, params[0].temperature
    assert sched.stats["verify_steps"] > 0 and sched.stats["decode_time"] > 0
    assert {t.label for t in sched.spec_policy.accepts} == {"1:1:2", "3:2:6"}
    seen = sched.spec_policy.observed  # wall ms a step between consecutive calls of the whole batch
    assert all(ms > 0 and n > 0 for ms, n in seen.values())
    assert {k for _, k in seen} == {"1:1:2", "3:2:6", "plain"}  # (plain calls chain on a tree's, and are timed)
    assert sched.stats["chained_switches"] > 0
    assert sched.spec_policy.launch  # calls not chained (after each prefill) measured the launch cost
    link = sched.spec_policy.links[(SMALL, BIG)]  # the big tree's calls counted what its cut to the small one emits
    assert link[1] > 0 and link[0] <= 0
    assert sched.pool.in_use == 0 and sched.late_compiles == []


def test_the_costs_decide_the_shape(tiny):
    prompts, params, plain, gen = _plain_and_auto(tiny, 1, 4, 24, 4)
    sched = gen.scheduler
    sched.spec_policy.timed = lambda *a: None  # the table alone decides
    ms = sched.spec_costs.ms
    ms.update({k: 1.0 for k in ms})
    ms.update({k: 1e3 for k in ms if k[2] == "3:2:6"})  # the big tree is far too slow: after one try, never
    assert [c.token_ids for c in gen.generate(prompts, params)] == plain
    chosen = sched.spec_policy.chosen
    small, big = (sum(n for (_, t), n in chosen.items() if t == label) for label in ("1:1:2", "3:2:6"))
    assert small > 4 and big <= 2 + small // 32  # tried (again if no row was left to emit), then probes
    assert sched.stats["decode_time"] == 0 and sched.pool.in_use == 0 and sched.late_compiles == []


def test_a_batch_mostly_behind_its_head_decodes_plainly_as_one(tiny, monkeypatch):
    """Requests whose heads fell behind (they decoded plainly, by a drafter whose plain steps
    leave its head behind: EAGLE's made so here) outnumber a fresh one: the whole batch
    decodes plainly, one call a step rather than a verify call beside a decode call, and its
    output is plain decoding's."""
    monkeypatch.setattr(EagleDrafter, "keeps_head_in_decode", property(lambda self: False))
    prompts, params, plain, gen = _plain_and_auto(tiny, 1, 4, 24, 4)
    sched = gen.scheduler
    choose = sched.spec_policy.choose
    sched.spec_policy.choose = lambda rows, keys=None: None  # decode plainly (as a bucket without trees does)
    old = [sched.add(p, pa) for p, pa in zip(prompts[:3], params)]
    for _ in range(20):
        if all(r.head_len is not None for r in old):
            break
        sched.step()
    assert all(r.head_len is not None and not r.finished for r in old)  # decoding plainly, heads behind
    sched.spec_policy.choose = choose
    fresh = sched.add(prompts[3], params[3])
    while any(not r.finished for r in old + [fresh]):
        sched.step()
    assert sched.stats["behind_plain_steps"] > 0 and fresh.head_len is not None
    assert [r.output_ids for r in old + [fresh]] == plain
    assert sched.pool.in_use == 0 and sched.late_compiles == []


def test_step_costs_are_kept_for_the_next_start(tiny, tmp_path, monkeypatch):
    _, _, _, gen = _plain_and_auto(tiny, 2, 1, 4, 2)
    sched = gen.scheduler
    sched.programs.store = str(tmp_path)  # an empty store: this start times its programs
    specs = sched.program_specs()
    first = sched._step_costs(specs)
    [kept] = tmp_path.glob("*.costs.json")
    monkeypatch.setattr(type(sched), "_time_steps", lambda self, specs: pytest.fail("timed again"))
    assert sched._step_costs(specs).ms == first.ms and first.ms  # read back, not timed
    kept.write_text("[[")  # an unreadable table is timed again
    monkeypatch.undo()
    assert set(sched._step_costs(specs).ms) == set(first.ms)


def test_step_costs_time_calls_whose_rows_run_every_step(tiny, monkeypatch):
    """The cost table times decode and verify calls in which every row is live for all the call's
    steps: a call leaves its loop once no row is alive, so idle rows timed a launch (at e4329d1 the
    measured policy then kept a batch-1 EAGLE-3 server decoding plainly)."""
    import jaxspec.scheduler.startup as startup
    from jaxspec.drafters.eagle_step import MAX_VERIFY_STEPS
    from jaxspec.programs import MAX_DECODE_STEPS
    _, _, _, gen = _plain_and_auto(tiny, 3, 1, 4, 2)
    sched, seen, chained = gen.scheduler, [], []
    monkeypatch.setattr(startup, "time_call", lambda call, reps=3, calls=1: (
        chained.append(calls), seen.append(np.asarray(call()[1])))[-1] or 1.0)
    costs = sched._time_steps(sched.program_specs())
    assert set(costs.ms) == {(kind, rows, tree) for rows in (1, 2) for kind, tree in
                             (("decode", None), ("verify", "1:1:2"), ("verify", "3:2:6"))}
    assert set(chained) == {startup.TIMED_CALLS} and startup.TIMED_CALLS > 1  # launched back to back, as calls chain
    decode_counts = [c for c in seen if c.ndim == 1]  # decode: tokens a row emitted in the call
    verify_counts = [c for c in seen if c.ndim == 2]  # verify_steps: tokens a row emitted at each step
    assert len(decode_counts) == 2 and len(verify_counts) == 4
    assert all((c == MAX_DECODE_STEPS).all() for c in decode_counts)
    assert all(c.shape[1] == MAX_VERIFY_STEPS and (c[:, :sched.verify_steps] >= 1).all() for c in verify_counts)


def test_a_host_drafters_costs_are_timed_at_warmup_with_every_row_verifying(tiny, monkeypatch):
    """NGRAM's policy gets a cost table too (plain decode and verify_tree per bucket), timed on
    calls whose rows all verify a full tree: without it the policy priced verify calls from the
    first few it saw, slow ones, and decoded plainly nearly always."""
    import jaxspec.scheduler.startup as startup
    from jaxspec import SpecConfig
    gen = Generator(tiny, None, drafter=SpecConfig("NGRAM", num_draft_tokens=4).build(tiny), max_batch=2,
                    max_seq_len=256)
    sched, seen, chained = gen.scheduler, [], []
    monkeypatch.setattr(startup, "time_call", lambda call, reps=3, calls=1: (
        chained.append(calls), seen.append(np.asarray(call()[1])))[-1] or 1.0)
    costs = sched._time_steps(sched.program_specs())
    assert set(costs.ms) == {(kind, rows, tree) for rows in (1, 2) for kind, tree in
                             (("decode", None), ("verify", "4 nodes"))}
    assert set(chained) == {1}  # its verify calls never chain: each pays its launch
    assert len(seen) == 4 and all((c >= 1).all() for c in seen)  # every row emitted: none idle


def test_a_host_drafters_lone_verify_calls_are_timed_and_old_costs_fade():
    """A host drafter's verify call follows the last outputs' arrival (it never chains), so a lone
    probe between plain calls is timed; a device drafter's call is timed where it was chained on
    the last (a change of shape too), not where it also paid a launch the chained calls hide."""
    from jaxspec.spec_policy import PLAIN, HostTree
    host = SpecPolicy(StepCosts(), {1: [HostTree(8)]}, plain=True)
    device = SpecPolicy(StepCosts(), {1: [SMALL, BIG]})
    for pol, label in ((host, "8 nodes"), (device, SMALL.label)):
        pol.arrived(1, PLAIN, 0.0, 8)
        pol.arrived(1, PLAIN, 0.008, 8)
        pol.arrived(1, label, 0.027, 1, measured=pol is host)  # slow at first (19 ms) ...
    assert host.cost(1, "8 nodes") == pytest.approx(19.0) and device.cost(1, SMALL.label) is None
    device.arrived(1, BIG.label, 0.035, 2)  # chained on SMALL's call: 4 ms a step
    assert device.cost(1, BIG.label) == pytest.approx(4.0) and device.cost(1, SMALL.label) is None
    t = 0.027
    for _ in range(200):  # ... then 4 ms probes among plain calls: the first cost fades
        host.arrived(1, PLAIN, t := t + 0.008, 8)
        host.arrived(1, "8 nodes", t := t + 0.004, 1)
    assert host.cost(1, "8 nodes") == pytest.approx(4.0, rel=0.005)  # 4.07 with the device drafters' memory
    assert host.cost(1, PLAIN) == pytest.approx(1.0)


def test_forgotten_costs_fall_back_to_the_table():
    from jaxspec.spec_policy import PLAIN, HostTree
    pol = SpecPolicy(StepCosts({("decode", 1, None): 1.0, ("verify", 1, "8 nodes"): 3.0}), {1: [HostTree(8)]}, plain=True)
    for t in range(10):  # seen under a load that is gone: 30 ms a verify step
        pol.arrived(1, PLAIN, 0.04 * t, 8)
        pol.arrived(1, "8 nodes", 0.04 * t + 0.03, 1)
    assert pol.cost(1, "8 nodes") > 20
    pol.forget_costs()
    assert pol.cost(1, "8 nodes") == 3.0 and pol.cost(1, PLAIN) == 1.0


def test_a_tree_flag_auto_asks_for_the_auto_policy():
    import argparse

    from jaxspec.speculative import add_flags, config_from_flags
    ap = argparse.ArgumentParser()
    add_flags(ap)
    args = ap.parse_args(["--speculative-algorithm", "EAGLE3", "--speculative-num-draft-tokens", "auto",
                          "--speculative-draft-model-path", "head"])
    cfg = config_from_flags(args)
    assert args.speculative_policy == "auto" and cfg.num_draft_tokens is None and cfg.algorithm == "EAGLE3"
    args = ap.parse_args(["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "5"])
    assert config_from_flags(args).num_steps == 5 and args.speculative_policy == "fixed"
    with pytest.raises(SystemExit):  # argparse names the bad value
        ap.parse_args(["--speculative-eagle-topk", "many"])


def test_plain_decoding_is_a_device_drafters_shape_where_its_heads_are_kept(monkeypatch):
    """PLAIN_CHOICE among a bucket's shapes: one token a step at the decode cost, never explored,
    chosen where no tree emits more tokens a ms, probed while held, and its steps timed."""
    from jaxspec.spec_policy import PLAIN, PLAIN_CHOICE
    monkeypatch.setattr(spec_policy, "EXPLORE_CALLS", 1)
    costs = StepCosts({("decode", 1, None): 1.0, ("verify", 1, "1:1:2"): 1.2,
                       ("decode", 64, None): 1.0, ("verify", 64, "1:1:2"): 2.5})
    policy = SpecPolicy(costs, {1: [SMALL, PLAIN_CHOICE], 64: [SMALL, PLAIN_CHOICE]}, probe_every=8, level_rate=0)
    assert policy.choose(1) == SMALL  # the tree explored; plain decoding's tokens a step are known
    policy.verified(SMALL, [2, 2, 1, 2])
    # batch 1: 1.75 tokens / 1.2 ms beats 1 / 1.0; batch 64: 1 / 1.0 beats 1.75 / 2.5 (None: decode plainly)
    assert [policy.choose(1) for _ in range(7)] == [SMALL] * 7
    assert [policy.choose(64) for _ in range(8)] == [None] * 7 + [SMALL]  # held, then the tree probed
    for t in range(4):  # plain steps arrive chained: timed, as 2 ms a step
        policy.arrived(64, PLAIN, 0.016 * t, 8)
    assert policy.cost(64, PLAIN) > 1.5 and policy.summary()["chosen"]["64"]["plain"] == 7
    host = SpecPolicy(costs, {64: [SMALL]})  # without the plain choice its steps are not timed
    for t in range(4):
        host.arrived(64, PLAIN, 0.016 * t, 8)
    assert host.cost(64, PLAIN) == 1.0


def test_calls_not_chained_add_their_launch_cost_to_every_shapes_steps():
    """A device drafter's call launched after the last outputs were read: what it took past its
    steps' cost is the bucket's launch cost, not its shape's; each shape's step pays the fraction
    of calls not chained x that cost / the steps a call of its kind runs; chained calls price the
    steps; plain steps where plain decoding is no choice are not timed."""
    from jaxspec.spec_policy import PLAIN, PLAIN_CHOICE
    costs = StepCosts({("decode", 8, None): 1.0, ("verify", 8, "1:1:2"): 2.0})
    policy = SpecPolicy(costs, {8: [SMALL, PLAIN_CHOICE]})
    policy.arrived(8, None, 0.0)  # a prefill: nothing to time from
    policy.arrived(8, "1:1:2", 0.018, 1, measured=False, launched=0.0)  # 18 ms: 2 for the step, 16 to launch
    assert list(policy.launch[8]) == [pytest.approx(16.0)] and (8, "1:1:2") not in policy.recent
    assert policy.unchained[8] == pytest.approx(spec_policy.CALL_RATE)
    # every call so far was one step: the verify step pays 0.1 x 16 ms of launch
    assert policy.cost(8, "1:1:2") == pytest.approx(2.0 + 1.6) and policy.cost(8, PLAIN) == pytest.approx(1.0 + 1.6)
    policy.arrived(8, PLAIN, 0.034, 8)  # chained: 16 ms over 8 steps prices plain steps, and calls of 8
    assert list(policy.recent[(8, PLAIN)]) == pytest.approx([2.0])
    u = spec_policy.CALL_RATE * (1 - spec_policy.CALL_RATE)
    assert policy.unchained[8] == pytest.approx(u)
    assert policy.cost(8, PLAIN) == pytest.approx(policy._step_cost(8, PLAIN) + u * 16 / 8)
    policy.arrived(8, "1:1:2", 0.1, 4, measured=False)  # not chained, its launch unknown: counted, not timed
    assert len(policy.launch[8]) == 1
    u += spec_policy.CALL_RATE * (1 - u)
    assert policy.summary()["launch"] == {"8": dict(ms=16.0, unchained=round(u, 3))}
    other = SpecPolicy(costs, {8: [SMALL]})
    other.arrived(8, PLAIN, 0.050, 8, measured=False, launched=0.010)
    assert 8 not in other.launch and other.cost(8, PLAIN) == 1.0
    # the engine's calls run 8 plain / 4 verify steps: plain decoding, never chosen yet at this bucket,
    # pays an eighth of a launch a step, not a whole one (at 57afa8d it lost HumanEval's batch 64 to 4:2:8 so)
    engine = SpecPolicy(costs, {8: [SMALL, PLAIN_CHOICE]}, steps_a_call=(8, 4))
    engine.arrived(8, None, 0.0)
    engine.arrived(8, "1:1:2", 0.024, 4, measured=False, launched=0.0)  # 24 ms: 8 for the steps, 16 to launch
    assert engine.cost(8, PLAIN) == pytest.approx(1.0 + 1.6 / 8)
    assert engine.cost(8, "1:1:2") == pytest.approx(2.0 + 1.6 / 4)


def test_calls_that_accept_nothing_do_not_sink_the_level():
    """A block drafter at batch 1 (DFLASH's chain of 16 accepts 1.9 tokens a step on MT-bench) often
    has calls whose steps accept no draft. Averaged as logs (floored at MIN_DRAFTS) a call at a
    time, a few such calls in a row took the level to where plain decoding looked faster, and the
    policy held plain steps at 0.87-0.93x the fixed chain (spec-dflash-b1-64-NVIDIA-H200.json). The
    level averages drafts over row-steps: the chain stays ahead of plain decoding on noise."""
    from jaxspec.spec_policy import PLAIN_CHOICE
    chain = TreeShape(15, 1, 16)
    costs = StepCosts({("decode", 1, None): 1.2, ("verify", 1, "15:1:16"): 1.5})
    policy = SpecPolicy(costs, {1: [chain, PLAIN_CHOICE]})
    rng = np.random.default_rng(0)
    plain, expected = 0, []
    for _ in range(400):
        pick = policy.choose(1)
        if pick is None:
            plain += 1
        else:  # a call of 4 steps, each 2 tokens on average (1 + a geometric number of drafts)
            policy.verified(pick, list(rng.geometric(0.5, size=4)), cut=((), np.zeros((4, 1))))
            expected.append(policy.expected(chain))
    assert np.mean(expected[50:]) == pytest.approx(2.0, abs=0.15)  # an average of logs said 1.3-1.7
    # 2 tokens in 1.5 ms against 1 in 1.2: plain decoding only as the probes' calls (the old level: 128 of 400)
    assert plain <= 400 * spec_policy.PROBE_CALLS / policy.probe_every, plain


def test_a_plain_spell_ends_as_the_level_returns_toward_its_mean():
    """Nothing is verified over a device drafter's plain steps, so a level that a stretch of calls
    accepting nothing took below plain decoding's break-even stayed there until a probe of the
    tree: DFLASH's chain (1.23 ms a step against plain's 1.20 at HumanEval batch 1) took 8 plain
    calls a round at 0.89x the fixed chain (spec-dflash-noplainprobe-NVIDIA-H200.json). Over plain
    steps the level moves back toward its long-run mean, and plain decoding is not held."""
    from jaxspec.spec_policy import PLAIN, PLAIN_CHOICE
    chain = TreeShape(15, 1, 16)
    # (1.3 ms a step: the engine's chain also pays a larger share of the launches, its calls being shorter)
    policy = SpecPolicy(StepCosts({("decode", 1, None): 1.2, ("verify", 1, "15:1:16"): 1.3}), {1: [chain, PLAIN_CHOICE]})
    no_cut = ((), np.zeros((4, 1)))
    for _ in range(60):  # a call of 4 steps, each one draft accepted
        assert policy.choose(1) is chain
        policy.verified(chain, [2] * 4, cut=no_cut)
    hard = 0
    while policy.choose(1) is chain and hard < 100:  # a stretch that accepts nothing
        policy.verified(chain, [1] * 4, cut=no_cut)
        hard += 1
    assert 4 <= hard <= 20 and policy.expected(chain) < 1.3 / 1.2  # plain decoding looked faster
    spell, now = 1, 0.0
    while spell < 100:
        now += 8 * 1.2e-3
        policy.arrived(1, PLAIN, now, 8)  # a plain call of 8 steps
        if policy.choose(1) is not None:
            break
        spell += 1
    assert spell == 1 and policy.expected(chain) > 1.3  # half way back to the long-run 2 tokens a step


def test_time_call_gives_the_time_of_one_call_among_calls_launched_back_to_back():
    """time_call(calls=n) runs reps batches of n calls without waiting between them and returns one
    call's share: the steady rate of chained calls, not n calls' time."""
    import time
    from jaxspec.step_costs import time_call
    made = []

    def call():
        made.append(1)
        time.sleep(0.004)
        return jnp.zeros(())
    ms = time_call(call, reps=3, calls=4)
    assert len(made) == 1 + 3 * 4  # one untimed call first
    assert 3.5 < ms < 12


def test_an_engine_comparing_by_the_level_alone_counts_no_cuts(tiny, monkeypatch):
    """With the links off (USE_LINKS, bench/spec.py's /auto-level) the verify programs count no
    cut's emitted tokens: nothing would read them (the counts cost every auto verify step kernels)."""
    head = DraftHead(HeadConfig.for_target(TINY, "eagle3"), rngs=nnx.Rngs(1))
    for links, cuts in ((True, {"1:1:2": (), "3:2:6": (SMALL,)}), (False, {"1:1:2": (), "3:2:6": ()})):
        monkeypatch.setattr(spec_policy, "USE_LINKS", links)
        gen = Generator(tiny, None, drafter=EagleDrafter(head, BIG), spec_policy="auto", spec_trees=(SMALL, BIG),
                        warmup=False, max_batch=2, max_seq_len=64, num_pages=20)
        assert {t.label: c for t, c in gen.scheduler.cut_shapes.items()} == cuts
        assert gen.scheduler.spec_policy.use_links is links
