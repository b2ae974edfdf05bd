"""Where a tensor-parallel decode step's time goes, and which XLA options change it.

One process a variant (XLA reads its flags once, at start): each times, for TP 1 and/or TP 2 of a
Llama-3-8B shape (random bf16 weights, `--layers` of them), at each batch:
  engine:   the engine's `decode` program (8 steps a call, chained), whose step loop and shared
            sampler's conditional run from the host wherever a collective keeps them out of a
            command buffer (compile_options.py);
  verify:   the engine's verify_tree program on a 24-node chain (EAGLE-3 6:4:24's size), chained;
  straight: one greedy step a call with no loop and no conditional (forward, argmax), chained, so
            the host never waits on the device;
and profiles each on every GPU: kernel time, collective kernel time, span per step, and the host
time a launch takes to return. Variants:
  default      the engine's options
  oneshot      XLA's own one-shot all-reduce kernel for small all-reduces, not NCCL's
  cb-coll      collectives as command buffer commands too (so a loop holding them can be one)
  cb-coll-upd  the same under XLA's default command-buffer update mode (not SKIP_TEMP)

    python bench/probes/tp_step.py [--variants default,oneshot,cb-coll] [--tp 1,2] [--batches 1,8] [--layers 8] [--model tiny]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

ENGINE_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"
ONESHOT = "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"
VARIANTS = {
    "default": {},
    "oneshot": {"XLA_FLAGS+": ONESHOT},
    "nccl": {"XLA_FLAGS+": ONESHOT.replace("true", "false")},
    "cb-coll": {"JAXSPEC_COMMAND_BUFFERS": ENGINE_BUFFERS + ",COLLECTIVES"},
    "cb-coll-upd": {"JAXSPEC_COMMAND_BUFFERS": ENGINE_BUFFERS + ",COLLECTIVES", "JAXSPEC_CMDBUF_UPDATE_MODE": ""},
    "oneshot-cb-coll": {"XLA_FLAGS+": ONESHOT, "JAXSPEC_COMMAND_BUFFERS": ENGINE_BUFFERS + ",COLLECTIVES"},
}
COLLECTIVE_NAMES = ("nccl", "all_reduce", "allreduce", "all-reduce")


def straight_steps(model, batch, context, page_size, mesh):
    """run(n): n greedy decode steps, one a call, no loop and no conditional in the program."""
    import contextlib
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from decode import paged_cache
    cfg = model.cfg
    graphdef, state = nnx.split(model)
    pages = -(-(context + 16) // page_size)
    cache = [paged_cache(cfg, batch * pages + 1, page_size, model.dtype, mesh)]
    pt = jnp.asarray(1 + np.arange(batch * pages, dtype=np.int32).reshape(batch, pages))
    kv = jnp.full(batch, context, jnp.int32)

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def step(state, cache, tok, kv, pt):
        m = nnx.merge(graphdef, state)
        h, cache, _ = m(tok, kv[:, None], cache, pt, kv, jnp.ones_like(kv))
        return cache, jnp.argmax(m.logits(h), axis=-1).astype(jnp.int32)

    tok = [jnp.ones((batch, 1), jnp.int32)]
    with (jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()):  # attention's shard_map
        exe = step.lower(state, cache[0], tok[0], kv, pt).compile()

    def run(n):
        for _ in range(n):  # the same position rewritten: the context stays `context`
            cache[0], tok[0] = exe(state, cache[0], tok[0], kv, pt)
        return tok[0]

    jax.block_until_ready(run(3))
    return run


def all_reduces(batch, hidden, mesh, n=64):
    """run(k): k calls of one program running n all-reduces of a [batch, hidden] bf16 activation
    in a row (each fed by the last), as a TP layer's row-parallel outputs are summed."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxspec.sharding import AXIS

    @functools.partial(jax.jit, donate_argnums=0)
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    def chain(x):
        for _ in range(n):
            x = jax.lax.psum(x * 0.5, AXIS)
        return x

    x = [jnp.ones((mesh.shape[AXIS] * batch, hidden), jnp.bfloat16)]

    def run(k):
        for _ in range(k):
            x[0] = chain(x[0])
        return x[0]

    jax.block_until_ready(run(2))
    return run


def timeline(kernels, n=48) -> list:
    """n kernels from the middle of a GPU's trace in order: (name, µs it ran, µs idle before it)."""
    ks = sorted(kernels, key=lambda e: e["ts"])
    mid = len(ks) // 2
    return [(e["name"][:48], round(e["dur"], 1), round(e["ts"] - (p["ts"] + p["dur"]), 1))
            for p, e in zip(ks[mid - 1:mid + n - 1], ks[mid:mid + n])]


def per_device_profile(run, steps: int) -> list:
    """Per GPU of a profiled run(): kernel ms, collective kernel ms, kernels and span per step."""
    import jax
    import jax.profiler

    from common import gpu_kernels, trace_events
    log_dir = tempfile.mkdtemp()
    jax.profiler.start_trace(log_dir)
    jax.block_until_ready(run())
    jax.profiler.stop_trace()
    events, procs, threads = trace_events(log_dir)
    ks = gpu_kernels(events, procs, threads)
    out = []
    for pid in sorted({e["pid"] for e in ks}):
        mine = [e for e in ks if e["pid"] == pid]
        coll = [e for e in mine if any(c in e["name"].lower() for c in COLLECTIVE_NAMES)]
        start, end = min(e["ts"] for e in mine), max(e["ts"] + e["dur"] for e in mine)
        out.append(dict(gpu=procs[pid][:40], kernel_ms=sum(e["dur"] for e in mine) / steps / 1e3,
                        collective_ms=sum(e["dur"] for e in coll) / steps / 1e3,
                        collectives=len(coll) / steps, kernels=len(mine) / steps, span_ms=(end - start) / steps / 1e3,
                        collective_kernels=sorted({e["name"][:60] for e in coll})[:4],
                        timeline=timeline(mine)))
    return out


