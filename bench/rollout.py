"""The jittable rollout (jaxspec.rollout: prefill + a lax.while_loop of the engine's fused
speculative steps, one jitted function; none, prompt lookup, and the shipped EAGLE-3 / DFLASH
drafters) beside the Generator's plain decoding of the same prompts.

SmolLM2, MT-bench first turns (chat template applied), greedy, `--max-tokens` new tokens, batches of
`--batches` prompts padded to the longest; tokens/s counts generated tokens (to EOS or the limit)
over the wall time of a jitted call, the median of `--repeats` calls after a compile call.

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

from common import mt_bench_prompts, print_table, write_results
from jaxspec import Generator, SamplingParams
from jaxspec.models.loading import load
from jaxspec.rollout import jit_rollout


def drafter_for(model, algorithm):
    """The shipped SmolLM2 drafter module for a learned algorithm (None for the others)."""
    from jaxspec.drafters.dflash import load_dflash
    from jaxspec.drafters.eagle import load_head
    from jaxspec.speculative import shipped_drafter
    if algorithm in ("eagle", "eagle3"):
        return load_head(shipped_drafter("smollm2-135m", algorithm.upper()), model.cfg, model, dtype=model.dtype)
    if algorithm == "dflash":
        return load_dflash(shipped_drafter("smollm2-135m", "DFLASH"), model.cfg, dtype=model.dtype)
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--algos", default="none,prompt_lookup:4,eagle3:6:4:24,dflash:16",
                    help="none, prompt_lookup:<tokens>, eagle|eagle3:<steps>:<topk>:<tokens>, dflash:<block>")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model, tok = load(args.model)
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in mt_bench_prompts()]
    encoded = [tok.encode(c, add_special_tokens=False) for c in chats]
    gen = Generator(model, tok, max_batch=max(map(int, args.batches.split(","))), max_seq_len=1024, warmup=True)
    rows = []
    for b in map(int, args.batches.split(",")):
        ids = encoded[:b]
        plen = max(map(len, ids))
        prompts = np.zeros((b, plen), np.int32)
        for i, x in enumerate(ids):
            prompts[i, :len(x)] = x
        lens = np.array([len(x) for x in ids], np.int32)
        for algo in args.algos.split(","):
            name, *nums = algo.split(":")
            shape = {}
            if name in ("eagle", "eagle3"):
                shape = dict(num_steps=int(nums[0]), topk=int(nums[1]), num_draft_tokens=int(nums[2]))
            elif nums:
                shape = dict(num_draft_tokens=int(nums[0]))
            fn, params, dparams = jit_rollout(model, drafter_for(model, name), algorithm=name,
                                              max_new_tokens=args.max_tokens, **shape)
            args_ = (params, dparams, jnp.asarray(prompts), jnp.asarray(lens), jnp.zeros(b, jnp.int32))
            out = jax.block_until_ready(fn(*args_))  # compile
            secs = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out = jax.block_until_ready(fn(*args_))
                secs.append(time.perf_counter() - t0)
            n = np.asarray(out.lengths)
            rows.append(dict(engine="rollout", algorithm=f"rollout {algo}", batch=b, tokens=int(n.sum()),
                             tokens_per_s=float(n.sum() / np.median(secs)), seconds=float(np.median(secs)),
                             accept_length=float(n.sum() / max(int(np.asarray(out.steps).sum()), 1))))
            print_table(rows[-1:], ["algorithm", "batch", "tokens", "tokens_per_s", "accept_length"])
        params = SamplingParams(max_tokens=args.max_tokens)
        gen.generate(ids, params)
        secs, tokens = [], 0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outs = gen.generate(ids, params)
            secs.append(time.perf_counter() - t0)
            tokens = sum(len(o.token_ids) for o in outs)
        rows.append(dict(engine="generator", algorithm="plain", batch=b, tokens=tokens,
                         tokens_per_s=float(tokens / np.median(secs)), seconds=float(np.median(secs))))
        k = len(args.algos.split(","))
        for r in rows[-k - 1:-1]:
            r["vs_generator_plain"] = r["tokens_per_s"] / rows[-1]["tokens_per_s"]
        print_table(rows[-k - 1:], ["engine", "algorithm", "batch", "tokens", "tokens_per_s", "vs_generator_plain"])
    print(write_results("rollout", rows, {"dtype": str(model.dtype)}))


if __name__ == "__main__":
    main()
