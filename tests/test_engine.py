"""Paged cache, scheduler, sampling and the Generator on CPU."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import Generator, SamplingParams
from jaxspec.kv_cache import KVCache
from jaxspec.paging import OutOfPages, PagePool
from jaxspec.programs import STOP_ID_SLOTS
from jaxspec.scheduler import Scheduler

from conftest import SMOL_KW



def logits_with_page_size(model, ids, ps, shuffle):
    cfg = model.cfg
    n = -(-len(ids) // ps)
    cache = KVCache.create(cfg.num_layers, n + 3, ps, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    pages = np.arange(1, n + 1)
    if shuffle:
        pages = np.random.default_rng(0).permutation(np.arange(1, n + 3))[:n]
    # feed in two chunks so the second attends to a paged prefix
    cut = len(ids) // 2
    outs = []
    kv = 0
    for chunk in (ids[:cut], ids[cut:]):
        t = len(chunk)
        h, cache, _ = model(jnp.array([chunk]), kv + jnp.arange(t)[None], cache, jnp.array([pages]),
                            jnp.array([kv]), jnp.array([t]))
        outs.append(np.asarray(model.logits(h)[0]))
        kv += t
    return np.concatenate(outs)


@pytest.mark.parametrize("ps", [1, 3, 16])
def test_paged_equals_contiguous(tiny, ps):
    ids = list(np.random.default_rng(1).integers(0, 64, 37))
    contiguous = logits_with_page_size(tiny, ids, 64, shuffle=False)  # one page holds everything
    np.testing.assert_allclose(logits_with_page_size(tiny, ids, ps, shuffle=True), contiguous, atol=1e-5)


def test_page_pool_accounting_and_prefix_chain():
    pool = PagePool(10, 4)
    a = pool.alloc(3)
    toks = list(range(12))
    pool.release(a, toks)
    pool.check()
    assert pool.available == 9 and len(pool.evictable) == 3
    got = pool.match_prefix(toks + [99])
    assert got == a  # all three full pages reused
    assert pool.match_prefix(list(range(5))) == [a[0]]  # shares only the first page
    assert pool.match_prefix([0, 1, 2, 7, 9]) == []  # diverges inside the first page
    pool.release(got, toks)
    pool.release([a[0]])
    pool.check()
    with pytest.raises(OutOfPages):
        pool.alloc(10)
    b = pool.alloc(9)  # evicts the cached pages when the free list runs out
    assert len(set(b)) == 9 and not pool.cached
    pool.release(b)
    pool.check()



def test_target_only_pages_serve_plain_requests_until_full_pages_replace_them():
    """Pages a request decoded without its drafter's K/V serve only requests that ask for the
    target's alone; a later page holding both caches for the same tokens takes their place in the
    index (the target-only page freed once unused)."""
    pool = PagePool(12, 4)
    toks = list(range(12))
    a = pool.alloc(3)
    pool.release(a, toks, complete=4)  # the drafter's K/V cover the first page only
    pool.check()
    assert pool.match_prefix(toks + [99], target_only_ok=False) == [a[0]]
    pool.release([a[0]])
    got = pool.match_prefix(toks + [99])
    assert got == a and pool.full_prefix(got) == 1
    # a request with both caches recomputes pages 2 and 3 while `got` still holds them
    mine = pool.match_prefix(toks + [99], target_only_ok=False) + pool.alloc(2)
    pool.release(mine, toks)
    pool.check()
    assert pool.match_prefix(toks + [99], target_only_ok=False) == mine
    pool.release(got, toks, complete=4)  # the replaced pages go back to the free list, not the index
    pool.check()
    assert not (set(a[1:]) & set(pool.evictable)) and set(a[1:]) <= set(pool.free)
    pool.release(mine)
    pool.check()
    assert pool.in_use == 0 and pool.full_prefix(pool.match_prefix(toks + [99])) == 3


def test_the_pool_is_sized_from_the_allocator_limit_or_the_drivers_free_memory(monkeypatch, tiny):
    """XLA's allocator limit where it names one (a BFC allocator's, most of the GPU); the driver's
    free memory where it names none or a small one (the VMM allocator maps memory as asked); the
    pool no bigger than twice what its rows hold at full length."""
    import types

    from jaxspec import paging
    from jaxspec.scheduler import core
    for fits, cap in ((10**6, True), (40, False)):
        monkeypatch.setattr(core, "pages_that_fit", lambda *a, fits=fits: fits)
        sched = Generator(tiny, None, max_batch=2, max_seq_len=64, page_size=4, mem_fraction=0.5).scheduler
        assert sched.pool.num_pages == (1 + 2 * 2 * sched.max_pages_per_seq if cap else fits)
    gib = 2**30
    dev = lambda stats, platform="gpu": types.SimpleNamespace(platform=platform, id=0, local_hardware_id=0,
                                                             memory_stats=lambda: stats)
    nvidia_smi = paging.gpu_memory
    monkeypatch.setattr(paging, "gpu_memory", lambda d: (140 * gib, 120 * gib))
    assert paging.device_free_bytes(dev({"bytes_limit": 100 * gib, "bytes_in_use": 10 * gib})) == 90 * gib
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert paging.device_free_bytes(dev({"bytes_limit": 2 * gib, "bytes_in_use": gib})) == 104 * gib
    assert paging.device_free_bytes(dev(None)) == 105 * gib  # (within the client's 0.75 of the GPU)
    assert paging.device_free_bytes(dev({"bytes_in_use": 10 * gib})) == 95 * gib
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    assert paging.device_free_bytes(dev({"bytes_in_use": 10 * gib})) == 120 * gib
    assert paging.device_free_bytes(dev({}, "cpu")) is None
    monkeypatch.setattr(paging, "gpu_memory", lambda d: None)  # no nvidia-smi: the allocator's word, or nothing
    assert paging.device_free_bytes(dev({"bytes_limit": 2 * gib, "bytes_in_use": gib})) == gib
    assert paging.device_free_bytes(dev({})) is None
    # nvidia-smi numbers GPUs physically: the device's ordinal through CUDA_VISIBLE_DEVICES
    calls = []
    monkeypatch.setattr(paging.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or types.SimpleNamespace(
        stdout="143771, 140000\n"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    gpu = dev({})
    gpu.local_hardware_id = 1
    assert nvidia_smi(gpu) == (143771 * 2**20, 140000 * 2**20) and "--id=5" in calls[-1]
    monkeypatch.setattr(paging.subprocess, "run", lambda cmd, **kw: types.SimpleNamespace(stdout="No devices were found"))
    assert nvidia_smi(gpu) is None


def make_gen(model, tok=None, **kw):
    kw.setdefault("max_batch", 8)
    kw.setdefault("max_seq_len", 256)
    kw.setdefault("num_pages", 200)
    kw.setdefault("page_size", 4)
    return Generator(model, tok, **kw)


def test_batch_equals_each_alone_and_pages_return(tiny):
    rng = np.random.default_rng(2)
    prompts = [list(map(int, rng.integers(0, 62, n))) for n in (1, 5, 17, 40, 9, 3)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    gen = make_gen(tiny, prefill_chunk=16)
    together = gen.generate(prompts, params)
    alone = [make_gen(tiny).generate([p], params)[0] for p in prompts]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    gen.scheduler.pool.check()
    assert gen.scheduler.pool.in_use == 0


def test_prefix_reuse_same_output_and_hits(tiny):
    rng = np.random.default_rng(3)
    shared = list(map(int, rng.integers(0, 62, 30)))
    gen = make_gen(tiny)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    first = gen.generate([shared + [5, 6]], params)[0]
    hits = gen.scheduler.pool.hits
    second = gen.generate([shared + [5, 6]], params)[0]
    assert gen.scheduler.pool.hits - hits >= 28  # 7 full pages of 4
    assert second.token_ids == first.token_ids
    fresh = make_gen(tiny).generate([shared + [5, 6]], params)[0]
    assert fresh.token_ids == first.token_ids
    assert gen.scheduler.pool.in_use == 0


def test_preemption_keeps_outputs(tiny):
    """A pool too small for every request at once: requests wait or get preempted, outputs unchanged."""
    rng = np.random.default_rng(4)
    prompts = [list(map(int, rng.integers(0, 62, 20))) for _ in range(6)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    small = make_gen(tiny, num_pages=40, max_seq_len=120)
    out = small.generate(prompts, params)
    ref = make_gen(tiny).generate(prompts, params)
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]
    assert small.scheduler.stats["preemptions"] > 0
    small.scheduler.pool.check()
    assert small.scheduler.pool.in_use == 0


def test_overlapped_steps_equal_synchronous(tiny):
    """Steady decoding launches step t+1 from step t's device outputs before step t is read back:
    tokens (greedy and seeded sampling), logprobs, stops inside the chain, an abort mid-chain and
    the page accounting all match the synchronous scheduler."""
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(0, 62, n))) for n in (3, 9, 14, 6)]
    free = make_gen(tiny, overlap=False).generate([prompts[3]], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    stop_id = free.token_ids[7]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=24, temperature=4.0, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=9, ignore_eos=True), SamplingParams(max_tokens=24, stop_token_ids=[stop_id])]
    sync = make_gen(tiny, overlap=False).generate(prompts, params)
    assert len(set(sync[1].token_ids)) > 8  # hot enough that a reused sampling key would show
    gen = make_gen(tiny, decode_steps=1)  # a call a step: many chained calls
    over = gen.generate(prompts, params)
    assert [c.token_ids for c in over] == [c.token_ids for c in sync]
    assert over[3].finish_reason == "stop" and len(over[3].token_ids) <= 8
    # a chained call keeps its batch's bucket where a request ended in the call before: float32
    # sums of another width
    np.testing.assert_allclose(over[0].logprobs, sync[0].logprobs, rtol=1e-5, atol=1e-6)
    assert gen.scheduler.stats["chained_steps"] > 10
    # an abort while a chained step is in flight: the others' outputs are unchanged
    sched = gen.scheduler
    chained = sched.stats["chained_steps"]
    reqs = [sched.add(p, q) for p, q in zip(prompts, params)]
    while sched.has_work and (sched.inflight is None or sched.stats["chained_steps"] < chained + 5):
        sched.step()
    sched.abort(reqs[0])
    while sched.has_work:
        sched.step()
    assert [r.output_ids for r in reqs[1:]] == [c.token_ids for c in sync[1:]]
    assert reqs[0].finish_reason == "abort" and 0 < len(reqs[0].output_ids) < 24
    sched.pool.check()
    assert sched.pool.in_use == 0


def test_requests_ending_on_the_device_do_not_break_the_chain(tiny):
    """A request that reaches max_tokens rides on as a padding row: the chain of calls goes on
    until the batch drops to a smaller bucket (8 -> 4 here), where before every end broke it; a
    stop string (seen by the host alone) still breaks it. Tokens match the synchronous scheduler."""
    rng = np.random.default_rng(8)
    prompts = [list(map(int, rng.integers(0, 62, n))) for n in (3, 9, 14, 6, 11, 5, 8, 4)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 9, 12, 15, 30, 30, 30, 30)]
    sync = make_gen(tiny, overlap=False).generate(prompts, params)
    gen = make_gen(tiny, decode_steps=1)
    over = gen.generate(prompts, params)
    assert [c.token_ids for c in over] == [c.token_ids for c in sync]
    stats = gen.scheduler.stats
    assert stats["steps"] - stats["chained_steps"] == 2  # the first call, and the one at bucket 4
    gen.scheduler.pool.check()
    assert gen.scheduler.pool.in_use == 0
    # a stop id past the STOP_ID_SLOTS the device checks: the host ends the request while its row
    # still runs on the device (as a stop string does), and the chain stops there
    seen = sync[4].token_ids[:12]
    stop = max(seen[3:])
    decoys = [t for t in range(stop) if t not in seen][:STOP_ID_SLOTS]
    assert len(decoys) == STOP_ID_SLOTS
    params[4] = SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=decoys + [stop])
    sync = make_gen(tiny, overlap=False).generate(prompts, params)
    before = stats["steps"] - stats["chained_steps"]
    over = gen.generate(prompts, params)
    assert [c.token_ids for c in over] == [c.token_ids for c in sync]
    assert over[4].finish_reason == "stop" and len(over[4].token_ids) < 12
    assert stats["steps"] - stats["chained_steps"] - before == 3  # the first call, after the stop, at bucket 4
    assert gen.scheduler.pool.in_use == 0


def test_multi_step_decode_equals_one_step_a_call(tiny):
    """N = 8 decode steps a call give what N = 1 gives: greedy and seeded tokens, logprobs and
    top logprobs, with EOS, stop ids and max_tokens falling mid-call, an abort while a call is in
    flight, and preemption in a pool too small for the batch; no page leaks."""
    from tests.conftest import TINY
    rng = np.random.default_rng(6)
    prompts = [list(map(int, rng.integers(0, 62, n))) for n in (3, 9, 14, 6, 11)]
    free = make_gen(tiny, decode_steps=1).generate([prompts[3]], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=30, temperature=3.0, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=11, ignore_eos=True),  # ends 3 steps into its second call
              SamplingParams(max_tokens=30, stop_token_ids=[free.token_ids[5]]),
              SamplingParams(max_tokens=30, temperature=3.0, seed=9)]  # may meet EOS (63) anywhere
    one = make_gen(tiny, decode_steps=1).generate(prompts, params)
    gen = make_gen(tiny)
    eight = gen.generate(prompts, params)
    assert [c.token_ids for c in eight] == [c.token_ids for c in one]
    assert [c.finish_reason for c in eight] == [c.finish_reason for c in one]
    assert eight[2].finish_reason == "length" and len(eight[2].token_ids) == 11
    assert eight[3].finish_reason == "stop" and len(eight[3].token_ids) <= 6
    np.testing.assert_allclose(eight[0].logprobs, one[0].logprobs, rtol=1e-5)
    assert [sorted(t) for t in eight[0].top_logprobs] == [sorted(t) for t in one[0].top_logprobs]
    assert (eight[4].finish_reason == "stop") == (eight[4].token_ids[-1] in TINY.eos_token_ids)
    sched = gen.scheduler
    assert sched.stats["steps"] < sum(len(c.token_ids) for c in eight) // 4  # several tokens a call
    assert sched.stats["chained_steps"] > 0
    # an abort while a multi-step call is in flight
    reqs = [sched.add(p, q) for p, q in zip(prompts, params)]
    while sched.has_work and (sched.inflight is None or len(reqs[0].output_ids) < 9):
        sched.step()
    sched.abort(reqs[0])
    while sched.has_work:
        sched.step()
    assert [r.output_ids for r in reqs[1:]] == [c.token_ids for c in one[1:]]
    assert reqs[0].finish_reason == "abort" and 0 < len(reqs[0].output_ids) < 30
    sched.pool.check()
    assert sched.pool.in_use == 0
    # preemption: a pool too small for every request's pages at once
    small = make_gen(tiny, num_pages=40, max_seq_len=120)
    long = [SamplingParams(max_tokens=40, ignore_eos=True)] * 5
    assert ([c.token_ids for c in small.generate(prompts, long)]
            == [c.token_ids for c in make_gen(tiny, decode_steps=1).generate(prompts, long)])
    assert small.scheduler.stats["preemptions"] > 0 and small.scheduler.pool.in_use == 0


def test_a_run_of_tokens_ends_where_emitting_them_one_by_one_ends(tiny):
    """A verify step's accepted run is emitted at once: it must end at the token, and for the
    reason, that emitting its tokens one at a time gives (a stop id or EOS before max_tokens,
    max_tokens before a later stop id, EOS ignored when asked), and call on_update once."""
    sched = make_gen(tiny).scheduler
    cases = [(dict(max_tokens=4), [5, 6, 7, 8, 9]),  # length inside the run
             (dict(max_tokens=4, stop_token_ids=[9]), [5, 6, 7, 8, 9]),  # length before the stop id
             (dict(max_tokens=4, stop_token_ids=[8]), [5, 6, 7, 8, 9]),  # the stop id on the last token allowed
             (dict(max_tokens=9, stop_token_ids=[6, 7]), [5, 7, 6, 8]),
             (dict(max_tokens=9), [5, 63, 6]),  # EOS
             (dict(max_tokens=9, ignore_eos=True), [5, 63, 6]),
             (dict(max_tokens=9), [5, 6])]
    for kw, run in cases:
        one, whole = (sched.add([1, 2], SamplingParams(**kw)) for _ in range(2))
        for t in run:
            if not one.finished:
                sched._emit(one, [t], None, None)
        updates = []
        whole.on_update = lambda r, new: updates.append(list(new))
        sched._emit(whole, list(run), None, None)
        assert (whole.output_ids, whole.finish_reason) == (one.output_ids, one.finish_reason), kw
        assert updates[0] == whole.output_ids, kw
    ends = [(r.output_ids, r.finish_reason) for r in sched.waiting[-2:]]
    assert ends[0] == ([5, 6], None)
    assert [r.finish_reason for r in sched.waiting[::2]] == ["length", "length", "stop", "stop", "stop", None, None]


def test_a_newcomer_decodes_in_the_step_that_prefills_it(tiny):
    """A request admitted while others decode joins the batch's decode call in the step of its
    (one-chunk) prefill, not a step later beside a one-step call; its tokens are its own alone."""
    rng = np.random.default_rng(8)
    first, second = (list(map(int, rng.integers(0, 62, n))) for n in (7, 5))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    gen = make_gen(tiny, max_batch=2)
    sched = gen.scheduler
    a = sched.add(first, params)
    while len(a.output_ids) < 3:
        sched.step()
    b = sched.add(second, params)
    while b.kv_len < len(second):  # the step that admits and prefills it
        sched.step()
    in_call = sched.inflight is not None and b in sched.inflight.reqs
    assert in_call or len(b.output_ids) > 1
    while sched.has_work:
        sched.step()
    alone = make_gen(tiny).generate([first, second], params)
    assert [a.output_ids, b.output_ids] == [c.token_ids for c in alone] and sched.pool.in_use == 0


def test_a_delay_factor_admits_newcomers_together(tiny):
    """scheduler_delay_factor (vLLM's): a running batch admits waiting requests once the oldest has
    waited that many times the last prefill's time, or they fill its free rows; then one prefill
    call takes them all, and outputs are each request's alone."""
    rng = np.random.default_rng(9)
    prompts = [list(map(int, rng.integers(0, 62, n))) for n in (7, 5, 6, 4)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    long = SamplingParams(max_tokens=120, ignore_eos=True)
    gen = make_gen(tiny, max_batch=4, scheduler_delay_factor=1e9)  # waits for rows to fill
    sched = gen.scheduler
    first = sched.add(prompts[0], long)
    while len(first.output_ids) < 3:
        sched.step()
    late = [sched.add(p, params) for p in prompts[1:3]]
    for _ in range(4):  # two wait (two rows free), the batch decodes on without them
        sched.step()
    assert all(r.kv_len == 0 for r in late) and len(first.output_ids) > 3
    late.append(sched.add(prompts[3], params))  # the free rows filled: all three in one prefill call
    calls = sched.stats["prefill_tokens"]
    while any(r.kv_len == 0 for r in late):
        sched.step()
    assert all(r.kv_len >= len(p) for r, p in zip(late, prompts[1:])) and sched.stats["prefill_tokens"] - calls == 15
    while sched.has_work:
        sched.step()
    alone = make_gen(tiny).generate(prompts, [long] + [params] * 3)
    assert [r.output_ids for r in [first] + late] == [c.token_ids for c in alone] and sched.pool.in_use == 0
    sched.delay_factor, sched.last_prefill_s = 2.0, 0.001  # waited long enough: admitted at once
    r = sched.add(prompts[0], params)
    r.arrival -= 1.0
    assert sched._admission_due()
    with pytest.raises(ValueError, match="scheduler_delay_factor must be >= 0"):
        make_gen(tiny, scheduler_delay_factor=-1)


def test_sampling_seeded_reproducible_and_batch_independent(tiny):
    gen = make_gen(tiny)
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=20, seed=7, ignore_eos=True)
    a = gen.generate([[1, 2, 3]], p)[0]
    b = gen.generate([[9, 9], [1, 2, 3], [4]], [dataclasses.replace(p, seed=1), p, p])[1]
    assert a.token_ids == b.token_ids
    c = gen.generate([[1, 2, 3]], dataclasses.replace(p, seed=8))[0]
    assert c.token_ids != a.token_ids


def test_top_k_one_is_greedy_and_logprobs(tiny):
    gen = make_gen(tiny)
    g = gen.generate([[1, 2, 3]], SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3))[0]
    s = gen.generate([[1, 2, 3]], SamplingParams(max_tokens=10, temperature=2.0, top_k=1, ignore_eos=True, seed=1))[0]
    assert g.token_ids == s.token_ids
    assert len(g.logprobs) == 10 and all(lp <= 0 for lp in g.logprobs)
    for tok, lp, top in zip(g.token_ids, g.logprobs, g.top_logprobs):
        assert len(top) == 3 and max(top, key=top.get) == tok  # greedy: chosen is the most likely
        assert abs(top[tok] - lp) < 1e-5


