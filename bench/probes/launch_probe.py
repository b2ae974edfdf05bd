"""Where a small model's decode step goes: the host launching kernels, or the device running them.

SmolLM2-shaped target, random bf16 weights, the engine's own `extend` program at batch 1 and 8,
context 1024, the engine's fixed page-table width. Per step:

  dispatch_ms   one program call a step, chained on the device (the engine's steady decode);
  launch_ms     host time until one call returns (async dispatch: the host's cost of a step);
  decodeN_ms    the engine's decode program, N steps a call, chained (per token);
  loop_ms       N steps inside one jitted program (fori_loop, trip count known to XLA): the
                device's own time a step, without a host launch between steps;
  kernel_ms / span_ms / kernels   from a profile of the dispatched steps.

Run once per XLA_FLAGS setting (a flag is read when the backend starts), e.g. with command
buffers forced on: XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL
    python bench/probes/launch_probe.py --tag default
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

from common import SMOLLM2, device_kernels, print_table, random_model, write_results
from decode import decode_steps
from jaxspec.kv_cache import KVCache
from jaxspec.models import ModelConfig
from jaxspec.programs import Programs
from jaxspec.sampling import SamplerFlags, SamplingBatch, SamplingParams


def probe(model, batch, context, max_seq_len, impl, loop_n):
    cfg = model.cfg
    ps = 16
    progs = Programs(model, attn_impl=impl)
    pages_per = -(-(context + 800) // ps)
    width = max(-(-max_seq_len // ps), pages_per)
    cache = KVCache.create(cfg.num_layers, batch * pages_per + 1, ps, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    pt = np.zeros((batch, width), np.int32)
    pt[:, :pages_per] = 1 + np.arange(batch * pages_per).reshape(batch, pages_per)
    flags = SamplerFlags()
    sb = jax.device_put(SamplingBatch.build([SamplingParams()] * batch, [0] * batch, [0] * batch))
    q_lens, nxt, pt = jax.device_put((np.ones(batch, np.int32), np.full(batch, -1, np.int32), pt))
    kv = jax.device_put(np.full(batch, context, np.int32))
    state = [cache, jax.device_put(np.ones((batch, 1), np.int32))]

    def step():
        *_, state[1], state[0] = progs.extend(state[0], state[1], nxt, pt, kv, q_lens, sb, flags=flags)
        return state[1]

    for _ in range(3):
        jax.block_until_ready(step())
    hlo = next(iter(progs.table.values())).as_text()
    out = dict(batch=batch, impl=impl, command_buffers=hlo.count("command_buffer"))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(50):
            step()
        jax.block_until_ready(state[1])
        ts.append((time.perf_counter() - t0) / 50)
    out["dispatch_ms"] = 1e3 * float(np.median(ts))
    ls = []
    for _ in range(20):
        jax.block_until_ready(state[1])
        t0 = time.perf_counter()
        step()
        ls.append(time.perf_counter() - t0)
    out["launch_ms"] = 1e3 * float(np.median(ls))
    prof = device_kernels(lambda: jax.block_until_ready([step() for _ in range(10)]), 10, tempfile.mkdtemp())
    if prof:
        out.update(kernels=prof["kernels"], kernel_ms=prof["kernel_ms"], span_ms=prof["span_ms"])

    fn = progs.fns["extend"]

    @jax.jit
    def loop(st, cache, tok):
        def body(_, c):
            cache, tok = c
            *_, tok, cache = fn(st, cache, tok, nxt, pt, kv, q_lens, sb, flags=flags)
            return cache, tok
        return jax.lax.fori_loop(0, loop_n, body, (cache, tok))

    # the engine's decode program: N steps a call, chained on the device (bench/decode.py's loop)
    for n in (1, 8):
        run = decode_steps(model, batch, context, max_seq_len, ps, impl, per_call=n)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(run(48))
            ts.append((time.perf_counter() - t0) / 48)
        out[f"decode{n}_ms"] = 1e3 * float(np.median(ts))

    c, t = loop(progs.state, state[0], state[1])
    jax.block_until_ready(t)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        c, t = loop(progs.state, c, t)
        jax.block_until_ready(t)
        ts.append((time.perf_counter() - t0) / loop_n)
    out["loop_ms"] = 1e3 * float(np.median(ts))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--impls", default="auto,ref")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--loop-n", type=int, default=16)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    model = random_model(ModelConfig(**SMOLLM2), jnp.bfloat16)
    rows = []
    for impl in args.impls.split(","):
        for b in map(int, args.batches.split(",")):
            rows.append(dict(tag=args.tag, **probe(model, b, args.context, args.max_seq_len, impl, args.loop_n)))
            print_table(rows[-1:], list(rows[-1]))
    print(write_results("launch_probe" + (f"-{args.tag}" if args.tag else ""), rows,
                        {"xla_flags": os.environ.get("XLA_FLAGS", "")}))


if __name__ == "__main__":
    main()
