"""What joining newcomers into a running batch's chain (scheduler/joining.py) changes in the calls of
continuous batching: more requests than rows, all queued at once (spec.py's `--admission continuous`),
through a plain engine (or `--drafter eagle3`: an EAGLE-3 one, 6:4:32, a random head) with joins and with
them off, side by side. Per engine: calls, calls launched
from the host after a read-back (unchained: the device waits), joins, prefill tokens, wall seconds.
A SmolLM2-shaped target with random weights (bf16 on a GPU); --smoke: a two-layer toy on the CPU,
where only the counts mean anything. Outputs are checked equal.

    python bench/probes/join_calls.py [--batch 64] [--requests 160] [--max-tokens 128] [--rounds 2] [--drafter eagle3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import SMOLLM2, print_table, random_model, write_results  # noqa: E402
from jaxspec import Generator, SamplingParams  # noqa: E402
from jaxspec.models import ModelConfig  # noqa: E402

COLS = ["engine", "drafter", "round", "batch", "requests", "tokens", "wall_s", "tokens_per_s", "calls", "unchained_calls",
        "joins", "prefill_tokens"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--drafter", choices=["none", "eagle3"], default="none")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    shape = dict(SMOLLM2, max_position=2048)
    if args.smoke:
        shape.update(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                     vocab_size=512)
    cfg = ModelConfig(**shape)
    model = random_model(cfg, jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, cfg.vocab_size - 1, rng.integers(20, 120)))) for _ in range(args.requests)]
    # lengths as answers vary (a quarter end early): rows free up one by one
    params = [SamplingParams(max_tokens=int(rng.integers(args.max_tokens // 4, args.max_tokens + 1)), ignore_eos=True)
              for _ in prompts]
    kw = dict(max_batch=args.batch, max_seq_len=512, warmup=not args.smoke)
    if args.drafter == "eagle3":
        from flax import nnx

        from jaxspec.drafters.eagle import DraftHead, EagleDrafter, HeadConfig
        from jaxspec.drafters.eagle_step import TreeShape
        hc = HeadConfig.for_target(cfg, "eagle3", draft_vocab_size=min(8192, cfg.vocab_size))
        head = DraftHead(hc, dtype=model.embed[...].dtype, rngs=nnx.Rngs(0))
        kw.update(drafter=EagleDrafter(head, TreeShape(6, 4, 32)), spec_max_verify_tokens=4096)
    engines = {"join": Generator(model, None, join_newcomers=True, **kw), "no_join": Generator(model, None, **kw)}
    outs, rows = {}, []
    for r in range(args.rounds + 1):  # round 0 compiles what warm-up did not
        for name, gen in engines.items():
            s = gen.scheduler.stats
            before = dict(s)
            t0 = time.perf_counter()
            got = gen.generate(prompts, params)
            wall = time.perf_counter() - t0
            outs.setdefault(name, [c.token_ids for c in got])
            d = {k: s[k] - before[k] for k in s if isinstance(s[k], (int, float))}
            if r:
                tokens = sum(len(c.token_ids) for c in got)
                rows.append(dict(engine=name, drafter=args.drafter, round=r, batch=args.batch, requests=len(prompts),
                                 tokens=tokens,
                                 wall_s=wall, tokens_per_s=tokens / wall, calls=d["steps"],
                                 unchained_calls=d["steps"] - d["chained_steps"], joins=d["joins"],
                                 prefill_tokens=d["prefill_tokens"]))
    assert outs["join"] == outs["no_join"], "joined and unjoined outputs differ"
    print_table(rows, COLS)
    write_results(f"join_calls{args.tag}", rows, dict(smoke=args.smoke))


if __name__ == "__main__":
    main()
