"""Why does one decode step get slow at large batch on the H100? Times a SmolLM2-shaped decode step
(random bf16 weights, jaxspec.train_data.decode: forward + sampling) over batch and cache length,
with the layer scan rolled and unrolled, the forward and the sampling alone, and counts the copies
of cache-sized buffers in the compiled step. Writes bench/results/step_probe-<device>.json.

    python bench/step_probe.py [--model /path/to/smollm2.gguf]
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from flax import nnx

from common import write_results
from jaxspec import train_data
from jaxspec.kv_cache import KVCache
from jaxspec.models import Llama, ModelConfig, llama

SMOL = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                   num_kv_heads=3, head_dim=64, max_position=8192, eos_token_ids=(2,), tie_word_embeddings=True)


def time_steps(fn, cache, *a, n=10):
    cache, tok = fn(cache, *a)
    jax.block_until_ready(tok)
    t0 = time.perf_counter()
    for _ in range(n):
        cache, tok = fn(cache, *a)
    jax.block_until_ready(tok)
    return 1e3 * (time.perf_counter() - t0) / n


def cache_copies(compiled_text, cache_shape):
    dims = ",".join(map(str, cache_shape))
    return sum(1 for l in compiled_text.splitlines() if " copy(" in l and f"[{dims}]" in l)


def time_self_generate(model, label):
    """Whole batches through train_data.self_generate (prefill + 48 steps at batch 1024)."""
    import numpy as np
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(100, 40000, int(rng.integers(20, 30))))) for _ in range(2048)]
    t0 = time.perf_counter()
    train_data.self_generate(model, prompts[:1024], np.full(1024, 0.8), 0, 48, [2], 1024)  # compiles
    t1 = time.perf_counter()
    train_data.self_generate(model, prompts, np.full(2048, 0.8), 0, 48, [2], 1024)
    t2 = time.perf_counter()
    row = dict(what="self_generate", model=label, batch=1024, new_tokens=48, first_batch_s=t1 - t0,
               batch_s=(t2 - t1) / 2, dtype=str(model.embed[...].dtype),
               weights_on=str(list(model.embed[...].devices())[0]))
    print(row, flush=True)
    return row


def main():
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="also time the real model's generation (a GGUF path or name)")
    args = ap.parse_args()
    model = Llama(SMOL, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    g, st = nnx.split(model)
    rows = []
    real_attention, real_write = llama.attention.paged_attention, llama.write_layer
    for unroll, b, s, skip in [(1, 64, 160, ""), (1, 1024, 160, ""), (1, 1024, 640, ""), (30, 1024, 640, ""),
                               (1, 1024, 640, "attention"), (1, 1024, 640, "kv_write")]:
        llama.LAYER_UNROLL = unroll
        # without attention (queries pass through) or without the K/V write: which part scales with the cache
        llama.attention.paged_attention = (lambda q, *a, **k: q) if skip == "attention" else real_attention
        llama.write_layer = (lambda pages, *a: pages) if skip == "kv_write" else real_write
        jax.clear_caches()
        cache = KVCache.create(SMOL.num_layers, b + 1, s, SMOL.num_kv_heads, SMOL.head_dim, jnp.bfloat16)
        tok, kv = jnp.ones(b, jnp.int32), jnp.full((b,), s // 2, jnp.int32)
        temps, seeds = jnp.full((b,), 0.7), jnp.arange(b, dtype=jnp.uint32)
        step = lambda c, t: train_data.decode(g, st, c, t, kv, temps, seeds, 3, top_k=0)
        text = train_data.decode.lower(g, st, cache, tok, kv, temps, seeds, 3, top_k=0).compile().as_text()
        row = dict(unroll=unroll, skipped=skip or None, batch=b, cache_len=s, cache_mb=2 * cache.k.nbytes / 2**20,
                   step_ms=time_steps(step, cache, tok), cache_copies=cache_copies(text, cache.k.shape))
        if unroll == 1 and s == 160 and not skip:
            h = jnp.ones((b, SMOL.hidden_size), jnp.bfloat16)
            pick = jax.jit(lambda h: train_data._pick(model, h, temps, seeds, 3, 0))
            jax.block_until_ready(pick(h))
            t0 = time.perf_counter()
            for _ in range(10):
                out = pick(h)
            jax.block_until_ready(out)
            row["sampling_ms"] = 1e3 * (time.perf_counter() - t0) / 10
        rows.append(row)
        print(row, flush=True)
        del cache
    llama.LAYER_UNROLL = 1
    llama.attention.paged_attention, llama.write_layer = real_attention, real_write
    jax.clear_caches()
    rows.append(time_self_generate(model, "random"))
    if args.model:
        from jaxspec.models.loading import load
        real, _ = load(args.model)
        rows.append(time_self_generate(real, args.model))
    write_results("step_probe", rows)


if __name__ == "__main__":
    main()
