"""Device time of each fused layer kernel (pallas/qkv_project, gated_up, matmul_residual) against
the XLA ops it replaces, at the Llama-3-8B and SmolLM2 shapes, for a few column blocks, K steps
and warp counts: which settings the model should pass.
    python bench/probes/fused_probe.py [--rows 16,64] [--ops gate_up] [--models llama3-8b]
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import jax.numpy as jnp
import numpy as np

from common import LLAMA3_8B, SMOLLM2, copy_bandwidth, device_kernels, print_table, write_results
from jaxspec.models import ModelConfig
from jaxspec.pallas.gated_up import gated_up, gated_up_ref
from jaxspec.pallas.matmul_residual import matmul_residual, matmul_residual_ref
from jaxspec.pallas.qkv_project import qkv_project, qkv_project_ref

REPS = 10  # calls a profile; distinct inputs, so XLA cannot merge them


def device_us(fn, args_list, kernel=None):
    """(us, kernels) a call: every kernel's time, or with `kernel` only the kernels named so (the
    cache copies XLA adds before an aliased call on a reused input are not the kernel's)."""
    f = jax.jit(lambda al: [fn(*a) for a in al])
    jax.block_until_ready(f(args_list))
    prof = device_kernels(lambda: jax.block_until_ready(f(args_list)), REPS, tempfile.mkdtemp(), top=40)
    if kernel is None:
        return prof["kernel_ms"] * 1e3, prof["kernels"]
    mine = [(t, c) for name, t, c in prof["top"] if name.startswith(kernel)]
    return sum(t for t, _ in mine), sum(c for _, c in mine)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--models", default="smollm2-135m")
    ap.add_argument("--ops", default="", help="e.g. gate_up (default: qkv, gate_up, down)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    bw = copy_bandwidth()
    bf = jnp.bfloat16
    rng = np.random.default_rng(0)
    rows_out = []
    for name in args.models.split(","):
        cfg = ModelConfig(**(SMOLLM2 if name == "smollm2-135m" else LLAMA3_8B))
        h, f, d, hq, hkv = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        arr = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.05, bf)
        w_qkv, w_up, w_down, norm = arr(h, (hq + 2 * hkv) * d), arr(h, 2 * f), arr(f, h), arr(h)
        kp = jnp.zeros((1, 8, 16, hkv, d), bf)
        # 8B's matrices are 7-50x SmolLM2's: wider column blocks (whole 128-byte lines a row of a tile), deeper
        # pipelines, K splits for enough programs (bn 16 ran gate_up at ~20% of bandwidth: decode-8b-fused-)
        wide = name != "smollm2-135m"
        bns, warps = ((64, 128, 256), (4, 8)) if wide else ((16, 32), (4, 8))
        extra = [dict(num_stages=st) for st in (4, 5)] if wide else [{}]
        for m in map(int, args.rows.split(",")):
            xs = [arr(m, h) for _ in range(REPS)]
            cos = sin = jnp.zeros((m, d // 2), jnp.float32)
            slots = jnp.arange(m, dtype=jnp.int32) % 128
            cases = {
                "qkv": ("_qkv", w_qkv.size * 2, qkv_project, qkv_project_ref,
                        lambda fn, **kw: lambda x: fn(x, norm, w_qkv, None, None, None, cos, sin, 0, slots, kp, kp,
                                                      num_q=hq, num_kv=hkv, eps=1e-5, **kw)[0],
                        [dict(bn=bn, num_warps=nw, bk=bk) for bn in bns for nw in warps for bk in (64, 128, 256, 512)
                         if bn <= d // 2]),
                "gate_up": ("_gated", w_up.size * 2, gated_up, gated_up_ref,
                            lambda fn, **kw: lambda x: fn(x, norm, w_up, eps=1e-5, **kw),
                            [dict(bn=bn, num_warps=nw, bk=bk, **x) for bn in bns for nw in warps
                             for bk in (64, 128, 256, 512) for x in extra]
                            + [dict(bn=bn, bk=bk, splits=sp) for sp in (2, 3, 4, 6) for bn in bns for bk in (64, 128)]),
                "down": ("_matmul", w_down.size * 2, matmul_residual, matmul_residual_ref,
                         lambda fn, **kw: lambda x: fn(jnp.tile(x, (1, f // h + 1))[:, :f], w_down, x, **kw),
                         [dict(bn=bn, num_warps=nw, bk=bk, **x) for bn in bns for nw in warps
                          for bk in (128, 256, 512, 1024) for x in extra]
                         + [dict(bn=bn, bk=bk, splits=sp) for sp in (2, 4, 6) for bn in bns for bk in (64, 128, 256)]),
            }
            for op, (kname, nbytes, fn, ref, bind, variants) in cases.items():
                if args.ops and op not in args.ops.split(","):
                    continue
                base_us, base_k = device_us(bind(ref), [(x,) for x in xs])
                rows_out.append(dict(model=name, rows=m, op=op, variant="xla", us=base_us, kernels=base_k,
                                     bandwidth_fraction=nbytes / (base_us * 1e-6) / (bw / 2)))
                for kw in variants:
                    try:
                        # a K split's time includes XLA's sum of the splits after the kernel
                        us, k = device_us(bind(functools.partial(fn, **kw)), [(x,) for x in xs],
                                          None if kw.get("splits", 1) > 1 else kname)
                    except Exception as e:  # a variant Triton cannot build: noted, not fatal
                        rows_out.append(dict(model=name, rows=m, op=op, variant=str(kw), error=str(e)[:200]))
                        continue
                    rows_out.append(dict(model=name, rows=m, op=op, variant=" ".join(f"{a}{v}" for a, v in kw.items()),
                                         us=us, kernels=k, bandwidth_fraction=nbytes / (us * 1e-6) / (bw / 2),
                                         vs_xla=base_us / us))
                print_table([r for r in rows_out if r["op"] == op and r["rows"] == m and r["model"] == name],
                            ["model", "rows", "op", "variant", "us", "kernels", "bandwidth_fraction", "vs_xla"])
    print(write_results("fused_probe" + args.tag, rows_out, {"copy_bandwidth_GBps": bw / 1e9}))


if __name__ == "__main__":
    main()
