"""The Mosaic GPU tree-verify kernel against the reference: interpreted on CPU, compiled on a GPU
(run there with JAX_PLATFORMS=cuda: conftest pins the CPU otherwise)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas.attention_ref import paged_attention_ref
from jaxspec.pallas.tree_mask import tree_attention_mask
from jaxspec.pallas.verify_hopper import supports, verify_tree_hopper
from test_kernels import random_parents

ON_GPU = jax.default_backend() == "gpu"
# cached prefixes: empty; one past a 128-key tile; mid-page; exactly on a tile boundary
CASES = [  # (B, T, Hq, Hkv, D, ps, tree, kernel options, kv_lens)
    # 8B-like GQA 4, head_dim 128, 28 tokens padded to 32; the overlapped loop (ping-pong)
    (2, 28, 4, 1, 128, 16, True, dict(overlap=True), [0, 150]),
    (2, 64, 3, 1, 64, 16, False, {}, [256, 129]),  # SmolLM2's GQA 3, D 64, a chain: 192 rows padded to 256
    # persistent CTAs: two for three requests, so one takes two items (its ring, after an odd
    # tile count, and its queries run on), the output through the last K slot of a ring of three
    # (the default) or two tiles
    (3, 20, 4, 1, 128, 16, True, dict(persistent=2), [100, 0, 150]),
    (3, 20, 4, 1, 128, 16, True, dict(persistent=2, stages=2), [100, 0, 150]),
    (4, 40, 4, 1, 128, 32, True, dict(block_kv=64, stages=3, overlap=True), [0, 129, 150, 256]),  # pages of 32
    (3, 64, 8, 2, 128, 16, True, dict(block_kv=64, wg_rows=128), [0, 129, 150]),  # 128 rows a consumer: one CTA a head
    # two CTAs a head: a cluster whose K/V copies are multicast to both, or apart
    (3, 64, 8, 2, 128, 16, True, dict(overlap=True, multicast=True), [0, 129, 150]),
    (3, 64, 8, 2, 128, 16, True, dict(multicast=False), [0, 129, 150]),
    (2, 64, 16, 2, 128, 8, True, dict(overlap=True), [0, 120]),  # GQA 8: four CTAs a head; pages of 8
    (3, 64, 8, 2, 128, 16, True, dict(stages=3), [0, 129, 150]),  # three 128-key tiles in flight
    (3, 64, 8, 2, 128, 16, True, dict(block_kv=192), [0, 192, 200]),  # 192-key tiles
    (3, 64, 8, 2, 128, 16, True, dict(block_kv=192, overlap=True, pingpong=False), [0, 192, 200]),
    (3, 64, 8, 2, 128, 16, True, dict(persistent=4), [0, 129, 150]),  # 12 items on 4 CTAs
    (3, 64, 8, 2, 128, 16, True, dict(persistent=5, overlap=True), [0, 129, 150]),
    (4, 16, 4, 1, 128, 16, True, dict(persistent=3, stages=3), [0, 129, 150, 256]),  # one query buffer
    (3, 64, 8, 2, 128, 16, True, dict(persistent=5, block_kv=64, stages=4), [0, 129, 150]),
    (2, 64, 3, 1, 64, 16, False, dict(persistent=3), [256, 129]),  # SmolLM2's heads, as the engine runs them
    # the softmax's two forms where the default takes the other (one CTA a head: the row max each tile)
    (3, 20, 4, 1, 128, 16, True, dict(persistent=2, stale_max=True), [100, 0, 150]),
    (3, 64, 8, 2, 128, 16, True, dict(persistent=4, stale_max=False), [0, 129, 150]),
]
if not ON_GPU:  # the interpreter runs every warpgroup as a thread (and has no clusters): four cases cover its
    CASES = CASES[:4]  # paths, and the stale-max softmax is the spike test's


@pytest.mark.parametrize("b,t,hq,hkv,d,ps,tree,opts,kv_lens", CASES)
def test_verify_tree_hopper_matches_reference(b, t, hq, hkv, d, ps, tree, opts, kv_lens):
    check_against_reference(b, t, hq, hkv, d, ps, tree, opts, kv_lens)


@pytest.mark.parametrize("t,opts", [(32, dict(stale_max=True))]  # (the interpreter: one CTA a head, half the rows)
                         + ([(64, {}), (64, dict(persistent=2)), (64, dict(overlap=True))] if ON_GPU else []))
def test_verify_tree_hopper_settles_scores_far_above_the_first_tiles(t, opts):
    """A row's reference max comes from an item's first tile and moves only where a later tile's P
    would pass 2^STALE_SLACK: keys scaled by 60 in the second and third tiles (scores some 200 log2
    units above the first tile's) must be caught and the tile redone with its row max."""
    # GQA 4 as the 8B's, one KV head: the interpreter runs each head's CTAs in turn
    check_against_reference(2, t, 4, 1, 128, 16, True, opts, [300, 150], spike=(range(140, 270), 60.0))


def check_against_reference(b, t, hq, hkv, d, ps, tree, opts, kv_lens, spike=None):
    rng = np.random.default_rng(t)
    n_pages, width = 104, 24  # 24 pages of 16 hold 256 + 64 keys
    k = rng.standard_normal((2, n_pages, ps, hkv, d))
    v = jnp.asarray(rng.standard_normal((2, n_pages, ps, hkv, d)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.bfloat16)
    kv_lens = np.array(kv_lens, np.int32)
    q_lens = np.array([t, t - 3, 1, t][:b], np.int32)
    pt = rng.permutation(np.arange(1, n_pages))[: b * width].reshape(b, width).astype(np.int32)
    if spike is not None:  # (cached positions, factor): those keys of every request scaled
        positions, factor = spike
        for r in range(b):
            for pos in positions:
                if pos < kv_lens[r]:
                    k[1, pt[r, pos // ps], pos % ps] *= factor
    k = jnp.asarray(k, jnp.bfloat16)
    mask = None
    if tree:
        mask, _ = tree_attention_mask(jnp.asarray(random_parents(rng, b, t)), jnp.full((b,), t, jnp.int32))
    assert supports(q, k, mask, block_kv=opts.get("block_kv"))
    out = verify_tree_hopper(q, k, v, 1, pt, kv_lens, q_lens, mask, **opts, interpret=not ON_GPU)
    ref = paged_attention_ref(q.astype(jnp.float32), k[1].astype(jnp.float32), v[1].astype(jnp.float32), pt,
                              kv_lens, q_lens, mask)
    valid = (np.arange(t)[None] < q_lens[:, None])[:, :, None, None]
    out, ref = np.asarray(out, np.float32), np.asarray(ref)
    assert np.isfinite(out).all()
    err = np.abs(np.where(valid, out - ref, 0)).max()
    assert err < 2e-2, err


def test_verify_tree_hopper_declines_what_it_cannot_run():
    q = jnp.zeros((2, 16, 8, 128), jnp.bfloat16)
    pages = jnp.zeros((1, 4, 16, 2, 128), jnp.bfloat16)
    assert supports(q, pages, None)
    assert not supports(q, pages, None, softcap=30.0)
    assert not supports(q.astype(jnp.float32), pages.astype(jnp.float32), None)  # float32: Triton's IEEE dots
    assert not supports(jnp.zeros((2, 65, 8, 128), jnp.bfloat16), pages, None)  # > 64 tokens: two bit words
    assert not supports(q, jnp.zeros((1, 4, 4, 2, 128), jnp.bfloat16), None)  # pages under TMA's 8-row tile
    # page-table rows too long for shared memory beside the ring (a 2M-token context in pages of 16)
    assert supports(q, pages, None, pages_per_seq=1024)
    assert not supports(q, pages, None, pages_per_seq=1 << 17)
    lens = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="bytes of shared memory"):
        verify_tree_hopper(q, pages, pages, 0, jnp.zeros((2, 1 << 17), jnp.int32), lens, lens, interpret=True)
    with pytest.raises(ValueError, match="multicast pairs a head's CTAs"):  # 16 tokens x GQA 4: one CTA a head
        verify_tree_hopper(q, pages, pages, 0, jnp.zeros((2, 4), jnp.int32), lens, lens, multicast=True)


def test_attention_dispatch_sends_verify_to_mosaic_and_decode_to_triton(monkeypatch):
    """impl="mosaic" (and "auto" on Hopper): a 16-token verify takes the Mosaic kernel; decode (one token) and shapes the
    Mosaic kernel declines stay on the Triton one."""
    from jaxspec import attention
    from jaxspec.pallas import paged_attention as triton_kernel
    from jaxspec.pallas import verify_hopper
    calls = []
    monkeypatch.setattr(verify_hopper, "verify_tree_hopper", lambda *a, **k: calls.append("mosaic") or a[0])
    monkeypatch.setattr(triton_kernel, "paged_attention", lambda *a, **k: calls.append("triton") or a[0])
    pages = jnp.zeros((1, 4, 16, 2, 128), jnp.bfloat16)
    lens = jnp.zeros((2,), jnp.int32)
    pt = jnp.zeros((2, 4), jnp.int32)
    for t, dtype in ((16, jnp.bfloat16), (1, jnp.bfloat16), (16, jnp.float32)):
        q = jnp.zeros((2, t, 8, 128), dtype)
        attention.paged_attention(q, pages.astype(dtype), pages.astype(dtype), 0, pt, lens, lens, impl="mosaic")
    # page-table rows too long for the Mosaic kernel's shared memory: Triton's
    attention.paged_attention(q.astype(jnp.bfloat16), pages, pages, 0, jnp.zeros((2, 1 << 17), jnp.int32), lens, lens,
                              impl="mosaic")
    assert calls == ["mosaic", "triton", "triton", "triton"]
    # 'auto' on a Hopper GPU: trees to the Mosaic kernel and decode to Triton's, at every batch (the page
    # table has the engine's full width: only the kernels stop at each request's length)
    calls.clear()
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(attention, "on_hopper", lambda: True)
    lens8, pt8 = jnp.zeros((8,), jnp.int32), jnp.zeros((8, 4), jnp.int32)
    for b, t in ((8, 16), (8, 1), (2, 16)):
        q = jnp.zeros((b, t, 8, 128), jnp.bfloat16)
        attention.paged_attention(q, pages, pages, 0, pt8[:b], lens8[:b], lens8[:b])
    assert calls == ["mosaic", "triton", "mosaic"]


def test_verify_probe_cuts_still_apply_to_the_kernel():
    """bench/probes/verify_probe.py and verify_timeline.py time copies of this kernel with one part edited
    out or undone; each edit must still find its text in the kernel's source, or the probe stops."""
    import os
    import sys
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    sys.path[:0] = [bench, os.path.join(bench, "probes")]
    try:
        import verify_probe
        import verify_timeline
    finally:
        del sys.path[:2]
    edits_of = verify_probe.CUTS + verify_timeline.UNDO + [verify_timeline.OUT_VIA_QUERIES] + verify_timeline.STALE
    for name, edits in edits_of:
        verify_probe.patched(name, edits)  # each edit finds its text in exactly one of the kernel's modules
