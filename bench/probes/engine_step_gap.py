"""Where a batch-1 EAGLE-3 step's time goes in the Generator, against the same fused step in the
rollout's device loop, with no host in the way.

With the shipped head on MT-bench the Generator's EAGLE-3 6:4:24 ran ~1.9 ms a step at batch 1
(spec-head6-: 1737 tok/s at 3.33 tokens a step) while the step_profile- probe timed the rollout's
step at ~1.40 ms. Here a SmolLM2-shaped target and an EAGLE-3 head with random bf16 weights (the
step's work does not depend on the values) run one prompt of `--context` tokens for
`--max-tokens` new tokens, ignore_eos, four ways:

- rollout: jit_rollout's loop, wall time over its steps;
- program, pipelined: the engine's own verify_steps (and decode) program launched back to back,
  each call on the last one's carried outputs as the scheduler chains them, one wait at the end;
- generator: Generator.generate, wall time over its verify steps, the launches' host time, the
  scheduler's wait time, and how many calls chained;
- generator, overlap off: each call read back before the next is launched.

generator / program > 1 is host time the device waited for; program / rollout > 1 is work the
engine's program does that the rollout's does not.

    python bench/probes/engine_step_gap.py [--context 256] [--max-tokens 256] [--trees 6:4:24]
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

from common import device_kernels, print_table, smollm2_and_head, write_results
from jaxspec import Generator, SamplingParams
from jaxspec import programs as programs_mod
from jaxspec.drafters.eagle import EagleDrafter
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.rollout import jit_rollout
from jaxspec.sampling import SamplerFlags

COLS = ["way", "algorithm", "steps", "ms_per_step", "calls", "chained", "launch_ms_per_call", "wait_ms_per_step",
        "kernel_ms", "span_ms", "kernels"]


def rollout_row(model, head, algo, prompt, max_tokens, profile=False):
    name, *tree = algo.split(":")
    conf = dict(algorithm="none" if name == "plain" else name, max_new_tokens=max_tokens, max_verify_tokens=None)
    if tree:
        conf.update(zip(("num_steps", "topk", "num_draft_tokens"), map(int, tree)))
    fn, params, dparams = jit_rollout(model, head if name == "eagle3" else None, **conf)
    prompts, lengths = jnp.asarray(prompt)[None], jnp.asarray([len(prompt)], jnp.int32)
    stop = jnp.full((1, 1), -1, jnp.int32)
    call = lambda: jax.block_until_ready(fn(params, dparams, prompts, lengths, jnp.zeros(1, jnp.uint32), stop_ids=stop))
    call()
    secs = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = call()
        secs.append(time.perf_counter() - t0)
    steps = int(np.asarray(out.steps).max())
    row = dict(way="rollout", algorithm=algo, steps=steps, ms_per_step=1e3 * float(np.median(secs)) / steps)
    return with_profile(row, call, steps) if profile else row


def with_profile(row, run, steps):
    """row with run()'s kernels a step (kernel ms, span, count, the busiest) where a GPU trace has them."""
    prof = device_kernels(run, steps, tempfile.mkdtemp(), top=24)
    if prof:
        row.update(kernel_ms=prof["kernel_ms"], span_ms=prof["span_ms"], kernels=prof["kernels"], top=prof["top"])
    return row


