"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3) as a Flax NNX module.

Layer weights are stacked on a leading layer axis and the forward scans over them: one compiled
layer body whatever the depth, so compile time stays flat. The KV cache is an explicit pytree
passed in and returned; the forward writes the new tokens' K/V and then attends over the pages.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import attention
from jaxspec.kv_cache import KVCache, slot_coordinates, write_layer
from jaxspec.models.config import ModelConfig


# lax.scan's unroll for the layer loop (bench/step_probe.py compares 1 with the full depth).
LAYER_UNROLL = 1


def rms_norm(x, w, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


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


def apply_rope(x, positions, inv_freq):
    """x [B, T, H, D] in HF's rotate-half layout; positions [B, T]."""
    ang = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Llama(nnx.Module):
    """Weights in [in, out] layout. Random init is for tests and benchmarks; loaders overwrite it."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        rngs = rngs or nnx.Rngs(0)
        L, H, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        hq, hk, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim

        def w(*shape, fan_in):
            return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype))

        def ones(*shape):
            return nnx.Param(jnp.ones(shape, dtype))

        self.embed = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, H), jnp.float32).astype(dtype) * 0.5)
        self.attn_norm = ones(L, H)
        self.wq, self.wk, self.wv = w(L, H, hq, fan_in=H), w(L, H, hk, fan_in=H), w(L, H, hk, fan_in=H)
        self.wo = w(L, hq, H, fan_in=hq)
        if cfg.qkv_bias:
            self.bq, self.bk, self.bv = (nnx.Param(jnp.zeros((L, n), dtype)) for n in (hq, hk, hk))
        if cfg.qk_norm:
            self.q_norm, self.k_norm = ones(L, d), ones(L, d)
        self.mlp_norm = ones(L, H)
        self.w_gate, self.w_up = w(L, H, F, fan_in=H), w(L, H, F, fan_in=H)
        self.w_down = w(L, F, H, fan_in=F)
        self.final_norm = ones(H)
        if not cfg.tie_word_embeddings:
            self.lm_head = w(H, cfg.vocab_size, fan_in=H)

    # -- pieces ------------------------------------------------------------------------------
    def embed_tokens(self, tokens):
        return self.embed[...][tokens]

    def logits(self, h):
        """h: final-normed hidden [..., H] -> float32 logits [..., V]."""
        w = self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        return jnp.einsum("...h,hv->...v", h, w, preferred_element_type=jnp.float32)

    def layer_weights(self):
        names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
        names += ["bq", "bk", "bv"] if self.cfg.qkv_bias else []
        names += ["q_norm", "k_norm"] if self.cfg.qk_norm else []
        return {n: getattr(self, n)[...] for n in names}

    # -- forward -----------------------------------------------------------------------------
    def __call__(self, tokens, positions, cache: KVCache, page_table, kv_lens, q_lens, tree_mask=None,
                 hidden_layers: tuple = (), attn_impl: str = "auto", unroll: int | None = None):
        """Run T new tokens per request through the decoder.

        tokens, positions [B, T]; kv_lens [B] tokens already cached; q_lens [B] valid new tokens;
        tree_mask [B, T, T] or None for causal; unroll: the layer scan's (default LAYER_UNROLL).
        Returns (final-normed hidden [B, T, H], cache,
        hidden states after each layer in hidden_layers, stacked [len, B, T, H] or None).
        """
        cfg = self.cfg
        b, t = tokens.shape
        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        inv_freq = rope_frequencies(cfg)
        page, offset = slot_coordinates(page_table, kv_lens, q_lens, t, cache.page_size)
        x = self.embed_tokens(tokens)

        def layer(carry, xs):
            x, k_pages, v_pages = carry
            lw, li = xs
            h = rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps)
            q = h @ lw["wq"]
            k = h @ lw["wk"]
            v = h @ lw["wv"]
            if cfg.qkv_bias:
                q, k, v = q + lw["bq"], k + lw["bk"], v + lw["bv"]
            q, k, v = q.reshape(b, t, hq, d), k.reshape(b, t, hkv, d), v.reshape(b, t, hkv, d)
            if cfg.qk_norm:
                q, k = rms_norm(q, lw["q_norm"], cfg.rms_norm_eps), rms_norm(k, lw["k_norm"], cfg.rms_norm_eps)
            q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
            k_pages = write_layer(k_pages, li, k, page, offset)
            v_pages = write_layer(v_pages, li, v, page, offset)
            o = attention.paged_attention(q, k_pages, v_pages, li, page_table, kv_lens, q_lens, tree_mask, impl=attn_impl)
            x = x + o.reshape(b, t, hq * d) @ lw["wo"]
            h = rms_norm(x, lw["mlp_norm"], cfg.rms_norm_eps)
            x = x + (jax.nn.silu(h @ lw["w_gate"]) * (h @ lw["w_up"])) @ lw["w_down"]
            return (x, k_pages, v_pages), (x if hidden_layers else None)

        (x, k_pages, v_pages), per_layer = jax.lax.scan(
            layer, (x, cache.k, cache.v), (self.layer_weights(), jnp.arange(cfg.num_layers)),
            unroll=unroll or LAYER_UNROLL)
        hidden = per_layer[jnp.array(hidden_layers)] if hidden_layers else None
        return rms_norm(x, self.final_norm[...], cfg.rms_norm_eps), KVCache(k_pages, v_pages), hidden
