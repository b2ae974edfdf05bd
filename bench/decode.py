"""Plain decoding: device step time and tokens/s at batch 1, 8, 64 beside the memory floor.

The step is the engine's own jitted `extend` program (T = 1) on a paged cache holding `--context`
tokens per request, chained on the device as the engine runs it. floor = (weight bytes + K/V bytes
read per step) / measured copy bandwidth.
    python bench/decode.py [--smollm PATH.gguf] [--batches 1,8,64] [--context 512]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from common import LLAMA3_8B, copy_bandwidth, param_bytes, print_table, random_model, write_results
from jaxspec.kv_cache import KVCache
from jaxspec.models import ModelConfig
from jaxspec.programs import Programs
from jaxspec.sampling import SamplerFlags, SamplingBatch, SamplingParams

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
               num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True)


def step_time(model, batch, context, page_size, attn_impl, steps=50):
    cfg = model.cfg
    progs = Programs(model, attn_impl=attn_impl)
    pages_per = -(-(context + steps + 1) // page_size)
    cache = KVCache.create(cfg.num_layers, batch * pages_per + 1, page_size, cfg.num_kv_heads, cfg.head_dim,
                           model.embed[...].dtype)
    pt = jnp.asarray(1 + np.arange(batch * pages_per).reshape(batch, pages_per), jnp.int32)
    flags = SamplerFlags.of([SamplingParams()])
    sb = jax.tree.map(jnp.asarray, SamplingBatch.build([SamplingParams()] * batch, [0] * batch, [0] * batch))
    q_lens = jnp.ones(batch, jnp.int32)
    tok = jnp.ones((batch, 1), jnp.int32)

    def run(n, cache, tok):
        for i in range(n):
            kv = jnp.full((batch,), context + i, jnp.int32)
            nxt, _, _, _, cache = progs.extend(progs.state, cache, tok, pt, kv, q_lens, sb, flags=flags)
            tok = nxt[:, None]
        return cache, tok

    cache, tok = run(3, cache, tok)  # compile + warm up
    jax.block_until_ready(tok)
    t0 = time.perf_counter()
    cache, tok = run(steps, cache, tok)
    jax.block_until_ready(tok)
    return (time.perf_counter() - t0) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--models", default="smollm2-135m,llama3-8b")
    ap.add_argument("--impls", default="auto,ref")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}: copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    rows = []
    for name in args.models.split(","):
        cfg = ModelConfig(**(SMOLLM2 if name == "smollm2-135m" else LLAMA3_8B))
        model = random_model(cfg, jnp.bfloat16)
        wbytes = param_bytes(model)
        for b in map(int, args.batches.split(",")):
            kv_bytes = b * args.context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
            floor = (wbytes + kv_bytes) / bw
            for impl in args.impls.split(","):
                t = step_time(model, b, args.context, args.page_size, impl)
                rows.append(dict(model=name, algorithm="plain", dataset="random", batch=b, context=args.context,
                                 kernel="pallas" if impl == "auto" else "jnp-ref", step_ms=t * 1e3,
                                 floor_ms=floor * 1e3, floor_ratio=t / floor, tokens_per_s=b / t))
                print_table(rows[-1:], ["model", "batch", "kernel", "step_ms", "floor_ms", "floor_ratio", "tokens_per_s"])
        del model
    print()
    print_table(rows, ["model", "batch", "kernel", "step_ms", "floor_ms", "floor_ratio", "tokens_per_s"])
    print(write_results("decode", rows, {"copy_bandwidth_GBps": bw / 1e9}))


if __name__ == "__main__":
    main()
