"""Where a model's load goes: cProfile of `load` (GGUF parse, dequantize, weights to the device,
tokenizer) and of the engine's construction, the top functions by cumulative time.

    python bench/probes/load_profile.py --model PATH.gguf
"""
import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    t0 = time.perf_counter()
    import jax
    from common import write_results
    from jaxspec import Generator, SpecConfig
    from jaxspec.models.loading import load
    jax.devices()
    rows = [dict(stage="imports+backend", seconds=time.perf_counter() - t0)]
    for stage, fn in (("load", lambda: load(args.model)), ("engine", None)):
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        if fn is not None:
            model, tok = fn()
            jax.block_until_ready(jax.tree.leaves(jax.tree.map(lambda x: x, model.embed[...])))
        else:
            spec = SpecConfig("EAGLE3", num_steps=6, eagle_topk=4, num_draft_tokens=24)
            Generator(model, tok, drafter=spec.build(model, "smollm2-135m"), max_batch=64, max_seq_len=2048)
        prof.disable()
        rows.append(dict(stage=stage, seconds=time.perf_counter() - t))
        stats = pstats.Stats(prof)
        top = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:args.top]
        for (file, line, name), (_, _, tt, ct, _) in top:
            where = f"{os.path.basename(file)}:{line}({name})"
            rows.append(dict(stage=stage, function=where, cumulative_s=round(ct, 3), own_s=round(tt, 3)))
    for r in rows:
        print(r)
    print(write_results("load_profile", rows))


if __name__ == "__main__":
    main()
