"""The layer kernels (pallas/qkv_project, gated_up, matmul_residual) under
interpret=True against their references, and the model and engine on them (attn_impl 'fused':
the fused layers; 'pallas': XLA's layers around the attention kernel) against the jnp path."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec import Generator, SamplingParams
from jaxspec.drafters.eagle import DraftHead, EagleDrafter, HeadConfig
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.kv_cache import KVCache
from jaxspec.models import Llama, ModelConfig
from jaxspec.models.llama import fused_layers, rope_frequencies, rope_table
from jaxspec.pallas.gated_up import gated_up, gated_up_ref
from jaxspec.pallas.matmul_residual import matmul_residual, matmul_residual_ref
from jaxspec.pallas.qkv_project import qkv_project, qkv_project_ref

# head_dim 32: rope's halves are one 16-wide column block each (the kernels' smallest)
CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, max_position=512, eos_token_ids=(63,))


def close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("bias_and_qk_norm", [False, True], ids=["llama", "qwen3-bias"])
def test_qkv_project_matches_reference_and_stores_only_valid_rows(bias_and_qk_norm):
    r = np.random.default_rng(0)
    mp, h, hq, hkv, d, ps = 16, 80, 4, 2, 32, 16  # K = 80: one ragged chunk of 128
    arr = lambda *s, scale=1.0: jnp.asarray(scale * r.standard_normal(s), jnp.float32)
    x, w = arr(mp, h), arr(h, (hq + 2 * hkv) * d, scale=0.2)
    norm = 1 + arr(h, scale=0.1)
    extra = (arr((hq + 2 * hkv) * d, scale=0.1), 1 + arr(d, scale=0.1), 1 + arr(d, scale=0.1)) if bias_and_qk_norm \
        else (None, None, None)
    cos, sin = (t[0, :, 0] for t in rope_table(jnp.arange(mp)[None] + 7, rope_frequencies(CFG)))
    slots = jnp.asarray([17, 40, 3] + [-1] * (mp - 3), jnp.int32)  # three tokens, the rest padding
    kp, vp = arr(2, 6, ps, hkv, d), arr(2, 6, ps, hkv, d)
    want = qkv_project_ref(x, norm, w, *extra, cos, sin, 1, slots, kp, vp, num_q=hq, num_kv=hkv, eps=1e-5)
    got = qkv_project(x, norm, w, *extra, cos, sin, 1, slots, kp + 0, vp + 0, num_q=hq, num_kv=hkv, eps=1e-5,
                      interpret=True)
    close(got[0][:3], want[0][:3])
    close(got[1], want[1])  # the three slots written at layer 1, every other slot as it was
    close(got[2], want[2])
    assert np.array_equal(np.asarray(got[1][0]), np.asarray(kp[0]))


def test_gated_up_and_matmul_residual_match_reference():
    r = np.random.default_rng(1)
    x, norm, w = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in ((32, 64), (64,), (64, 2 * 96)))
    close(gated_up(x, norm, w, eps=1e-6, interpret=True), gated_up_ref(x, norm, w, eps=1e-6))
    for splits, bk in ((2, None), (3, 16)):  # K split over programs; 3 x 2 chunks of 16 run past K = 64
        close(gated_up(x, norm, w, eps=1e-6, splits=splits, bk=bk, interpret=True), gated_up_ref(x, norm, w, eps=1e-6))
    a, wd, res = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in ((16, 96), (96, 64), (16, 64)))
    close(matmul_residual(a, wd, res, interpret=True), matmul_residual_ref(a, wd, res))
    close(matmul_residual(a, wd, res, splits=4, bk=16, interpret=True), matmul_residual_ref(a, wd, res))


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, rngs=nnx.Rngs(4))


@pytest.mark.parametrize("t,tree", [(1, False), (5, True)], ids=["decode", "tree-verify"])
def test_kernel_forwards_match_jnp(model, t, tree):
    """The fused layers, and the unfused ones on the attention kernel: decode over a long page
    table (split-K partials merged by the last split) and a tree verify; the final hidden, a kept
    layer's hidden and every cache slot agree (on the CPU: a GPU's XLA dots take TF32)."""
    b, ps, width = 3, 16, 16
    rng = np.random.default_rng(t)
    tokens = jnp.asarray(rng.integers(0, 64, (b, t)), jnp.int32)
    kv_lens = jnp.asarray([0, 37, 130], jnp.int32)
    q_lens = jnp.asarray([t, max(1, t - 2), t], jnp.int32)
    positions = kv_lens[:, None] + jnp.arange(t)[None]
    page_table = jnp.asarray(1 + np.arange(b * width).reshape(b, width), jnp.int32)
    mask = None
    if tree:
        par = [-1, 0, 0, 1, 2]
        anc = np.eye(t, dtype=bool)
        for j in range(1, t):
            anc[j] |= anc[par[j]]
        mask = jnp.asarray(np.broadcast_to(anc, (b, t, t)))
    outs = {}
    for impl in ("ref", "fused", "pallas"):
        cache = KVCache(*(jnp.full((2, b * width + 1, ps, 2, 32), 0.1, jnp.float32) for _ in range(2)))
        outs[impl] = model(tokens, positions, cache, page_table, kv_lens, q_lens, mask, hidden_layers=(0,),
                           attn_impl=impl)
    for impl in ("fused", "pallas"):
        for i in range(b):
            n = int(q_lens[i])
            close(outs[impl][0][i, :n], outs["ref"][0][i, :n])
            close(outs[impl][2][:, i, :n], outs["ref"][2][:, i, :n])
        close(outs[impl][1].k, outs["ref"][1].k)
        close(outs[impl][1].v, outs["ref"][1].v)


def test_fused_layers_choice():
    assert fused_layers(CFG, 4, "fused") and not fused_layers(CFG, 4, "ref")
    assert not fused_layers(CFG, 4, "auto")  # off the GPU, 'auto' keeps XLA's layers
    narrow = ModelConfig(**{**CFG.__dict__, "head_dim": 16})  # rope halves below the 16-column block
    assert not fused_layers(narrow, 4, "fused")


def test_one_row_padded_to_two_keeps_outputs_and_cache(model, monkeypatch):
    """llama.pads_one_row (GPU only; forced here): a one-row forward run as two rows, the second
    padding, returns the one row's hidden states and layer outputs and writes only its K/V; the
    engine's batch-1 greedy tokens are unchanged, plain and EAGLE-3 (heads kept in step)."""
    from jaxspec.models import llama
    r = np.random.default_rng(3)
    shape = (CFG.num_layers, 8, 16, CFG.num_kv_heads, CFG.head_dim)
    cache = KVCache(jnp.asarray(r.normal(size=shape), jnp.float32), jnp.asarray(r.normal(size=shape), jnp.float32))
    args = (jnp.array([[5]]), jnp.array([[20]]), cache, jnp.array([[2, 6, 0, 0]]), jnp.array([20]), jnp.array([1]))
    want = model(*args, hidden_layers=(0, 1))
    assert llama.pads_one_row(CFG, 1, "auto") is False  # a GPU path only
    monkeypatch.setattr(llama, "pads_one_row", lambda cfg, rows, impl: rows == 1)
    got = model(*args, hidden_layers=(0, 1))
    assert got[0].shape == want[0].shape and got[2].shape == want[2].shape
    close(got[0], want[0])
    close(got[2], want[2])
    close(got[1].k, want[1].k)
    close(got[1].v, want[1].v)
    assert np.array_equal(np.asarray(got[1].k[:, 0]), np.asarray(cache.k[:, 0]))  # the padding row's page 0: untouched
    prompts, params = [list(range(3, 20))], SamplingParams(max_tokens=12, ignore_eos=True)
    kw = dict(max_batch=2, max_seq_len=64, num_pages=12, page_size=16)
    monkeypatch.undo()
    plain = [c.token_ids for c in Generator(model, None, **kw).generate(prompts, params)]
    head = DraftHead(HeadConfig.for_target(CFG, "eagle3"), rngs=nnx.Rngs(5))
    monkeypatch.setattr(llama, "pads_one_row", lambda cfg, rows, impl: rows == 1)
    padded = Generator(model, None, **kw)
    assert [c.token_ids for c in padded.generate(prompts, params)] == plain
    spec = Generator(model, None, drafter=EagleDrafter(head, TreeShape(2, 2, 4)), **kw)
    assert [c.token_ids for c in spec.generate(prompts, params)] == plain
    assert padded.scheduler.pool.in_use == 0 and spec.scheduler.pool.in_use == 0