def test_penalties_change_output(tiny):
    gen = make_gen(tiny)
    base = gen.generate([[1, 2, 3]], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    pen = gen.generate([[1, 2, 3]], SamplingParams(max_tokens=30, ignore_eos=True, presence_penalty=2.0,
                                                    frequency_penalty=2.0))[0]
    assert len(set(pen.token_ids)) > len(set(base.token_ids))


def test_sampler_matches_distribution():
    """Temperature + top-k + top-p sampling draws from the filtered, renormalised softmax."""
    from jaxspec.sampling import SamplerFlags, SamplingBatch, sample
    logits = jnp.log(jnp.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.05]))[None, None]
    n = 4000
    params = [SamplingParams(temperature=1.0, top_k=4, top_p=0.75)] * n
    sb = SamplingBatch.build(params, list(range(n)), [0] * n)
    toks = np.asarray(sample(jnp.tile(logits, (n, 1, 1)), sb, SamplerFlags.of(params)))[:, 0]
    counts = np.bincount(toks, minlength=6)
    # top-p 0.75 keeps 0.4, 0.25, 0.15 (mass before 0.15 is 0.65 < 0.75); renormalised over 0.8
    expect = np.array([0.5, 0.3125, 0.1875, 0, 0, 0]) * n
    assert counts[3:].sum() == 0
    chi2 = ((counts[:3] - expect[:3]) ** 2 / expect[:3]).sum()
    assert chi2 < 13.8  # p = 0.001 at 2 degrees of freedom


