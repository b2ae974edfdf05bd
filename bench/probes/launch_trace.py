"""Where a scheduler call's host time goes below Python: the runtime's own trace events (XLA's
executable launch, command-buffer updates and launches, transfers) on the host threads, summed
over one Generator pass and divided by its calls.

bench/probes/host_probe.py found the host at 3.9 ms a call for EAGLE-3 at batch 1 on the H200
(half the call), most of it inside the program launch, which cProfile cannot see into. Here a
SmolLM2-shaped target with random bf16 weights (and a random EAGLE-3 head) runs `--max-tokens` at
each batch, ignore_eos; after warm passes one pass runs under jax.profiler. Events nest, so each
name's time includes its children's.

    python bench/probes/launch_trace.py [--batches 1,8] [--algos plain,eagle3]
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
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

from common import print_table, write_results
from host_probe import SMOL, one_pass
from jaxspec import Generator, SamplingParams
from jaxspec.drafters.eagle import DraftHead, EagleDrafter, HeadConfig
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.models import Llama


def host_events(log_dir):
    """(name, thread name, µs) of every complete event on a non-GPU line of the newest trace."""
    path = max(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz")), key=os.path.getmtime)
    events = json.load(gzip.open(path))["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = {p for p, n in procs.items() if "GPU" in n.upper() and "HOST" not in n.upper()}
    thread = lambda e: re.sub(r"/-?\d+$", "", threads.get((e["pid"], e.get("tid")), "?"))  # one line a pool
    return [(e["name"], thread(e), e["dur"]) for e in events
            if e.get("ph") == "X" and e.get("pid") not in gpu]


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
    ap.add_argument("--top", type=int, default=40)
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
    for algo in args.algos.split(","):
        t0 = time.perf_counter()
        gen = make[algo]()
        print(f"{algo}: built in {time.perf_counter() - t0:.0f} s", flush=True)
        for b in map(int, args.batches.split(",")):
            prompts = [[int(t) for t in rng.integers(3, SMOL.vocab_size, 64)] for _ in range(b)]
            for _ in range(2):
                one_pass(gen, prompts, params)
            r, events = traced_pass(gen, prompts, params)
            calls = r["steps"]
            by = collections.defaultdict(lambda: [0.0, 0])
            for name, thread, dur in events:
                key = (name[:90], thread[:30])
                by[key][0] += dur
                by[key][1] += 1
            top = sorted(by.items(), key=lambda kv: -kv[1][0])[:args.top]
            rows.append(dict(algorithm=algo, batch=b, calls=calls, wall_ms_per_call=1e3 * r["wall"] / calls,
                             wait_ms_per_call=1e3 * r["wait"] / calls,
                             host_events=[(n, t, round(us / calls / 1e3, 4), round(c / calls, 2))
                                          for (n, t), (us, c) in top]))
            print_table(rows[-1:], ["algorithm", "batch", "calls", "wall_ms_per_call", "wait_ms_per_call"])
            for n, t, ms, c in rows[-1]["host_events"]:
                print(f"  {ms:8.3f} ms {c:7.2f}x  [{t}] {n}")
        del gen
    print(write_results("launch_trace" + args.tag, rows))


if __name__ == "__main__":
    main()
