"""Why is the training step slow on the H100? Times the target forward of a training batch
(jaxspec.train.target_outputs) with the K/V scatter as is and declared unique, then one full
training step. Prints BEST_UNIQUE=0|1 for the caller; writes bench/results/scatter_probe-<device>.json.

    python bench/scatter_probe.py --model /path/to/smollm2.gguf
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from flax import nnx

from common import write_results
from jaxspec import train as T
from jaxspec.drafters.eagle import HeadConfig
from jaxspec.models.loading import load


def timed(f, *a, n=3):
    jax.block_until_ready(f(*a))
    t0 = time.perf_counter()
    for _ in range(n):
        jax.block_until_ready(f(*a))
    return (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=320)
    args = ap.parse_args()
    m, _ = load(args.model)
    cfg = HeadConfig.for_target(m.cfg, "eagle3", draft_vocab_size=4096)
    hot = jnp.arange(4096)
    g, st = nnx.split(m)
    x = jnp.ones((args.batch, args.seq_len), jnp.int32)
    lens = jnp.full((args.batch,), args.seq_len, jnp.int32)
    rows = []
    for unique in ("0", "1"):
        os.environ["JAXSPEC_UNIQUE_SCATTER"] = unique
        f = jax.jit(lambda st, x, l: T.target_outputs(nnx.merge(g, st), x, l, cfg, hot))
        rows.append(dict(what="target_outputs", unique_scatter=unique == "1", batch=args.batch, seq_len=args.seq_len,
                         ms=1e3 * timed(f, st, x, lens)))
        print(rows[-1], flush=True)
    best = min(rows, key=lambda r: r["ms"])["unique_scatter"]
    print(f"BEST_UNIQUE={int(best)}", flush=True)
    write_results("scatter_probe", rows)


if __name__ == "__main__":
    main()
