"""The auto policy's state call by call, for a DFLASH engine at batch 64 on MT-bench: why its
expectation of the top-4 tree ran to 7.5-11 tokens a step (it accepts ~2.4) in spec-dflash-s85-,
where the same code's predecessor read ~2.1 (spec-dflash-s85-base-b64-). After each verify call it
records the shape, the rows' mean tokens, the level (log drafts a row-step) and its unit, and each
shape's expectation; plain calls record the level only. Variants, each its own engine: `main`,
`no-first-runs` (Scheduler.first_runs off), `no-prefill-chain` (Dispatch._chain_on_prefill off).
    python bench/probes/policy_trace.py [--variants main,no-first-runs] [--passes 3]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax.numpy as jnp  # noqa: E402

from common import mt_bench_prompts, print_table, write_results  # noqa: E402
from jaxspec import SamplingParams, SpecConfig  # noqa: E402
from jaxspec.generator import Generator  # noqa: E402
from jaxspec.models.loading import load  # noqa: E402
from jaxspec.sampling import SamplerFlags  # noqa: E402
from jaxspec.scheduler.dispatch import Dispatch  # noqa: E402
from jaxspec.speculative import shipped_drafter  # noqa: E402


def traced(policy, log):
    """Wrap the policy's verified/arrived so that each call appends its state to log."""
    verified, arrived = policy.verified, policy.arrived

    def state():
        exp = {t.label: round(e, 3) for t in policy.seen if (e := policy.expected(t)) is not None}
        unit = policy.unit if isinstance(policy.unit, str) or policy.unit is None else policy.unit.label
        return dict(level=None if policy.level is None else round(policy.level, 4), unit=unit, expected=exp)

    def on_verified(tree, emitted, keys=None, rows=None, cut=None):
        verified(tree, emitted, keys, rows, cut)
        if emitted:
            log.append(dict(kind="verify", rows=rows, tree=tree.label, row_steps=len(emitted),
                            mean=round(sum(emitted) / len(emitted), 3), **state()))

    def on_arrived(rows, label, now, steps=1, measured=True, launched=None):
        arrived(rows, label, now, steps, measured, launched)
        if label == "plain":
            log.append(dict(kind="plain", rows=rows, steps=steps, **state()))

    policy.verified, policy.arrived = on_verified, on_arrived


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="main,no-first-runs,no-prefill-chain")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    model, tok = load("smollm2-135m", jnp.bfloat16)
    drafter = SpecConfig("DFLASH", draft_model_path=shipped_drafter("smollm2-135m", "DFLASH"),
                         num_draft_tokens=16).build(model, "smollm2-135m")
    prompts = [[{"role": "user", "content": q}] for q in mt_bench_prompts()][:2 * args.batch]
    chain_on_prefill = Dispatch._chain_on_prefill
    rows = []
    for variant in args.variants.split(","):
        Dispatch._chain_on_prefill = (lambda self, *a: False) if variant == "no-prefill-chain" else chain_on_prefill
        gen = Generator(model, tok, drafter=drafter, max_batch=args.batch, max_seq_len=1024, page_size=16,
                        num_pages=1 + args.batch * (1024 + 128) // 16, warmup=False, spec_policy="auto",
                        spec_max_verify_tokens=4096)
        gen.scheduler.first_runs = gen.scheduler.first_runs and variant != "no-first-runs"
        gen.scheduler.warmup([SamplerFlags.of([SamplingParams(max_tokens=1)])])
        log = []
        traced(gen.scheduler.spec_policy, log)
        for p in range(args.passes):
            for i in range(0, len(prompts), args.batch):
                gen.generate(prompts[i:i + args.batch], SamplingParams(max_tokens=args.max_tokens))
            log.append(dict(kind="pass", n=p))
        verifies = [e for e in log if e["kind"] == "verify"]
        levels = [e["level"] for e in log if e.get("level") is not None]
        top = max(verifies, key=lambda e: max(e["expected"].values(), default=0), default=None)
        rows.append(dict(variant=variant, calls=len(verifies), min_level=min(levels, default=None),
                         final=log[-2]["expected"] if len(log) > 1 else None,
                         most_expected=top and max(top["expected"].items(), key=lambda kv: kv[1]),
                         trace=log))
        print_table(rows[-1:], ["variant", "calls", "min_level", "final", "most_expected"])
    Dispatch._chain_on_prefill = chain_on_prefill
    write_results("policy_trace" + args.tag, rows)


if __name__ == "__main__":
    main()
