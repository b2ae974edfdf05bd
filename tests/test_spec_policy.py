"""Speculation sized by measured costs (spec_policy.py): the choice from a cost table and the
accept lengths seen, and greedy output unchanged whichever way each step goes."""
import numpy as np
import pytest
from flax import nnx

from jaxspec import Generator, SamplingParams
from jaxspec.drafters.eagle import DraftHead, EagleDrafter, HeadConfig
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.spec_policy import SpecPolicy, StepCosts

from conftest import TINY


def test_the_choice_follows_tokens_per_millisecond():
    costs = StepCosts({("decode", 1): 1.0, ("verify", 1): 1.5, ("decode", 8): 1.0, ("verify", 8): 3.0})
    policy = SpecPolicy(costs, probe_every=4)
    assert policy.should_verify(1) and policy.gain(1) is None  # nothing seen yet: verify, to learn
    policy.verified(1, [3, 2, 4])  # 3 tokens a row-step for 1.5x a plain step's time: worth it
    assert policy.gain(1) == 2.0 and policy.should_verify(1)
    policy.verified(8, [2, 2, 3, 1])  # 2 tokens a row-step for 3x the time: plain is faster
    assert policy.gain(8) == 2.0 / 3.0
    assert [policy.should_verify(8) for _ in range(8)] == [False, False, False, True] * 2  # a probe every 4th
    for _ in range(20):  # drafts that start to pay move the estimate (an average that forgets)
        policy.verified(8, [5, 4, 4])
    assert policy.gain(8) > 1.0 and policy.should_verify(8)
    assert policy.should_verify(16)  # a bucket without costs verifies
    assert "verify/decode" in costs.table() and "3.00" in costs.table()


def _plain_and_measured(tiny, seed, n, max_tokens, max_batch):
    """n random prompts, their plain greedy outputs, and an EAGLE-3 engine (random head) with the
    measured policy, warmed up."""
    head = DraftHead(HeadConfig.for_target(TINY, "eagle3"), rngs=nnx.Rngs(1))
    rng = np.random.default_rng(seed)
    prompts = [list(map(int, rng.integers(0, 62, int(rng.integers(3, 20))))) for _ in range(n)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    kw = dict(max_batch=max_batch, max_seq_len=128, num_pages=200)
    plain = [c.token_ids for c in Generator(tiny, None, **kw).generate(prompts, params)]
    gen = Generator(tiny, None, drafter=EagleDrafter(head, TreeShape(3, 2, 6)), spec_policy="measured",
                    warmup=True, **kw)
    return prompts, params, plain, gen


def test_greedy_output_is_plain_decoding_whichever_way_steps_go(tiny):
    prompts, params, plain, gen = _plain_and_measured(tiny, 0, 5, 20, 8)
    sched = gen.scheduler
    assert {k for k, _ in sched.spec_costs.ms} == {"decode", "verify"}  # timed at warm-up
    assert all(ms > 0 for ms in sched.spec_costs.ms.values())
    # verify steps made to look costly: after the first verify steps, batches decode plainly
    sched.spec_costs.ms.update({k: 1e3 for k in sched.spec_costs.ms if k[0] == "verify"})
    out = gen.generate(prompts, params)
    assert [c.token_ids for c in out] == plain
    stats = dict(sched.stats)
    assert stats["verify_steps"] > 0 and stats["decode_time"] > 0  # verified to learn, then decoded plainly
    # and cheap: every later step verifies again (new requests, whose heads are current)
    sched.spec_costs.ms.update({k: 1e-3 for k in sched.spec_costs.ms if k[0] == "verify"})
    out = gen.generate(prompts, params)
    assert [c.token_ids for c in out] == plain
    assert sched.stats["verify_steps"] > stats["verify_steps"] and sched.stats["decode_time"] == stats["decode_time"]
    assert sched.pool.in_use == 0 and sched.late_compiles == []


def test_a_batch_mostly_behind_its_head_decodes_plainly_as_one(tiny):
    """Requests whose heads fell behind (they decoded plainly) outnumber a fresh one: the whole
    batch decodes plainly, one call a step rather than a verify call beside a decode call, and
    its output is plain decoding's."""
    prompts, params, plain, gen = _plain_and_measured(tiny, 1, 4, 24, 4)
    sched = gen.scheduler
    sched.spec_costs.ms.update({k: 1e3 for k in sched.spec_costs.ms if k[0] == "verify"})  # plain pays
    old = [sched.add(p, params) for p in prompts[:3]]
    for _ in range(20):
        if all(r.head_len is not None for r in old):
            break
        sched.step()
    assert all(r.head_len is not None and not r.finished for r in old)  # decoding plainly, heads behind
    sched.spec_costs.ms.update({k: 1e-3 for k in sched.spec_costs.ms if k[0] == "verify"})  # verifying pays
    fresh = sched.add(prompts[3], params)
    while any(not r.finished for r in old + [fresh]):
        sched.step()
    assert sched.stats["behind_plain_steps"] > 0 and fresh.head_len is not None
    assert [r.output_ids for r in old + [fresh]] == plain
    assert sched.pool.in_use == 0 and sched.late_compiles == []


def test_step_costs_are_kept_for_the_next_start(tiny, tmp_path, monkeypatch):
    _, _, _, gen = _plain_and_measured(tiny, 2, 1, 4, 4)
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
    import jaxspec.scheduler.core as core
    from jaxspec.drafters.eagle_step import MAX_VERIFY_STEPS
    from jaxspec.programs import MAX_DECODE_STEPS
    _, _, _, gen = _plain_and_measured(tiny, 3, 1, 4, 2)
    sched, seen = gen.scheduler, []
    monkeypatch.setattr(core, "time_call", lambda call, reps=3: seen.append(np.asarray(call()[1])) or 1.0)
    costs = sched._time_steps(sched.program_specs())
    assert set(costs.ms) == {(kind, rows) for kind in ("decode", "verify") for rows in (1, 2)}
    decode_counts = [c for c in seen if c.ndim == 1]  # decode: tokens a row emitted in the call
    verify_counts = [c for c in seen if c.ndim == 2]  # verify_steps: tokens a row emitted at each step
    assert len(decode_counts) == len(verify_counts) == 2
    assert all((c == MAX_DECODE_STEPS).all() for c in decode_counts)
    assert all(c.shape[1] == MAX_VERIFY_STEPS and (c >= 1).all() for c in verify_counts)
