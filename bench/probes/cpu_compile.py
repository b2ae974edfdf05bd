"""How long the CPU backend takes to lower and compile a tiny EAGLE-3 engine's programs (extend,
decode, verify_steps; greedy) under XLA flag sets, one process each (XLA reads its flags once):
the test suite's compile cost (tests/conftest.py picks its flags from this).

--smollm2: SmolLM2 (float32, the tests' engine shape) under the tests' flags, with and without
tests/conftest.py's per-compile full optimisation of big target-only programs: a plain engine's
three greedy generates of 30 tokens (the first compiles, the third only runs), and an EAGLE-3
engine's (4:4:8, the shipped head) first generate with each compile's seconds; a third variant
optimises the drafter's big programs too.

    python bench/probes/cpu_compile.py [--repeats 2] [--sets old-emitters,split1] [--smollm2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BASE = ("--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 "
        "--xla_llvm_disable_expensive_passes=true")
OLD = BASE + " --xla_cpu_use_fusion_emitters=false"
FLAG_SETS = {"tests-before": BASE, "old-emitters": OLD,
             "split1": OLD + " --xla_cpu_parallel_codegen_split_count=1",
             "no-region": OLD + " --xla_cpu_copy_insertion_use_region_analysis=false",
             "no-xnn": OLD + " --xla_cpu_use_xnnpack=false"}


def child() -> dict:
    sys.path.insert(0, ROOT)
    import jax
    from flax import nnx

    from jaxspec import Generator
    from jaxspec.compile_options import program_options
    from jaxspec.drafters.eagle import DraftHead, EagleDrafter, HeadConfig
    from jaxspec.drafters.eagle_step import TreeShape
    from jaxspec.models import Llama, ModelConfig
    from jaxspec.sampling import SamplerFlags
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position=512, eos_token_ids=(63,))  # tests/conftest.py's TINY
    jax.config.update("jax_compilation_cache_dir", None)
    head = DraftHead(HeadConfig.for_target(cfg, "eagle3"), rngs=nnx.Rngs(1))
    gen = Generator(Llama(cfg, rngs=nnx.Rngs(3)), None, drafter=EagleDrafter(head, TreeShape(3, 2, 6)), max_batch=8,
                    max_seq_len=128, num_pages=300, compile_cache="off")
    out = {}
    for progs, name, flags, cache, args in gen.scheduler.program_specs((SamplerFlags(),)):
        if name in out:
            continue
        progs.store = None
        t0 = time.perf_counter()
        lowered = progs._lower(name, flags, cache, args)
        t1 = time.perf_counter()
        lowered.compile(program_options(name, args))
        out[name] = dict(rows=int(args[0].shape[0]), tokens=int(args[0].shape[1]), lower_s=t1 - t0,
                         compile_s=time.perf_counter() - t1)
    return out


def smollm2_child(conftest: int) -> dict:
    """Seconds of each generate and compile (see the module's doc). conftest: 1 imports the tests'
    conftest, whose patches compile big target-only programs fully optimised; 2 as 1, and a
    drafter's big programs too."""
    sys.path.insert(0, ROOT)
    if conftest:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import conftest as tests_conf
        if conftest == 2:
            tests_conf.compiles_optimised = tests_conf.big
    import jax
    import jax.numpy as jnp
    from jax import stages

    from jaxspec import Generator, SamplingParams, SpecConfig
    from jaxspec.models.loading import load
    jax.config.update("jax_compilation_cache_dir", None)
    compiles, inner = [], stages.Lowered.compile

    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        out = inner(self, *a, **kw)
        compiles.append(round(time.perf_counter() - t0, 2))
        return out
    stages.Lowered.compile = timed
    model, tok = load("smollm2-135m", jnp.float32)
    kw = dict(max_batch=4, max_seq_len=256, num_pages=80, compile_cache="off")  # the tests' SMOL_KW
    prompt = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    out = {}
    gen = Generator(model, tok, **kw)
    for i in range(3):
        t0 = time.perf_counter()
        gen.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True))
        out[f"plain generate {i + 1}"] = dict(seconds=time.perf_counter() - t0, compiles=compiles[:])
        compiles.clear()
    drafter = SpecConfig("EAGLE3", num_steps=4, eagle_topk=4, num_draft_tokens=8).build(model, "smollm2-135m")
    gen = Generator(model, tok, drafter=drafter, **kw)
    t0 = time.perf_counter()
    gen.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    out["eagle3 generate 1"] = dict(seconds=time.perf_counter() - t0, compiles=compiles[:])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sets", default="tests-before,old-emitters", help=f"of {','.join(FLAG_SETS)}")
    ap.add_argument("--smollm2", action="store_true", help="SmolLM2's generates, with and without conftest's options")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-conftest", type=int, default=-1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child()))
        return
    if args.child_conftest >= 0:
        print(json.dumps(smollm2_child(args.child_conftest)))
        return
    from common import print_table, write_results
    rows = []
    if args.smollm2:
        for rep in range(args.repeats):
            for conftest in (0, 1, 2):
                env = dict(os.environ, XLA_FLAGS=OLD, JAX_PLATFORMS="cpu")
                r = subprocess.run([sys.executable, __file__, "--child-conftest", str(conftest)], env=env,
                                   capture_output=True, text=True, check=True)
                for what, t in json.loads(r.stdout.strip().splitlines()[-1]).items():
                    rows.append(dict(flags="old-emitters" + ("", " + conftest's options",
                                                             " + the options for drafters' programs too")[conftest],
                                     repeat=rep, program=what, **t))
        print_table(rows, ["flags", "repeat", "program", "seconds", "compiles"])
        print(write_results("cpu_compile-smollm2", rows, {"flag_sets": {"old-emitters": OLD}}))
        return
    for name in args.sets.split(","):
        flags = FLAG_SETS[name]
        for rep in range(args.repeats):
            env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
            r = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True)
            if r.returncode:  # an XLA that does not know a flag aborts at start
                print(f"{name}: failed: {r.stderr.strip()[-300:]}")
                continue
            for program, t in json.loads(r.stdout.strip().splitlines()[-1]).items():
                rows.append(dict(flags=name, repeat=rep, program=program, **t))
    print_table(rows, ["flags", "repeat", "program", "rows", "tokens", "lower_s", "compile_s"])
    print(write_results("cpu_compile", rows, {"flag_sets": {n: FLAG_SETS[n] for n in args.sets.split(",")}}))


if __name__ == "__main__":
    main()
