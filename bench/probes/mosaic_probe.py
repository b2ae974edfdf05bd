"""Where the Mosaic GPU verify kernel's time goes: timed beside JAX's own FlashAttention-3 example
(jax.experimental.pallas.ops.gpu.attention_mgpu) at the same work without pages (512 heads x 128
or 256 query rows x 2048 keys, head_dim 128, float16: 32- and 64-token trees at batch 64, 8 KV
heads, GQA 4). An Nsight Compute pass over every kernel of the run outran 400 s and was dropped.

    python bench/mosaic_probe.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

import jax
import jax.numpy as jnp

T, CTX = 32, 2048


def programs(t=T):
    """(name, jitted function, args) for each kernel compared, at t draft tokens (t * 4 rows)."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu as fa3
    from kernels import random_tree, setup
    from jaxspec.pallas.tree_mask import tree_attention_mask
    from jaxspec.pallas.verify_hopper import verify_tree_hopper
    out = []
    q, k, v, pt, kv_lens, q_lens = setup(64, t, CTX)
    # float16, as the example's shared-memory buffers are (the verify kernel takes either)
    q, k, v = (x.astype(jnp.float16) for x in (q, k, v))
    mask = tree_attention_mask(random_tree(64, t), q_lens)[0]
    for name, kw in (("verify_hopper kv128 st2", dict(block_kv=128, wg_rows=64)),
                     ("verify_hopper kv64 st4", dict(block_kv=64, stages=4, wg_rows=64))):
        f = jax.jit(lambda q, k, v, kw=kw: verify_tree_hopper(q, k, v, 0, pt, kv_lens, q_lens, mask, **kw))
        out.append((f"{name} t{t}", f, (q, k, v)))
    # the same matrix work contiguous: [512 heads as batch, 128 rows, 1 head, 128]
    key = jax.random.key(0)
    qc = jax.random.normal(key, (512, 4 * t, 1, 128), jnp.float16)
    kc = jax.random.normal(jax.random.key(1), (512, CTX, 1, 128), jnp.float16)
    vc = jax.random.normal(jax.random.key(2), (512, CTX, 1, 128), jnp.float16)
    for bq, bkv, steps in ((64, 128, 2), (64, 64, 4)):
        cfg = fa3.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=steps)
        f = jax.jit(lambda q, k, v, cfg=cfg: fa3.attention(q, k, v, cfg))
        out.append((f"jax fa3 example bq{bq} bkv{bkv} st{steps} rows{4 * t}", f, (qc, kc, vc)))
    return out


def main():
    from common import print_table, time_fn, write_results
    rows = []
    for name, f, args in programs(32) + programs(64):
        try:
            jax.block_until_ready(f(*args))
            t = time_fn(f, *args, queue=5)
        except Exception as e:
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}")
            continue
        flops = 512 * args[0].shape[1] * (4 if "verify" in name else 1) * CTX * 128 * 4
        rows.append(dict(kernel=name, time_us=t * 1e6, tflops=flops / t / 1e12))
    print_table(rows, ["kernel", "time_us", "tflops"])
    print(write_results("mosaic_probe", rows))


if __name__ == "__main__":
    main()
