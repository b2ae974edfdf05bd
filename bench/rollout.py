"""The jittable rollout (jaxspec.rollout: prefill + a lax.while_loop of prompt-lookup speculative
steps, one jitted function) beside the Generator's plain decoding of the same prompts.

SmolLM2, MT-bench first turns (chat template applied), greedy, `--max-tokens` new tokens, batches of
`--batches` prompts padded to the longest; tokens/s counts generated tokens (to EOS or the limit)
over the wall time of a jitted call, the median of `--repeats` calls after a compile call.

    python bench/rollout.py [--model smollm2-135m] [--batches 1,8] [--max-tokens 128] [--num-draft 4]
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--ngram", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model, tok = load(args.model)
    eos = int(model.cfg.eos_token_ids[0])
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
        for name, draft in (("rollout plain", 0), (f"rollout ngram:{args.num_draft}", args.num_draft)):
            fn, weights = jit_rollout(model, max_new_tokens=args.max_tokens, num_draft=draft, ngram=args.ngram,
                                      eos_id=eos)
            args_ = (weights, jnp.asarray(prompts), jnp.asarray(lens), jnp.zeros(b, jnp.int32))
            out, n = jax.block_until_ready(fn(*args_))  # compile
            secs = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out, n = jax.block_until_ready(fn(*args_))
                secs.append(time.perf_counter() - t0)
            rows.append(dict(engine="rollout", algorithm=name, batch=b, tokens=int(np.sum(n)),
                             tokens_per_s=float(np.sum(n) / np.median(secs)), seconds=float(np.median(secs))))
            print_table(rows[-1:], ["algorithm", "batch", "tokens", "tokens_per_s"])
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
        for r in rows[-3:-1]:
            r["vs_generator_plain"] = r["tokens_per_s"] / rows[-1]["tokens_per_s"]
        print_table(rows[-3:], ["engine", "algorithm", "batch", "tokens", "tokens_per_s", "vs_generator_plain"])
    print(write_results("rollout", rows, {"dtype": str(model.dtype), "num_draft": args.num_draft,
                                          "ngram": args.ngram}))


if __name__ == "__main__":
    main()
