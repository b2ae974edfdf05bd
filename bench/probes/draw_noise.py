"""The sampled verify's draw: Gumbel noise per tree node, or once a depth (sampling.sample's
max_depth). A node's key is its request's seed and output position, so all nodes of one depth
share it; drawing per depth gives the same tokens from fewer random values. Times sample() alone
over [B, N, V] float32 logits (SmolLM2's vocabulary, a 6:4:24 EAGLE tree: N = 24, depth <= 6),
every row sampling at temperature 1, and checks the tokens are identical:

    python bench/probes/draw_noise.py [--batches 1,8,64] [--nodes 24] [--max-depth 7]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import print_table, write_results  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--nodes", type=int, default=24)
    ap.add_argument("--max-depth", type=int, default=7)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from jaxspec import sampling
    rows = []
    rng = np.random.default_rng(0)
    n, d, v = args.nodes, args.max_depth, args.vocab
    for b in map(int, args.batches.split(",")):
        logits = jnp.asarray(rng.normal(0, 3, (b, n, v)), jnp.float32)
        depth = jnp.asarray(np.sort(rng.integers(0, d, (b, n)), axis=1), jnp.int32)
        sb = sampling.SamplingBatch.build([sampling.SamplingParams(temperature=1.0)] * b, list(range(b)),
                                          list(rng.integers(0, 100, b)))
        flags = sampling.SamplerFlags(sample=True)
        out = {}
        for variant, md in (("per node", None), ("per depth", d)):
            fn = jax.jit(lambda lg, sb, dp, md=md: sampling.sample(lg, sb, flags, depth=dp, max_depth=md))
            out[variant] = np.asarray(fn(logits, sb, depth))
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(logits, sb, depth))
                times.append(1e3 * (time.perf_counter() - t0))
            rows.append(dict(batch=b, nodes=n, max_depth=d, vocab=v, noise=variant, ms=float(np.median(times))))
        same = bool((out["per node"] == out["per depth"]).all())
        for r in rows[-2:]:
            r.update(identical=same, speedup=rows[-2]["ms"] / r["ms"])
    print_table(rows, ["batch", "nodes", "noise", "ms", "speedup", "identical"])
    print(write_results("draw_noise", rows))


if __name__ == "__main__":
    main()
