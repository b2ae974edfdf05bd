"""The auto policy alone (no engine) fed a block drafter's batch-1 calls: a chain of 16 at a given
verify cost against plain decoding's, each call `steps` steps, each step emitting 1 + a geometric
number of drafts (mean 1 / p tokens). Counts the calls the policy gave to plain decoding and its
expected tokens a step, against the true mean: how far calls that accept no draft move its level.

--hard F: a text in which stretches of `--hard-tokens` tokens (a fraction F of it) accept no draft.
Plain calls run 8 steps and emit a token each; the verify call after them verifies its roots alone
on its first step. Rows then carry tokens a ms, the policy's and the fixed chain's on the same text.
CPU only: nothing runs on a device.

    python bench/probes/level_noise.py [--steps 1,2,4] [--verify-ms 1.24,1.5] [--hard 0.1] [--tag -before]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np

from common import print_table, results_tag, write_results
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.spec_policy import PLAIN, PLAIN_CHOICE, SpecPolicy, StepCosts

CHAIN = TreeShape(15, 1, 16)


def chain_policy(verify_ms: float, plain_ms: float) -> SpecPolicy:
    return SpecPolicy(StepCosts({("decode", 1, None): plain_ms, ("verify", 1, CHAIN.label): verify_ms}),
                      {1: [CHAIN, PLAIN_CHOICE]})


def run(steps: int, verify_ms: float, p: float, calls: int, plain_ms: float = 1.2) -> dict:
    chain, policy = CHAIN, chain_policy(verify_ms, plain_ms)
    rng = np.random.default_rng(0)
    plain, expected = 0, []
    for _ in range(calls):
        if policy.choose(1) is None:
            plain += 1
        else:
            policy.verified(chain, list(rng.geometric(p, size=steps)), cut=((), np.zeros((steps, 1))))
        expected.append(policy.expected(chain))
    seen = [e for e in expected if e is not None]
    return dict(steps_a_call=steps, verify_ms=verify_ms, plain_ms=plain_ms, true_tokens_a_step=1 / p, calls=calls,
                plain_calls=plain, expected_mean=float(np.mean(seen)), expected_min=float(np.min(seen)))


def run_text(steps: int, verify_ms: float, p: float, hard: float, hard_tokens: int, tokens: int,
             plain_ms: float = 1.2, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    easy = []  # per token: whether a step starting there can accept drafts
    while len(easy) < tokens + 64:
        if rng.random() < hard / (hard_tokens * (1 - hard) + hard):  # (a stretch starts there: a fraction `hard` of tokens)
            easy += [False] * hard_tokens
        else:
            easy.append(True)
    draws = rng.geometric(p, size=tokens + 64)

    def step(x):  # tokens one verify step starting at x emits
        return int(draws[x]) if easy[x] else 1

    def fixed():
        x, ms = 0, 0.0
        while x < tokens:
            x, ms = x + step(x), ms + verify_ms
        return x / ms

    chain, policy = CHAIN, chain_policy(verify_ms, plain_ms)
    x, ms, plain, after_plain = 0, 0.0, 0, False
    while x < tokens:
        if policy.choose(1) is None:
            plain, after_plain = plain + 1, True
            x, ms = x + 8, ms + 8 * plain_ms
            policy.arrived(1, PLAIN, ms / 1e3, 8)
            continue
        emitted = []
        for i in range(steps):
            emitted.append(1 if after_plain and i == 0 else step(x))
            x, ms = x + emitted[-1], ms + verify_ms
        policy.verified(chain, emitted[1:] if after_plain else emitted, cut=((), np.zeros((steps, 1))))
        after_plain = False
    return dict(steps_a_call=steps, verify_ms=verify_ms, plain_ms=plain_ms, hard_fraction=hard,
                hard_tokens=hard_tokens, tokens=x, plain_calls=plain, tokens_per_ms=x / ms,
                vs_fixed_chain=(x / ms) / fixed())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="1,2,4")
    ap.add_argument("--verify-ms", default="1.24,1.5")
    ap.add_argument("--p", type=float, default=0.5)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--hard", type=float, default=0.0)
    ap.add_argument("--hard-tokens", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--tag", type=results_tag, default="")
    args = ap.parse_args()
    if args.hard:
        rows = [run_text(s, v, args.p, args.hard, args.hard_tokens, args.tokens, seed=seed)
                for v in map(float, args.verify_ms.split(",")) for s in map(int, args.steps.split(",")) for seed in (0, 1)]
    else:
        rows = [run(s, v, args.p, args.calls) for v in map(float, args.verify_ms.split(","))
                for s in map(int, args.steps.split(","))]
    print_table(rows, list(rows[0]))
    write_results("level_noise" + args.tag, rows)


if __name__ == "__main__":
    main()
