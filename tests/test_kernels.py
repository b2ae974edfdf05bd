"""Pallas kernels under interpret=True (compiled on a GPU) against their references."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas.accept import accept_tree, accept_tree_ref
from jaxspec.pallas.attention_ref import NEG_INF, paged_attention_ref, prefix_attention_ref
from jaxspec.pallas.paged_attention import COUNT_SLOTS, paged_attention, prefix_attention
from jaxspec.pallas.swiglu import swiglu, swiglu_ref
from jaxspec.pallas.tree_mask import tree_attention_mask


def random_parents(rng, b, n):
    par = np.full((b, n), -1, np.int32)
    for j in range(1, n):
        par[:, j] = rng.integers(0, j, b)
    return par


CASES = [  # (B, T, Hq, Hkv, D, ps, tree, dtype)
    (3, 1, 6, 2, 64, 16, False, jnp.float32),  # decode, GQA 3
    (4, 1, 8, 1, 128, 16, False, jnp.bfloat16),  # decode, GQA 8, bf16
    (2, 21, 8, 8, 64, 16, False, jnp.float32),  # extend, MHA
    (2, 8, 9, 3, 64, 32, True, jnp.float32),  # tree verify
    (2, 40, 4, 1, 128, 16, True, jnp.float32),  # tree verify over two bit words
]


BLOCKINGS = [  # (case, pages_per_block, splits, grid_order): several pages a tile, split-K with empty and
    # partial splits, grid axes launched in other orders (case 4 has two query blocks)
    (0, 1, 1, "bhqs"), (1, 2, 3, "bhqs"), (3, 1, 6, "bhqs"), (3, 4, 2, "bhqs"), (4, 1, 4, "bhqs"), (2, 1, 4, "bhqs"),
    (4, 1, 4, "qhbs"), (1, 2, 3, "hbqs"), (4, 2, 1, "qsbh"),
]


@pytest.mark.parametrize("b,t,hq,hkv,d,ps,tree,dtype", CASES)
def test_paged_attention_kernel_matches_reference(b, t, hq, hkv, d, ps, tree, dtype):
    check_kernel(b, t, hq, hkv, d, ps, tree, dtype)


@pytest.mark.parametrize("merge_in_kernel", [False, True], ids=["xla-merge", "kernel-merge"])
@pytest.mark.parametrize("case,pages_per_block,splits,grid_order", BLOCKINGS)
def test_paged_attention_split_k_and_page_blocks_match_reference(case, pages_per_block, splits, grid_order,
                                                                 merge_in_kernel):
    check_kernel(*CASES[case], pages_per_block=pages_per_block, splits=splits, grid_order=grid_order,
                 merge_in_kernel=merge_in_kernel)


@pytest.mark.parametrize("case,splits", [(3, 1), (1, 3)])
def test_paged_attention_softcap_matches_reference(case, splits):
    # scores scaled up (x4) so that the cap bends them: tanh near-linear would hide a wrong cap
    check_kernel(*CASES[case], softcap=5.0, q_gain=4.0, splits=splits)


@pytest.mark.parametrize("b,t,hq,hkv,d,dtype", [(4, 4, 9, 3, 64, jnp.float32), (2, 1, 8, 1, 128, jnp.bfloat16)])
def test_prefix_attention_kernel_matches_reference(b, t, hq, hkv, d, dtype):
    """The draft tree's prefix attention (eagle_step.attend_drafted merges it with the drafted rows):
    output and base-2 log-sum-exp over each row's kv_len cached keys, none past it (a row with no
    key: log-sum-exp NEG_INF); a table wider than the rows use."""
    rng = np.random.default_rng(t)
    ps, n_pages, width = 16, 40, 8
    k = jnp.asarray(rng.standard_normal((2, n_pages, ps, hkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((2, n_pages, ps, hkv, d)), dtype)
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), dtype)
    kv_lens = jnp.asarray([37, 0, 1, 5 * ps][:b], jnp.int32)
    pt = jnp.asarray(rng.permutation(np.arange(1, n_pages))[:b * width].reshape(b, width), jnp.int32)
    out, lse = prefix_attention(q, k, v, 1, pt, kv_lens, interpret=jax.default_backend() != "gpu")
    with jax.default_matmul_precision("highest"):
        ref, ref_lse = prefix_attention_ref(q.astype(jnp.float32), k[1].astype(jnp.float32), v[1].astype(jnp.float32),
                                            pt, kv_lens)
    live = np.asarray(kv_lens) > 0
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    assert np.abs(np.asarray(out)[live] - np.asarray(ref)[live]).max() < tol
    assert np.abs(np.asarray(lse)[live] - np.asarray(ref_lse)[live]).max() < tol * 10
    assert (np.asarray(lse)[~live] == NEG_INF).all() and (np.asarray(ref_lse)[~live] == NEG_INF).all()
    # only the first kv_len keys count: changing the pages past them changes nothing
    k2 = k.at[1, pt[0, 3]].set(100.0)  # row 0's keys 48..63, past its 37
    assert np.array_equal(np.asarray(prefix_attention(q, k2, v, 1, pt, kv_lens,
                                                      interpret=jax.default_backend() != "gpu")[0]), np.asarray(out))


@pytest.mark.parametrize("case,splits,merge_in_kernel,softcap", [
    (0, 1, None, None), (1, 3, True, None), (1, 3, False, None), (0, 4, False, None), (1, 1, None, 5.0),
    (1, 3, True, 5.0), (0, 4, False, 5.0)])
def test_decode_with_the_new_key_out_of_the_pages_matches_reference(case, splits, merge_in_kernel, softcap):
    """new_kv: a decode step's own key and value passed beside the pages, which hold only the prefix
    (the slot the token would take holds garbage): the same output as with them written, whichever
    path finishes the softmax (the kernel's one split, its merge, XLA's merge), capped or not."""
    check_kernel(*CASES[case], splits=splits, merge_in_kernel=merge_in_kernel, new_kv=True, softcap=softcap,
                 q_gain=1.0 if softcap is None else 4.0)


@pytest.mark.parametrize("normed", [False, True], ids=["kernel-norms", "normed-before"])
@pytest.mark.parametrize("case,splits,merge_in_kernel", [(0, 1, None), (1, 3, True), (0, 4, False)])
def test_decode_norming_and_roping_its_projection_matches_reference(case, splits, merge_in_kernel, normed):
    """projection: the kernel reads a decode step's fused projection [B, (Hq + 2 Hkv) * D] neither
    normed nor roped, scales it by its input's 1 / rms and ropes q and the new key itself, and
    folds that key and value in: the same output as normed, roped q with the K/V in the pages,
    whichever path finishes the softmax; and it returns the new K/V as the pages hold them. With x
    None the projection comes normed (larger batches: models.llama.KERNEL_NORM_MAX_BATCH)."""
    check_kernel(*CASES[case], splits=splits, merge_in_kernel=merge_in_kernel,
                 new_kv="projection-normed" if normed else "projection")


def check_kernel(b, t, hq, hkv, d, ps, tree, dtype, softcap=None, q_gain=1.0, new_kv="", **blocking):
    rng = np.random.default_rng(b * 100 + t)
    n_pages, width, layers = 48, 6, 2
    k = jnp.asarray(rng.standard_normal((layers, n_pages, ps, hkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((layers, n_pages, ps, hkv, d)), dtype)
    q = jnp.asarray(q_gain * rng.standard_normal((b, t, hq, d)), dtype)
    # ragged: empty prefix, one token, page boundaries, a full table
    kv_lens = np.array([0, ps, 2 * ps - 1, 3 * ps + 1][:b] + [0] * max(0, b - 4), np.int32)
    q_lens = np.array([t, max(t - 1, 0), 1, t][:b] + [t] * max(0, b - 4), np.int32)
    if t == 1:
        q_lens[:] = 1
    pt = rng.permutation(np.arange(1, n_pages))[: b * width].reshape(b, width).astype(np.int32)
    mask = None
    if tree:
        mask, _ = tree_attention_mask(jnp.asarray(random_parents(rng, b, t)), jnp.full((b,), t, jnp.int32))
    # interpret mode starts every output buffer as NaN, so an element the kernel never wrote fails
    # the isfinite check below (padding rows included)
    # (on a GPU, JAX_PLATFORMS=cuda, the kernel runs compiled, and the reference's float32 dots are
    # asked for full precision: XLA's GPU default is TF32)
    on_gpu = jax.default_backend() == "gpu"
    pages_in, extra = (k, v), {}
    if new_kv:  # the token's K/V taken out of its slot, which then holds garbage the kernel must not read
        page, slot = pt[np.arange(b), kv_lens // ps], kv_lens % ps
        extra["new_kv"] = (k[1, page, slot], v[1, page, slot])
        pages_in = (k.at[1, page, slot].set(1e4), v.at[1, page, slot].set(-1e4))
    q_in, wanted_kv = q, extra.get("new_kv")
    projection = str(new_kv).startswith("projection")
    if projection:  # q and the new K/V rotated back and divided by 1 / rms(x) of an input x
        from jaxspec.models.llama import rope_table, rotate
        eps, x = 1e-5, jnp.asarray(rng.standard_normal((b, 96)) * 3, dtype)  # 96: the norm's loads 3 x 32
        scale = jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1) + eps)[:, None]
        if new_kv == "projection-normed":
            x, scale = None, 1.0
        cos, sin = rope_table(jnp.asarray(kv_lens + 5)[:, None], 1e4 ** -(jnp.arange(0, d, 2) / d))
        back = lambda a: rotate(a.astype(jnp.float32), (cos, -sin)).reshape(b, -1) / scale
        new_k, new_v = extra.pop("new_kv")
        q_in = jnp.concatenate([back(q), back(new_k[:, None]), new_v.reshape(b, -1) / scale], axis=-1).astype(dtype)
        extra.update(projection=(x, cos, sin), eps=eps)
    out = paged_attention(q_in, *pages_in, 1, pt, kv_lens, q_lens, mask, interpret=not on_gpu, softcap=softcap,
                          **blocking, **extra)
    if projection:
        out, got_kv = out
        kv_tol = 1e-4 if dtype == jnp.float32 else 5e-2
        for got, want in zip(got_kv, wanted_kv):
            assert np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max() < kv_tol
    with jax.default_matmul_precision("highest"):
        ref = paged_attention_ref(q.astype(jnp.float32), k[1].astype(jnp.float32), v[1].astype(jnp.float32), pt,
                                  kv_lens, q_lens, mask, softcap=softcap)
    valid = (np.arange(t)[None] < q_lens[:, None])[:, :, None, None]
    out, ref = np.asarray(out, np.float32), np.asarray(ref)
    assert np.isfinite(out).all()
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    err = np.abs(np.where(valid, out - ref, 0)).max()
    assert err < tol, err
    if blocking.get("merge_in_kernel") and b * hkv <= COUNT_SLOTS:  # arrival counts passed in come back zero
        again, counts = paged_attention(q_in, *pages_in, 1, pt, kv_lens, q_lens, mask, interpret=not on_gpu,
                                        softcap=softcap, counts=jnp.zeros(COUNT_SLOTS, jnp.int32), **blocking, **extra)
        again = again[0] if projection else again
        assert np.array_equal(np.asarray(again, np.float32), out) and not np.asarray(counts).any()


def test_tree_mask_ancestors_and_depth():
    rng = np.random.default_rng(0)
    par = random_parents(rng, 3, 12)
    num = np.array([12, 5, 1], np.int32)
    mask, depth = tree_attention_mask(jnp.asarray(par), jnp.asarray(num))
    mask, depth = np.asarray(mask), np.asarray(depth)
    for b in range(3):
        for i in range(num[b]):
            anc, j = {i}, i
            while par[b, j] >= 0:
                j = par[b, j]
                anc.add(j)
            assert set(np.nonzero(mask[b, i])[0]) == anc
            assert depth[b, i] == len(anc) - 1
        for i in range(num[b], 12):  # padding sees only itself
            assert set(np.nonzero(mask[b, i])[0]) == {i}
    # a 64-node chain: depth 63 needs every doubling round
    mask, depth = tree_attention_mask(jnp.arange(-1, 63, dtype=jnp.int32)[None], jnp.array([64], jnp.int32))
    assert (np.asarray(mask[0]) == np.tril(np.ones((64, 64), bool))).all()
    assert (np.asarray(depth[0]) == np.arange(64)).all()


def test_accept_tree_matches_python():
    rng = np.random.default_rng(1)
    b, n = 64, 10
    par = random_parents(rng, b, n)
    tokens = rng.integers(0, 3, (b, n)).astype(np.int32)  # few symbols, so paths are long
    target = rng.integers(0, 3, (b, n)).astype(np.int32)
    num = rng.integers(1, n + 1, b).astype(np.int32)
    path, count = accept_tree(jnp.asarray(tokens), jnp.asarray(par), jnp.asarray(target), jnp.asarray(num))
    rpath, rcount = accept_tree_ref(tokens, par, target, num)
    np.testing.assert_array_equal(np.asarray(count), rcount)
    for r in range(b):
        np.testing.assert_array_equal(np.asarray(path)[r, :rcount[r] + 1], rpath[r, :rcount[r] + 1])
    assert rcount.max() >= 2


def test_accept_by_sampling_reproduces_target_distribution():
    """Two-token draft tree on a 4-symbol vocabulary: the first emitted token must be distributed as
    the target's p, whatever the draft proposed (chi-square, fixed seed)."""
    p = np.array([0.1, 0.2, 0.3, 0.4])
    n_trials = 20000
    key = jax.random.key(0)
    target = jax.random.categorical(key, jnp.log(jnp.asarray(p)), shape=(n_trials, 3)).astype(jnp.int32)
    tokens = jnp.tile(jnp.array([[0, 3, 1]], jnp.int32), (n_trials, 1))  # root, then two sibling drafts
    parents = jnp.tile(jnp.array([[-1, 0, 0]], jnp.int32), (n_trials, 1))
    path, count = accept_tree(tokens, parents, target, jnp.full((n_trials,), 3, jnp.int32))
    first = np.asarray(jnp.take_along_axis(target, path, axis=1)[:, 0])
    counts = np.bincount(first, minlength=4)
    chi2 = ((counts - p * n_trials) ** 2 / (p * n_trials)).sum()
    assert chi2 < 16.3  # p = 0.001 at 3 degrees of freedom
    # and the drafts were really used: a draft is accepted exactly when the target drew it
    acc = np.asarray(count) > 0
    assert abs(acc.mean() - (p[3] + p[1])) < 0.02


