"""Where the engine's plain step loses to the rollout's plain loop at small batch (rollout-NVIDIA-
H200.json, 00f7bbb: 963 against 672 tok/s at batch 1, the same model forward): the engine's
`decode` program timed as the engine runs it (bench/decode.py: 8 steps a call, chained), then with
one thing changed at a time, then the rollout's loop:

    engine       the program as built (page table of the engine's width, shared greedy/sampling
                 program, log-probabilities every step)
    narrow       page table sized to the request (fewer split-K parts to merge per layer)
    greedy       compiled for greedy rows only (no lax.cond around the sampler)
    no-logprobs  the log-softmax over the vocabulary left out (a probe-only patch)
    rollout      jaxspec.rollout's plain loop: (time for N + 128 tokens - time for N) / 128

Random bf16 weights of the model's shape. ms a step and kernels a step (from a profile).

    python bench/probes/decode_variants.py [--model smollm2-135m] [--batches 1,8] [--contexts 256,1024]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import jax.numpy as jnp
import numpy as np

from common import LLAMA3_8B, SMOLLM2, device_kernels, print_table, random_model, write_results
from decode import decode_steps
from jaxspec import programs, sampling
from jaxspec.models import ModelConfig
from jaxspec.rollout import jit_rollout

VARIANTS = ("engine", "narrow", "greedy", "no-logprobs", "rollout")


@contextlib.contextmanager
def patched(variant):
    """The probe-only changes of a variant, in force while its program is built and run."""
    saved = programs.program_flags, sampling.logprobs_of
    if variant == "greedy":
        programs.program_flags = lambda name, flags, shared=True: flags
    if variant == "no-logprobs":
        sampling.logprobs_of = lambda logits, nxt, k: (jnp.zeros(nxt.shape, jnp.float32), None, None)
    try:
        yield
    finally:
        programs.program_flags, sampling.logprobs_of = saved


def engine_step_ms(model, batch, context, variant, steps):
    width = 0 if variant == "narrow" else 8192  # max_seq_len: 0 gives the request's own pages
    with patched(variant):
        run = decode_steps(model, batch, context, width, 16, "auto")
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(run(steps))
            times.append((time.perf_counter() - t0) / steps)
        prof = device_kernels(lambda: jax.block_until_ready(run(16)), 16, tempfile.mkdtemp())
    return 1e3 * float(np.median(times)), prof and prof["kernels"]


def rollout_step_ms(model, batch, context, steps):
    prompts = jnp.ones((batch, context), jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    stop = jnp.full((batch, 1), -1, jnp.int32)  # random weights: never stop early

    def timed(n):
        fn, params, dparams = jit_rollout(model, None, algorithm="none", max_new_tokens=n)
        jax.block_until_ready(fn(params, dparams, prompts, lengths, jnp.arange(batch), stop_ids=stop).tokens)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, dparams, prompts, lengths, jnp.arange(batch), stop_ids=stop).tokens)
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    return 1e3 * (timed(8 + steps) - timed(8)) / steps, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    cfg = ModelConfig(**(SMOLLM2 if args.model == "smollm2-135m" else LLAMA3_8B))
    model = random_model(cfg, jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)
    rows = []
    for context in map(int, args.contexts.split(",")):
        for b in map(int, args.batches.split(",")):
            base = None
            for v in args.variants.split(","):
                ms, kernels = (rollout_step_ms(model, b, context, args.steps) if v == "rollout"
                               else engine_step_ms(model, b, context, v, args.steps))
                base = ms if v == "engine" else base
                rows.append(dict(model=args.model, batch=b, context=context, variant=v, ms_per_step=ms,
                                 tokens_per_s=1e3 * b / ms, kernels_per_step=kernels,
                                 vs_engine=None if base is None else base / ms))
                print_table(rows[-1:], ["context", "batch", "variant", "ms_per_step", "kernels_per_step",
                                        "vs_engine"])
    print()
    print_table(rows, ["model", "context", "batch", "variant", "ms_per_step", "tokens_per_s", "kernels_per_step", "vs_engine"])
    print(write_results("decode_variants", rows))


if __name__ == "__main__":
    main()
