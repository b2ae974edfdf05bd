"""What an EAGLE-3 head's draft vocabulary leaves out: the share of the target's own greedy tokens on
MT-bench and HumanEval prompts (the first --prompts of each, --max-tokens new tokens) outside the
shipped head's draft ids, and outside the N most frequent ids of the committed training corpora
for N from 8k to the whole vocabulary (a token outside it can never be drafted). Also how far the
head's trained lm_head rows moved from the target's output rows they started as (cosine per row):
why grow_draft_vocab maps a new id's target row before adding it.

    python bench/probes/draft_vocab.py [--prompts 32] [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np

from common import humaneval_prompts, mt_bench_prompts, print_table, write_results
from jaxspec import Generator, SamplingParams
from jaxspec.drafters.eagle import load_head
from jaxspec.models.loading import load
from jaxspec.speculative import shipped_drafter
from jaxspec.train_data import token_counts

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = (8192, 12288, 16384, 24576, 32768)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    model, tok = load("smollm2-135m")
    vocab = model.cfg.vocab_size
    head = load_head(shipped_drafter("smollm2-135m", "EAGLE3"), model.cfg, model)
    shipped = np.asarray(head.draft_to_target[...])
    counts = 0
    for path in sorted(glob.glob(os.path.join(REPO, "data/smollm2-135m-selfgen-seed*/data.npz"))):
        d = np.load(path)
        counts = counts + token_counts(d["tokens"], d["lengths"], vocab)
    ranked = np.argsort(-counts, kind="stable")
    gen = Generator(model, tok, max_batch=16, max_seq_len=1024, warmup=False)
    rows = []
    for name, qs in (("mt-bench", mt_bench_prompts()), ("humaneval", humaneval_prompts())):
        chats = [q if isinstance(q, list) else [{"role": "user", "content": q}] for q in qs[:args.prompts]]
        ids = np.array([t for o in gen.generate(chats, SamplingParams(max_tokens=args.max_tokens, temperature=0))
                        for t in o.token_ids])
        rows.append(dict(dataset=name, draft_ids="shipped head", size=len(shipped), tokens=len(ids),
                         outside=float(1 - np.isin(ids, shipped).mean()),
                         corpus_coverage=float(counts[shipped].sum() / counts.sum())))
        for n in SIZES:
            rows.append(dict(dataset=name, draft_ids="corpus top-N", size=n, tokens=len(ids),
                             outside=float(1 - np.isin(ids, ranked[:n]).mean()),
                             corpus_coverage=float(counts[ranked[:n]].sum() / counts.sum())))
    trained = np.asarray(head.lm_head[...], np.float32)
    target = np.asarray(model.embed[...], np.float32).T[:, shipped]
    cos = (trained * target).sum(0) / np.linalg.norm(trained, axis=0) / np.linalg.norm(target, axis=0)
    print_table(rows, ["dataset", "draft_ids", "size", "tokens", "outside", "corpus_coverage"])
    print(f"trained rows against the target's: cosine median {np.median(cos):.3f}")
    print(write_results("draft_vocab", rows, {"row_cosine_p5_p50_p95": [float(x) for x in np.percentile(cos, [5, 50, 95])],
                                               "prompts": args.prompts, "max_tokens": args.max_tokens}))


if __name__ == "__main__":
    main()
