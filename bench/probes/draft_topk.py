"""A draft step's tail: the head's logits over its draft vocabulary, then its k best children, as
draft_tree runs it (log_softmax, then lax.top_k: one TopK kernel a row walks the whole vocabulary)
against top_k on the logits with the log-normalizer subtracted after, and a two-stage top_k (the
k best of each chunk, then of those: more rows of work in flight). Device time and kernels a call
(bench/common.device_kernels) for the rows of a draft step (batch x top-k) and draft vocabularies
8k-32k; every variant's ids must equal the reference's.

    python bench/probes/draft_topk.py [--rows 4,32,256] [--vocabs 8192,16384,32768]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import jax.numpy as jnp

from common import device_kernels, print_table, write_results

HIDDEN, K, REPS = 576, 4, 10


def logits(x, w):
    return jnp.einsum("rh,hv->rv", x, w, preferred_element_type=jnp.float32)


def reference(x, w):
    return jax.lax.top_k(jax.nn.log_softmax(logits(x, w)), K)


def normalized_after(x, w):
    l = logits(x, w)
    v, i = jax.lax.top_k(l, K)
    return v - jax.nn.logsumexp(l, axis=-1, keepdims=True), i


def two_stage(chunk):
    def f(x, w):
        l = logits(x, w)
        r, v = l.shape
        cv, ci = jax.lax.top_k(l.reshape(r, v // chunk, chunk), K)  # [R, C, K]
        ci = ci + (jnp.arange(v // chunk) * chunk)[None, :, None]
        best, at = jax.lax.top_k(cv.reshape(r, -1), K)  # candidates in id order: ties keep the lower id
        return best - jax.nn.logsumexp(l, axis=-1, keepdims=True), jnp.take_along_axis(ci.reshape(r, -1), at, 1)
    return f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="4,32,256")
    ap.add_argument("--vocabs", default="8192,16384,32768")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    variants = {"log_softmax+top_k": reference, "top_k, then -lse": normalized_after,
                "two-stage 512": two_stage(512), "two-stage 1024": two_stage(1024)}
    rows_out = []
    for vocab in map(int, args.vocabs.split(",")):
        for r in map(int, args.rows.split(",")):
            keys = jax.random.split(jax.random.PRNGKey(vocab + r), 2 * REPS)
            inputs = [(jax.random.normal(keys[2 * i], (r, HIDDEN), jnp.bfloat16),
                       (jax.random.normal(keys[2 * i + 1], (HIDDEN, vocab), jnp.float32) / 24).astype(jnp.bfloat16))
                      for i in range(REPS)]
            ref_v, ref_i = jax.jit(reference)(*inputs[0])
            for name, fn in variants.items():
                v, i = jax.jit(fn)(*inputs[0])
                same = bool(jnp.array_equal(i, ref_i)) and bool(jnp.allclose(v, ref_v, atol=1e-4))
                many = jax.jit(lambda al, fn=fn: [fn(*a) for a in al])
                jax.block_until_ready(many(inputs))
                prof = device_kernels(lambda: jax.block_until_ready(many(inputs)), REPS, tempfile.mkdtemp())
                rows_out.append(dict(vocab=vocab, rows=r, variant=name, same_ids=same,
                                     device_us=None if prof is None else prof["kernel_ms"] * 1e3,
                                     kernels=None if prof is None else prof["kernels"]))
                print_table(rows_out[-1:], ["vocab", "rows", "variant", "same_ids", "device_us", "kernels"])
    print()
    print_table(rows_out, ["vocab", "rows", "variant", "same_ids", "device_us", "kernels"])
    print(write_results("draft_topk" + args.tag, rows_out, {"hidden": HIDDEN, "k": K}))


if __name__ == "__main__":
    main()
