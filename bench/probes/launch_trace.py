"""Where a scheduler call's host time goes below Python: the runtime's own trace events (XLA's
executable launch, command-buffer updates and launches, transfers) on the host threads, summed
over one Generator pass and divided by its calls.

bench/probes/host_probe.py found the host at 3.9 ms a call for EAGLE-3 at batch 1 on the H200
(half the call), most of it inside the program launch, which cProfile cannot see into. Here a
SmolLM2-shaped target with random bf16 weights (and a random EAGLE-3 head) runs `--max-tokens` at
each batch, ignore_eos; after warm passes one pass runs under jax.profiler. Events nest, so each
name's time includes its children's.

    python bench/probes/launch_trace.py [--batches 1,8] [--algos plain,eagle3]

(Run it under JAXSPEC_CMDBUF_UPDATE_MODE= and without: `update_mode` says which ran.)
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from common import print_table, trace_events, write_results
from host_probe import SMOL, one_pass
from jaxspec import Generator, SamplingParams, compile_options
from jaxspec.drafters.eagle import DraftHead, EagleDrafter, HeadConfig
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.models import Llama


COLS = ["algorithm", "update_mode", "batch", "calls", "wall_ms_per_call", "wait_ms_per_call", "updates_per_call",
        "update_ms_per_call", "tokens_per_s"]


def host_events(log_dir):
    """(name, thread name, µs) of every complete event on a non-GPU line of the newest trace."""
    events, procs, threads = trace_events(log_dir)
    gpu = {p for p, n in procs.items() if "GPU" in n.upper() and "HOST" not in n.upper()}
    thread = lambda e: re.sub(r"/-?\d+$", "", threads.get((e["pid"], e.get("tid")), "?"))  # one line a pool
    return [(e["name"], thread(e), e["dur"]) for e in events
            if e.get("ph") == "X" and e.get("pid") not in gpu]


def pointer_pass(gen, prompts, params, program="verify_steps"):
    """One more pass, logging for each call of `program` the device addresses of its arguments
    (before the call: donated ones are gone after) and of its outputs. Returns, per argument and
    output leaf that moved, how many addresses it had."""
    from jaxspec.programs import Programs
    log = []
    run = Programs.run

    def logged(self, name, flags, cache, args):
        ptr = lambda t: [x.unsafe_buffer_pointer() if isinstance(x, jax.Array) else None for x in jax.tree.leaves(t)]
        before = ptr((cache, args))
        out = run(self, name, flags, cache, args)
        if name == program:
            log.append((before, ptr(out)))
        return out

    Programs.run = logged
    try:
        one_pass(gen, prompts, params)
    finally:
        Programs.run = run
    moved = {}
    for side in (0, 1):
        for i in range(len(log[0][side]) if log else 0):
            seen = {ptrs[side][i] for ptrs in log}
            if len(seen) > 1:
                moved[f"{'out' if side else 'in'}[{i}]"] = len(seen)
    return dict(calls=len(log), moved=moved)


def traced_pass(gen, prompts, params):
    log = tempfile.mkdtemp()
    jax.profiler.start_trace(log)
    r = one_pass(gen, prompts, params)
    jax.profiler.stop_trace()
    return r, host_events(log)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--algos", default="plain,eagle3")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=40, help="host events printed a row (the file keeps 60)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    model = Llama(SMOL, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    head = DraftHead(HeadConfig.for_target(SMOL, "eagle3", draft_vocab_size=8192), dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    make = {"plain": lambda: Generator(model, None, max_batch=8, max_seq_len=1024, warmup=True),
            "eagle3": lambda: Generator(model, None, drafter=EagleDrafter(head, TreeShape(6, 4, 24)), max_batch=8,
                                        max_seq_len=1024, warmup=True)}
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    mode = compile_options.update_mode()
    for algo in args.algos.split(","):
        t0 = time.perf_counter()
        gen = make[algo]()
        print(f"{algo}: built in {time.perf_counter() - t0:.0f} s", flush=True)
        for b in map(int, args.batches.split(",")):
            prompts = [[int(t) for t in rng.integers(3, SMOL.vocab_size, 64)] for _ in range(b)]
            for _ in range(2):
                one_pass(gen, prompts, params)
            r, events = traced_pass(gen, prompts, params)
            moved = pointer_pass(gen, prompts, params, "verify_steps" if algo == "eagle3" else "decode")
            print("addresses:", moved, flush=True)
            calls = r["steps"]
            by = collections.defaultdict(lambda: [0.0, 0])
            for name, thread, dur in events:
                key = (name[:90], thread[:30])
                by[key][0] += dur
                by[key][1] += 1
            top = sorted(by.items(), key=lambda kv: -kv[1][0])[:60]
            updates = [d for n, _, d in events if n == "command_buffer::update"]
            rows.append(dict(algorithm=algo, update_mode=mode, batch=b, calls=calls, wall_ms_per_call=1e3 * r["wall"] / calls,
                             wait_ms_per_call=1e3 * r["wait"] / calls, updates_per_call=len(updates) / calls,
                             update_ms_per_call=sum(updates) / 1e3 / calls,
                             tokens_per_s=r["tokens"] / r["wall"], addresses=moved,
                             host_events=[(n, t, round(us / calls / 1e3, 4), round(c / calls, 2))
                                          for (n, t), (us, c) in top]))
            print_table(rows[-1:], COLS)
            for n, t, ms, c in rows[-1]["host_events"][:args.top]:
                print(f"  {ms:8.3f} ms {c:7.2f}x  [{t}] {n}")
        del gen
    print_table(rows, COLS)
    print(write_results("launch_trace" + args.tag, rows))


if __name__ == "__main__":
    main()
