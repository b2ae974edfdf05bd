"""What one program for greedy and sampled batches costs a greedy batch: the engine's merged
sampler (draw and filters behind a lax.cond on whether any row samples) against programs
compiled without any sampler (the former greedy flag set), side by side in one process.
SmolLM2 shapes, random bf16 weights (the shipped EAGLE-3 head), 128 new greedy tokens a request.

    python bench/probes/sampler_probe.py [--batches 1,64] [--algos plain,eagle3]
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import SMOLLM2, print_table, random_model, write_results  # noqa: E402
from jaxspec import Generator, SamplingParams, SpecConfig  # noqa: E402
from jaxspec.models import ModelConfig  # noqa: E402
from jaxspec.sampling import SamplerFlags  # noqa: E402

MERGED = SamplerFlags.of


def greedy_only(params):  # the flags a greedy batch got before the merge: no sampler compiled in
    f = MERGED(params)
    return f._replace(sample=False, filter=False) if all(p.temperature == 0 for p in params) else f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--algos", default="plain,eagle3")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = random_model(ModelConfig(**SMOLLM2, max_position=4096), jnp.bfloat16)
    rng = np.random.default_rng(0)
    rows = []
    for algo in args.algos.split(","):
        drafter = None
        if algo == "eagle3":
            drafter = SpecConfig("EAGLE3", num_steps=6, eagle_topk=4, num_draft_tokens=24).build(model, "smollm2-135m")
        gen = Generator(model, None, drafter=drafter, max_batch=64, max_seq_len=1024, compile_cache="off")
        for b in map(int, args.batches.split(",")):
            prompts = [list(map(int, rng.integers(0, 40000, 100))) for _ in range(b)]
            params = SamplingParams(max_tokens=128, ignore_eos=True)
            got, toks = {"merged": [], "greedy_only": []}, {}
            for rnd in range(args.rounds + 1):
                for variant in got:
                    SamplerFlags.of = classmethod(lambda cls, p: greedy_only(p)) if variant == "greedy_only" \
                        else MERGED
                    t0 = time.perf_counter()
                    outs = gen.generate(prompts, params)
                    dt = time.perf_counter() - t0
                    if rnd:  # round 0 compiles
                        got[variant].append(sum(len(o.token_ids) for o in outs) / dt)
                    toks[variant] = [o.token_ids for o in outs]
            SamplerFlags.of = MERGED
            base = statistics.median(got["greedy_only"])
            for variant, runs in got.items():
                rows.append(dict(algorithm=algo, batch=b, variant=variant, tokens_per_s=statistics.median(runs),
                                 runs=runs, vs_greedy_only=statistics.median(runs) / base,
                                 # bf16 and random weights: near-tied logits, which two programs' rounding may order apart
                                 same_tokens=toks["merged"] == toks["greedy_only"]))
                print(rows[-1], flush=True)
    print_table(rows, ["algorithm", "batch", "variant", "tokens_per_s", "vs_greedy_only", "same_tokens"])
    print(write_results("sampler_probe", rows))


if __name__ == "__main__":
    main()
