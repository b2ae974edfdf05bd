"""Sampled speculation with and without Gumbel-coupled drafts (sampling.coupled_draft_logits).

The target draws each token as argmax(logits / T + Gumbel noise keyed by the request's seed and
the token's output position). A coupled draft ranks its candidates by the same perturbed logits,
so where the drafter agrees with the target it proposes the token the draw will pick; an
uncoupled one proposes its most probable tokens, which a draw at T = 1 picks only as often as
their probability. Verification is the same either way, so the outputs are identical (checked
here); only how many drafts a step accepts changes. SmolLM2 with the shipped EAGLE-3 head and
DFLASH drafter, MT-bench first turns (evaluation prompts: nothing here trains), greedy and
sampled at each temperature, the same seeds for both variants:

    python bench/probes/coupled_drafts.py [--prompts 8] [--max-tokens 64] [--temperatures 0.7,1.0]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from common import mt_bench_prompts, print_table, write_results  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--algos", default="EAGLE3,DFLASH")
    args = ap.parse_args()
    from jaxspec import Generator, SamplingParams, SpecConfig
    from jaxspec.drafters import dflash_step, eagle_step
    from jaxspec.models.loading import load
    model, tok = load("smollm2-135m")
    prompts = [[{"role": "user", "content": q}] for q in mt_bench_prompts()[:args.prompts]]
    rows = []
    temps = [0.0] + [float(x) for x in args.temperatures.split(",")]
    for algo in args.algos.split(","):
        spec = SpecConfig(algo, num_steps=6, eagle_topk=4, num_draft_tokens=24) if algo == "EAGLE3" else SpecConfig(algo)
        outs = {}
        for variant in ("coupled", "uncoupled"):
            with contextlib.ExitStack() as patches:
                if variant == "uncoupled":  # the drafter's own ranking: its most probable tokens
                    for module in (eagle_step, dflash_step):
                        patches.enter_context(mock.patch.object(module, "coupled", lambda *a: None))
                # no program store: a program kept on disk would skip the (patched) trace
                gen = Generator(model, tok, drafter=spec.build(model, "smollm2-135m"), max_batch=args.prompts,
                                max_seq_len=512, warmup=False, compile_cache="off")
                for t in temps:
                    params = [SamplingParams(max_tokens=args.max_tokens, temperature=t, seed=i)
                              for i in range(len(prompts))]
                    outs[variant, t] = gen.generate(prompts, params)
        for t in temps:
            for variant in ("coupled", "uncoupled"):
                done = outs[variant, t]
                rows.append(dict(algorithm=algo.lower(), temperature=t, drafts=variant, prompts=len(prompts),
                                 accept_length=float(np.mean([c.mean_accept_length for c in done])),
                                 tokens=sum(len(c.token_ids) for c in done),
                                 identical_to_coupled=[c.token_ids for c in done] ==
                                 [c.token_ids for c in outs["coupled", t]]))
                print(rows[-1], flush=True)
    print_table(rows, ["algorithm", "temperature", "drafts", "accept_length", "identical_to_coupled"])
    print(write_results("coupled_drafts", rows))


if __name__ == "__main__":
    main()
