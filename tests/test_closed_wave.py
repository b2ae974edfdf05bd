"""A closed batch (one generate call's, nobody waiting) ends when its slowest rows do: the auto
policy's tree is run only where the rows, each at its own rate, finish sooner under it than
decoding plainly (closed_wave.py)."""
import numpy as np

from jaxspec import SamplingParams, closed_wave
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.scheduler.request import Request
from jaxspec.scheduler.trees import PLAIN
from jaxspec.spec_policy import PLAIN_CHOICE, SpecPolicy, StepCosts

from test_spec_policy import SMALL, _plain_and_auto


def test_a_wave_runs_each_step_at_the_bucket_of_the_rows_left():
    cost = {4: 3.0, 2: 2.0, 1: 1.0}.get
    assert closed_wave.wave_ms([4, 2, 2], cost) == 2 * 3.0 + 2 * 1.0  # three rows (bucket 4), then one
    assert closed_wave.wave_ms([3, 3], cost) == 3 * 2.0
    assert closed_wave.wave_ms([2.5, 1.0], cost) == 1.0 * 2.0 + 1.5 * 1.0


def _requests(accepted, expected, max_tokens=100):
    reqs = []
    for i, (a, e) in enumerate(zip(accepted, expected)):
        r = Request(i, [1, 2, 3], SamplingParams(max_tokens=max_tokens), seed=i)
        r.drafts = [a, e]
        reqs.append(r)
    return reqs


def test_a_row_that_accepts_far_less_than_the_rest_makes_the_batch_decode_plainly():
    """Per step the tree emits 1.8 tokens for 1.5 ms against plain's 1 for 1 ms (the policy's
    choice); a row accepting a tenth of the drafts the others do would need 93 of the tree's
    steps, 139 ms, against 100 plain steps, 100 ms: plain decoding ends the batch first (unless
    the batch verifies now and moving costs a launch of 50 ms)."""
    costs = StepCosts({(k, b, t): c for b in (1, 2, 4) for k, t, c in (("decode", None, 1.0), ("verify", SMALL.label, 1.5))})
    policy = SpecPolicy(costs, {b: [SMALL, PLAIN_CHOICE] for b in (1, 2, 4)}, level_rate=0)
    policy.verified(SMALL, [2, 2, 2, 2, 1])
    assert policy.expected(SMALL) == 1.8 and policy.choose(4) == SMALL
    even = _requests([80, 80, 80, 80], [80, 80, 80, 80])
    assert not closed_wave.plain_finishes_first(policy, 4, SMALL, even)  # 56 tree steps, 83 ms
    slow = _requests([80, 80, 80, 8], [80, 80, 80, 80])
    assert closed_wave.plain_finishes_first(policy, 4, SMALL, slow)
    assert closed_wave.row_factors(slow)[3] < 0.3
    # a change of mode pays a launch (the bucket's, as seen): near-tied estimates keep the batch where it is
    policy.launch_ms[4], policy.unchained[4], policy.run = 50.0, 0.0, (SMALL.label, 3)  # (every call chained)
    assert not closed_wave.plain_finishes_first(policy, 4, SMALL, slow)  # 100 + 50 ms against 139
    policy.run = ("plain", 3)
    assert closed_wave.plain_finishes_first(policy, 4, SMALL, slow)
    policy.launch_ms.clear()
    # a row with little history counts as the others: one unlucky step does not decide
    assert not closed_wave.plain_finishes_first(policy, 4, SMALL, _requests([80, 80, 80, 0], [80, 80, 80, 1.6]))
    # a tree never verified has no expectation: the policy's choice stands
    assert not closed_wave.plain_finishes_first(policy, 4, TreeShape(3, 2, 6), even)


