"""The jittable rollout against the Generator: each algorithm's tokens, seeded samples and
logprobs, stops, vmap, a data-parallel mesh, and new weights without a recompile."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import TINY
from jaxspec import Generator, SamplingParams
from jaxspec.drafters.dflash import load_dflash
from jaxspec.drafters.eagle import DraftHead, HeadConfig, load_head
from jaxspec.program_store import compile_count
from jaxspec.rollout import RolloutConfig, jit_rollout, lookup_draft, make_rollout

PAGE = 4
NEW = 20


def test_lookup_draft_finds_latest_match():
    buf = jnp.array([[5, 6, 7, 8, 5, 6, 9, 1, 5, 6, 0, 0]])
    d = lookup_draft(buf, jnp.array([10]), ngram=2, num_draft=3)
    assert d.tolist() == [[9, 1, 5]]  # the later "5 6" is followed by 9 1 5
    assert lookup_draft(buf, jnp.array([4]), 2, 2).tolist() == [[0, 0]]  # "7 8" never seen before


def padded(prompts):
    p = max(map(len, prompts))
    arr = np.zeros((len(prompts), p), np.int32)
    for i, x in enumerate(prompts):
        arr[i, :len(x)] = x
    return jnp.asarray(arr), jnp.asarray([len(x) for x in prompts], jnp.int32)


def prompts_of(seed):
    rng = np.random.default_rng(seed)
    return [list(map(int, (list(rng.integers(0, 62, 3)) * 5)[:n])) for n in (4, 9, 13)]


PROMPTS = prompts_of(0)
TEMPS = [0.0, 1.0, 1.0]  # one greedy row beside sampled ones, in the same call


@functools.cache
def reference(model):
    """The Generator's plain decoding: greedy, then rows at TEMPS with seeds 1..3, with logprobs."""
    gen = Generator(model, None, max_batch=8, max_seq_len=128, num_pages=300, page_size=PAGE)  # test_dflash.py's
    greedy = gen.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=0))
    sampled = gen.generate(PROMPTS, [SamplingParams(max_tokens=NEW, temperature=t, seed=s, ignore_eos=True, logprobs=0)
                                     for t, s in zip(TEMPS, (1, 2, 3))])
    return greedy, sampled


def drafter_for(algorithm, tiny, tiny_eagle3, tiny_dflash):
    if algorithm == "eagle3":
        return load_head(str(tiny_eagle3 / "head"), TINY, tiny), dict(num_steps=3, topk=2, num_draft_tokens=6)
    if algorithm == "eagle":  # an untrained head: drafts mostly rejected, outputs still the target's
        return DraftHead(HeadConfig.for_target(TINY, "eagle"), rngs=nnx.Rngs(1)), dict(num_steps=2, topk=2,
                                                                                        num_draft_tokens=4)
    if algorithm == "dflash":
        return load_dflash(str(tiny_dflash / "drafter"), TINY), dict(num_draft_tokens=4)
    if algorithm == "dflash_tree":  # a tree from the block's per-position top-k
        return load_dflash(str(tiny_dflash / "drafter"), TINY), dict(num_steps=3, topk=3, num_draft_tokens=8)
    return None, dict(num_draft_tokens=4 if algorithm == "prompt_lookup" else 8)


NO_STOP = jnp.full((3, 1), -1, jnp.int32)


@pytest.mark.parametrize("algorithm", ["none", "prompt_lookup", "eagle", "eagle3", "dflash", "dflash_tree"])
def test_rollout_gives_the_generators_tokens_samples_and_logprobs(tiny, tiny_eagle3, tiny_dflash, algorithm):
    head, shape = drafter_for(algorithm, tiny, tiny_eagle3, tiny_dflash)
    algorithm = algorithm.removesuffix("_tree")
    greedy, sampled = reference(tiny)
    toks, lens = padded(PROMPTS)
    seeds = jnp.array([1, 2, 3])
    for sample, ref in ((False, greedy), (True, sampled)):
        fn, params, dparams = jit_rollout(tiny, head, algorithm=algorithm, max_new_tokens=NEW, sample=sample,
                                          page_size=PAGE, **shape)
        out = fn(params, dparams, toks, lens, seeds, temperature=jnp.array(TEMPS) if sample else None,
                 stop_ids=NO_STOP)
        assert out.lengths.tolist() == [NEW] * 3 and not out.stopped.any()
        for i, r in enumerate(ref):
            assert np.asarray(out.tokens[i]).tolist() == r.token_ids, (sample, i)
            np.testing.assert_allclose(np.asarray(out.logprobs[i]), r.logprobs, rtol=1e-4, atol=1e-4)
        accept = np.asarray(out.lengths) / np.asarray(out.steps + (1 if head is not None else 0))
        if algorithm in ("eagle3", "dflash", "prompt_lookup"):  # trained drafters (and repeats) are accepted
            # (less often where two rows of three draw at temperature 1: the tiny DFLASH drafter's
            # coupled drafts, 1.26 a step, its own argmaxes 1.35)
            assert accept.mean() > (1.2 if sample else 1.3), accept
        if algorithm == "none":
            assert out.steps.tolist() == [NEW] * 3