def child(args) -> list:
    import jax
    import numpy as np

    from common import copy_bandwidth, random_model
    from decode import decode_steps
    from jaxspec import compile_options, sharding
    from jaxspec.models import ModelConfig
    from tp import MODELS, memory, verify_step

    cfg = ModelConfig(**dict(MODELS[args.model], num_layers=args.layers or MODELS[args.model]["num_layers"]))
    bw = copy_bandwidth()
    rows = []
    for tp in [int(x) for x in args.tp.split(",")]:
        if tp > len(jax.devices()):
            continue
        mesh = sharding.tp_mesh(tp) if tp > 1 else None
        model = random_model(cfg, jax.numpy.bfloat16, mesh=mesh)
        for b in [int(x) for x in args.batches.split(",")]:
            mem = memory(cfg, tp, b, args.context)
            floor = (mem["weight_bytes_per_device"] + mem["kv_bytes_per_device"]) / bw
            for algo in args.algos.split(","):
                row = dict(variant=args.child, all_reduces_per_call=64 if algo == "psum" else None, tp=tp, batch=b,
                           algorithm=algo, layers=args.layers, context=args.context,
                           command_buffers=compile_options.COMMAND_BUFFERS, update_mode=compile_options.update_mode())
                try:
                    if algo == "psum":  # per all-reduce: 64 a call
                        if mesh is None:
                            continue
                        run, per = all_reduces(b, cfg.hidden_size, mesh), 1
                    elif algo == "verify":  # one verify_tree call of a 24-node chain
                        run, per = verify_step(model, b, args.context, 24, 16, mesh), 1
                    elif algo == "engine":
                        run, per = decode_steps(model, b, args.context, 2048, 16, "auto", mesh=mesh), 8
                    else:
                        run, per = straight_steps(model, b, args.context, 16, mesh), 1
                    n = args.steps
                    times = []
                    for _ in range(3):
                        t0 = time.perf_counter()
                        jax.block_until_ready(run(n))
                        times.append((time.perf_counter() - t0) / n)
                    t0 = time.perf_counter()
                    out = run(per)  # one call: how long its launch holds the host
                    launch = time.perf_counter() - t0
                    jax.block_until_ready(out)
                    t = float(np.median(times))
                    row.update(ms_per_step=t * 1e3, floor_ms=floor * 1e3, floor_ratio=t / floor,
                               launch_ms=launch * 1e3 / per,
                               profile=per_device_profile(lambda: run(16), 16))
                except Exception as e:  # a variant XLA cannot run: recorded, the rest go on
                    row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
                print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
                rows.append(row)
        del model
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="default,oneshot,cb-coll,cb-coll-upd")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--algos", default="engine,straight")
    ap.add_argument("--model", default="llama3-8b", help="llama3-8b, smollm2-135m, tiny (bench/tp.py)")
    ap.add_argument("--layers", type=int, default=0, help="0: the model's own")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--baseline-tp1-only", action="store_true", help="TP 1 in the first variant only")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rows-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        rows = child(args)
        with open(args.rows_file, "w") as f:
            json.dump(rows, f)
        return rows
    from common import print_table, write_results
    rows = []
    for i, name in enumerate(args.variants.split(",")):
        env = dict(os.environ)
        for k, v in VARIANTS[name].items():
            if k == "XLA_FLAGS+":
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + v).strip()
            else:
                env[k] = v
        tps = args.tp if not (args.baseline_tp1_only and i) else ",".join(t for t in args.tp.split(",") if t != "1")
        rows_file = tempfile.mktemp(suffix=".json")
        cmd = [sys.executable, __file__, "--child", name, "--rows-file", rows_file, "--tp", tps,
               "--batches", args.batches, "--algos", args.algos, "--model", args.model, "--layers", str(args.layers),
               "--context", str(args.context), "--steps", str(args.steps)]
        r = subprocess.run(cmd, env=env)
        if os.path.exists(rows_file):
            rows += json.load(open(rows_file))
        else:
            rows.append(dict(variant=name, error=f"process exited {r.returncode}"))
        write_results("tp_step", rows)  # as it goes
    for r in rows:  # against TP 1's step of the same batch and algorithm in the first variant
        base = [x for x in rows if x.get("tp") == 1 and x.get("ms_per_step")
                and (x["batch"], x["algorithm"]) == (r.get("batch"), r.get("algorithm"))]
        if base and r.get("ms_per_step"):
            r["vs_tp1"] = r["ms_per_step"] / base[0]["ms_per_step"]
    print_table(rows, ["variant", "tp", "batch", "algorithm", "ms_per_step", "floor_ratio", "launch_ms", "vs_tp1", "error"])
    print(write_results("tp_step", rows))
    return rows


if __name__ == "__main__":
    main()
