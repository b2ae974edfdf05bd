"""NGRAM trie cost on the host: insertion time and the garbage collector's pauses while a trie of
HumanEval batch-64 size (64 sequences x 280 tokens, depth 19) is built, then one full collection.

    python bench/ngram_trie.py [--tag=-x]

Only `NgramCache(max_trie_depth).insert` and `.size` are used, so the same script times earlier
tries too (run it from an older checkout with --tag).
"""
from __future__ import annotations

import gc
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

from common import print_table, write_results  # noqa: E402
from jaxspec.drafters.ngram import NgramCache  # noqa: E402


def main():
    tag = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--tag=")), "")
    rng = np.random.default_rng(0)
    # code-like streams: half the tokens from a small set, so paths repeat as in real text
    seqs = [np.where(rng.random(280) < 0.5, rng.integers(0, 50, 280), rng.integers(0, 2000, 280)).tolist()
            for _ in range(64)]
    pauses = []

    def on_gc(phase, info):
        if phase == "start":
            on_gc.t0 = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - on_gc.t0))

    rows = []
    for rep in range(3):
        gc.collect()
        pauses.clear()
        gc.callbacks.append(on_gc)
        cache = NgramCache(max_trie_depth=19)
        t0 = time.perf_counter()
        for s in seqs:
            cache.insert(s)
        insert_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        gc.collect()
        full_s = time.perf_counter() - t0
        gc.callbacks.remove(on_gc)
        rows.append(dict(rep=rep, tokens=sum(map(len, seqs)), nodes=cache.size, insert_s=insert_s,
                         us_per_token=1e6 * insert_s / sum(map(len, seqs)),
                         gc_collections=len(pauses) - 1, gc_pause_s=sum(p for _, p in pauses[:-1]),
                         gen2_pause_s=sum(p for g, p in pauses[:-1] if g == 2), full_collect_s=full_s))
        del cache
    print_table(rows, list(rows[0]))
    print(write_results("ngram_trie" + tag, rows))


if __name__ == "__main__":
    main()