def test_rollout_stops_on_stop_ids_and_eos(tiny, tiny_eagle3):
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    fn, params, dparams = jit_rollout(tiny, head, algorithm="eagle3", max_new_tokens=NEW, page_size=PAGE,
                                      num_steps=3, topk=2, num_draft_tokens=6)
    toks, lens = padded(PROMPTS)
    full = reference(tiny)[0]
    stop = full[0].token_ids[5]  # row 0 stops at that token's first occurrence; the others where it occurs, if at all
    out = fn(params, dparams, toks, lens, jnp.zeros(3, jnp.int32), stop_ids=jnp.array([[stop, -1]] * 3))
    for i, r in enumerate(full):
        want = r.token_ids[:r.token_ids.index(stop) + 1] if stop in r.token_ids else r.token_ids
        n = int(out.lengths[i])
        assert np.asarray(out.tokens[i, :n]).tolist() == want and bool(out.stopped[i]) == (stop in r.token_ids)
        assert not np.asarray(out.tokens[i, n:]).any()
    # by default a row stops at the model's EOS ids
    out = fn(params, dparams, toks, lens, jnp.zeros(3, jnp.int32))
    for i, r in enumerate(full):
        eos = TINY.eos_token_ids[0]
        want = r.token_ids[:r.token_ids.index(eos) + 1] if eos in r.token_ids else r.token_ids
        assert np.asarray(out.tokens[i, :int(out.lengths[i])]).tolist() == want


def test_rollout_filters_rows_given_top_k(tiny, tiny_eagle3):
    """The filter is compiled in when top_k / top_p rows are passed: top_k 1 at temperature 1 is the
    greedy token at every position, drafts or not."""
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    fn, params, dparams = jit_rollout(tiny, head, algorithm="eagle3", max_new_tokens=NEW, sample=True,
                                      page_size=PAGE, num_steps=3, topk=2, num_draft_tokens=6)
    toks, lens = padded(PROMPTS)
    out = fn(params, dparams, toks, lens, jnp.array([1, 2, 3]), temperature=jnp.ones(3),
             top_k=jnp.ones(3, jnp.int32), stop_ids=NO_STOP)
    assert [np.asarray(t).tolist() for t in out.tokens] == [r.token_ids for r in reference(tiny)[0]]


def test_rollout_vmaps_shards_and_takes_new_weights_without_recompiling(tiny, tiny_eagle3):
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    fn, params, dparams = make_rollout(tiny, head, RolloutConfig("eagle3", max_new_tokens=12, page_size=PAGE,
                                                                 num_steps=2, topk=2, num_draft_tokens=4, sample=True))
    groups = [padded(prompts_of(s)) for s in (0, 1)]
    toks = jnp.stack([g[0] for g in groups])
    lens = jnp.stack([g[1] for g in groups])
    seeds = jnp.array([[1, 2, 3], [4, 5, 6]])
    call = jax.jit(fn)
    single = [call(params, dparams, toks[g], lens[g], seeds[g]) for g in range(2)]
    # G groups of rows in one call: vmap over the group axis
    batched = jax.jit(jax.vmap(fn, in_axes=(None, None, 0, 0, 0)))(params, dparams, toks, lens, seeds)
    for g in range(2):
        np.testing.assert_array_equal(np.asarray(batched.tokens[g]), np.asarray(single[g].tokens))
    # a data-parallel mesh over the batch axis (forced host devices): the same tokens
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, P("data"))
    flat = (toks.reshape(6, -1), lens.reshape(6), seeds.reshape(6))
    sharded = jax.jit(fn)(params, dparams, *(jax.device_put(x, rows) for x in flat))
    np.testing.assert_array_equal(np.asarray(sharded.tokens).reshape(2, 3, -1),
                                  np.stack([np.asarray(s.tokens) for s in single]))
    # new weights (an RL update) run in the compiled program
    moved = jax.tree.map(lambda x: x * 1.01 if jnp.issubdtype(x.dtype, jnp.floating) else x, dparams)
    before = compile_count()
    call(params, moved, toks[0], lens[0], seeds[0]).tokens.block_until_ready()
    assert compile_count() == before


