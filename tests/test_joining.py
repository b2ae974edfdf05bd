"""Newcomers joined into a running batch's chain of calls (scheduler/joining.py)."""
import numpy as np
import pytest
from flax import nnx

from jaxspec import Generator, SamplingParams
from jaxspec.drafters.dflash import DFlashConfig, DFlashDrafter, DFlashHead
from jaxspec.drafters.eagle import DraftHead, EagleDrafter, HeadConfig
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.scheduler.joining import RowJoin

from conftest import TINY, run_mixed_requests_with_aborts

KW = dict(max_batch=4, max_seq_len=128, num_pages=120, page_size=4, prefill_chunk=32)
JOIN = dict(KW, join_newcomers=True)


def requests(rng, n=14):
    prompts = [list(map(int, rng.integers(0, 62, rng.integers(1, 30)))) for _ in range(n)]
    params = [SamplingParams(max_tokens=int(rng.integers(2, 20)), ignore_eos=True, seed=i,
                             temperature=3.0 if i % 3 == 0 else 0.0, logprobs=1 if i % 5 == 0 else None)
              for i in range(n)]
    return prompts, params


def run(gen, prompts, params, max_steps=2000):
    """All requests through the scheduler (a bound on its steps: a row that never ends fails here)."""
    sched = gen.scheduler
    reqs = [sched.add(p, q) for p, q in zip(prompts, params)]
    for _ in range(max_steps):
        if not sched.has_work:
            break
        sched.step()
    assert all(r.finished for r in reqs)
    return reqs


def drafter_kw(name):
    if name == "eagle3":
        return dict(drafter=EagleDrafter(DraftHead(HeadConfig.for_target(TINY, "eagle3"), rngs=nnx.Rngs(5)),
                                         TreeShape(2, 2, 4)))
    if name == "dflash":
        head = DFlashHead(DFlashConfig.for_target(TINY, num_layers=1, block_size=4, mask_token=62), rngs=nnx.Rngs(0))
        return dict(drafter=DFlashDrafter(head, TreeShape(steps=3, topk=1, num_draft_tokens=4)))
    return {}


@pytest.mark.parametrize("drafter", [None, "eagle3", "dflash"])
def test_newcomers_join_the_chain_and_outputs_are_unchanged(tiny, drafter):
    """A request admitted where another ended takes that row in the next call, launched from the
    running call's device outputs, its prompt but the last token prefilled before it (an EAGLE-3
    or DFLASH engine's newcomer verifies its root alone first): fewer calls wait for the host than
    where newcomers break the chain, and tokens (greedy and seeded sampling) and logprobs are the
    synchronous plain scheduler's. Several newcomers at once, prompts of one token (nothing to
    prefill) and one whose prompt takes two prefill chunks (the unchained way). Every merge it
    took is in the start-up set."""
    prompts, params = requests(np.random.default_rng(4))
    prompts[5], prompts[9] = [7], list(range(40))
    sync = run(Generator(tiny, None, overlap=False, **KW), prompts, params)
    gen = Generator(tiny, None, decode_steps=2, **drafter_kw(drafter), **JOIN)
    unjoined = Generator(tiny, None, decode_steps=2, join_newcomers=False, **drafter_kw(drafter), **KW)
    for g in (gen, unjoined):
        out = run(g, prompts, params)
        assert [r.output_ids for r in out] == [r.output_ids for r in sync]
        for r, s in zip(out, sync):
            if s.params.logprobs is not None:
                np.testing.assert_allclose(r.logprobs, s.logprobs, rtol=1e-5, atol=1e-6)
        g.scheduler.pool.check()
        assert g.scheduler.pool.in_use == 0
    stats, before = gen.scheduler.stats, unjoined.scheduler.stats
    assert stats["joins"] >= 4 and before["joins"] == 0
    assert stats["steps"] - stats["chained_steps"] < before["steps"] - before["chained_steps"] - 4
    assert set(gen.scheduler.row_join.table) <= set(gen.scheduler.join_specs())  # what warm-up builds
    if drafter:
        assert stats["verify_steps"] > 10 and gen.scheduler.mean_accept_length() > 1


@pytest.mark.parametrize("drafter", [None, "eagle3"])
def test_joins_leak_no_pages_among_aborts_and_stops(tiny, drafter):
    gen = Generator(tiny, None, **drafter_kw(drafter), **JOIN)
    run_mixed_requests_with_aborts(gen, np.random.default_rng(2), n=300)
    assert gen.scheduler.stats["joins"] > 10


def test_row_join_is_built_per_bucket_at_start_up():
    """merge_rows takes the joined rows from the host's packed values and the others from the
    chained call's; a bucket not built at warm-up compiles late, and is counted."""
    join = RowJoin()
    join.build([(1, None), (2, None)], run=True)
    chained, ints, floats, seeds = RowJoin.dummy(2)
    ints[1], floats[1], seeds[1] = (6, 10, 4, 3, 2, 1), (0.5, 0.9, 0.1, 1.0, 0.0, 0.0), 77
    tok, kv, sb, budget = join(chained, ints, floats, seeds)
    assert tok.tolist() == [[0], [6]] and kv.tolist() == [0, 10] and budget.tolist() == [0, 4]
    assert sb.top_k.tolist() == [0, 3] and sb.step.tolist() == [0, 2] and sb.seed.tolist() == [0, 77]
    np.testing.assert_allclose(sb.temperature, [0.0, 0.5])
    np.testing.assert_allclose(sb.top_p, [1.0, 0.9])
    assert join.late_compiles == []
    join(*RowJoin.dummy(4))
    assert join.late_compiles == [(4, None)]
    trees, ints, floats, seeds = RowJoin.dummy(2, width=4)
    trees = (np.arange(8, dtype=np.int32).reshape(2, 4), np.zeros((2, 4), np.int32)) + trees[2:]
    ints[0] = (9, 5, 1, 0, 0, 1)
    tokens, parents, *_ = join(trees, ints, floats, seeds)  # a tree's row: the root alone
    assert tokens.tolist() == [[9, 0, 0, 0], [4, 5, 6, 7]] and parents.tolist() == [[-1] * 4, [0] * 4]
