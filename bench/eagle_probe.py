"""Where an EAGLE step's time goes at small batch: the fused step (verify + accept + catch-up +
next draft) against plain decode and against tree verify alone (the same tree through the
target, no head), timed on the engine's own compiled programs with the inputs of a real step.

    python bench/eagle_probe.py --model /path/to/smollm2.gguf [--batches 1,8,64]
        [--trees 4:4:8,5:4:16,6:8:32,8:8:64]

ms_pipelined: steps issued back to back, one sync at the end (device time per step);
ms_synced: a sync after every step (what the engine's loop pays, host dispatch included).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

from common import device_kernels, mt_bench_prompts, print_table, write_results
from jaxspec import SamplingParams, SpecConfig
from jaxspec.speculative import DEFAULT_HEADS
from jaxspec.generator import Generator
from jaxspec.models import Llama
from jaxspec.models.loading import load
from jaxspec import programs
from jaxspec.programs import Programs


def capture(gen, name, prompts, max_tokens=48):
    """Run the prompts; keep the arguments of the program's last call (a steady-state step)."""
    progs = gen.scheduler.programs
    orig, rec = getattr(progs, name), {}

    def wrapped(state, cache, *a, **kw):
        rec["a"], rec["kw"] = a, kw
        return orig(state, cache, *a, **kw)
    setattr(progs, name, wrapped)
    gen.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    setattr(progs, name, orig)
    return orig, rec["a"], rec["kw"]


def profile_program(fn, state, cache, a, kw, log_dir, n=10):
    """device_kernels over n pipelined steps."""
    box = [cache]

    def go():
        out = None
        for _ in range(n):
            out = fn(state, box[0], *a, **kw)
            box[0] = out[-1]
        jax.block_until_ready(out)
    prof = device_kernels(go, n, log_dir)
    return prof, box[0]


