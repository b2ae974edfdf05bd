"""Speculative decoding (NGRAM + tree verify): lossless greedy and sampling, stops, page accounting."""
import dataclasses

import numpy as np
import pytest
from flax import nnx

from jaxspec import Generator, SamplingParams, SpecConfig
from jaxspec.drafters.ngram import NgramCache
from jaxspec.models import Llama

from conftest import SMOL_KW, TINY, run_mixed_requests_with_aborts


def test_ngram_cache_insert_match_evict():
    c = NgramCache(max_trie_depth=5, capacity=10_000)
    c.insert([1, 2, 3, 4, 5])
    c.insert([1, 2, 3, 9])
    node, w = c.match([7, 1, 2, 3], max_window=3)
    assert w == 3 and set(c.children(node)) == {4, 9}
    assert c.count(c.children(node)[4]) == 1
    c.insert([2, 3, 4])
    node = c.match([2, 3])[0]
    assert c.count(c.children(node)[4]) == 2
    assert c.match([8, 8])[0] is None  # no suffix known
    toks, par = c.draft([1, 2, 3], budget=3, match_type="BFS", breadth=8, branch_length=4)
    assert sorted(toks[:2]) == [4, 9] and par[:2] == [0, 0]  # both children of the match
    assert toks[2] == 5 and par[2] == 1 + toks.index(4)  # 4's child follows, below it
    toks, par = c.draft([1, 2, 3], budget=2, match_type="PROB", breadth=8, branch_length=4)
    assert len(toks) == 2 and par[0] == 0
    small = NgramCache(max_trie_depth=3, capacity=20)
    for i in range(30):
        small.insert([100 + i, 200 + i, 300 + i])
        small.evict_if_full()
    assert small.size <= 20 + 9
    assert small.match([129, 229])[0] is not None  # the most recent survive
    assert small.match([100, 200])[0] is None  # the oldest are gone


def test_ngram_cache_gives_the_garbage_collector_nothing_to_walk():
    """A trie of node objects made the collector walk all of them again and again as it grew
    (bench/results/ngram_trie-*.json); the flat trie adds no GC-tracked objects however large."""
    import gc
    rng = np.random.default_rng(0)
    c = NgramCache(max_trie_depth=19)
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(20):
        c.insert(rng.integers(0, 500, 200).tolist())
    gc.collect()
    assert c.size > 30_000
    assert len(gc.get_objects()) - before < 100  # the recent-sequences deque's lists and the like


def test_ngram_folds_only_while_the_device_is_busy():
    """prepare folds min_fold_tokens when the device is idle (the host would stall it), and the
    whole backlog while the device is still busy."""
    from jaxspec.drafters.ngram import NgramDrafter
    from jaxspec.scheduler import Request
    reqs = [Request(i, list(range(100 * i, 100 * i + 40)), SamplingParams(), 0) for i in range(2)]
    idle = NgramDrafter(8, min_fold_tokens=16)
    idle.prepare(reqs, busy=lambda: False)
    assert sum(idle.folded.values()) == 16
    idle.prepare(reqs, busy=lambda: False)
    assert sum(idle.folded.values()) == 32  # every call makes progress
    polls = []
    busy = NgramDrafter(8, min_fold_tokens=16)
    busy.prepare(reqs, busy=lambda: polls.append(1) or True)
    assert busy.folded == {0: 40, 1: 40} and polls
    assert busy.cache.children(busy.cache.match([10, 11])[0]).keys() == {12}


def repetitive_prompts(rng, n):
    out = []
    for _ in range(n):
        motif = list(map(int, rng.integers(0, 62, rng.integers(2, 6))))
        out.append((motif * 8)[: rng.integers(3, 30)])
    return out


