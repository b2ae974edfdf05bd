"""The Mosaic GPU verify kernel inside the engine: NGRAM tree verify at batch 8 (or --batch) with 32-token trees
(128 query rows a KV head) on a random bf16 model with Llama-3-8B's attention (32 q / 8 kv heads,
head_dim 128, hidden 4096; 4 layers, MLP 4096 wide), contexts 1.5k-2k, run with attn_impl
'pallas' (Triton kernel) and 'mosaic', greedy. Reports how many requests' outputs are
token-identical between the two, and the GPU's own time for the timed generation (a profiler
trace: all kernels, and the attention kernels alone), since its tokens/s move with the host; bf16
kernels may round differently, so a divergence late in a sequence is possible, an early one is a
bug sign. (Files before 0e66d34's successor ran 8 q / 2 kv heads, hidden 1024, contexts 0.6k-1k.)

    python bench/mosaic_engine_check.py [--batch=8]       (GPU)
"""
from __future__ import annotations

import itertools
import os
import tempfile
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

import jax.numpy as jnp
import numpy as np
from flax import nnx

from common import device_kernels, print_table, write_results
from jaxspec import scheduler
from jaxspec.generator import Generator
from jaxspec.models import Llama, ModelConfig
from jaxspec.sampling import SamplingParams
from jaxspec.speculative import SpecConfig

CFG = ModelConfig(vocab_size=512, hidden_size=4096, intermediate_size=4096, num_layers=4, num_heads=32,
                  num_kv_heads=8, head_dim=128, max_position=4096, eos_token_ids=(511,))
ATTENTION_KERNELS = ("verify_tree_hopper", "_kernel")  # the Mosaic kernel's name, the Triton kernel's


def main():
    # the drafting policy reads a tick a step instead of wall time (as the tests do): each run then
    # drafts the same trees for the same outputs, so the runs' GPU times compare (a0028f6's file, mosaic_engine_check-8b:
    # wall-timed policy, accept lengths 6.27 / 4.66 / 4.56 for identical outputs)
    scheduler.Scheduler.clock = staticmethod(itertools.count().__next__)
    model = Llama(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = []
    batch = int(next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--batch=")), 8))
    for _ in range(batch):  # repetitive prompts, so that NGRAM drafts full trees
        motif = list(map(int, rng.integers(0, 500, rng.integers(3, 8))))
        prompts.append((motif * 400)[: int(rng.integers(1500, 2000))])
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    rows, outs = [], []
    smoke = "--smoke" in sys.argv  # CPU: the script's plumbing, with the reference attention
    if smoke:
        prompts, params = [p[:80] for p in prompts], SamplingParams(max_tokens=8, ignore_eos=True)
    for impl in ("ref", "ref", "ref") if smoke else ("pallas", "mosaic", "pallas"):
        drafter = SpecConfig(num_draft_tokens=32).build(model)
        # fold every new token into the trie each step, not what fits while the device runs: the
        # drafts then do not depend on timing (3db13c5's runs drafted different trees without this)
        drafter.min_fold_tokens = 1 << 30
        gen = Generator(model, None, drafter=drafter, max_batch=batch,
                        max_seq_len=2176, num_pages=136 * batch + 64, page_size=16, attn_impl=impl,
                        spec_max_host_verify_tokens=32 * batch, spec_min_gain=0.0)  # verify every step
        gen.generate(prompts, params)  # compiles every bucket the timed run meets (5635ae2 warmed up on
        # two prompts only: its tokens_per_s, in bench/results, include compiles)
        t0 = time.perf_counter()
        res = gen.generate(prompts, params)
        dt = time.perf_counter() - t0
        outs.append([c.token_ids for c in res])
        rows.append(dict(attn_impl=impl, tokens_per_s=sum(len(c.token_ids) for c in res) / dt,
                         accept_length=float(np.mean([c.mean_accept_length for c in res]))))
        if not smoke:  # the same generation again under the profiler: the GPU's own time
            trace = device_kernels(lambda: gen.generate(prompts, params), 1, tempfile.mkdtemp(prefix="engine_check_"), top=40)
            if trace:
                attn = [(n, t, c) for n, t, c in trace["top"] if n.startswith(ATTENTION_KERNELS)]
                rows[-1].update(gpu_kernel_ms=trace["kernel_ms"], gpu_span_ms=trace["span_ms"],
                                attention_kernel_ms=sum(t for _, t, _ in attn) / 1e3,
                                attention_kernel_launches=sum(c for _, _, c in attn),
                                top_kernels=trace["top"][:6])
    same = [a == b for a, b in zip(outs[0], outs[1])]  # Triton run against the Mosaic run
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(outs[0], outs[1])]
    for r in rows:
        r["identical_requests"] = f"{sum(same)}/{len(same)}"
    print_table(rows, ["attn_impl", "tokens_per_s", "accept_length", "identical_requests", "gpu_kernel_ms",
                       "attention_kernel_ms", "attention_kernel_launches"])
    print("first differing position per request:", first_diff)
    if not smoke:
        print(write_results(f"mosaic_engine_check-8b-b{batch}", rows, {"first_diff": first_diff}))


if __name__ == "__main__":
    main()
