"""EAGLE-3 heads (or DFLASH drafters) side by side: the accept length each gets on the benchmarks' prompts,
decoding greedily through the engine with one tree (DFLASH: a chain of its block). Accept length is a property
of the drafter and the target's greedy text, not of the machine's speed, so a CPU measures it (float32 here;
bf16 on a GPU may differ a little). `straggle`: the steps the closed waves of --batch requests took (each as many as
its slowest request) over their requests' mean steps; `plain_straggle` the same for plain decoding (a step a token).
Their ratio is what a wave loses to speculation's spread between requests, against batch 1.

    python bench/probes/head_accept.py --heads jaxspec/drafters/weights/smollm2-135m-eagle3,runs/x/head \
        [--datasets mt-bench,humaneval] [--tree 6:4:24] [--batch 8] [--max-tokens 128] [--prompts 80]
    python bench/probes/head_accept.py --kind dflash --heads jaxspec/drafters/weights/smollm2-135m-dflash,runs/y/head
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from common import humaneval_prompts, mt_bench_prompts, print_table, results_tag, write_results  # noqa: E402

COLS = ["head", "dataset", "tree", "nodes", "prompts", "steps", "accept_length", "straggle", "plain_straggle",
        "identical_to_first"]


def straggle(waves) -> float:
    """Steps closed waves take (each as many as its slowest request) over their requests' mean steps."""
    return sum(max(s) for s in waves) / sum(np.mean(s) for s in waves)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", required=True, help="EAGLE-3 head (or DFLASH drafter) directories, comma-separated")
    ap.add_argument("--kind", choices=["eagle3", "dflash"], default="eagle3")
    ap.add_argument("--datasets", default="mt-bench,humaneval")
    ap.add_argument("--tree", default=None, help="steps:topk:draft tokens (default 6:4:24; DFLASH: the block's chain)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=None, help="the first N of each dataset (default: all)")
    ap.add_argument("--tag", type=results_tag, default="")
    args = ap.parse_args()

    from jaxspec import Generator, SamplingParams, SpecConfig
    from jaxspec.models.loading import load
    model, tok = load("smollm2-135m")
    tree = args.tree or ("6:4:24" if args.kind == "eagle3" else None)
    shape = dict(zip(("num_steps", "eagle_topk", "num_draft_tokens"), map(int, tree.split(":")))) if tree else {}
    rows, first = [], {}
    for head in args.heads.split(","):
        drafter = SpecConfig(args.kind.upper(), draft_model_path=head, **shape).build(model, "smollm2-135m")
        # (a tree for every row at any --batch: the default budget, 128 nodes a call, decodes batch 32 plainly)
        gen = Generator(model, tok, drafter=drafter, max_batch=args.batch, max_seq_len=1024, page_size=16, warmup=False,
                        spec_max_verify_tokens=64 * args.batch)
        for ds in args.datasets.split(","):
            prompts = (humaneval_prompts() if ds == "humaneval"
                       else [[{"role": "user", "content": q}] for q in mt_bench_prompts()])[:args.prompts]
            outs = []
            for w in range(0, len(prompts), args.batch):
                outs += gen.generate(prompts[w:w + args.batch], SamplingParams(max_tokens=args.max_tokens))
            acc = [a for o in outs for a in o.accept_lengths]
            by_wave = lambda f: [[f(o) for o in outs[w:w + args.batch]] for w in range(0, len(outs), args.batch)]
            waves = by_wave(lambda o: len(o.accept_lengths))  # steps; plain decoding's: one a token
            lengths = by_wave(lambda o: len(o.token_ids))
            texts = [o.token_ids for o in outs]
            first.setdefault(ds, texts)  # greedy: every head's text is the target's
            rows.append(dict(head=os.path.relpath(head) if os.path.isabs(head) else head, dataset=ds, kind=args.kind,
                             tree=tree or "chain", nodes=gen.scheduler.tree_size(args.batch), prompts=len(prompts),
                             steps=len(acc), accept_length=float(np.mean(acc)),
                             identical_to_first=texts == first[ds], max_tokens=args.max_tokens,
                             wave_steps=sum(max(s) for s in waves), straggle=straggle(waves),
                             plain_straggle=straggle(lengths)))
            print_table(rows[-1:], COLS)
    print(write_results("head_accept" + args.tag, rows, dict(batch=args.batch)))
    print_table(rows, COLS)


if __name__ == "__main__":
    main()