def test_engine_on_fused_layers_equals_unfused_plain_and_eagle3(model):
    prompts = [[1, 2, 3, 4, 5], list(range(7, 30))]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    kw = dict(max_batch=2, max_seq_len=64, num_pages=12, page_size=16)
    want = [c.token_ids for c in Generator(model, None, attn_impl="ref", **kw).generate(prompts, params)]
    got = [c.token_ids for c in Generator(model, None, attn_impl="fused", **kw).generate(prompts, params)]
    head = DraftHead(HeadConfig.for_target(CFG, "eagle3"), rngs=nnx.Rngs(5))
    spec = Generator(model, None, attn_impl="fused", drafter=EagleDrafter(head, TreeShape(2, 2, 4)), **kw)
    assert got == want
    assert [c.token_ids for c in spec.generate(prompts, params)] == want
    assert spec.scheduler.pool.in_use == 0


def test_engine_on_the_attention_kernel_equals_the_jnp_path():
    """Generator decoding on the attention kernel, whose decode steps take their layer's raw
    projection (norm at one request, rope always: models.llama._run_block), and EAGLE-3 verifying
    there: the jnp path's tokens, at batch 2 and at batch 1, and no page left in use."""
    cfg = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, max_position=512, eos_token_ids=(63,))
    model = Llama(cfg, rngs=nnx.Rngs(6))
    prompts, params = [[1, 2, 3, 4, 5], list(range(7, 30))], SamplingParams(max_tokens=10, ignore_eos=True)
    kw = dict(max_batch=2, max_seq_len=64, num_pages=12, page_size=16)
    want = [c.token_ids for c in Generator(model, None, attn_impl="ref", **kw).generate(prompts, params)]
    kernel = Generator(model, None, attn_impl="pallas", **kw)
    assert [c.token_ids for c in kernel.generate(prompts, params)] == want
    assert kernel.generate([prompts[1]], params)[0].token_ids == want[1]
    head = DraftHead(HeadConfig.for_target(cfg, "eagle3"), rngs=nnx.Rngs(7))  # and EAGLE-3 verifying on the kernels
    spec = Generator(model, None, attn_impl="pallas", drafter=EagleDrafter(head, TreeShape(2, 2, 4)), **kw)
    assert [c.token_ids for c in spec.generate(prompts, params)] == want
    assert kernel.scheduler.pool.in_use == 0 and spec.scheduler.pool.in_use == 0