@pytest.mark.parametrize("draft,match,ps", [(2, "BFS", 4), (8, "BFS", 16), (16, "PROB", 4)])
def test_ngram_greedy_equals_plain(tiny, draft, match, ps):
    rng = np.random.default_rng(draft)
    prompts = repetitive_prompts(rng, 7)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    kw = dict(max_batch=8, max_seq_len=128, num_pages=300, page_size=ps)
    plain = Generator(tiny, None, **kw).generate(prompts, params)
    spec_gen = Generator(tiny, None, drafter=SpecConfig(num_draft_tokens=draft, ngram_match_type=match).build(tiny),
                         spec_max_host_verify_tokens=128, **kw)  # trees for all 7 requests at once
    spec = spec_gen.generate(prompts, params)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert max(c.mean_accept_length for c in spec) > 1.5  # drafts were accepted, not just verified
    assert spec_gen.scheduler.pool.in_use == 0


def test_ngram_prompt_insertion_happens_while_the_device_runs(tiny, monkeypatch):
    """Prompts enter the trie during the prefill step's device time (between dispatch and the
    read of its outputs), so the first propose only matches; drafts stay lossless."""
    gen = Generator(tiny, None, drafter=SpecConfig(num_draft_tokens=8).build(tiny), max_batch=8, max_seq_len=128,
                    num_pages=300)
    drafter, sched = gen.scheduler.drafter, gen.scheduler
    events = []
    real_extend = sched.programs.extend

    def extend(*a, **k):
        out = real_extend(*a, **k)
        events.append(("dispatched", set(drafter.cursors)))
        return out
    monkeypatch.setattr(sched.programs, "extend", extend)
    real_prepare = drafter.prepare
    monkeypatch.setattr(drafter, "prepare", lambda reqs, busy=None: (
        real_prepare(reqs, busy), events.append(("prepared", set(drafter.cursors)))))
    prompt = [5, 6, 7, 8] * 6
    req = gen.submit(prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    sched.step()  # prefill
    assert events[0] == ("dispatched", set()) and events[1] == ("prepared", {req.rid})
    assert drafter.overlapped_time > 0
    while sched.has_work:
        n = len(req.output_ids)
        sched.step()
        if not req.finished:  # a step's tokens enter the trie during a later step's device time
            assert len(prompt) + n <= drafter.folded[req.rid] <= len(prompt) + len(req.output_ids)
    plain = Generator(tiny, None, max_batch=8, max_seq_len=128, num_pages=300).generate(
        [prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert req.output_ids == plain.token_ids and max(req.accept_lengths) > 1


def test_ngram_skips_trie_work_while_the_batch_decodes_plainly(tiny, monkeypatch):
    """Above spec_max_host_verify_tokens / nodes requests the step decodes plainly and the trie is
    left alone; once requests finish and trees fit again, the backlog is folded in and drafting
    resumes. Output stays the plain greedy output."""
    rng = np.random.default_rng(3)
    prompts = repetitive_prompts(rng, 7)
    # the last outlives the rest by more than the plain calls (8 steps each) that time a new bucket
    params = [SamplingParams(max_tokens=min(4 + 6 * i, 24) + 24 * (i == 6), ignore_eos=True) for i in range(7)]
    kw = dict(max_batch=8, max_seq_len=128, num_pages=300)
    plain = Generator(tiny, None, **kw).generate(prompts, params)
    gen = Generator(tiny, None, drafter=SpecConfig(num_draft_tokens=8).build(tiny), spec_max_host_verify_tokens=8, **kw)
    drafter, batches = gen.scheduler.drafter, []
    real_prepare = drafter.prepare
    monkeypatch.setattr(drafter, "prepare", lambda reqs, busy=None: (batches.append(len(reqs)), real_prepare(reqs, busy)))
    spec = gen.generate(prompts, params)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert batches and max(batches) <= 2  # 8 // batch >= 4 nodes only at batch <= 2
    assert gen.scheduler.stats["verify_steps"] > 0 and max(c.mean_accept_length or 1 for c in spec) > 1
    assert gen.scheduler.pool.in_use == 0


def test_ngram_greedy_equals_plain_smollm(smollm):
    model, tok = smollm
    prompts = [[{"role": "user", "content": "Write the numbers one to twelve as words, comma separated."}],
               "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
               "The quick brown fox"]
    params = SamplingParams(max_tokens=40)
    kw = SMOL_KW
    plain = Generator(model, tok, **kw).generate(prompts, params)
    spec = Generator(model, tok, drafter=SpecConfig(num_draft_tokens=8).build(model), **kw).generate(prompts, params)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert max(c.mean_accept_length for c in spec) > 1.3


def test_tree_shrinks_then_falls_back_to_plain_at_large_batch(tiny):
    gen = Generator(tiny, None, drafter=SpecConfig(num_draft_tokens=16).build(tiny), max_batch=64, max_seq_len=64,
                    num_pages=200, spec_max_host_verify_tokens=128, spec_min_nodes=4)
    sizes = [gen.scheduler.tree_size(b) for b in (1, 8, 16, 32, 33, 64)]
    assert sizes == [16, 16, 8, 4, 1, 1]
    outs = gen.generate([[1, 2, 3, 1, 2, 3]] * 40, SamplingParams(max_tokens=6, ignore_eos=True))
    plain = Generator(tiny, None, max_batch=64, max_seq_len=64, num_pages=200).generate(
        [[1, 2, 3, 1, 2, 3]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert all(o.token_ids == plain.token_ids for o in outs)


def test_stops_inside_accepted_runs(tiny):
    rng = np.random.default_rng(5)
    prompts = repetitive_prompts(rng, 6)
    kw = dict(max_batch=8, max_seq_len=128, num_pages=300, page_size=4)
    plain = Generator(tiny, None, **kw).generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    spec = Generator(tiny, None, drafter=SpecConfig(num_draft_tokens=8).build(tiny), **kw)
    for p, ref in zip(prompts, plain):
        stop = ref.token_ids[12]
        got = spec.generate([p], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop]))[0]
        assert got.token_ids == ref.token_ids[: ref.token_ids.index(stop) + 1] and got.finish_reason == "stop"
        got = spec.generate([p], SamplingParams(max_tokens=7, ignore_eos=True))[0]
        assert got.token_ids == ref.token_ids[:7] and got.finish_reason == "length"
    assert spec.scheduler.pool.in_use == 0


SMALL_VOCAB = dataclasses.replace(TINY, vocab_size=6, eos_token_ids=())


def test_ngram_sampling_is_lossless():
    """Two-sample chi-square on the joint of the first three sampled tokens: plain vs speculative."""
    model = Llama(SMALL_VOCAB, rngs=nnx.Rngs(11))
    model.embed = nnx.Param(model.embed[...] * 0.3)  # flatter next-token distributions: a test with power
    n = 2000
    prompt = [1, 2, 1, 2, 1, 2, 1]
    kw = dict(max_batch=64, max_seq_len=64, num_pages=1100, page_size=4)

    def joint(gen, temperature=1.0):
        ps = [SamplingParams(max_tokens=3, temperature=temperature, seed=s) for s in range(n)]
        outs = gen.generate([prompt] * n, ps)
        return np.bincount([a * 36 + b * 6 + c for a, b, c in (o.token_ids for o in outs)], minlength=216)

    plain = joint(Generator(model, None, **kw))
    spec_gen = Generator(model, None, drafter=SpecConfig(num_draft_tokens=4).build(model),
                         spec_max_host_verify_tokens=4096, **kw)  # keep verifying trees at batch 64
    spec = joint(spec_gen)
    assert spec_gen.scheduler.stats["emitted"] > spec_gen.scheduler.stats["verify_steps"]  # drafts accepted
    def chi2_two_sample(a, b):
        keep = (a + b) >= 10  # pool sparse cells
        a, b = np.append(a[keep], a[~keep].sum()), np.append(b[keep], b[~keep].sum())
        dof = len(a) - 1
        return (((a - b) ** 2) / np.maximum(a + b, 1)).sum(), dof + 4 * np.sqrt(2 * dof)  # ~ p < 0.001

    # keys follow output positions, so in float32 the speculative draws are the plain draws
    np.testing.assert_array_equal(spec, plain)
    stat, limit = chi2_two_sample(plain, spec)
    assert stat < limit, (stat, limit)
    # the test has power: a wrong sampler (temperature 0.5 instead of 1) is caught
    stat, limit = chi2_two_sample(plain, joint(Generator(model, None, **kw), temperature=0.5))
    assert stat > limit, (stat, limit)


def test_no_leaked_pages_after_many_mixed_requests(tiny):
    rng = np.random.default_rng(9)
    gen = Generator(tiny, None, drafter=SpecConfig(num_draft_tokens=4).build(tiny), max_batch=32,
                    max_seq_len=64, num_pages=120, page_size=4)
    run_mixed_requests_with_aborts(gen, rng)


def test_host_drafter_drafts_only_while_it_pays(tiny):
    """A host drafter's batch verifies trees while expected accept length x plain step time / verify
    step time >= spec_min_gain, and otherwise decodes plainly with sparse probes; outputs stay plain greedy's. The
    step timer is driven: each read-back advances it by its kind's cost."""
    rng = np.random.default_rng(9)
    prompts = [list(map(int, rng.integers(0, 62, 12))) for _ in range(2)]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    kw = dict(max_batch=8, max_seq_len=128, num_pages=300)
    plain = [c.token_ids for c in Generator(tiny, None, **kw).generate(prompts, params)]
    verify_steps = {}
    for verify_cost in (0.5, 50.0):  # plain steps cost 1.0
        gen = Generator(tiny, None, drafter=SpecConfig(num_draft_tokens=8).build(tiny), spec_probe_every=4,
                        spec_min_gain=1.1, **kw)
        sched, now = gen.scheduler, [0.0]
        sched.clock = lambda: now[0]
        collect = sched._collect

        def driven(f, *args, **kwargs):
            now[0] += verify_cost if f.kind == "verify" else 1.0
            return collect(f, *args, **kwargs)

        sched._collect = driven
        assert [c.token_ids for c in gen.generate(prompts, params)] == plain
        verify_steps[verify_cost] = sched.stats["verify_steps"]
        assert sched.pool.in_use == 0
        if verify_cost == 50.0:
            assert max(sched.spec_policy.backoff.values()) > 1  # failed probes space the next ones out
    # verify steps cost half a plain one: drafting always pays (plain steps only to time them);
    # verify steps cost 50 plain ones: each match length tried once (8 of them), then sparse probes
    assert verify_steps[0.5] >= 20
    assert 2 <= verify_steps[50.0] <= 14


def test_host_policy_learns_accept_by_match_length():
    """A host drafter's SpecPolicy verifies where the accept length learned at a match length pays
    for a verify step (1.5 plain steps here), optimistic while its samples are few; decodes
    plainly where it does not pay; probes such a match length after probe_every x backoff plain
    steps x the verify step's cost in plain steps; and reopens it once probes pay."""
    from jaxspec.spec_policy import PLAIN, HostTree, SpecPolicy, StepCosts, match_key
    tree = HostTree(8)
    pol = SpecPolicy(StepCosts(), {1: [tree]}, plain=True, min_gain=1.1, probe_every=4, explore=1, kept=16)
    clock = iter(range(0, 10_000, 1))

    def read_back(label, n=1):
        for _ in range(n):
            pol.arrived(1, label, next(clock) * (1.5 if label != PLAIN else 1.0))

    assert pol.choose(1, [8]) is None  # plain steps are timed first
    read_back(PLAIN, 2)
    assert pol.choose(1, [8]) == tree  # never verified at 8: tried
    assert pol.choose(1, [0]) is None  # no match, nothing to draft
    pol.verified(tree, [5], [8], 1)
    pol.forget_costs()  # ms: the clock reads seconds
    pol.timed(1, PLAIN, 1e3, 1)
    pol.timed(1, tree.label, 1.5e3, 1)
    pol.verified(tree, [1], [2], 1)
    assert pol.choose(1, [2]) == tree  # one sample of 1 token: 1 + 1 expected, 2 x 1 / 1.5 >= 1.1
    for _ in range(15):
        pol.verified(tree, [1], [2], 1)
    assert pol.choose(1, [8]) == tree and pol.choose(1, [2]) is None  # 16 samples: 1.25 expected
    assert pol.choose(1, [2, 8]) == tree  # mean expected accept (1.25 + 6) / 2 x 1 / 1.5 >= 1.1
    assert pol.choose(1, [2, 0, 0]) is None
    assert pol.backoff[2] == 8  # each verify at 2 that did not pay doubled it (up to 8)
    read_back(PLAIN, 47)
    assert pol.choose(1, [2]) is None
    read_back(PLAIN, 1)  # 48 = probe_every x backoff x a verify step's 1.5 plain ones since 2 last verified
    assert pol.choose(1, [2]) == tree
    pol.verified(tree, [1], [2], 1)  # the probe did not pay: the next waits as long again
    assert pol.choose(1, [2]) is None
    for _ in range(8):  # the text turned repetitive: probes pay, 2 verifies again
        pol.verified(tree, [4], [2], 1)
    assert pol.backoff[2] == 1 and pol.choose(1, [2]) == tree
    assert pol.summary()["chosen"]["1"] == {PLAIN: 6, tree.label: 6}  # every decision counted
    assert [match_key(m) for m in (0, 1, 2, 3, 4, 7, 8, 30)] == [0, 1, 2, 2, 4, 4, 8, 8]


def test_host_drafter_policy_reads_match_lengths(tiny):
    """The scheduler asks the policy with each request's NGRAM match length: with accept learned
    high at long matches and low at none-to-short ones, a request repeating a stretch seen before
    verifies a tree, a fresh one decodes plainly, and one repeating request in the batch lifts it."""
    from jaxspec.scheduler import Scheduler
    from jaxspec.spec_policy import PLAIN, HostTree
    sched = Scheduler(tiny, None, drafter=SpecConfig(num_draft_tokens=8).build(tiny), max_batch=8, max_seq_len=128,
                      num_pages=300, spec_min_gain=1.1, spec_probe_every=1000)
    params = SamplingParams(max_tokens=4)
    fresh = sched.add(list(range(1, 25)) + [3], params)  # its last token was seen once before
    repeated = sched.add([5, 9, 14, 2, 33, 7, 21, 40] * 3, params)  # its last 8+ tokens occurred before
    assert sched._match_keys([fresh, repeated]) == [0, 0]  # nothing folded in yet
    for _ in range(4):  # each call folds at least 16 tokens in
        sched.drafter.prepare([fresh, repeated])
    assert sched._match_keys([fresh, repeated]) == [1, 8]  # the kept matches were renewed
    pol, tree = sched.spec_policy, HostTree(8)
    assert pol.trees_at[1] == pol.trees_at[2] == [tree] and pol.trees_at[4] == [HostTree(4)]  # learn apart
    for rows in (1, 2):
        for label, ms in ((PLAIN, 1.0), (tree.label, 1.5)):
            pol.timed(rows, label, ms, 1)
    pol.emitted = {(tree, 1): 1.1, (tree, 8): 6.0}  # over 20 verify steps each: expected 1.35 and 6.25 tokens
    pol.totals = {(tree, 1): [22.0, 20], (tree, 8): [120.0, 20]}
    assert sched._choice_for([fresh]) == (None, 1)
    assert sched._choice_for([repeated]) == (None, sched.tree_size(1)) == (None, 8)
    assert sched._choice_for([fresh, repeated]) == (None, 8)  # mean expected accept 3.8 x 1 / 1.5
    pol.emitted[(tree, 8)] = 1.2
    assert sched._choice_for([repeated]) == (None, 1)