def test_rollout_config_errors():
    with pytest.raises(ValueError, match="rollout algorithm 'medusa': choose one of"):
        RolloutConfig("medusa")
    with pytest.raises(ValueError, match="needs its drafter module"):
        make_rollout(None, None, RolloutConfig("eagle3"))


def test_a_large_batch_verifies_a_cut_tree_or_decodes_plainly(tiny, tiny_eagle3, tiny_dflash):
    """The engine's rule: at most max_verify_tokens nodes a step over the batch; a tree cut below
    min_nodes (or a DFLASH block cut at all) gives way to plain decoding. Tokens stay the target's."""
    from jaxspec.drafters.eagle_step import TreeShape
    cfg = RolloutConfig("eagle3", num_steps=3, topk=2, num_draft_tokens=6, max_verify_tokens=12, min_nodes=4)
    assert cfg.tree(1) == TreeShape(3, 2, 6) and cfg.tree(3) == TreeShape(3, 2, 4) and cfg.tree(4) is None
    assert RolloutConfig("eagle3", num_draft_tokens=8, max_verify_tokens=None).tree(1000) == TreeShape(3, 4, 8)
    dflash = RolloutConfig("dflash", num_draft_tokens=4, max_verify_tokens=12)
    assert dflash.tree(3) == TreeShape(3, 1, 4) and dflash.tree(4) is None  # its block is never cut
    sampled = RolloutConfig("eagle3", num_steps=3, topk=2, num_draft_tokens=6, max_verify_tokens=12, min_nodes=4,
                            sample=True, sampled_max_verify_tokens=6)
    assert sampled.tree(1) == TreeShape(3, 2, 6) and sampled.tree(2) is None  # 3 nodes a row < min_nodes
    assert dataclasses.replace(sampled, sampled_max_verify_tokens=None).tree(2) == TreeShape(3, 2, 6)
    assert dataclasses.replace(sampled, sample=False).tree(2) == TreeShape(3, 2, 6)
    greedy, _ = reference(tiny)
    toks, lens = padded(PROMPTS)
    head = load_head(str(tiny_eagle3 / "head"), TINY, tiny)
    for budget, plain in ((12, False), (15, True)):  # 3 rows: a 4-node tree; 5 nodes < min_nodes 6
        fn, params, dparams = jit_rollout(tiny, head, algorithm="eagle3", max_new_tokens=NEW, page_size=PAGE,
                                          num_steps=3, topk=2, num_draft_tokens=6, max_verify_tokens=budget,
                                          min_nodes=6 if plain else 4)
        out = fn(params, dparams, toks, lens, jnp.array([1, 2, 3]), stop_ids=NO_STOP)
        assert [np.asarray(t).tolist() for t in out.tokens] == [r.token_ids for r in greedy], budget
        if plain:
            assert out.steps.tolist() == [NEW] * 3  # one token a target pass after the prefill's
        else:
            assert (np.asarray(out.lengths) > np.asarray(out.steps) + 1).all()  # drafts were accepted
    fn, params, dparams = jit_rollout(tiny, load_dflash(str(tiny_dflash / "drafter"), TINY), algorithm="dflash",
                                      max_new_tokens=NEW, page_size=PAGE, num_draft_tokens=4, max_verify_tokens=8)
    out = fn(params, dparams, toks, lens, jnp.array([1, 2, 3]), stop_ids=NO_STOP)
    assert [np.asarray(t).tolist() for t in out.tokens] == [r.token_ids for r in greedy]
    assert out.steps.tolist() == [NEW] * 3
