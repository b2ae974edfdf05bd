"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3) as a Flax NNX module.

Each layer is its own `Block` with its own arrays, and the forward is a Python loop over them.
A `lax.scan` over weights stacked on a layer axis made XLA copy each layer's slice out before
every multi-row GEMM (the 8B step read its weights about three times: 16.6 ms against 6.9 ms
unrolled on the H100). Q/K/V and gate/up are single fused matrices, concatenated at load: one
GEMM reads the layer's input once. The norms' weights are folded into wqkv's and w_gate_up's rows at
load (loading.layer_weights), so that a decode step's kernels can take the norms' scales themselves.
The KV cache is an explicit pytree passed in and returned.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import attention
from jaxspec.kv_cache import DROP_PAGE, KVCache, slot_coordinates, write_layer, write_layers
from jaxspec.models.config import ModelConfig
from jaxspec.pallas.gated_up import gated_up
from jaxspec.pallas.matmul_residual import matmul_residual
from jaxspec.pallas.paged_attention import COUNT_SLOTS
from jaxspec.pallas.qkv_project import qkv_project
from jaxspec.pallas.rows import padded_rows, rms_norm
from jaxspec.pallas.swiglu import swiglu


def rope_frequencies(cfg: ModelConfig):
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if cfg.rope_scaling is not None:
        factor, low, high, orig = cfg.rope_scaling
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = orig / low, orig / high
        smooth = (orig / wavelen - low) / (high - low)
        scaled = jnp.where(wavelen > low_wl, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = jnp.where(is_mid, mid, scaled)
    return inv


def rope_table(positions, inv_freq):
    """(cos, sin) [B, T, 1, D/2] for positions [B, T]: computed once per forward, shared by layers."""
    ang = positions[..., None].astype(jnp.float32) * inv_freq
    return jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]


def rotate(x, table):
    """x [B, T, H, D] in HF's rotate-half layout."""
    cos, sin = table
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def apply_rope(x, positions, inv_freq):
    return rotate(x, rope_table(positions, inv_freq))


def _param(rngs, shape, fan_in, dtype):
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype))