def generator_rows(gen, algo, prompt, max_tokens, passes=3):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    gen.generate([prompt], params)
    launches, run = [], programs_mod.Programs.run

    def logged(self, name, flags, cache, a):
        t0 = time.perf_counter()
        out = run(self, name, flags, cache, a)
        launches.append((name, time.perf_counter() - t0))
        return out

    rows = []
    for overlap in (True, False):
        gen.scheduler.overlap = overlap
        per = []
        for _ in range(passes):
            launches.clear()
            st0 = dict(gen.scheduler.stats)
            programs_mod.Programs.run = logged
            try:
                t0 = time.perf_counter()
                gen.generate([prompt], params)
                wall = time.perf_counter() - t0
            finally:
                programs_mod.Programs.run = run
            st = gen.scheduler.stats
            d = {k: st[k] - st0[k] for k in st if isinstance(st[k], (int, float))}
            steps = d["verified_rows"] if algo != "plain" else max_tokens
            calls = [l for l in launches if l[0] != "extend"]
            per.append(dict(way="generator" if overlap else "generator, overlap off", algorithm=algo, steps=steps,
                            ms_per_step=1e3 * wall / steps, calls=len(calls), chained=d["chained_steps"],
                            launch_ms_per_call=1e3 * sum(t for _, t in calls) / max(1, len(calls)),
                            wait_ms_per_step=1e3 * d["wait_time"] / steps, wall_ms=1e3 * wall))
        rows.append(sorted(per, key=lambda r: r["ms_per_step"])[len(per) // 2])
    gen.scheduler.overlap = True
    return rows


def pipelined_rows(gen, algo, calls=24, profile=False):
    """The engine's own program launched back to back as the scheduler chains it (each call's
    carried outputs are the next one's inputs, one wait at the end), every row live: its device
    time a step with no host work but the launches, and the launches' host time."""
    sched, flags = gen.scheduler, SamplerFlags()  # greedy
    steps = sched.verify_steps if algo != "plain" else sched.decode_steps
    pages = np.arange(1, sched.max_pages_per_seq + 1, dtype=np.int32)[None]
    if algo == "plain":
        progs = sched.plain_programs or sched.programs
        args = list(sched._dummy_decode(1, steps, alive=True))
        args[1], args[2] = pages, np.full(1, 256, np.int32)
    else:
        progs = sched.programs
        width = next(a[0].shape[1] for _, name, _, _, a in sched.program_specs((flags,))
                     if name == "verify_steps" and a[0].shape[0] == 1)  # the batch-1 program's tree columns
        args = list(sched._dummy_verify(1, width, steps, alive=True))
        args[2], args[3] = pages, np.full(1, 256, np.int32)
    args = jax.device_put(tuple(args))
    cache = sched.cache

    def launch(args):
        nonlocal cache
        if algo == "plain":
            t = cache[0] if isinstance(cache, tuple) else cache
            *out, t = progs.decode(t, *args, flags=flags)
            cache = (t, cache[1]) if isinstance(cache, tuple) else t
            tokens, kv, sb, budget = out[6]
            return out, (tokens, args[1], kv, budget, args[4], args[5], sb)
        *out, cache = progs.verify_steps(cache, *args, flags=flags)
        tokens, parents, kv, sb, budget = out[6]
        return out, (tokens, parents, args[2], kv, args[4], budget, args[6], args[7], args[8], sb)

    for _ in range(3):
        out, args = launch(args)
    jax.block_until_ready(out)
    host, t0 = 0.0, time.perf_counter()
    for _ in range(calls):
        h = time.perf_counter()
        out, args = launch(args)
        host += time.perf_counter() - h
    jax.block_until_ready(out)
    wall = time.perf_counter() - t0
    row = dict(way="program, pipelined", algorithm=algo, steps=calls * steps, calls=calls,
               ms_per_step=1e3 * wall / (calls * steps), launch_ms_per_call=1e3 * host / calls)
    if profile:  # the same calls' kernels: a slow instance against a fast one, kernel by kernel
        def run():
            nonlocal args
            for _ in range(8):
                res, args = launch(args)
            jax.block_until_ready(res)
        with_profile(row, run, 8 * steps)
    sched.cache = cache
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--trees", default="6:4:24")
    ap.add_argument("--verify-steps", type=int, default=None, help="the Generator's verify steps a call")
    ap.add_argument("--max-seq-len", type=int, default=1024, help="the Generator's (its page table's width)")
    ap.add_argument("--skip-plain", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="also profile 8 pipelined calls of each instance (kernel ms, span and kernels a step, the "
                         "busiest kernels); with XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true the "
                         "command buffers stay on under the profiler")
    ap.add_argument("--layers", type=int, default=None, help="fewer target layers (a CPU smoke run)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    cfg, model, head = smollm2_and_head(args.layers)
    prompt = list(map(int, np.random.default_rng(0).integers(100, cfg.vocab_size, args.context)))
    kw = dict(max_batch=1, max_seq_len=args.max_seq_len, warmup=True)
    if args.verify_steps:
        kw["verify_steps"] = args.verify_steps
    rows = []
    if not args.skip_plain:
        rows.append(rollout_row(model, head, "plain", prompt, args.max_tokens))
        gen = Generator(model, None, **kw)
        rows += generator_rows(gen, "plain", prompt, args.max_tokens)
        rows.append(pipelined_rows(gen, "plain"))
        print_table(rows, COLS)
    for t in args.trees.split(","):
        algo = f"eagle3:{t}"
        rows.append(rollout_row(model, head, algo, prompt, args.max_tokens, args.profile))
        gen = Generator(model, None, drafter=EagleDrafter(head, TreeShape.parse(t)), **kw)
        rows += generator_rows(gen, algo, prompt, args.max_tokens)
        rows.append(pipelined_rows(gen, algo, profile=args.profile))
        print_table(rows, COLS)
    print(write_results("engine_step_gap" + args.tag, rows, {"context": args.context, "max_tokens": args.max_tokens,
                                                              "max_seq_len": args.max_seq_len}))


if __name__ == "__main__":
    main()
