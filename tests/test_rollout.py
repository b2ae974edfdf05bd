"""The jittable whole-loop function against the Generator, under jit and vmap."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec import Generator, SamplingParams
from jaxspec.rollout import jit_rollout, lookup_draft, rollout


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


def test_rollout_matches_generator_greedy_and_sampled(tiny):
    rng = np.random.default_rng(0)
    prompts = [list(map(int, (list(rng.integers(0, 62, 3)) * 5)[:n])) for n in (4, 9, 13)]
    toks, lens = padded(prompts)
    seeds = jnp.array([1, 2, 3])
    gen = Generator(tiny, None, max_batch=4, max_seq_len=128, num_pages=100, page_size=4)
    for temp in (0.0, 1.0):
        fn, state = jit_rollout(tiny, max_new_tokens=20, num_draft=3, temperature=temp, page_size=4)
        out, n = fn(state, toks, lens, seeds)
        ref = gen.generate(prompts, [SamplingParams(max_tokens=20, temperature=temp, seed=s, ignore_eos=True)
                                     for s in (1, 2, 3)])
        for i, r in enumerate(ref):
            assert int(n[i]) == 20
            assert np.asarray(out[i]).tolist() == r.token_ids, temp


def test_rollout_vmaps_and_stops_at_eos(tiny):
    graphdef, state = nnx.split(tiny)
    toks, lens = padded([[1, 2, 3, 1, 2], [7, 8, 9, 7, 8]])
    f = jax.jit(jax.vmap(lambda t, l, s: rollout(graphdef, state, t, l, s, max_new_tokens=12, num_draft=2)))
    out, n = f(toks[:, None], lens[:, None], jnp.array([[0], [0]]))
    single, _ = jax.jit(lambda t, l, s: rollout(graphdef, state, t, l, s, max_new_tokens=12, num_draft=2))(
        toks, lens, jnp.array([0, 0]))
    np.testing.assert_array_equal(np.asarray(out[:, 0]), np.asarray(single))
    eos = int(single[0, 4])
    out, n = jax.jit(lambda t, l, s: rollout(graphdef, state, t, l, s, max_new_tokens=12, num_draft=2, eos_id=eos))(
        toks, lens, jnp.array([0, 0]))
    first = list(np.asarray(single[0])).index(eos)
    assert int(n[0]) == first + 1 and np.asarray(out[0, : first + 1]).tolist() == np.asarray(single[0, : first + 1]).tolist()
