"""Where an NGRAM verify call's time goes: a SmolLM2-shaped target (random bf16 weights) with the
NGRAM drafter verifying every call (spec_min_gain 0) beside plain decoding, batch 1, a prompt
that repeats itself (so that the trie matches); or (--real N) SmolLM2's weights on N MT-bench
questions under the default policy, as bench/spec.py runs it. Rows: tokens/s, the wall time
between a call's outputs and the next's by kind (host included), and a profile's GPU kernel
time, kernel count and busiest kernels per call; --host-profile adds cProfile's top functions.

    python bench/probes/ngram_step.py [--tokens 256] [--nodes 8] [--real 8] [--host-profile]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from common import device_kernels, print_table, smollm2_and_head, write_results  # noqa: E402


def host_profile(run, calls: int, top: int = 25) -> dict:
    """cProfile of run(): ms per call by function, its own time and with its callees."""
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    run()
    pr.disable()
    st = pstats.Stats(pr).stats
    rows = [(f"{os.path.basename(f)}:{line}:{name}", tt, ct) for (f, line, name), (_, _, tt, ct, _) in st.items()]
    ms = lambda x: round(1e3 * x / calls, 4)  # noqa: E731
    return dict(host_self=[(n, ms(tt)) for n, tt, _ in sorted(rows, key=lambda r: -r[1])[:top]],
                host_cumulative=[(n, ms(ct)) for n, _, ct in sorted(rows, key=lambda r: -r[2])[:top]])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--layers", type=int, default=None, help="fewer target layers (a CPU smoke run)")
    ap.add_argument("--real", type=int, default=0, metavar="N",
                    help="SmolLM2's real weights, the first N MT-bench questions one at a time, the default policy")
    ap.add_argument("--verify-always", action="store_true", help="with --real: NGRAM verifies every call")
    ap.add_argument("--host-profile", action="store_true", help="also a cProfile of a run: the host's top functions")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    from jaxspec import Generator, SamplingParams, SpecConfig
    from jaxspec.scheduler import Scheduler
    if args.real:
        from common import mt_bench_token_ids
        from jaxspec.models.loading import load
        model, tok = load("smollm2-135m")
        prompts = mt_bench_token_ids(tok, args.real)
        params = SamplingParams(max_tokens=args.tokens)
        gate = dict(spec_min_gain=0.0) if args.verify_always else {}
    else:
        cfg, model, _ = smollm2_and_head(args.layers)
        rng = np.random.default_rng(0)
        prompts = [list(map(int, np.tile(rng.integers(100, cfg.vocab_size, 40), 6)))]
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        gate = dict(spec_min_gain=0.0)  # verify every call

    def generate():
        if args.real and hasattr(gen.scheduler.drafter, "reset"):
            gen.scheduler.drafter.reset()  # as bench/spec.py's passes: the trie learns each pass afresh
        return [o for p in prompts for o in gen.generate([p], params)]
    rows = []
    for name, kw in (("plain", {}), (f"ngram:{args.nodes}", dict(
            drafter=SpecConfig("NGRAM", num_draft_tokens=args.nodes).build(model),
            spec_max_host_verify_tokens=args.nodes, **gate))):
        gen = Generator(model, tok if args.real else None, max_batch=1, max_seq_len=1024, warmup=True, **kw)
        generate()
        arrivals = []
        original = Scheduler._arrived

        def arrived(self, f, now, steps=1, prefill=False):
            arrivals.append(("prefill" if prefill else f.kind, time.perf_counter(), steps))
            return original(self, f, now, steps, prefill)
        gen.scheduler._arrived = arrived.__get__(gen.scheduler)
        t0 = time.perf_counter()
        outs = generate()
        secs = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        accepts = [a for o in outs for a in (o.accept_lengths or [])]
        gaps = {}
        for (k0, t_0, _), (k1, t_1, s1) in zip(arrivals, arrivals[1:]):
            if k0 == k1 and k1 != "prefill":
                gaps.setdefault(k1, []).append(1e3 * (t_1 - t_0) / max(s1, 1))
        calls = sum(1 for k, _, _ in arrivals if k != "prefill")
        kinds = dict(collections.Counter(k for k, _, _ in arrivals))
        host = host_profile(generate, calls) if args.host_profile else None
        prof = device_kernels(generate, calls, tempfile.mkdtemp())
        row = dict(engine=name, prompts=len(prompts), tokens=tokens, tokens_per_s=tokens / secs,
                   calls=calls, accept_length=sum(accepts) / len(accepts) if accepts else None,
                   ms_between_outputs={k: float(np.median(v)) for k, v in gaps.items()},
                   ms_between_outputs_p90={k: float(np.percentile(v, 90)) for k, v in gaps.items()},
                   calls_by_kind=kinds,
                   late_compiles=len(gen.scheduler.late_compiles))
        if prof:
            row.update(prof)
        if host:
            row.update(host)
        rows.append(row)
        print_table(rows[-1:], ["engine", "tokens_per_s", "calls", "accept_length", "ms_between_outputs"])
        print({k: v for k, v in row.items() if k not in ("engine",)})
    print(write_results("ngram_step" + args.tag, rows))


if __name__ == "__main__":
    main()
