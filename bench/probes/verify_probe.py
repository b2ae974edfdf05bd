"""Where the 64-token Mosaic verify's time goes (batch 64, context 2048, 8B heads): the persistent
kernel beside copies of it with one part of the work taken out, timed in turns, with the SM clock
read by nvidia-smi during the timing. (verify_probe-b19c869 also ran a kernel option since removed,
fma_cols: a share of each tile's exponentials by polynomial on the FMA pipe.)

The copies ("cut:" rows) compute wrong attention on purpose: each is verify_hopper.py's source with
one part edited (CUTS, below), so its time says what that part costs; a cut that changes nothing
means the part is not on the critical path.

    python bench/verify_probe.py [--overlap]       (GPU)
"""
from __future__ import annotations

import os
import tempfile
import subprocess
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

import jax
import numpy as np

from common import print_table, time_interleaved, write_results
from jaxspec.pallas import verify_hopper
from jaxspec.pallas.attention_ref import paged_attention_ref
from jaxspec.pallas.tree_mask import tree_attention_mask
from kernels import rel_err, random_tree, setup

# (name, [(old, new), ...]): the edits to the kernel's source
SOFTMAX = """                p = jnp.exp2(s * scale - lax.broadcast_in_dim(m, s.shape, [0]))
                l_next = l + p.sum(axis=1)
                if not interpret:
                    return settle_softmax(s, m, l, acc, p.astype(k_smem.dtype), l_next, scale)
"""
CUTS = [
    ("no exp2 (scaled scores as P)", [("p = jnp.exp2(s * scale - lax.broadcast_in_dim(m, s.shape, [0]))",
                                       "p = (s * scale - lax.broadcast_in_dim(m, s.shape, [0]))")]),
    ("no softmax (scores as P, no exponentials, sum or redo)",
     [(SOFTMAX, "                return s.astype(k_smem.dtype), m, l, acc\n")]),
    ("no DRAM (every tile from its item's first pages, L2-resident)",
     [("page = pt[lax.div(p, PT_LANES), lax.rem(p, PT_LANES)]", "page = pt[0, j]")]),
    ("no redo (P against the reference max, never settled)",
     [("return settle_softmax(s, m, l, acc, p.astype(k_smem.dtype), l_next, scale)",
       "return p.astype(k_smem.dtype), m, l_next, acc")]),
    ("no scores product", [("plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(keys, (1, 0)))", "pass")]),
    ("no values product", [("plgpu.wgmma(acc_ref, p16, v_smem.at[slot] if width == block_kv\n"
                            "                                        else v_smem.at[slot, pl.ds(0, width)])", "pass")]),
    ("half the V pages (the other half of each V tile left stale)",
     [("for j in range(pages_per_tile):", "for j in range(pages_per_tile if smem is k_smem else pages_per_tile // 2):"),
      ("plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=stages),\n             "
       "plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=stages),",
       "plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=stages),\n             "
       "plgpu.Barrier(num_arrivals=pages_per_tile // 2, num_barriers=stages),")]),
    ("half the K and V pages",
     [("for j in range(pages_per_tile):", "for j in range(pages_per_tile // 2):"),
      ("plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=stages),\n             "
       "plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=stages),",
       "plgpu.Barrier(num_arrivals=pages_per_tile // 2, num_barriers=stages),\n             "
       "plgpu.Barrier(num_arrivals=pages_per_tile // 2, num_barriers=stages),")]),
    ("no turn-taking (consumers run free)",
     [("        plgpu.barrier_arrive(turn)\n        plgpu.barrier_wait(turn)\n", "        pass\n"),
      ("                    plgpu.barrier_arrive(turn)\n                    with jax.named_scope(\"softmax\"):\n",
       "                    with jax.named_scope(\"softmax\"):\n"),
      ("plgpu.barrier_arrive(turn)  # softmax done", "pass  # softmax done"),
      ("                    with jax.named_scope(\"turn wait\"):\n                        plgpu.barrier_wait(turn)\n", "")]),
]


KERNEL_MODULES = ("jaxspec.pallas.verify_hopper_softmax", "jaxspec.pallas.verify_hopper_kernel",
                  "jaxspec.pallas.verify_hopper")


def patched(name, edits, path=None):
    """verify_tree_hopper from the kernel's sources with edits [(old, new)], each applied in the one
    of its three modules that holds `old` (path: another version of verify_hopper.py, whole, as the
    wrapper). The edited modules are executed in order under their own names, so each imports the
    edited ones, then the real ones are put back."""
    import importlib
    srcs = {m: open(importlib.import_module(m).__file__).read() for m in KERNEL_MODULES}
    if path:
        srcs[KERNEL_MODULES[-1]] = open(path).read()
    for old, new in edits:
        holders = [m for m, src in srcs.items() if src.count(old) == 1]
        assert len(holders) == 1, (name, old)
        srcs[holders[0]] = srcs[holders[0]].replace(old, new)
    saved = {m: sys.modules[m] for m in KERNEL_MODULES}
    try:
        for m in KERNEL_MODULES:
            mod = sys.modules[m] = types.ModuleType(m)
            exec(compile(srcs[m], f"<{name}: {m}>", "exec"), mod.__dict__)
        return mod.verify_tree_hopper
    finally:
        sys.modules.update(saved)


