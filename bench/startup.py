"""Start-up: a fresh process's time to its first token with the program set built at start-up,
with the persistent compilation cache empty (cold) and filled by the run before (warm); then a
mixed workload after warm-up, twice, with the compiles it caused.

    python bench/startup.py [--algos plain,eagle3] [--model PATH.gguf] [--no-mixed]

Each (algorithm, cache) row is its own process (`--child`): Generator.from_pretrained(model) (the
embedded SmolLM2 GGUF, or a copy of it at --model), the program set built, and one request of one
token. first_token_s counts from the process's start. A cold row starts with an empty compilation
cache and program store; the warm row after it finds what the cold one left.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spec_of(algo):
    from jaxspec import SpecConfig
    from jaxspec.speculative import shipped_drafter
    return None if algo == "plain" else SpecConfig("EAGLE3", num_steps=6, eagle_topk=4, num_draft_tokens=24,
                                                   draft_model_path=shipped_drafter("smollm2-135m", "EAGLE3"))


def child(model_path, algo, cache_dir, started, mixed, out):
    import numpy as np
    from jaxspec import Generator, SamplingParams
    import jax
    from jaxspec.program_store import compile_count
    imported_s = time.time() - started  # the interpreter's start and the imports
    jax.devices()
    backend_s = time.time() - started - imported_s
    events = {}
    jax.monitoring.register_event_listener(lambda e, **_: events.__setitem__(e, events.get(e, 0) + 1))
    t0 = time.perf_counter()
    from jaxspec.program_store import enable_compilation_cache
    enable_compilation_cache(cache_dir)  # as Generator.from_pretrained does, whose steps are timed here
    if os.environ.get("STARTUP_RANDOM_WEIGHTS"):  # SmolLM2's shapes, weights made on the device
        import jax.numpy as jnp
        from common import SMOLLM2, random_model
        from jaxspec.models import ModelConfig
        model, tokenizer = random_model(ModelConfig(**SMOLLM2, max_position=8192), jnp.bfloat16), None
    else:
        from jaxspec.models.loading import load
        model, tokenizer = load(model_path)
    weights_s = time.perf_counter() - t0
    spec = spec_of(algo)
    workers = os.environ.get("STARTUP_BUILD_WORKERS")  # program_workers' choice unless set
    gen = Generator(model, tokenizer, drafter=spec and spec.build(model), compile_cache=cache_dir,
                    max_batch=64, max_seq_len=2048, build_workers=None if workers is None else int(workers))
    load_s = time.perf_counter() - t0
    info = gen.scheduler.warmup()
    gen.generate([[1, 2, 3]], SamplingParams(max_tokens=1))
    groups = [p for p in (gen.scheduler.programs, gen.scheduler.plain_programs) if p]
    row = dict(model="smollm2-135m", build_workers=os.environ.get("STARTUP_BUILD_WORKERS", "auto"),
               weights="random" if os.environ.get("STARTUP_RANDOM_WEIGHTS") else "gguf",
               algorithm=algo, programs=info["programs"], imported_s=imported_s, backend_s=backend_s,
               weights_s=weights_s, load_s=load_s,
               warmup_s=info["seconds"], workers_s=info["workers_s"], build_s=info["build_s"], costs_s=info["costs_s"],
               first_token_s=time.time() - started,
               lower_s=sum(p.build_seconds["lower"] for p in groups),
               compile_s=sum(p.build_seconds["compile"] for p in groups),
               store_reads=sum(p.store_reads for p in groups),
               executable_reads=sum(p.executable_reads for p in groups),
               cache_hits=events.get("/jax/compilation_cache/cache_hits", 0),
               cache_misses=events.get("/jax/compilation_cache/cache_misses", 0))
    rows = [row]
    if mixed:
        rng = np.random.default_rng(0)
        vocab = gen.model.cfg.vocab_size
        waves = [1, 8, 64, 3]
        reqs = []
        for b in waves:
            for _ in range(b):
                n = int(rng.integers(1, 1500))
                reqs.append((list(map(int, rng.integers(0, vocab - 1, n))),
                             SamplingParams(max_tokens=int(rng.choice([128, 256, 512])), ignore_eos=True,
                                            temperature=float(rng.choice([0.0, 1.0])), seed=len(reqs))))
        for p in (1, 2):
            c0, t1, tokens = compile_count(), time.perf_counter(), 0
            i = 0
            for b in waves:
                outs = gen.generate([r[0] for r in reqs[i:i + b]], [r[1] for r in reqs[i:i + b]])
                tokens += sum(len(o.token_ids) for o in outs)
                i += b
            rows.append(dict(model="smollm2-135m", algorithm=algo, workload="mixed", passno=p,
                             tokens_per_s=tokens / (time.perf_counter() - t1), compiles=compile_count() - c0,
                             late_compiles=len(gen.scheduler.late_compiles)))
    json.dump(rows, open(out, "w"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--algos", default="plain,eagle3")
    ap.add_argument("--model", default="smollm2-135m", help="the embedded name, or a path to SmolLM2's GGUF")
    ap.add_argument("--child", nargs=4, metavar=("ALGO", "CACHE", "STARTED", "MIXED"))
    ap.add_argument("--out", default="")
    ap.add_argument("--no-mixed", action="store_true", help="start-up rows only")
    ap.add_argument("--workers", default="auto",
                    help="build worker processes, a list: a cold row for each (auto: program_workers decides)")
    ap.add_argument("--kinds", default="cold,warm")
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    args = ap.parse_args()
    if args.child:
        algo, cache, started, mixed = args.child
        return child(args.model, algo, cache, float(started), mixed == "1", args.out)
    from common import print_table, results_tag, write_results
    args.tag = results_tag(args.tag)
    rows = []
    for algo in args.algos.split(","):
        runs = [("cold", w) for w in args.workers.split(",") if "cold" in args.kinds]
        runs += [("warm", "auto")] if "warm" in args.kinds else []
        for kind, workers in runs:
            if kind == "cold":
                cache = tempfile.mkdtemp(prefix="jaxspec-xla-")
            out = os.path.join(tempfile.mkdtemp(), "rows.json")
            started = time.time()
            env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
            if workers != "auto":
                env["STARTUP_BUILD_WORKERS"] = workers
            subprocess.run([sys.executable, __file__, "--model", args.model, "--child", algo, cache, str(started),
                            "1" if kind == "warm" and not args.no_mixed else "0",
                            "--out", out], check=True, env=env)
            got = json.load(open(out))
            got[0]["cache"] = kind
            rows += got
            print_table(got, ["algorithm", "cache", "workload", "passno", "programs", "warmup_s", "first_token_s",
                              "tokens_per_s", "compiles"])
    print()
    print_table(rows, ["algorithm", "cache", "build_workers", "workload", "passno", "programs", "imported_s",
                       "backend_s", "weights_s", "load_s", "warmup_s", "lower_s", "compile_s",
                       "store_reads", "executable_reads", "cache_hits", "cache_misses", "first_token_s",
                       "tokens_per_s", "compiles", "late_compiles"])
    print(write_results("startup" + args.tag, rows))


if __name__ == "__main__":
    main()
