"""How long the CPU backend takes to lower and compile a tiny EAGLE-3 engine's programs (extend,
decode, verify_steps; greedy) under XLA flag sets, one process each (XLA reads its flags once):
the test suite's compile cost (tests/conftest.py picks its flags from this).

    python bench/probes/cpu_compile.py [--repeats 2]
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
FLAG_SETS = {"tests-before": BASE, "old-emitters": BASE + " --xla_cpu_use_fusion_emitters=false"}


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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child()))
        return
    from common import print_table, write_results
    rows = []
    for name, flags in FLAG_SETS.items():
        for rep in range(args.repeats):
            env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
            r = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, check=True)
            for program, t in json.loads(r.stdout.strip().splitlines()[-1]).items():
                rows.append(dict(flags=name, repeat=rep, program=program, **t))
    print_table(rows, ["flags", "repeat", "program", "rows", "tokens", "lower_s", "compile_s"])
    print(write_results("cpu_compile", rows, {"flag_sets": FLAG_SETS}))


if __name__ == "__main__":
    main()
