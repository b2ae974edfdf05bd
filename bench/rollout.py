"""The jittable rollout (jaxspec.rollout: prefill + a lax.while_loop of the engine's fused
speculative steps, one jitted function; none, prompt lookup, and the shipped EAGLE-3 / DFLASH
drafters) beside the Generator's plain decoding of the same prompts.

SmolLM2, MT-bench first turns (chat template applied), `--max-tokens` new tokens, batches of
`--batches` prompts padded to the longest; a batch smaller than `--prompts` runs several calls one
after the other (batch 1: eight prompts, not one), so that its accept length is not one prompt's.
tokens/s counts generated tokens (to EOS or the limit) over the wall time of those calls, the median
of `--repeats` rounds after a compile round.

    python bench/rollout.py [--model smollm2-135m] [--batches 1,8] [--max-tokens 128] [--algos none,eagle3:6:4:24]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from common import mt_bench_token_ids, print_table, write_results
from jaxspec import Generator, SamplingParams, SpecConfig
from jaxspec.models.loading import load
from jaxspec.rollout import jit_rollout


def drafter_for(model, algorithm, eagle3_dir=None):
    """The shipped SmolLM2 drafter module for a learned algorithm (None for the others); eagle3_dir:
    another EAGLE-3 head instead of the shipped one."""
    from jaxspec.drafters.dflash import load_dflash
    from jaxspec.drafters.eagle import load_head
    from jaxspec.speculative import shipped_drafter
    if algorithm in ("eagle", "eagle3"):
        path = eagle3_dir if algorithm == "eagle3" and eagle3_dir else shipped_drafter("smollm2-135m", algorithm.upper())
        return load_head(path, model.cfg, model, dtype=model.dtype)
    if algorithm == "dflash":
        return load_dflash(shipped_drafter("smollm2-135m", "DFLASH"), model.cfg, dtype=model.dtype)
    return None


def timed(fn, groups, repeats):
    """Run fn on each group of arguments in turn (one shape: one compile); returns the outputs and
    the median over repeats of the summed wall time."""
    outs = [jax.block_until_ready(fn(*args)) for args in groups]  # compile
    secs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [jax.block_until_ready(fn(*args)) for args in groups]
        secs.append(time.perf_counter() - t0)
    return outs, float(np.median(secs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--algos", default="none,prompt_lookup:4,eagle3:6:4:24,dflash:16",
                    help="none (first: the baseline), prompt_lookup:<tokens>, eagle|eagle3:<steps>:<topk>:<tokens>, "
                         "dflash:<block>")
    ap.add_argument("--engine", default="eagle3:6:4:24", help="the Generator's speculative run beside (greedy)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8,
                    help="prompts a batch size runs at least: batch 1 runs this many calls of one prompt")
    ap.add_argument("--draft-model", default=None, help="EAGLE-3 head directory (default: the shipped one)")
    args = ap.parse_args()
    model, tok = load(args.model)
    encoded = mt_bench_token_ids(tok)
    batches = list(map(int, args.batches.split(",")))
    steps, topk, nodes = map(int, args.engine.split(":")[1:])
    # warmed up: built lazily, the Generator compiled through its first two passes at batch 64 (the
    # second: prompts from the prefix cache) and its rows read 2345 tok/s (rollout-*.json, c617a50)
    engines = {"plain": Generator(model, tok, max_batch=max(batches), max_seq_len=1024, warmup=True),
               args.engine: Generator(model, tok, max_batch=max(batches), max_seq_len=1024, warmup=True,
                                      drafter=SpecConfig("EAGLE3", num_steps=steps, eagle_topk=topk,
                                                         num_draft_tokens=nodes,
                                                         draft_model_path=args.draft_model).build(model, "smollm2-135m"))}
    rows = []
    for b in batches:
        calls = max(1, args.prompts // b)  # several calls of b prompts, one after the other
        ids = (encoded * (-(-b * calls // len(encoded))))[:b * calls]
        prompts = np.zeros((b * calls, max(map(len, ids))), np.int32)
        for i, x in enumerate(ids):
            prompts[i, :len(x)] = x
        lens = np.array([len(x) for x in ids], np.int32)
        for temp in map(float, args.temperatures.split(",")):
            base = None
            for algo in args.algos.split(","):
                name, *nums = algo.split(":")
                shape = {}
                if len(nums) == 3:  # eagle3:6:4:24, dflash:15:4:32 (a tree from the block)
                    shape = dict(num_steps=int(nums[0]), topk=int(nums[1]), num_draft_tokens=int(nums[2]))
                elif nums:
                    shape = dict(num_draft_tokens=int(nums[0]))
                fn, params, dparams = jit_rollout(model, drafter_for(model, name, args.draft_model), algorithm=name,
                                                  max_new_tokens=args.max_tokens, sample=temp > 0, **shape)
                groups = [(params, dparams, jnp.asarray(prompts[c * b:(c + 1) * b]), jnp.asarray(lens[c * b:(c + 1) * b]),
                           jnp.arange(c * b, (c + 1) * b), jnp.full(b, temp, jnp.float32)) for c in range(calls)]
                outs, secs = timed(fn, groups, args.repeats)
                n = sum(int(np.asarray(o.lengths).sum()) for o in outs)
                steps_taken = sum(int(np.asarray(o.steps).sum()) for o in outs)
                row = dict(engine="rollout", algorithm=algo, batch=b, temperature=temp, prompts=b * calls, tokens=n,
                           tokens_per_s=n / secs, seconds=secs, accept_length=n / max(steps_taken, 1))
                base = base or row
                row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
                rows.append(row)
                print_table(rows[-1:], ["algorithm", "batch", "temperature", "tokens_per_s", "speedup", "accept_length"])
        params = SamplingParams(max_tokens=args.max_tokens)
        for label, gen in engines.items():  # the engine beside, greedy, the same calls of b prompts
            run = lambda: [o for c in range(calls) for o in gen.generate(ids[c * b:(c + 1) * b], params)]
            run()
            secs, tokens = [], 0
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                outs = run()
                secs.append(time.perf_counter() - t0)
                tokens = sum(len(o.token_ids) for o in outs)
            rows.append(dict(engine="generator", algorithm=label, batch=b, temperature=0.0, tokens=tokens,
                             tokens_per_s=float(tokens / np.median(secs)), seconds=float(np.median(secs))))
        greedy = [r for r in rows if r["batch"] == b and r["temperature"] == 0.0]
        plain_engine = next(r for r in greedy if r["engine"] == "generator" and r["algorithm"] == "plain")
        for r in greedy:
            r["vs_generator_plain"] = r["tokens_per_s"] / plain_engine["tokens_per_s"]
        print_table(greedy, ["engine", "algorithm", "batch", "tokens_per_s", "speedup", "vs_generator_plain"])
        path = write_results("rollout", rows, {"dtype": str(model.dtype)})  # after each batch: a cut-off run keeps its rows
    print(path)


if __name__ == "__main__":
    main()
