"""Where one program's compile goes: XLA's own phase timers (its VLOG'd scoped timers) for the
EAGLE-3 engine's batch-1 verify_steps and a prefill extend (SmolLM2 shapes, random bf16 weights,
no compilation cache), summed by phase name over XLA's compile threads (so a phase can sum to more
than the compile's wall time).

    python bench/probes/compile_phases.py     (sets TF_CPP_VMODULE for the child it runs)
"""
import collections
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def child():
    import time

    import jax.numpy as jnp
    from common import SMOLLM2, random_model
    from jaxspec import Generator, SpecConfig
    from jaxspec.models import ModelConfig
    from jaxspec.sampling import SamplerFlags
    model = random_model(ModelConfig(**SMOLLM2, max_position=8192), jnp.bfloat16)
    spec = SpecConfig("EAGLE3", num_steps=6, eagle_topk=4, num_draft_tokens=24)
    gen = Generator(model, None, drafter=spec.build(model, "smollm2-135m"), max_batch=64, max_seq_len=2048,
                    compile_cache="off")
    specs = gen.scheduler.program_specs([SamplerFlags()])
    pick = [s for s in specs if s[1] == "verify_steps" and s[4][0].shape[0] == 1][:1]
    pick += [s for s in specs if s[1] == "extend" and s[4][0].shape[0] == 1][:1]
    pick += [s for s in specs if s[1] == "decode" and s[4][0].shape[0] == 2][:1]
    for progs, name, fl, cache, args in pick:
        print(f"=== PROGRAM {name} rows {args[0].shape[0]}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        lowered = progs._lower(name, fl, cache, args)
        t1 = time.perf_counter()
        txt = lowered.as_text()
        lowered.compile()
        t2 = time.perf_counter()
        print(f"=== DONE {name} lower {t1 - t0:.2f} s compile {t2 - t1:.2f} s, stablehlo {len(txt) // 1000} kB, "
              f"custom calls {txt.count('stablehlo.custom_call')}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        child()
        sys.exit(0)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "0"
    env["TF_CPP_VMODULE"] = "gpu_compiler=1,nvptx_compiler=1,compile_module_to_llvm_ir=1,triton_fusion_emitter=1"
    r = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True)
    prog, phases, rows = None, collections.OrderedDict(), []
    timer = re.compile(r"\] (.*?)(?: time|:)? ?(?:took|:) *([0-9.]+) ?(s|ms|us|sec|msec|usec)\b")
    done = re.compile(r"=== DONE (\S+) lower ([0-9.]+) s compile ([0-9.]+) s")
    for line in r.stderr.splitlines():
        if line.startswith("=== PROGRAM"):
            prog = line[12:]
            continue
        if line.startswith("=== DONE"):
            print(line)
            m = done.match(line)
            rows.append(dict(program=prog, phase="ALL", lower_s=float(m.group(2)), seconds=float(m.group(3))))
            for (p, name), (n, s) in phases.items():
                if p == prog and s > 0.05:
                    print(f"  {s:8.2f} s  x{n:<5d} {name[:110]}")
                    rows.append(dict(program=prog, phase=name[:110], count=n, seconds=s))
            continue
        m = timer.search(line)
        if m and prog:
            unit = {"s": 1, "sec": 1, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}[m.group(3)]
            name = re.sub(r"[0-9]+", "#", m.group(1))[-120:]
            n, s = phases.get((prog, name), (0, 0.0))
            phases[(prog, name)] = (n + 1, s + float(m.group(2)) * unit)
    if r.returncode:
        print(r.stderr[-3000:])
        sys.exit(r.returncode)
    from common import write_results
    print(write_results("compile_phases", rows, {"xla_flags": os.environ.get("XLA_FLAGS", "")}))