class Block(nnx.Module):
    """One decoder layer; weights in [in, out] layout, wqkv = [wq | wk | wv] and w_gate_up = [gate | up]
    (per shard, with cfg.shard_groups > 1), each row scaled by its norm's weight."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        H, F = cfg.hidden_size, cfg.intermediate_size
        hq, hk = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.wqkv = _param(rngs, (H, hq + 2 * hk), H, dtype)
        if cfg.qkv_bias:
            self.bqkv = nnx.Param(jnp.zeros((hq + 2 * hk,), dtype))
        if cfg.qk_norm:
            self.q_norm = nnx.Param(jnp.ones((cfg.head_dim,), dtype))
            self.k_norm = nnx.Param(jnp.ones((cfg.head_dim,), dtype))
        self.wo = _param(rngs, (hq, H), hq, dtype)
        self.w_gate_up = _param(rngs, (H, 2 * F), H, dtype)
        self.w_down = _param(rngs, (F, H), F, dtype)

    def project(self, x):
        """The attention's input: x [B, T, H] normed and through wqkv (and its bias), [B, T, (Hq + 2 Hkv) * D]."""
        qkv = rms_norm(x, None, self.cfg.rms_norm_eps) @ self.wqkv[...]
        return qkv + self.bqkv[...] if self.cfg.qkv_bias else qkv

    def heads(self, qkv):
        """The projection's q [B, T, Hq, D], k, v [B, T, Hkv, D], unroped (q and k normed where the model norms them)."""
        cfg = self.cfg
        b, t, _ = qkv.shape
        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        g = cfg.shard_groups  # > 1: each shard's [q k v] together (sharding.py), so a column split is local
        q, k, v = jnp.split(qkv.reshape(b, t, g, -1), [hq // g * d, (hq + hkv) // g * d], axis=-1)
        q, k, v = q.reshape(b, t, hq, d), k.reshape(b, t, hkv, d), v.reshape(b, t, hkv, d)
        if cfg.qk_norm:
            q, k = rms_norm(q, self.q_norm[...], cfg.rms_norm_eps), rms_norm(k, self.k_norm[...], cfg.rms_norm_eps)
        return q, k, v

    def finish(self, x, attn, gating_kernel=False):
        """The rest of the layer, from the attention's output attn [B, T, Hq, D]; with gating_kernel the
        MLP's gating takes its norm's scale itself (pallas/swiglu.py; no shard groups), else XLA's norm and gating."""
        b, t, _ = x.shape
        x = x + attn.reshape(b, t, -1) @ self.wo[...]
        if gating_kernel:
            rows = lambda a: a.reshape(b * t, -1)
            h = swiglu(rows(x), rows(x @ self.w_gate_up[...]), eps=self.cfg.rms_norm_eps,
                       interpret=jax.default_backend() != "gpu")
            return x + h.reshape(b, t, -1) @ self.w_down[...]
        gate_up = rms_norm(x, None, self.cfg.rms_norm_eps) @ self.w_gate_up[...]
        gate, up = jnp.split(gate_up.reshape(b, t, self.cfg.shard_groups, -1), 2, axis=-1)
        return x + (jax.nn.silu(gate) * up).reshape(b, t, -1) @ self.w_down[...]

    def __call__(self, x, rope, attend):
        """x [B, T, H] -> x after the layer; attend(q, k, v [B, T, H*, D], roped) -> [B, T, Hq, D]."""
        q, k, v = self.heads(self.project(x))
        return self.finish(x, attend(rotate(q, rope), rotate(k, rope), v))

    def fused(self, x, cos, sin, slots, k_pages, v_pages, layer, attend, interpret):
        """The layer as four Pallas kernels around attention (pallas/qkv_project.py, gated_up.py,
        matmul_residual.py) on x [Mp, H] rows padded as pallas/rows.py says; attend(q [Mp, Hq*D],
        k_pages, v_pages) -> [Mp, Hq*D]. Returns (x, k_pages, v_pages)."""
        cfg = self.cfg
        opt = lambda name: getattr(self, name)[...] if hasattr(self, name) else None
        q, k_pages, v_pages = qkv_project(x, jnp.ones(x.shape[-1:], x.dtype), self.wqkv[...], opt("bqkv"), opt("q_norm"),
                                          opt("k_norm"), cos, sin, layer, slots, k_pages, v_pages,
                                          num_q=cfg.num_heads, num_kv=cfg.num_kv_heads, eps=cfg.rms_norm_eps,
                                          interpret=interpret)
        x = matmul_residual(attend(q, k_pages, v_pages), self.wo[...], x, interpret=interpret)
        h = gated_up(x, jnp.ones(x.shape[-1:], x.dtype), self.w_gate_up[...], eps=cfg.rms_norm_eps, interpret=interpret)
        return matmul_residual(h, self.w_down[...], x, interpret=interpret), k_pages, v_pages


def fused_layers(cfg: ModelConfig, rows: int, attn_impl: str) -> bool:
    """Whether a forward runs Block.fused: for impl 'fused' (interpreted off the GPU), where the
    kernels' shape rules hold, never under a mesh (the kernels see whole matrices). Until 'auto' padded
    one-row forwards (pads_one_row) it chose these kernels for SmolLM2's batch-1 decode: 1.34 ms against
    1.49 in XLA's one-row layers on the H200 (decode-smol-NVIDIA-H200.json, 47960d2), but 1.36 against
    1.19 at batch 8, where XLA's autotuned GEMMs beat them (fused_probe-NVIDIA-H200.json: 2-6x per op)."""
    if attn_impl != "fused" or jax.sharding.get_abstract_mesh().size > 1 or cfg.shard_groups != 1:
        return False
    return cfg.head_dim // 2 % 16 == 0 and cfg.hidden_size % 16 == 0 and cfg.intermediate_size % 16 == 0


ONE_ROW_MAX_HIDDEN = 1024  # 'auto' pads one-row forwards of models up to this width (pads_one_row)


def pads_one_row(cfg: ModelConfig, rows: int, attn_impl: str) -> bool:
    """Whether a one-row forward (batch-1 decode) runs as two rows, the second padding: under 'auto'
    on a GPU, for a model up to ONE_ROW_MAX_HIDDEN wide on one device, whose steps are launches more
    than bytes. XLA's GEMMs of two rows beat both its one-row dots and the fused kernels: SmolLM2's
    batch-1 decode step took 0.92 ms padded against 1.10 through Block.fused, alternately in one
    process on the H200 (layer_ablation-padrow-smol-), and the Generator's plain batch-1 decoding
    on MT-bench ran 964 tokens/s against 849 (spec-padrow-on-, spec-padrow-off-: two processes, off
    first; EAGLE-3 6:4:32, whose steps verify 32 rows, ran 1948 against 1855 there). At the widest
    such shape, Qwen3-0.6B's (1024, random weights), 1.47 ms against 1.85 (layer_ablation-padrow-qwen3-)."""
    return (attn_impl == "auto" and jax.default_backend() == "gpu" and rows == 1 and cfg.hidden_size <= ONE_ROW_MAX_HIDDEN
            and jax.sharding.get_abstract_mesh().size <= 1 and cfg.shard_groups == 1)


def _vocab_parallel_lookup(table, tokens):
    """One shard's rows of the embedding [V / tp, H]: the tokens it holds, zeros elsewhere, summed
    over the shards (each token is found in exactly one: the sum is exact)."""
    from jaxspec.sharding import AXIS
    n = table.shape[0]
    local = tokens - jax.lax.axis_index(AXIS) * n
    found = (local >= 0) & (local < n)
    x = jnp.where(found[..., None], table[jnp.clip(local, 0, n - 1)], jnp.zeros((), table.dtype))
    return jax.lax.psum(x, AXIS)


class Llama(nnx.Module):
    """Random init is for tests and benchmarks; loaders overwrite it."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        rngs = rngs or nnx.Rngs(0)
        H = cfg.hidden_size
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, H), jnp.float32).astype(dtype) * 0.5)
        self.layers = nnx.List([Block(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = nnx.Param(jnp.ones((H,), dtype))
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (H, cfg.vocab_size), H, dtype)

    @property
    def dtype(self):
        return self.embed[...].dtype

    def embed_tokens(self, tokens):
        """Under a tensor-parallel mesh the table is split by vocabulary (sharding.py): each shard
        looks up the tokens in its own rows, and one all-reduce of [B, T, H] sums the rows found.
        Left to XLA's partitioner, a batch-1 step on the GPU all-gathered the whole table: a 1.95 ms
        NCCL all-gather in a 3.4 ms step (8B shape, 8 layers, two H100s; tp_step-*.json as committed in dec7aa2)."""
        from jaxspec import sharding
        table = self.embed[...]
        mesh = jax.sharding.get_abstract_mesh()
        tp = sharding.tp_size(mesh)
        if tp == 1 or table.shape[0] % tp:
            return table[tokens]
        P = jax.sharding.PartitionSpec  # manual over the TP axis only: a 'data' axis stays XLA's
        return jax.shard_map(_vocab_parallel_lookup, mesh=mesh, in_specs=(P(sharding.AXIS, None), P()),
                             out_specs=P(), axis_names={sharding.AXIS}, check_vma=False)(table, tokens)

    def logits(self, h):
        """h: final-normed hidden [..., H] -> float32 logits [..., V]."""
        w = self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        return jnp.einsum("...h,hv->...v", h, w, preferred_element_type=jnp.float32)

    def __call__(self, tokens, positions, cache: KVCache, page_table, kv_lens, q_lens, tree_mask=None,
                 hidden_layers: tuple = (), attn_impl: str = "auto"):
        """Run T new tokens per request through the decoder.

        tokens, positions [B, T]; kv_lens [B] tokens already cached; q_lens [B] valid new tokens;
        tree_mask [B, T, T] or None for causal. Returns (final-normed hidden [B, T, H], cache,
        hidden states after each layer in hidden_layers, stacked [len, B, T, H] or None).
        """
        cfg = self.cfg
        b, t = tokens.shape
        if pads_one_row(cfg, b * t, attn_impl):  # a second row, of padding: nothing cached, its output dropped
            two = lambda a: jnp.concatenate([a, jnp.zeros_like(a)])
            mask = None if tree_mask is None else two(tree_mask)
            h, cache, hidden = self(two(tokens), two(positions), cache, two(page_table), two(kv_lens), two(q_lens), mask,
                                    hidden_layers, attn_impl)
            return h[:1], cache, None if hidden is None else hidden[:, :1]
        rope = rope_table(positions, rope_frequencies(cfg))
        page, offset = slot_coordinates(page_table, kv_lens, q_lens, t, cache.page_size)
        k_pages, v_pages = cache.k, cache.v
        x = self.embed_tokens(tokens)
        kept = {}
        counts = jnp.zeros((COUNT_SLOTS,), jnp.int32)  # the attention kernel's, passed from layer to layer
        fused = fused_layers(cfg, b * t, attn_impl)
        # a decode step's K/V written after the last layer, all layers in one scatter each for K and V
        defer = DEFER_KV_WRITE and not fused and attention.defers_kv_write(t, cache.k, tree_mask, attn_impl)
        deferred = []  # with defer: each layer's (k, v)
        if fused:
            # rows padded once for the whole stack; each row's rope table and cache slot (-1: padding)
            mp = padded_rows(b * t)
            rows = lambda a, fill=0: jnp.pad(a.reshape(b * t, -1), ((0, mp - b * t), (0, 0)), constant_values=fill)
            x = rows(x)
            cos, sin = rows(rope[0]), rows(rope[1])
            slots = rows(jnp.where(page == DROP_PAGE, -1, page * cache.page_size + offset), -1)[:, 0]
        for li, block in enumerate(self.layers):
            graphdef, state = nnx.split(block)
            if fused:
                x, k_pages, v_pages, counts = _run_block_fused(graphdef, attn_impl, state, x, cos, sin, slots, k_pages,
                                                               v_pages, jnp.int32(li), page_table, kv_lens, q_lens,
                                                               tree_mask, counts, b, t)
            else:
                x, k_pages, v_pages, counts, new = _run_block(graphdef, attn_impl, state, x, rope, k_pages, v_pages,
                                                              jnp.int32(li), page, offset, page_table, kv_lens,
                                                              q_lens, tree_mask, counts, defer)
                if defer:
                    deferred.append(new)
            if li in hidden_layers:
                kept[li] = x
        if defer:
            k_pages, v_pages = write_layers(k_pages, v_pages, deferred, page, offset)
        if fused:
            x = x[:b * t].reshape(b, t, -1)
            kept = {li: h[:b * t].reshape(b, t, -1) for li, h in kept.items()}
        hidden = jnp.stack([kept[i] for i in hidden_layers]) if hidden_layers else None
        return rms_norm(x, self.final_norm[...], cfg.rms_norm_eps), KVCache(k_pages, v_pages), hidden


DEFER_KV_WRITE = True  # attention.defers_kv_write's steps write their K/V after the last layer
NORM_ROPE_IN_KERNEL = True  # and, for models without q/k norms or a QKV bias, their attention kernel norms and ropes
KERNEL_NORM_MAX_BATCH = 1  # the attention norm taken in the kernel up to this many requests
MLP_NORM_IN_KERNEL = True  # and then the MLP norm's scale in the gating kernel (pallas/swiglu.py)


def causal_mask(t: int, segments=None):
    """Which key each query may see: [T, S] causal, or with segments [B, T] (packed sequences)
    [B, T, S] causal within the query's own segment."""
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    return causal if segments is None else causal[None] & (segments[:, :, None] == segments[:, None, :])


def dense_forward(model: Llama, tokens, hidden_layers: tuple = (), segments=None, positions=None):
    """Whole sequences [B, T] through the decoder with causal attention and no KV cache, as training
    reads the target: (final-normed hidden [B, T, H], outputs of hidden_layers stacked [len, B, T, H]
    or None). Rows are one right-padded sequence each, or several packed ones: segments [B, T] (a
    token attends within its own segment) and positions [B, T] (restarting at each). Padding's
    positions hold padding's outputs."""
    cfg = model.cfg
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    rope = rope_table(positions, rope_frequencies(cfg))
    mask = None if segments is None else causal_mask(t, segments)[:, None]  # [B, 1, T, S]
    attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=mask is None).astype(q.dtype)
    x = model.embed_tokens(tokens)
    kept = {}
    for i, block in enumerate(model.layers):
        x = block(x, rope, attend)
        if i in hidden_layers:
            kept[i] = x
    hidden = jnp.stack([kept[i] for i in hidden_layers]) if hidden_layers else None
    return rms_norm(x, model.final_norm[...], cfg.rms_norm_eps), hidden


@functools.partial(jax.jit, static_argnums=(0, 1, 15))
def _run_block(graphdef, attn_impl, state, x, rope, k_pages, v_pages, layer, page, offset, page_table, kv_lens,
               q_lens, tree_mask, counts, defer):
    """One layer, its K/V written into the pages at `layer` (a traced index), or with `defer`
    passed to the attention beside them and returned, (k, v), for the caller to write. Jitted so
    that a program traces and lowers the layer once, not once per layer: identical calls hit JAX's
    trace cache and share one lowered function, which XLA inlines (the executable is the unrolled
    one). counts: the attention kernel's (attention.local_paged_attention), returned for the next layer."""
    block = nnx.merge(graphdef, state)
    kw = dict(impl=attn_impl, counts=counts)
    if defer and NORM_ROPE_IN_KERNEL and not (block.cfg.qk_norm or block.cfg.qkv_bias or block.cfg.shard_groups > 1):
        # the kernel reads the projection as it is and ropes q and the new key itself, and for one
        # request takes x's norm too: XLA's rope after the projection cost a kernel a layer (0.21 ms
        # of the 8B batch-1 step's 4.53 on the H200, layer_ablation-rope-8b-), the norm before it
        # 0.07 more at batch 1. Each program's norm of its request's x cost more than XLA's one kernel
        # for all elsewhere: 0.36 ms of an 8B batch-64 step (layer_ablation-normrope-8b-), 0.03 of
        # SmolLM2's batch-8 one (1.139 ms against 1.109, -normrope-smol- / -rope-smol-); level at 8B batch 8
        cos, sin = rope
        normed = x.shape[0] > KERNEL_NORM_MAX_BATCH
        (out, new), counts = attention.paged_attention(
            block.project(x) if normed else x @ block.wqkv[...], k_pages, v_pages, layer, page_table,
            kv_lens, q_lens, projection=(None if normed else x, cos, sin), eps=block.cfg.rms_norm_eps, **kw)
        # and for as few requests the MLP norm's scale is the gating kernel's
        return (block.finish(x, out, gating_kernel=not normed and MLP_NORM_IN_KERNEL), k_pages, v_pages, counts,
                tuple(a[:, None] for a in new))
    new = None

    def attend(q, k, v):
        nonlocal k_pages, v_pages, counts, new
        if defer:
            new = (k, v)
        else:
            k_pages = write_layer(k_pages, layer, k, page, offset)
            v_pages = write_layer(v_pages, layer, v, page, offset)
        out, counts = attention.paged_attention(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask,
                                                new_kv=(k[:, 0], v[:, 0]) if defer else None, **kw)
        return out
    x = block(x, rope, attend)
    return x, k_pages, v_pages, counts, new


@functools.partial(jax.jit, static_argnums=(0, 1, 15, 16))
def _run_block_fused(graphdef, attn_impl, state, x, cos, sin, slots, k_pages, v_pages, layer, page_table, kv_lens,
                     q_lens, tree_mask, counts, b, t):
    """_run_block for Block.fused: x [Mp, H] holds the b * t tokens' rows, padded."""
    block = nnx.merge(graphdef, state)

    def attend(q, k_pages, v_pages):  # q [Mp, Hq * D]: the token layout
        nonlocal counts
        out, counts = attention.paged_attention(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask,
                                                impl=attn_impl, token_rows=x.shape[0], tokens=t, counts=counts)
        return out
    x, k_pages, v_pages = block.fused(x, cos, sin, slots, k_pages, v_pages, layer, attend, jax.default_backend() != "gpu")
    return x, k_pages, v_pages, counts
