"""NGRAM's drafting policy on a modeled clock: the real engine and drafter (SmolLM2, greedy, batch 1)
decide when to draft, but every step's read-back advances a clock by the cost the H100 measured
for that kind of step, so the policy sees H100 timings while running on any machine.

    python bench/ngram_policy.py [--datasets humaneval,mt-bench] [--prompts 8]
        [--plain-ms 2.23 --verify-ms 3.37 --prefill-ms 5]

Defaults: bench/results/spec-v15-humaneval-b1-gain0-* (plain 448 tok/s: 2.23 ms a step; NGRAM
drafting every step, 827 tok/s at 2.79 tokens a step: 3.37 ms a verify step). The modeled
speedup is plain's modeled time over the policy's; outputs are checked against plain decoding.
Policies: `always` (spec_min_gain 0: verify wherever a request has a match), `default` (the
scheduler's defaults, spec_policy.SpecPolicy), and variants given as
--policies name=key:value,... over Scheduler keyword arguments.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

from common import humaneval_prompts, mt_bench_prompts, print_table, write_results  # noqa: E402
from jaxspec import SamplingParams, SpecConfig  # noqa: E402
from jaxspec.generator import Generator  # noqa: E402
from jaxspec.models.loading import load  # noqa: E402
from jaxspec.scheduler import Scheduler  # noqa: E402


def modeled_run(gen, prompts, max_tokens, cost):
    """Generate prompts one at a time with the scheduler's step clock driven by `cost`; returns
    (outputs, modeled seconds, plain steps, verify steps)."""
    sched = gen.scheduler
    clock = [0.0]
    steps = {"decode": 0, "verify": 0, "prefill": 0}
    original = Scheduler._arrived

    def arrived(self, f, now, n=1, prefill=False):
        k = "prefill" if prefill else f.kind
        steps[k] += 1 if prefill else n
        clock[0] += cost[k] * (1 if prefill else n)  # a plain call runs several steps
        return original(self, f, clock[0], n, prefill)

    sched._arrived = arrived.__get__(sched)
    try:
        outs = [gen.generate([p], SamplingParams(max_tokens=max_tokens))[0] for p in prompts]
    finally:
        del sched._arrived
    return outs, clock[0], steps["decode"], steps["verify"]


def parse_policy(text):
    name, _, kv = text.partition("=")
    kw = {}
    for item in filter(None, kv.split(",")):
        k, v = item.split(":")
        kw[k] = float(v) if "." in v else int(v)
    return name, kw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--datasets", default="humaneval,mt-bench")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--plain-ms", type=float, default=2.23)
    ap.add_argument("--verify-ms", type=float, default=3.37)
    ap.add_argument("--prefill-ms", type=float, default=5.0)
    ap.add_argument("--policies", default="always=spec_min_gain:0.0;default=",
                    help="';'-separated name=key:value,... (Scheduler keyword arguments)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    cost = {"decode": args.plain_ms / 1e3, "verify": args.verify_ms / 1e3, "prefill": args.prefill_ms / 1e3}
    model, tok = load(args.model)
    policies = [parse_policy(p) for p in args.policies.split(";")]
    rows = []
    for ds in args.datasets.split(","):
        prompts = (humaneval_prompts() if ds == "humaneval"
                   else [[{"role": "user", "content": q}] for q in mt_bench_prompts()])[:args.prompts]
        plain = Generator(model, tok, max_batch=1, max_seq_len=1024, page_size=16)
        ref, plain_s, _, _ = modeled_run(plain, prompts, args.max_tokens, cost)
        ntok = sum(len(o.token_ids) for o in ref)
        for name, kw in policies:
            gen = Generator(model, tok, drafter=SpecConfig("NGRAM", num_draft_tokens=8).build(model, args.model),
                            max_batch=1, max_seq_len=1024, page_size=16, **kw)
            outs, secs, n_plain, n_verify = modeled_run(gen, prompts, args.max_tokens, cost)
            acc = [a for o in outs for a in (o.accept_lengths or [])]
            rows.append(dict(dataset=ds, policy=name, options=kw, tokens=ntok, plain_steps=n_plain,
                             verify_steps=n_verify, accept_length=sum(acc) / max(len(acc), 1),
                             modeled_speedup=plain_s / secs,
                             identical_to_plain=[o.token_ids for o in outs] == [o.token_ids for o in ref]))
            print_table(rows[-1:], ["dataset", "policy", "plain_steps", "verify_steps", "accept_length",
                                    "modeled_speedup", "identical_to_plain"])
    print()
    print_table(rows, ["dataset", "policy", "plain_steps", "verify_steps", "accept_length", "modeled_speedup",
                       "identical_to_plain"])
    print(write_results("ngram_policy" + args.tag, rows, {"cost_ms": {k: v * 1e3 for k, v in cost.items()}}))


if __name__ == "__main__":
    main()