@pytest.mark.parametrize("qk_norm", [False, True], ids=["kernel-ropes", "roped-before"])
@pytest.mark.parametrize("b", [1, 3], ids=["kernel-merge", "xla-merge"])
def test_decode_on_the_kernel_writes_kv_after_the_last_layer(b, qk_norm, monkeypatch):
    """A decode step on the attention kernel passes each layer's new K/V beside the pages and writes
    every layer's after the last one (attention.defers_kv_write): the final and a kept hidden state
    and every cache slot as the jnp path's, and as the kernel's with the K/V written layer by layer
    before each attention; split-K partials merged by the kernel (batch 1) or by XLA; the kernel
    norming (batch 1) and roping the projection itself, or (q/k normed, Qwen3's) given them roped."""
    from jaxspec import attention
    from jaxspec.models import llama
    cfg = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, max_position=512, eos_token_ids=(63,), qk_norm=qk_norm)
    model = Llama(cfg, rngs=nnx.Rngs(5))
    if qk_norm:  # norm weights away from one, so that a path that skipped them would differ
        for blk in model.layers:
            blk.q_norm[...], blk.k_norm[...] = blk.q_norm[...] * 1.5, blk.k_norm[...] * 0.5
    ps, width = 16, 16
    rng = np.random.default_rng(b)
    tokens = jnp.asarray(rng.integers(0, 64, (b, 1)), jnp.int32)
    kv_lens = jnp.asarray([130, 0, 37][:b], jnp.int32)
    page_table = jnp.asarray(1 + np.arange(b * width).reshape(b, width), jnp.int32)
    pages = jnp.asarray(rng.standard_normal((2, b * width + 1, ps, 2, 64)), jnp.float32)
    assert attention.defers_kv_write(1, pages, None, "pallas") and not attention.defers_kv_write(2, pages, None, "pallas")
    outs = {}
    for name, impl, defer in (("ref", "ref", True), ("deferred", "pallas", True), ("eager", "pallas", False)):
        monkeypatch.setattr(llama, "DEFER_KV_WRITE", defer)
        monkeypatch.setattr(llama, "KERNEL_NORM_MAX_BATCH", 1)  # batch 3: XLA's norm, the kernel's rope
        outs[name] = model(tokens, kv_lens[:, None], KVCache(pages, -pages), page_table, kv_lens,
                           jnp.ones(b, jnp.int32), hidden_layers=(0,), attn_impl=impl)
    for name in ("deferred", "eager"):
        close(outs[name][0], outs["ref"][0])
        close(outs[name][2], outs["ref"][2])
        close(outs[name][1].k, outs["ref"][1].k)
        close(outs[name][1].v, outs["ref"][1].v)
    written = np.asarray(outs["deferred"][1].k) != np.asarray(pages)
    assert written.any(axis=(2, 3, 4)).sum() == 2 * b  # each request's new slot, in both layers, and nothing else
