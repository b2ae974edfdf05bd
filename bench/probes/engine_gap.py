"""Where the Generator's time goes at a large batch, beside the rollout's loop on the same prompts.

At batch 64 (SmolLM2, MT-bench, 128 new tokens, H100: rollout-NVIDIA-H100-80GB-HBM3.json) the
Generator's plain decoding made 13.9k tok/s and the rollout's 45.2k, while the engine's decode
program alone runs a batch-64 step in 1.75 ms (decode-smol-NVIDIA-H200.json). This probe times one
Generator pass and one rollout call, records each program launch of the pass (name, rows, width,
steps a call, host time of the launch), and profiles the GPU kernels of one pass: kernel time
against the span from first to last kernel (span - kernel time = the device idle) and against
the pass's wall time (wall - span = before the first kernel and after the last).

    python bench/probes/engine_gap.py [--batch 64] [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import jax.numpy as jnp
import numpy as np

from common import device_kernels, mt_bench_token_ids, print_table, write_results
from jaxspec import Generator, SamplingParams
from jaxspec import programs as programs_mod
from jaxspec.models.loading import load
from jaxspec.rollout import jit_rollout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    model, tok = load("smollm2-135m")
    ids = mt_bench_token_ids(tok, args.batch)
    b = len(ids)
    params = SamplingParams(max_tokens=args.max_tokens)
    gen = Generator(model, tok, max_batch=64, max_seq_len=1024)
    gen.generate(ids, params)

    launches = []
    run = programs_mod.Programs.run

    def logged(self, name, flags, cache, a):
        t0 = time.perf_counter()
        out = run(self, name, flags, cache, a)
        leaves = jax.tree.leaves(a)
        launches.append(dict(name=name, rows=int(leaves[0].shape[0]), width=int(leaves[0].shape[1]),
                             launch_ms=1e3 * (time.perf_counter() - t0), at=t0))
        return out

    rows = []
    for i in range(args.passes):
        launches.clear()
        st0 = dict(gen.scheduler.stats)
        t0 = time.perf_counter()
        programs_mod.Programs.run = logged
        try:
            outs = gen.generate(ids, params)
        finally:
            programs_mod.Programs.run = run
        wall = time.perf_counter() - t0
        st = gen.scheduler.stats
        d = {k: st[k] - st0[k] for k in ("steps", "chained_steps", "prefill_tokens", "wait_time", "decode_time",
                                         "prefill_time")}
        tokens = sum(len(o.token_ids) for o in outs)
        rows.append(dict(engine="generator", passno=i, wall_ms=1e3 * wall, tokens=tokens, tokens_per_s=tokens / wall,
                         calls=len(launches), launch_ms=sum(l["launch_ms"] for l in launches),
                         wait_ms=1e3 * d["wait_time"], steps=d["steps"], chained=d["chained_steps"],
                         prefill_tokens=d["prefill_tokens"]))
        print_table(rows[-1:], ["engine", "passno", "wall_ms", "tokens_per_s", "calls", "launch_ms", "wait_ms",
                                "prefill_tokens"])
    timeline = [dict(name=l["name"], rows=l["rows"], width=l["width"], launch_ms=round(l["launch_ms"], 3),
                     at_ms=round(1e3 * (l["at"] - launches[0]["at"]), 3)) for l in launches]
    for l in timeline:
        print(l)
    t0 = time.perf_counter()
    prof = device_kernels(lambda: gen.generate(ids, params), 1, tempfile.mkdtemp())
    wall = time.perf_counter() - t0
    if prof:
        rows.append(dict(engine="generator", passno="profiled", wall_ms=1e3 * wall, kernel_ms=prof["kernel_ms"],
                         span_ms=prof["span_ms"], kernels=prof["kernels"], top=prof["top"]))
        print_table(rows[-1:], ["engine", "wall_ms", "kernel_ms", "span_ms", "kernels"])
        for t in prof["top"]:
            print("  ", t)

    width = max(map(len, ids))
    prompts = np.zeros((b, width), np.int32)
    for i, x in enumerate(ids):
        prompts[i, :len(x)] = x
    fn, p, dp = jit_rollout(model, None, algorithm="none", max_new_tokens=args.max_tokens)
    call = lambda: jax.block_until_ready(fn(p, dp, jnp.asarray(prompts), jnp.asarray([len(x) for x in ids]),
                                            jnp.arange(b)))
    call()
    t0 = time.perf_counter()
    out = call()
    wall = time.perf_counter() - t0
    tokens = int(np.asarray(out.lengths).sum())
    rows.append(dict(engine="rollout", wall_ms=1e3 * wall, tokens=tokens, tokens_per_s=tokens / wall))
    prof = device_kernels(call, 1, tempfile.mkdtemp())
    if prof:
        rows[-1].update(kernel_ms=prof["kernel_ms"], span_ms=prof["span_ms"], kernels=prof["kernels"], top=prof["top"])
    print_table(rows[-1:], ["engine", "wall_ms", "tokens_per_s", "kernel_ms", "span_ms", "kernels"])
    print(write_results("engine_gap", rows, {"batch": b, "max_tokens": args.max_tokens, "timeline": timeline}))


if __name__ == "__main__":
    main()
