"""The host's cost of reading a verify call back: Scheduler._collect on made-up outputs of an
EAGLE verify_steps call (batch B, S steps of an N-node tree, each row accepting `accept` tokens a
step), over live requests that no stop ends. It is the part of a call's host work that grows with
the tokens a call emits; the launch is not in it. CPU is enough: nothing runs on the device but
the read-back copy.

    python bench/probes/collect_cost.py [--batches 8,32,64,128] [--accept 1,3] [--tag -before]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from common import print_table, results_tag, write_results
from jaxspec import Generator, SamplingParams
from jaxspec.drafters.eagle import DraftHead, EagleDrafter, HeadConfig
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.models import Llama, ModelConfig
from jaxspec.scheduler.request import InFlight

CFG = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                  head_dim=16, max_position=8192, eos_token_ids=(2,), tie_word_embeddings=True)


def collect_ms(gen, batch, steps, nodes, accept, calls):
    """ms a _collect of one call, median over `calls` calls."""
    sched = gen.scheduler
    reqs = [sched.add([5, 6, 7], SamplingParams(max_tokens=4000)) for _ in range(batch)]
    sched.waiting.clear()
    rng = np.random.default_rng(0)
    out = []
    for _ in range(calls):
        toks = jnp.asarray(rng.integers(3, CFG.vocab_size, (batch, steps, nodes)), jnp.int32)
        count = jnp.full((batch, steps), accept, jnp.int32)
        tree = (jnp.zeros((batch, nodes), jnp.int32), jnp.zeros((batch, nodes), jnp.int32))
        f = InFlight("verify", reqs, (toks, count, None, None, None, tree), {}, None, nodes=nodes, steps=steps)
        jax.block_until_ready(f.outputs)
        t0 = time.perf_counter()
        sched._collect(f)
        out.append(1e3 * (time.perf_counter() - t0))
    return float(np.median(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,32,64,128")
    ap.add_argument("--accept", default="1,3")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--calls", type=int, default=200)  # (x steps x accept < max_tokens)
    ap.add_argument("--tag", type=results_tag, default="")
    args = ap.parse_args()
    model = Llama(CFG, dtype=jnp.float32, rngs=nnx.Rngs(0))
    head = DraftHead(HeadConfig.for_target(CFG, "eagle3"), dtype=jnp.float32, rngs=nnx.Rngs(1))
    rows = []
    for b in map(int, args.batches.split(",")):
        for a in map(int, args.accept.split(",")):
            gen = Generator(model, None, drafter=EagleDrafter(head, TreeShape(4, 2, args.nodes)), max_batch=b,
                            max_seq_len=4096)
            ms = collect_ms(gen, b, args.steps, args.nodes, a, args.calls)
            tokens = b * args.steps * a
            rows.append(dict(batch=b, steps=args.steps, nodes=args.nodes, accept=a, tokens_per_call=tokens,
                             collect_ms=ms, us_per_token=1e3 * ms / tokens))
            print_table(rows[-1:], list(rows[-1]))
    write_results("collect_cost" + args.tag, rows)


if __name__ == "__main__":
    main()
