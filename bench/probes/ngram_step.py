"""Where an NGRAM verify call's time goes: a SmolLM2-shaped target (random bf16 weights) with the
NGRAM drafter verifying every call (spec_min_gain 0) beside plain decoding, batch 1, a prompt
that repeats itself (so that the trie matches). Rows: tokens/s, the wall time between a call's
outputs and the next's by kind (host included), and a profile's GPU kernel time, kernel count
and busiest kernels per call.

    python bench/probes/ngram_step.py [--tokens 256] [--nodes 8]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from common import device_kernels, print_table, smollm2_and_head, write_results  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--layers", type=int, default=None, help="fewer target layers (a CPU smoke run)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    from jaxspec import Generator, SamplingParams, SpecConfig
    from jaxspec.scheduler import Scheduler
    cfg, model, _ = smollm2_and_head(args.layers)
    rng = np.random.default_rng(0)
    prompt = list(map(int, np.tile(rng.integers(100, cfg.vocab_size, 40), 6)))
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    rows = []
    for name, kw in (("plain", {}), (f"ngram:{args.nodes}", dict(
            drafter=SpecConfig("NGRAM", num_draft_tokens=args.nodes).build(model), spec_min_gain=0.0,
            spec_max_host_verify_tokens=args.nodes))):
        gen = Generator(model, None, max_batch=1, max_seq_len=1024, warmup=True, **kw)
        gen.generate([prompt], params)
        arrivals = []
        original = Scheduler._arrived

        def arrived(self, f, now, steps=1, prefill=False):
            arrivals.append(("prefill" if prefill else f.kind, time.perf_counter(), steps))
            return original(self, f, now, steps, prefill)
        gen.scheduler._arrived = arrived.__get__(gen.scheduler)
        t0 = time.perf_counter()
        out = gen.generate([prompt], params)[0]
        secs = time.perf_counter() - t0
        gaps = {}
        for (k0, t_0, _), (k1, t_1, s1) in zip(arrivals, arrivals[1:]):
            if k0 == k1 and k1 != "prefill":
                gaps.setdefault(k1, []).append(1e3 * (t_1 - t_0) / max(s1, 1))
        calls = sum(1 for k, _, _ in arrivals if k != "prefill")
        prof = device_kernels(lambda: gen.generate([prompt], params), calls, tempfile.mkdtemp())
        row = dict(engine=name, tokens=len(out.token_ids), tokens_per_s=len(out.token_ids) / secs,
                   calls=calls, accept_length=out.mean_accept_length,
                   ms_between_outputs={k: float(np.median(v)) for k, v in gaps.items()},
                   late_compiles=len(gen.scheduler.late_compiles))
        if prof:
            row.update(prof)
        rows.append(row)
        print_table(rows[-1:], ["engine", "tokens_per_s", "calls", "accept_length", "ms_between_outputs"])
        print({k: v for k, v in row.items() if k not in ("engine",)})
    print(write_results("ngram_step" + args.tag, rows))


if __name__ == "__main__":
    main()