def test_kv_writes_skip_padding_and_compaction_moves_only_accepted():
    """Padded tokens (beyond q_len, or whole padded batch rows) write nothing, not even to the trash
    page; valid tokens land at (page_table[slot // ps], slot % ps); move_slots touches only the
    accepted destinations."""
    from jaxspec.kv_cache import KVCache, move_slots, slot_coordinates, write_layer
    L, N, ps, h, d = 2, 6, 4, 1, 2
    pages = jnp.full((L, N, ps, h, d), -1.0)
    page_table = jnp.array([[1, 2], [3, 4], [0, 0]], jnp.int32)  # row 2: a padded batch row
    kv_lens, q_lens = jnp.array([3, 0, 0]), jnp.array([2, 3, 0])
    new = jnp.arange(3 * 4 * h * d, dtype=jnp.float32).reshape(3, 4, h, d)
    page, off = slot_coordinates(page_table, kv_lens, q_lens, 4, ps)
    out = np.asarray(write_layer(pages, 1, new, page, off))
    want = np.full(pages.shape, -1.0)
    for b, (kv, q) in enumerate(zip([3, 0], [2, 3])):
        for j in range(q):
            s = kv + j
            want[1, int(page_table[b, s // ps]), s % ps] = np.asarray(new[b, j])
    np.testing.assert_array_equal(out, want)
    cache = KVCache(jnp.asarray(out), jnp.asarray(out))
    # row 0 accepts tree nodes [0, 1] -> slots 3, 4 take slots 3 and 4; row 1 keeps node 2 at slot 1
    src = jnp.array([[0, 1, 0, 0], [0, 2, 0, 0], [0, 0, 0, 0]], jnp.int32)
    moved = np.asarray(move_slots(cache, page_table, jnp.array([3, 0, 0]), src, jnp.array([2, 2, 0])).k)
    want2 = out.copy()
    want2[:, 3, 1] = out[:, 3, 2]
    np.testing.assert_array_equal(moved, want2)


@pytest.mark.parametrize("lead,vocab,k,dtype", [((3, 4), 1000, 4, jnp.float32), ((2,), 300, 3, jnp.bfloat16),
                                                ((5,), 64, 1, jnp.float32), ((1,), 8192, 8, jnp.float32)])
def test_top_k_log_softmax_kernel_matches_reference(lead, vocab, k, dtype):
    """The draft tree's top-k (ties to the lower id, a promoted id first) as log_softmax + lax.top_k."""
    from jaxspec.pallas.top_k import top_k_log_softmax, top_k_log_softmax_ref
    rng = np.random.default_rng(vocab)
    x = jnp.asarray(rng.normal(0, 3, lead + (vocab,)), dtype)
    x = x.at[..., 7].set(jnp.max(x, axis=-1))  # every row's best value twice: ids 7 and the argmax
    promote = jnp.asarray(rng.integers(-1, vocab, lead), jnp.int32)
    for p in (None, promote):
        vals, ids = top_k_log_softmax(x, k, p, interpret=jax.default_backend() != "gpu")
        ref_vals, ref_ids = top_k_log_softmax_ref(x, k, p)
        assert vals.shape == ids.shape == lead + (k,) and ids.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
        np.testing.assert_allclose(np.asarray(vals), np.asarray(ref_vals), atol=2e-6)
    top = np.asarray(top_k_log_softmax(x, k, promote, interpret=jax.default_backend() != "gpu")[1])[..., 0]
    np.testing.assert_array_equal(top[np.asarray(promote) >= 0], np.asarray(promote)[np.asarray(promote) >= 0])


def test_top_k_log_softmax_kernel_under_vmap():
    """The rollout vmaps its step over groups: the kernel's batching rule adds a grid axis."""
    from jaxspec.pallas.top_k import top_k_log_softmax, top_k_log_softmax_ref
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(0, 3, (3, 2, 4, 300)), jnp.float32)
    promote = jnp.asarray(rng.integers(-1, 300, (3, 2, 4)), jnp.int32)
    step = jax.jit(jax.vmap(lambda a, p: top_k_log_softmax(a, 4, p, interpret=jax.default_backend() != "gpu")))
    (vals, ids), (ref_vals, ref_ids) = step(x, promote), top_k_log_softmax_ref(x, 4, promote)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_allclose(np.asarray(vals), np.asarray(ref_vals), atol=2e-6)


@pytest.mark.parametrize("m,hidden,inter,dtype", [(1, 96, 48, jnp.float32), (3, 128, 1536, jnp.bfloat16)])
def test_swiglu_takes_the_norm_scale_as_reference(m, hidden, inter, dtype):
    """silu(s * gate) * (s * up), s = 1 / rms(x) taken in the kernel (x's row read in 3 x 32 at
    hidden 96; 1536 columns in blocks of 512): as the reference, and as the unfused norm-then-gate."""
    rng = np.random.default_rng(m)
    x = jnp.asarray(3 * rng.standard_normal((m, hidden)), dtype)
    w = jnp.asarray(rng.standard_normal((hidden, 2 * inter)) / hidden ** 0.5, dtype)
    gate_up = x @ w
    out = swiglu(x, gate_up, eps=1e-5, interpret=jax.default_backend() != "gpu")
    ref = swiglu_ref(x, gate_up, eps=1e-5)
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-5)
    gate, up = jnp.split(normed @ w.astype(jnp.float32), 2, axis=-1)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    for want in (ref, jax.nn.silu(gate) * up):
        want = np.asarray(want, np.float32)
        assert np.abs(np.asarray(out, np.float32) - want).max() < tol * max(1.0, np.abs(want).max())