def test_a_closed_batch_decodes_plainly_where_its_slowest_row_would_end_later(tiny, monkeypatch):
    """The engine: with one row's factor far below the others', every call of a generate call's
    batch decodes plainly (the drafter kept in step) although the policy ranks a tree first, and
    the outputs are plain decoding's; with a request waiting, or requests added one by one (a
    server's), the policy's tree is run."""
    prompts, params, plain, gen = _plain_and_auto(tiny, 2, 4, 24, 4)
    sched = gen.scheduler
    ms = sched.spec_costs.ms
    ms.update({k: 2.0 if k[0] == "verify" else 1.0 for k in ms})
    sched.spec_policy.timed = lambda *a: None  # the table alone prices the shapes
    monkeypatch.setattr(sched.spec_policy, "expected", lambda tree, key=None: 3.0)  # 1.5 tokens a ms: trees first
    monkeypatch.setattr(closed_wave, "row_factors", lambda reqs: np.array([1.0] * (len(reqs) - 1) + [0.01]))
    verify0, decode0 = sched.stats["verify_steps"], sched.stats["decode_time"]
    assert [c.token_ids for c in gen.generate(prompts, params)] == plain
    assert sched.stats["verify_steps"] == verify0 and sched.stats["decode_time"] > decode0
    plain_calls = sum(n for (rows, label), n in sched.spec_policy.chosen.items() if label == "plain")
    assert plain_calls >= sched.stats["closed_plain_calls"] > 0
    reqs = [sched.add(p, pa) for p, pa in zip(prompts, params)]  # (as a server adds them: no group)
    sched.step()  # prefill
    sched.spec_policy.launch_ms.clear()  # (the CPU's launches, tens of ms, would price the calls: the table alone does)
    assert sched._choice_for(reqs[1:])[0] is not None  # each client waits for its own: the per-step rate decides
    for r in reqs:
        r.group = reqs  # one generate call's
    assert sched._choice_for(reqs[1:]) == PLAIN
    sched.waiting.append(reqs[0])  # (a stand-in: only its presence is read)
    assert sched._choice_for(reqs[1:])[0] is not None
    sched.waiting.pop()
    while sched.has_work:
        sched.step()
    assert sched.pool.in_use == 0 and sched.late_compiles == []


def test_a_shrunk_batch_moves_to_a_smaller_bucket_only_where_the_steps_left_pay_its_launch():
    costs = StepCosts({("verify", 4, SMALL.label): 2.0, ("verify", 2, SMALL.label): 1.8,
                       ("decode", 4, None): 1.0, ("decode", 2, None): 0.5})
    policy = SpecPolicy(costs, {b: [SMALL, PLAIN_CHOICE] for b in (2, 4)})
    assert closed_wave.shrink_pays(policy, 4, 2, SMALL.label, 20)  # no launch seen yet: it moves, as before
    policy.launch_ms[2], policy.unchained[2] = 5.0, 0.0
    assert not closed_wave.shrink_pays(policy, 4, 2, SMALL.label, 20)  # saves 20 x 0.2 ms, pays 5
    assert closed_wave.shrink_pays(policy, 4, 2, SMALL.label, 30)
    assert closed_wave.shrink_pays(policy, 4, 2, "plain", 11) and not closed_wave.shrink_pays(policy, 4, 2, "plain", 9)
    assert closed_wave.shrink_pays(policy, 4, 2, "3:2:6", 1)  # a shape without costs at either: it moves


def test_a_shrunk_batch_that_stays_in_its_bucket_chains_on_with_plain_outputs(tiny, monkeypatch):
    """Three requests (bucket 4), one ending early: where moving to bucket 2 would not pay, the next
    calls chain on at bucket 4 with the ended row as padding; the outputs are plain decoding's and
    every page comes back."""
    from jaxspec import Generator
    prompts, _, _, gen = _plain_and_auto(tiny, 3, 3, 24, 4)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (5, 24, 24)]
    want = [c.token_ids for c in Generator(tiny, None, max_batch=4, max_seq_len=128, num_pages=300).generate(prompts, params)]
    sched, chained = gen.scheduler, {}
    monkeypatch.setattr(sched.spec_policy, "choose", lambda rows, keys=None: SMALL)  # a tree on every call
    monkeypatch.setattr(closed_wave, "plain_finishes_first", lambda *a: False)
    for stays in (False, True):
        asked = []
        monkeypatch.setattr(closed_wave, "shrink_pays", lambda policy, rows, small, *a: asked.append((rows, small)) or not stays)
        c0 = sched.stats["chained_steps"]
        assert [c.token_ids for c in gen.generate(prompts, params)] == want
        chained[stays] = sched.stats["chained_steps"] - c0
        assert (4, 2) in asked and sched.pool.in_use == 0
    assert chained[True] > chained[False]
