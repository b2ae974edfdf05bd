"""Is the engine's loop host-bound at small batch? Runs the scheduler end to end on a SmolLM2-shaped
target with random bf16 weights (and a random EAGLE-3 head: it drafts badly, so every step emits
about one token, but a step's host work is the same), with ignore_eos so every request runs
max_tokens, and times per step:

  ms_per_step    wall time of a pass / scheduler steps;
  wait_ms        time the host sat blocked on a step's outputs (device-bound part);
  host_ms        the rest: launching, reading back, emitting (when it exceeds the device's time per
                 step, the device idles).

A cProfile of one EAGLE-3 pass at batch 1 lists the host's top functions (a program's launch, the
host enqueueing its GPU kernels one by one, shows as the self time of the scheduler function that
calls it). Writes bench/results/host_probe-<device>.json. (At 4364adc this probe also compared
packing the step's small inputs and outputs into one copy each way: 0.73x at batch 1, the two
extra small programs cost more than the copies they saved; host_probe-packed-*.json.)

    python bench/host_probe.py [--batches 1,8] [--max-tokens 128] [--rounds 3]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

import jax.numpy as jnp
import numpy as np
from flax import nnx

from common import print_table, write_results
from jaxspec import Generator, SamplingParams
from jaxspec.drafters.eagle import DraftHead, EagleDrafter, HeadConfig
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.models import Llama, ModelConfig

SMOL = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                   num_kv_heads=3, head_dim=64, max_position=8192, eos_token_ids=(2,), tie_word_embeddings=True)


def one_pass(gen, prompts, params):
    st0 = dict(gen.scheduler.stats)
    t0 = time.perf_counter()
    outs = gen.generate(prompts, params)
    wall = time.perf_counter() - t0
    st = gen.scheduler.stats
    steps = st["steps"] - st0["steps"]
    return dict(wall=wall, steps=steps, wait=st["wait_time"] - st0["wait_time"],
                tokens=sum(len(o.token_ids) for o in outs), chained=st["chained_steps"] - st0["chained_steps"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    model = Llama(SMOL, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    head = DraftHead(HeadConfig.for_target(SMOL, "eagle3"), dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    gens = {"plain": Generator(model, None, max_batch=64, max_seq_len=1024, warmup=True),
            "plain 1/call": Generator(model, None, max_batch=64, max_seq_len=1024, warmup=True, decode_steps=1),
            "eagle3 6:4:24": Generator(model, None, drafter=EagleDrafter(head, TreeShape(6, 4, 24)), max_batch=64,
                                       max_seq_len=1024, warmup=True)}
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for b in map(int, args.batches.split(",")):
        prompts = [[int(t) for t in rng.integers(3, SMOL.vocab_size, 64)] for _ in range(b)]
        for algo, gen in gens.items():
            one_pass(gen, prompts, params)  # compile every shape
            rs = [one_pass(gen, prompts, params) for _ in range(args.rounds)]
            rows.append(dict(algorithm=algo, batch=b, ms_per_step=float(np.median([1e3 * r["wall"] / r["steps"] for r in rs])),
                             wait_ms=float(np.median([1e3 * r["wait"] / r["steps"] for r in rs])),
                             host_ms=float(np.median([1e3 * (r["wall"] - r["wait"]) / r["steps"] for r in rs])),
                             tokens_per_s=float(np.median([r["tokens"] / r["wall"] for r in rs])),
                             steps=rs[0]["steps"], chained=rs[0]["chained"]))
            print_table(rows[-1:], ["algorithm", "batch", "ms_per_step", "wait_ms", "host_ms", "tokens_per_s"])
    # where the host's time goes: one EAGLE-3 pass at batch 1
    algo = next(a for a in gens if a.startswith("eagle"))
    gen, prompts = gens[algo], [[int(t) for t in rng.integers(3, SMOL.vocab_size, 64)]]
    one_pass(gen, prompts, params)
    prof = cProfile.Profile()
    prof.enable()
    r = one_pass(gen, prompts, params)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).strip_dirs().sort_stats("tottime").print_stats(30)  # no machine paths
    profile = [l for l in text.getvalue().splitlines() if l.strip()][:45]
    print("\n".join(profile))
    write_results("host_probe" + args.tag, rows, {"xla_flags": os.environ.get("XLA_FLAGS", ""),
                                                  "profile_eagle3_b1": profile, "profile_steps": r["steps"]})


if __name__ == "__main__":
    main()