def sm_clock_during(fn):
    """fn() while nvidia-smi samples the SM clock (MHz) every 100 ms -> (fn's result, clocks)."""
    log = os.path.join(tempfile.mkdtemp(), "verify_probe_clocks.csv")
    p = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                          "-lms", "100", "-f", log])
    try:
        out = fn()
    finally:
        p.terminate()
        p.wait()
    rows = [line.split(",") for line in open(log) if line.strip()]
    return out, [float(r[0]) for r in rows], [float(r[1]) for r in rows]


def main():
    n_sm = jax.devices()[0].core_count
    t = 64
    q, k, v, pt, kv_lens, q_lens = setup(64, t, 2048)
    mask, _ = tree_attention_mask(random_tree(64, t), q_lens)
    ref = jax.jit(lambda q, k, v: paged_attention_ref(q, k[0], v[0], pt, kv_lens, q_lens, mask))(q, k, v)
    variants = [("pers", verify_hopper.verify_tree_hopper, {})]
    # the same kernel options side by side: one CTA an item, and a head's two CTAs as a multicast cluster
    variants += [("one CTA an item", verify_hopper.verify_tree_hopper, dict(persistent=0)),
                 ("multicast pairs", verify_hopper.verify_tree_hopper, dict(persistent=0, multicast=True))]
    variants += [(f"cut: {name}", patched(name, edits), {}) for name, edits in CUTS]
    # --overlap: the overlapped loop beside the default, whole and with the same cuts (does a part
    # cost the overlapped loop more than the default, e.g. the exponentials?)
    if "--overlap" in sys.argv:
        keep = ("no exp2", "no softmax", "no row max", "half the K")  # (the product cuts edit the default loop only)
        variants += [("ovl", verify_hopper.verify_tree_hopper, dict(overlap=True))]
        variants += [(f"ovl, cut: {name}", patched(name, edits), dict(overlap=True)) for name, edits in CUTS
                     if name.startswith(keep)]
    fns, errs = {}, {}
    for name, fn, kw in variants:
        kw = dict(dict(persistent=n_sm), **kw)
        f = jax.jit(lambda q, k, v, fn=fn, kw=kw: fn(q, k, v, 0, pt, kv_lens, q_lens, mask, **kw))
        try:
            errs[name] = rel_err(f(q, k, v), ref)
        except Exception as e:  # noqa: BLE001 - a variant that fails to lower is reported, not fatal
            print(f"{name}: {type(e).__name__}: {str(e)[:400]}")
            continue
        fns[name] = f
    t0 = time.time()
    times, clocks, power = sm_clock_during(lambda: time_interleaved(fns, q, k, v, rounds=9))
    rows = [dict(kernel="verify", impl=f"mosaic[{name}]", batch=64, q_tokens=t, context=2048, time_us=tt * 1e6,
                 over_pers=tt / times["pers"], rel_err=errs[name]) for name, tt in times.items()]
    # pages of 128 keys: one TMA copy a K or V tile instead of eight, the same bytes
    by_ps = {}
    for ps in (16, 128):
        q2, k2, v2, pt2, kv2, ql2 = setup(64, t, 2048, ps=ps)
        f = jax.jit(lambda q, k, v, pt=pt2: verify_hopper.verify_tree_hopper(q, k, v, 0, pt, kv2, ql2, mask,
                                                                              persistent=n_sm))
        by_ps[f"pers, pages of {ps}"] = (lambda f=f, a=(q2, k2, v2): f(*a))
        jax.block_until_ready(by_ps[f"pers, pages of {ps}"]())
    for name, tt in time_interleaved(by_ps, rounds=9).items():
        rows.append(dict(kernel="verify", impl=f"mosaic[{name}]", batch=64, q_tokens=t, context=2048, time_us=tt * 1e6))
    print_table(rows, ["impl", "time_us", "over_pers", "rel_err"])
    # the GPU's own kernel times (profiler trace), 64-token verify against decode: what a timed
    # call holds besides the attention kernel (the wrapper's small XLA ops, gaps between launches)
    from common import device_kernels
    from jaxspec.pallas.paged_attention import paged_attention
    qd, kd, vd, ptd, kvd, qld = setup(64, 1, 2048)
    decode = jax.jit(lambda q, k, v: paged_attention(q, k, v, 0, ptd, kvd, qld))
    traces = {}
    for name, f, args in (("verify pers", fns["pers"], (q, k, v)), ("decode (Triton, engine's choice)", decode, (qd, kd, vd))):
        jax.block_until_ready(f(*args))
        traces[name] = device_kernels(lambda f=f, args=args: jax.block_until_ready([f(*args) for _ in range(20)]), 20,
                                      tempfile.mkdtemp(prefix="verify_probe_trace"))
        print(name, traces[name])
    clock = dict(sm_clock_MHz_median=float(np.median(clocks)) if clocks else None,
                 sm_clock_MHz_min=min(clocks, default=None), power_W_median=float(np.median(power)) if power else None,
                 clock_samples=len(clocks), timing_s=time.time() - t0)
    print(clock)
    print(write_results("verify_probe", rows, {**clock, "timing": "time_interleaved: median of 9 rounds in turns",
                                                "profiler_per_call": traces,
                                                "cuts": {n: e for n, e in CUTS}}))


if __name__ == "__main__":
    main()
