"""Does an EAGLE-3 step's cost grow with the KV pool's size? In server.py's own process with its
defaults (the pool sized by --mem-fraction-static 0.8: most of an H100), EAGLE-3 was no faster
than plain at concurrency 1 (serve-NVIDIA-H100-80GB-HBM3.json, 3b796d5), while the Generator
with its default pool (2049 pages at max batch 128) gave about 2x. Each configuration runs in a
process of its own (no compile cache or memory shared with another engine): SmolLM2, eight
MT-bench first turns one at a time, 128 new tokens, greedy; tok/s of a second pass.

    python bench/probes/pool_size.py [--configs eagle3:small,eagle3:0.8,plain:0.8]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from common import mt_bench_prompts, print_table, write_results


def one(config: str) -> dict:
    from jaxspec import Generator, SamplingParams, SpecConfig
    algo, pool = config.split(":")
    spec = SpecConfig("EAGLE3", num_steps=6, eagle_topk=4, num_draft_tokens=24) if algo == "eagle3" else None
    gen = Generator.from_pretrained("smollm2-135m", speculative=spec, max_batch=128, max_seq_len=1024,
                                    spec_policy="fixed", warmup=True,
                                    mem_fraction=None if pool == "small" else float(pool))
    params = SamplingParams(max_tokens=128)
    chats = [[{"role": "user", "content": q}] for q in mt_bench_prompts()[:8]]
    for c in chats:
        gen.generate(c, params)
    s = gen.scheduler
    st0, t0, n = dict(s.stats), time.perf_counter(), 0
    for c in chats:
        n += len(gen.generate(c, params).token_ids)
    wall = time.perf_counter() - t0
    return dict(algorithm=algo, pool=pool, num_pages=s.pool.num_pages, tokens=n, tokens_per_s=n / wall,
                verify_steps=s.stats["verify_steps"] - st0["verify_steps"], steps=s.stats["steps"] - st0["steps"],
                late_compiles=len(s.late_compiles))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="eagle3:small,eagle3:0.8,plain:small,plain:0.8")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("ROW " + json.dumps(one(args.one)))
        return
    rows = []
    for config in args.configs.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", config], capture_output=True, text=True)
        line = next((l for l in out.stdout.splitlines() if l.startswith("ROW ")), None)
        if line is None:
            print(out.stdout[-2000:], out.stderr[-3000:])
            continue
        rows.append(json.loads(line[4:]))
        print_table(rows[-1:], ["algorithm", "pool", "num_pages", "tokens_per_s", "verify_steps", "steps", "late_compiles"])
    print(write_results("pool_size", rows))


if __name__ == "__main__":
    main()
