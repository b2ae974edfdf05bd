"""The Mosaic GPU verify kernel inside the engine: NGRAM tree verify at batch 8 with 32-token trees
(128 query rows a KV head) on a random bf16 model with 8B-like heads (8 q / 2 kv, head_dim 128),
run with attn_impl 'pallas' (Triton kernel) and 'mosaic', greedy. Reports how many requests'
outputs are token-identical between the two and the steps' speed; bf16 kernels may round
differently, so a divergence late in a sequence is possible, an early one is a bug sign.

    python bench/mosaic_engine_check.py        (GPU)
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp
import numpy as np
from flax import nnx

from common import print_table, write_results
from jaxspec.generator import Generator
from jaxspec.models import Llama, ModelConfig
from jaxspec.sampling import SamplingParams
from jaxspec.speculative import SpecConfig

CFG = ModelConfig(vocab_size=512, hidden_size=1024, intermediate_size=2048, num_layers=4, num_heads=8,
                  num_kv_heads=2, head_dim=128, max_position=4096, eos_token_ids=(511,))


def main():
    model = Llama(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = []
    for _ in range(8):  # repetitive prompts, so that NGRAM drafts full trees
        motif = list(map(int, rng.integers(0, 500, rng.integers(3, 8))))
        prompts.append((motif * 200)[: int(rng.integers(600, 1000))])
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    rows, outs = [], []
    smoke = "--smoke" in sys.argv  # CPU: the script's plumbing, with the reference attention
    if smoke:
        prompts, params = [p[:80] for p in prompts], SamplingParams(max_tokens=8, ignore_eos=True)
    for impl in ("ref", "ref", "ref") if smoke else ("pallas", "mosaic", "pallas"):
        gen = Generator(model, None, drafter=SpecConfig(num_draft_tokens=32).build(model), max_batch=8,
                        max_seq_len=1280, num_pages=800, page_size=16, attn_impl=impl,
                        spec_max_host_verify_tokens=256, spec_min_gain=0.0)  # verify every step
        gen.generate(prompts, params)  # compiles every bucket the timed run meets (5635ae2 warmed up on
        # two prompts only: its tokens_per_s, in bench/results, include compiles)
        t0 = time.perf_counter()
        res = gen.generate(prompts, params)
        dt = time.perf_counter() - t0
        outs.append([c.token_ids for c in res])
        rows.append(dict(attn_impl=impl, tokens_per_s=sum(len(c.token_ids) for c in res) / dt,
                         accept_length=float(np.mean([c.mean_accept_length for c in res]))))
    same = [a == b for a, b in zip(outs[0], outs[1])]  # Triton run against the Mosaic run
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(outs[0], outs[1])]
    for r in rows:
        r["identical_requests"] = f"{sum(same)}/8"
    print_table(rows, ["attn_impl", "tokens_per_s", "accept_length", "identical_requests"])
    print("first differing position per request:", first_diff)
    if not smoke:
        print(write_results("mosaic_engine_check", rows, {"first_diff": first_diff}))


if __name__ == "__main__":
    main()
