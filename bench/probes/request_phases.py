"""Where a batch-1 request's time goes through the Generator: its first token (prompt templating,
tokenizing, prefill, the head's catch-up) against its steps after it, on SmolLM2 with real weights
and MT-bench prompts, plain and EAGLE-3 side by side.

bench/spec.py gave EAGLE-3 6:4:24 about 2.0 ms a step at batch 1 (3.19 tokens a step) while the
same fused step in the rollout's device loop took about 1.55 ms, and neither 8 verify steps a call
nor XLA's SKIP_TEMP update mode (fewer command-buffer re-recordings) moved it (spec-steps-,
spec-mode-*.json). This splits each request: `first_ms` is a max_tokens=1 request's wall time,
`full_ms` the same prompt's max_tokens=N request, `step_ms` = (full - first) / the steps after the
first token, alongside the scheduler's own timers per step. A cProfile of one EAGLE-3 request lists
the host's top functions.

    python bench/probes/request_phases.py [--prompts 8] [--max-tokens 128] [--algos plain,eagle3:3:4:8,eagle3:6:4:24]
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

import numpy as np

from common import mt_bench_prompts, print_table, write_results
from jaxspec import Generator, SamplingParams, SpecConfig
from jaxspec.models.loading import load

COLS = ["algorithm", "requests", "first_ms", "full_ms", "tokens", "steps", "step_ms", "tokens_per_s",
        "host_ms_per_step", "wait_ms_per_step"]
TIMERS = ("verify_time", "decode_time", "prefill_time", "draft_time", "wait_time")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--algos", default="plain,eagle3:6:4:24", help="plain and eagle3:<steps>:<topk>:<tokens> trees")
    ap.add_argument("--lazy", action="store_true", help="no start-up build (a CPU smoke run)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    model, tok = load("smollm2-135m")
    prompts = [[{"role": "user", "content": q}] for q in mt_bench_prompts()[:args.prompts]]
    gens = {}
    for algo in args.algos.split(","):
        name, *tree = algo.split(":")
        steps, topk, nodes = map(int, tree or (0, 0, 0))
        drafter = None if name == "plain" else SpecConfig(name.upper(), num_draft_tokens=nodes, num_steps=steps,
                                                          eagle_topk=topk).build(model, "smollm2-135m")
        gens[algo] = Generator(model, tok, drafter=drafter, max_batch=8, max_seq_len=1024, warmup=not args.lazy)
    one, full = SamplingParams(max_tokens=1), SamplingParams(max_tokens=args.max_tokens)
    rows, profile = [], None
    for name, gen in gens.items():
        for _ in range(2):  # every shape these prompts meet, compiled
            for p in prompts:
                gen.generate(p, one)
                gen.generate(p, full)
        firsts, fulls, tokens, steps = [], [], [], []
        timers = dict.fromkeys(TIMERS, 0.0)
        for p in prompts:
            t0 = time.perf_counter()
            gen.generate(p, one)
            firsts.append(time.perf_counter() - t0)
            before = dict(gen.scheduler.stats)
            t0 = time.perf_counter()
            out = gen.generate(p, full)
            fulls.append(time.perf_counter() - t0)
            after = gen.scheduler.stats
            tokens.append(len(out.token_ids))
            # device steps after the first token: a row's verify steps for EAGLE-3 (batch 1: one row
            # a step), a token each for plain decoding
            steps.append(after["verified_rows"] - before["verified_rows"] if name != "plain" else len(out.token_ids) - 1)
            for k in TIMERS:
                timers[k] += after.get(k, 0.0) - before.get(k, 0.0)
        if name != "plain" and profile is None:
            prof = cProfile.Profile()
            prof.enable()
            gen.generate(prompts[0], full)
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime").print_stats(25)  # no machine paths
            profile = buf.getvalue().splitlines()[:40]
        after_first = sum(f - s for f, s in zip(fulls, firsts))
        n_steps = max(1, sum(steps))
        rows.append(dict(algorithm=name, requests=len(prompts), first_ms=1e3 * float(np.median(firsts)),
                         full_ms=1e3 * float(np.median(fulls)), tokens=sum(tokens), steps=n_steps,
                         step_ms=1e3 * after_first / n_steps, tokens_per_s=sum(tokens) / sum(fulls),
                         host_ms_per_step=1e3 * (sum(fulls) - timers["wait_time"]) / n_steps,
                         wait_ms_per_step=1e3 * timers["wait_time"] / n_steps,
                         timers_ms={k: 1e3 * v for k, v in timers.items()}))
        print_table(rows[-1:], COLS)
    print_table(rows, COLS)
    if profile:
        print("\n".join(profile))
    print(write_results("request_phases" + args.tag, rows, {"profile_eagle3": profile}))


if __name__ == "__main__":
    main()
