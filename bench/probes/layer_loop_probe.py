"""Can a loop over layers read weights stacked on a layer axis in place? Compile time grows with
the unrolled layer count (compile_probe-*.json: 8-13 s a verify or extend program); a loop
compiles the layer once, but XLA used to copy each layer's weight slice before its GEMMs.

A decoder-shaped stack (norm, fused QKV, out projection + residual, norm, gate/up, silu, down +
residual; attention is left out: it reads the cache, not weights) run unrolled over per-layer
weights and as a lax.fori_loop over stacked weights, each in a fresh process per XLA flag set:
ms a forward against the weights' floor, kernels and copy kernels a forward, compile seconds.

    python bench/probes/layer_loop_probe.py [--rows 1,32] [--models smollm2-135m,llama3-8b]
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

FLAGS = {"default": "", "dsfusion": "--xla_gpu_enable_dynamic_slice_fusion=true"}


def child(flagset, models, rows_list, out):
    import jax
    import jax.numpy as jnp
    from common import LLAMA3_8B, SMOLLM2, copy_bandwidth, device_kernels, time_fn

    bw = copy_bandwidth()
    rows_out = []
    for name in models:
        c = SMOLLM2 if name == "smollm2-135m" else LLAMA3_8B
        h, f, L = c["hidden_size"], c["intermediate_size"], c["num_layers"]
        qkv = (c["num_heads"] + 2 * c["num_kv_heads"]) * c["head_dim"]
        qd = c["num_heads"] * c["head_dim"]
        shapes = dict(norm1=(h,), wqkv=(h, qkv), wo=(qd, h), norm2=(h,), w_gate_up=(h, 2 * f), w_down=(f, h))
        key = jax.random.key(0)
        stacked = {k: (jax.random.normal(jax.random.fold_in(key, i), (L,) + s, jnp.bfloat16) * 0.02)
                   for i, (k, s) in enumerate(shapes.items())}
        layers = [{k: v[i] for k, v in stacked.items()} for i in range(L)]
        weight_bytes = sum(v.size * 2 for v in stacked.values())

        def layer(x, w):
            def norm(x, g):
                xf = x.astype(jnp.float32)
                return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-5) * g).astype(x.dtype)
            a = norm(x, w["norm1"]) @ w["wqkv"]
            x = x + a[:, :qd] @ w["wo"]
            g, u = jnp.split(norm(x, w["norm2"]) @ w["w_gate_up"], 2, axis=-1)
            return x + (jax.nn.silu(g) * u) @ w["w_down"]

        def unrolled(x, layers):
            for w in layers:
                x = layer(x, w)
            return x

        def looped(x, stacked):
            return jax.lax.fori_loop(0, L, lambda i, x: layer(x, {k: v[i] for k, v in stacked.items()}), x)

        for rows in rows_list:
            x = jax.random.normal(key, (rows, h), jnp.bfloat16)
            ref = None
            for impl, fn, w in (("unrolled", unrolled, layers), ("loop", looped, stacked)):
                t0 = time.perf_counter()
                exe = jax.jit(fn).lower(x, w).compile()
                compile_s = time.perf_counter() - t0
                y = exe(x, w)
                ref = y if ref is None else ref
                err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref.astype(jnp.float32))))
                s = time_fn(exe, x, w, iters=20, queue=5)
                prof = device_kernels(lambda: jax.block_until_ready([exe(x, w) for _ in range(5)]), 5,
                                      tempfile.mkdtemp(), top=200)
                prof = prof or dict(kernels=None, kernel_ms=None, top=[], most_launched=[])  # no GPU trace
                names = {n: cnt for n, _, cnt in prof["most_launched"] + prof["top"]}
                copies = sum(cnt for n, cnt in names.items() if "copy" in n.lower() or "slice" in n.lower())
                row = dict(flags=flagset, model=name, rows=rows, impl=impl, ms=1e3 * s,
                           floor_ms=1e3 * weight_bytes / bw, floor_ratio=s * bw / weight_bytes,
                           kernels=prof["kernels"], kernel_ms=prof["kernel_ms"], copy_kernels=copies,
                           compile_s=compile_s, max_abs_diff=err,
                           busiest=[n for n, _, _ in prof["top"][:4]])
                print(row, flush=True)
                rows_out.append(row)
        del stacked, layers
    json.dump(rows_out, open(out, "w"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--models", default="smollm2-135m,llama3-8b")
    ap.add_argument("--flags", default=",".join(FLAGS))
    ap.add_argument("--child", nargs=2)
    args = ap.parse_args()
    models, rows = args.models.split(","), [int(r) for r in args.rows.split(",")]
    if args.child:
        return child(args.child[0], models, rows, args.child[1])
    from common import print_table, write_results
    out_rows = []
    for fs in args.flags.split(","):
        out = os.path.join(tempfile.mkdtemp(), "rows.json")
        env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FLAGS[fs]).strip()
        r = subprocess.run([sys.executable, __file__, "--models", args.models, "--rows", args.rows,
                            "--child", fs, out], env=env)
        if r.returncode != 0:
            out_rows.append(dict(flags=fs, error=f"exit {r.returncode}"))
            continue
        out_rows += json.load(open(out))
    print_table(out_rows, ["flags", "model", "rows", "impl", "ms", "floor_ratio", "kernels", "copy_kernels",
                           "compile_s", "max_abs_diff", "error"])
    print(write_results("layer_loop_probe", out_rows))


if __name__ == "__main__":
    main()