def test_stop_conditions_and_abort(smollm):
    model, tok = smollm
    gen = Generator(model, tok, **SMOL_KW)
    prompt = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    full = gen.generate(prompt, SamplingParams(max_tokens=40))
    assert "4, 5" in full.text
    cut = gen.generate(prompt, SamplingParams(max_tokens=40, stop=["5"]))
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index("5")]
    stop_id = tok.encode(",", add_special_tokens=False)[0]
    by_id = gen.generate(prompt, SamplingParams(max_tokens=40, stop_token_ids=[stop_id]))
    assert by_id.token_ids[-1] == stop_id and stop_id not in by_id.token_ids[:-1]
    one = gen.generate(prompt, SamplingParams(max_tokens=1))
    assert len(one.token_ids) == 1 and one.finish_reason == "length"
    it = gen.stream(prompt, SamplingParams(max_tokens=40))
    pieces = [next(it), next(it)]
    it.close()  # closing the stream aborts the request
    assert "".join(pieces) and full.text.startswith("".join(pieces))
    assert gen.scheduler.pool.in_use == 0 and not gen.scheduler.running
    assert "".join(gen.stream(prompt, SamplingParams(max_tokens=40))) == full.text


def test_bad_inputs_get_clear_errors(tiny):
    gen = make_gen(tiny)
    cases = [
        (SamplingParams(temperature=-1), "temperature must be >= 0"),
        (SamplingParams(top_p=0), r"top_p must be in \(0, 1\]"),
        (SamplingParams(max_tokens=0), "max_tokens must be an integer in \\[1, 2\\*\\*31\\)"),
        (SamplingParams(top_k=-5), r"top_k must be an integer in \[-1, 2\*\*31\)"),
        (SamplingParams(logprobs=50), "logprobs must be an integer in"),
        (SamplingParams(stop_token_ids=[1000]), "stop_token_ids entry 1000"),
        (SamplingParams(temperature=float("nan")), "temperature must be a finite number"),
        (SamplingParams(max_tokens=250), r"exceeds the maximum sequence length 256"),
    ]
    for p, msg in cases:
        with pytest.raises(ValueError, match=msg):
            gen.generate([[1, 2, 3, 4, 5, 6, 7]], p)
    with pytest.raises(ValueError, match="prompt is empty"):
        gen.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.generate([[1, 64]], SamplingParams())
    with pytest.raises(ValueError, match="prompt must be a string"):
        gen.generate([3.5], SamplingParams())
    # a bad request in a batch queues nothing, and the engine still serves
    with pytest.raises(ValueError):
        gen.generate([[1, 2], [1, 99]], SamplingParams())
    assert not gen.scheduler.waiting and gen.scheduler.pool.in_use == 0
    assert len(gen.generate([[1, 2]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        Scheduler(tiny, None, num_pages=4, page_size=4, max_seq_len=256)


def test_a_call_ends_when_no_row_is_left():
    """steps_while_alive runs body up to num_steps times, and stops after the step that leaves no
    live row (the carry's alive rows), as a call whose rows all stopped does."""
    import jax
    import jax.numpy as jnp
    from jaxspec.programs import steps_while_alive

    def run(n, stop_at):
        body = lambda i, c: (c[0] + 1, c[1] & (i + 1 < stop_at))  # (steps run, alive [B])
        return jax.jit(lambda n, stop_at: steps_while_alive(n, body, (jnp.int32(0), jnp.ones(3, bool)),
                                                            lambda c: c[1]))(n, stop_at)[0]
    assert int(run(8, 3)) == 3 and int(run(8, 100)) == 8 and int(run(2, 1)) == 1 and int(run(0, 5)) == 0


def test_host_inputs_reach_the_device_unchanged():
    from jaxspec.sampling import SamplingBatch
    from jaxspec.scheduler.dispatch import _to_device
    sb = SamplingBatch.build([SamplingParams(temperature=0.7, top_p=0.9, seed=4000000000)], [4000000000], [5], pad_to=2)
    on_device = jnp.arange(3.0)
    tree = (np.arange(6, dtype=np.int32).reshape(2, 3), on_device, np.int32(7), sb)
    out = _to_device(tree)
    assert out[1] is on_device  # a device array passes as it is
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(out)):
        assert isinstance(b, jax.Array) and b.dtype == np.asarray(a).dtype and b.shape == np.shape(a)
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_sampling_parameters_are_sent_once_per_batch_and_the_step_every_call(tiny):
    from jaxspec.sampling import SamplerFlags, SamplingBatch
    sched = Scheduler(tiny, None, max_batch=4, max_seq_len=256)
    reqs = [sched.add([1, 2, 3], SamplingParams(temperature=0.5 + i, top_k=3, seed=i)) for i in range(3)]
    flags = SamplerFlags.of([r.params for r in reqs])
    first = sched._sampling(reqs, 4, flags, reuse=True)
    reqs[1].output_ids += [5, 6]
    second = sched._sampling(reqs, 4, flags, reuse=True)
    want = SamplingBatch.build([r.params for r in reqs], [r.seed for r in reqs], [len(r.output_ids) for r in reqs],
                               pad_to=4)
    for field in dataclasses.fields(SamplingBatch):
        got = getattr(second, field.name)
        np.testing.assert_array_equal(np.asarray(got), getattr(want, field.name), err_msg=field.name)
        if field.name != "step":  # reused from the device, not sent again
            assert got is getattr(first, field.name)
    assert sched._sampling(reqs[:2], 4, flags, reuse=True).temperature is not first.temperature  # another batch
