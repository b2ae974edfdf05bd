"""Did a benchmark prompt leak into a drafter's training data? The self-generated prompts of a
run's data.npz against MT-bench's first turns and HumanEval's prompts: for each benchmark prompt,
the longest run of words it shares with any training prompt, and how many benchmark prompts share
a 13-word run (GPT-3's contamination test) with the data.

    python bench/probes/data_leak.py RUN_DIR [--model smollm2-135m] [--tag=-seed0]
    python bench/probes/data_leak.py --code-prompts 8192 [--tag=-code]   # train_data.code_prompts, before generating
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np

from common import humaneval_prompts, mt_bench_prompts, print_table, write_results

N = 13


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(ws: list[str], n: int) -> set:
    return {tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)}


def longest_shared(ws: list[str], grams_by_n: dict) -> int:
    """Longest k (up to N) such that some k-word run of ws is in the data's k-grams."""
    best = 0
    for k in range(1, N + 1):
        if ngrams(ws, k) & grams_by_n[k]:
            best = k
        else:
            break
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run", nargs="?")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--code-prompts", type=int, help="check this many of this machine's code prompts, no run")
    ap.add_argument("--tag", default="", help="suffix of the results file (one file per corpus)")
    args = ap.parse_args()
    if args.code_prompts:
        from jaxspec.train_data import code_prompts
        prompts, source = code_prompts(args.code_prompts, 0), f"code_prompts, Python {sys.version.split()[0]}"
    else:
        from jaxspec.models.loading import load
        _, tok = load(args.model)
        d = np.load(os.path.join(args.run, "data.npz"))
        prompts = [tok.decode(row[:n].tolist()) for row, n in zip(d["tokens"], d["prompt_lengths"])]
        source = os.path.basename(os.path.normpath(args.run))
    grams = {k: set() for k in range(1, N + 1)}
    for p in prompts:
        ws = words(p)
        for k in grams:
            grams[k] |= ngrams(ws, k)
    rows = []
    for name, bench in (("mt-bench", mt_bench_prompts()), ("humaneval", humaneval_prompts())):
        longest = [longest_shared(words(q), grams) for q in bench]
        rows.append(dict(benchmark=name, prompts=len(bench), training_prompts=len(prompts),
                         with_13_word_run=sum(x >= N for x in longest), median_longest_run=float(np.median(longest)),
                         max_longest_run=int(max(longest))))
    print_table(rows, list(rows[0]))
    write_results(f"data_leak{args.tag}", rows, {"run": source})


if __name__ == "__main__":
    main()
