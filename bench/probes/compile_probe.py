"""Where a cold start's time goes: every program of an EAGLE-3 engine (SmolLM2 shapes, random bf16
weights, the shipped head, max batch 64) lowered and compiled one at a time with no compilation
cache, timed apiece; then the whole set built in threads, as warm-up does; each variant in a fresh
process (XLA keeps autotuning results in-process).

    python bench/probes/compile_probe.py [--variants serial,threads,serial-autotune0]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

VARIANTS = {"serial": {}, "threads": {}, "serial-autotune0": {"XLA_FLAGS": "--xla_gpu_autotune_level=0"},
            # XLA's dots as cuBLAS calls rather than Triton GEMM fusions, each of which XLA emits and
            # compiles through Triton (compile_phases.py: 404 of them in one verify program)
            "threads-cublas": {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"},
            "serial-cublas": {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}}


def child(variant, out, flag_sets):
    import jax.numpy as jnp
    from common import SMOLLM2, random_model
    from jaxspec import Generator, SpecConfig
    from jaxspec.models import ModelConfig
    from jaxspec.compile_options import program_options
    from jaxspec.sampling import SamplerFlags
    model = random_model(ModelConfig(**SMOLLM2, max_position=8192), jnp.bfloat16)
    spec = SpecConfig("EAGLE3", num_steps=6, eagle_topk=4, num_draft_tokens=24)
    gen = Generator(model, None, drafter=spec.build(model, "smollm2-135m"), max_batch=64, max_seq_len=2048,
                    compile_cache="off")
    sched = gen.scheduler
    flags = [SamplerFlags()] + ([SamplerFlags(sample=True, filter=True)] if flag_sets == 2 else [])
    specs = sched.program_specs(flags)
    rows = []
    t0 = time.perf_counter()
    if variant.startswith("serial"):
        for progs, name, fl, cache, args in specs:
            t1 = time.perf_counter()
            lowered = progs._lower(name, fl, cache, args)
            t2 = time.perf_counter()
            lowered.compile(program_options(name, args))
            t3 = time.perf_counter()
            rows.append(dict(variant=variant, program=name, group="plain" if progs is sched.plain_programs else "spec",
                             sample=fl.sample, rows=int(args[0].shape[0]), tokens=int(args[0].shape[1]),
                             lower_s=t2 - t1, compile_s=t3 - t2))
            print(rows[-1], flush=True)
    else:
        for progs in (sched.programs, sched.plain_programs):
            progs.build([s[1:] for s in specs if s[0] is progs], threads=8)
    total = time.perf_counter() - t0
    rows.append(dict(variant=variant, program="ALL", programs=len(specs), total_s=total,
                     lower_s=sum(r.get("lower_s", 0) for r in rows) or None,
                     compile_s=sum(r.get("compile_s", 0) for r in rows) or None))
    print(rows[-1], flush=True)
    if variant.startswith("threads"):  # the programs' step times: a compile flag must not slow them
        for (kind, r), ms in sorted(sched._time_steps(specs).ms.items()):
            rows.append(dict(variant=variant, program=kind, rows=r, step_ms=ms))
            print(rows[-1], flush=True)
    json.dump(rows, open(out, "w"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--flag-sets", type=int, default=1, help="1: greedy programs; 2: also sampling")
    ap.add_argument("--child", nargs=2)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.flag_sets)
    from common import print_table, write_results
    rows = []
    for v in args.variants.split(","):
        out = os.path.join(tempfile.mkdtemp(), "rows.json")
        env = {k: val for k, val in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
        env.update(VARIANTS[v])
        subprocess.run([sys.executable, __file__, "--flag-sets", str(args.flag_sets), "--child", v, out],
                       check=True, env=env)
        rows += json.load(open(out))
    print_table(rows, ["variant", "program", "group", "rows", "tokens", "lower_s", "compile_s", "total_s", "step_ms"])
    print(write_results("compile_probe", rows))


if __name__ == "__main__":
    main()