def time_program(fn, state, cache, a, kw, n=50):
    out = fn(state, cache, *a, **kw)
    cache = out[-1]
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn(state, cache, *a, **kw)
        cache = out[-1]
    jax.block_until_ready(out)
    pipelined = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn(state, cache, *a, **kw)
        cache = out[-1]
        jax.block_until_ready(out[1])
    synced = (time.perf_counter() - t0) / n
    return 1e3 * pipelined, 1e3 * synced, cache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--trees", default="4:4:8,5:4:16,6:8:32,8:8:64")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--unroll", type=int, default=None, help="lax.scan unroll of the target's layer loop")
    ap.add_argument("--profile", action="store_true", help="add the GPU kernel sums of each program (profiler)")
    ap.add_argument("--random", action="store_true",
                    help="a SmolLM2-shaped target and EAGLE-3 head with random bf16 weights (no checkpoint needed)")
    ap.add_argument("--tree-unroll", default="", help="comma list of layer-loop unrolls for the tree programs "
                    "(default: the engine's choice)")
    ap.add_argument("--hlo", action="store_true", help="write each program's optimized HLO next to the results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.unroll is not None:
        from jaxspec.models import llama
        llama.LAYER_UNROLL = args.unroll
    cols = ["batch", "step", "nodes", "ms_pipelined", "ms_synced", "draft_share", "kernel_ms", "kernels", "span_ms"]
    log_dir = os.path.join(os.environ.get("BENCH_OUT", "/tmp"), "probe_trace")

    def add_profile(row, fn, state, cache, a, kw):
        if args.hlo:
            path = os.path.join(os.environ.get("BENCH_OUT", "/tmp"), f"hlo-{row['step'].replace(' ', '_').replace(':', '-')}-b{row['batch']}.txt")
            with open(path, "w") as f:
                f.write(fn.lower(state, cache, *a, **kw).compile().as_text())
        if not args.profile:
            return cache
        prof, cache = profile_program(fn, state, cache, a, kw, log_dir)
        if prof:
            row.update(kernel_ms=prof["kernel_ms"], kernels=prof["kernels"], span_ms=prof["span_ms"],
                       most_launched=prof["most_launched"])
            print(f"  {row['step']} b{row['batch']}: busiest kernels (us/step, count/step)")
            for name, us, c in prof["top"]:
                print(f"    {us:8.1f} {c:5.1f}  {name}")
            print("  most launched")
            for name, us, c in prof["most_launched"]:
                print(f"    {us:8.1f} {c:5.1f}  {name}")
        return cache
    if args.draft_model is None and "smol" in args.model.lower():  # a SmolLM2 GGUF path: the shipped head
        args.draft_model = DEFAULT_HEADS["smollm2-135m"]
    if args.random:
        import jax.numpy as jnp
        import numpy as np
        from flax import nnx
        from host_probe import SMOL
        from jaxspec.drafters.eagle import DraftHead, EagleDrafter, HeadConfig
        from jaxspec.drafters.eagle_step import TreeShape
        model, tok = Llama(SMOL, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), None
        head = DraftHead(HeadConfig.for_target(SMOL, "eagle3"), dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
        rng = np.random.default_rng(0)
        chats = [[int(t) for t in rng.integers(3, SMOL.vocab_size, 64)] for _ in range(64)]
    else:
        model, tok = load(args.model)
        chats = [[{"role": "user", "content": q}] for q in mt_bench_prompts()]
    plain = Generator(model, tok, max_batch=64, max_seq_len=1024)
    rows = []
    for b in map(int, args.batches.split(",")):
        prompts = chats[:b]
        fn, a, kw = capture(plain, "extend", prompts)
        pipe, sync, plain.scheduler.cache = time_program(fn, plain.scheduler.programs.state, plain.scheduler.cache,
                                                         a, kw, args.iters)
        rows.append(dict(batch=b, step="plain decode", nodes=1, ms_pipelined=pipe, ms_synced=sync))
        plain.scheduler.cache = add_profile(rows[-1], fn, plain.scheduler.programs.state, plain.scheduler.cache, a, kw)
        print_table(rows[-1:], cols)
        for tree in args.trees.split(","):
          for u in [int(x) for x in args.tree_unroll.split(",") if x] or [None]:
            programs.TREE_UNROLL = u
            tag = "" if u is None else f" u{u}"
            steps, topk, n = map(int, tree.split(":"))
            if args.random:
                drafter = EagleDrafter(head, TreeShape(steps, topk, n))
            else:
                drafter = SpecConfig("EAGLE3", draft_model_path=args.draft_model, num_steps=steps, eagle_topk=topk,
                                     num_draft_tokens=n).build(model, args.model)
            # no shrinking of the tree at large batch here: the probe prices the full tree
            gen = Generator(model, tok, drafter=drafter, max_batch=64, max_seq_len=1024, spec_max_verify_tokens=1 << 16)
            fn, a, kw = capture(gen, "verify_tree", prompts)
            pipe, sync, gen.scheduler.cache = time_program(fn, gen.scheduler.programs.state, gen.scheduler.cache,
                                                           a, kw, args.iters)
            rows.append(dict(batch=b, step=f"eagle3 {tree}{tag}", nodes=n, ms_pipelined=pipe, ms_synced=sync))
            gen.scheduler.cache = add_profile(rows[-1], fn, gen.scheduler.programs.state, gen.scheduler.cache, a, kw)
            # the same tree through the target alone, on a cache of the target's shape
            bare = Programs(model)
            pipe_v, sync_v, tcache = time_program(bare.verify_tree, bare.state, gen.scheduler.cache[0], a, kw,
                                                         args.iters)
            rows.append(dict(batch=b, step=f"verify only {n}{tag}", nodes=n, ms_pipelined=pipe_v, ms_synced=sync_v))
            tcache = add_profile(rows[-1], bare.verify_tree, bare.state, tcache, a, kw)
            rows[-2]["draft_share"] = 1 - pipe_v / pipe
            print_table(rows[-2:], cols)
            del gen, tcache
    print()
    print_table(rows, cols)
    print(write_results("eagle_probe" + args.tag, rows, {"unroll": args.unroll, "xla_flags": os.environ.get("XLA_FLAGS", "")}))


if __name__ == "__main__":
    main()
