"""Bounded load against the real HTTP server on loopback: throughput and p50/p99 latency,
plain vs NGRAM, side by side in one run.

    python bench/serve.py [--requests 200] [--concurrency 32] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx
import numpy as np

import server as srv
from common import mt_bench_prompts, print_table, write_results
from jaxspec import SpecConfig
from jaxspec.generator import Generator
from jaxspec.models.loading import load


def serve(gen, name):
    return srv.start_in_thread(srv.create_app(gen, name))


def load_test(url, prompts, concurrency, max_tokens):
    def one(p):
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/chat/completions", timeout=600,
                       json={"messages": [{"role": "user", "content": p}], "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
        return time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as ex:
        res = list(ex.map(one, prompts))
    wall = time.perf_counter() - t0
    lat = np.array([r[0] for r in res])
    toks = sum(r[1] for r in res)
    return dict(requests=len(prompts), tokens=toks, wall_s=wall, tokens_per_s=toks / wall,
                requests_per_s=len(prompts) / wall, p50_latency_s=float(np.percentile(lat, 50)),
                p99_latency_s=float(np.percentile(lat, 99)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    model, tok = load(args.model)
    qs = mt_bench_prompts()
    prompts = [qs[i % len(qs)] for i in range(args.requests)]
    rows = []
    for algo, spec in [("plain", None), ("ngram", SpecConfig("NGRAM", num_draft_tokens=8))]:
        gen = Generator(model, tok, drafter=spec.build(model) if spec else None, max_batch=args.concurrency,
                        max_seq_len=1024)
        url, server, th = serve(gen, args.model)
        load_test(url, prompts[: args.concurrency], args.concurrency, args.max_tokens)  # compile
        row = dict(model="smollm2-135m" if "smol" in args.model.lower() else args.model, algorithm=algo, dataset="mt-bench",
                   concurrency=args.concurrency,
                   **load_test(url, prompts, args.concurrency, args.max_tokens))
        server.should_exit = True
        th.join(timeout=30)
        rows.append(row)
        print_table(rows[-1:], ["algorithm", "requests", "tokens_per_s", "p50_latency_s", "p99_latency_s"])
    rows[1]["speedup"] = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    print()
    print_table(rows, ["algorithm", "requests", "concurrency", "tokens_per_s", "requests_per_s", "p50_latency_s",
                       "p99_latency_s", "speedup"])
    print(write_results("serve", rows))


if __name__ == "__main__":
    main()
