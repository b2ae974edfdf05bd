"""The 64-token Mosaic verify (8B heads, context 2048) inside one kernel run: Mosaic GPU's in-kernel
profiler records each warpgroup's named regions (verify_hopper.py: scores, softmax, values,
epilogue and a consumer's waits; the producer's page-table and slot waits) in clock cycles, and
this sums them per role (profiled rows: batch 32, rings of two tiles, for shared memory). Beside
it, variants timed in turns by device time (profiler trace, median of 5 rounds), with the Triton
decode at the same batch and context for the verify/decode ratio:
  (default)         the kernel, and with a ring of two tiles
  --undo            each of 612317c's per-item changes undone (UNDO: source edits as in verify_probe.py)
  --out             the output through the query buffers, not the last K slot (0515872's comparison)
  --softmax         the overlapped loop and softmax-less copies (CUTS), profiled (84cd98b's)
  --tiles           192-key tiles; 128 rows a consumer (one CTA a head) (463c3e4's)
  --stale           the stale max and the row max each tile (stale_max=True, False), and the
                    stale max with the turn's arrival after it, a smaller slack, the redo's P packed
                    as the kept P (STALE); the row max each tile also profiled
  --baseline=FILE   another version of verify_hopper.py's source, side by side
  --tokens=N        N query tokens a request instead of 64 (the profiled rows too)
  --heads=HQ,HKV,D  query heads, KV heads and head_dim instead of 8B's 32,8,128 (SmolLM2: 9,3,64)
  --cuts=A,B        verify_probe.py's cut-out copies whose names start with A or B (wrong output)

(verify_timeline-bf75a55 ran a --fence flag at bf75a55, a kernel since reverted whose consumers
stored their row sums to shared memory before the softmax-done arrival: with that store taken out,
and with the turns at the scores issue alone; verify_timeline-4841fba ran --defer at 4841fba, also
reverted; verify_timeline-4a76ae1 ran --convert at 4a76ae1, whose kernel rounded P to bf16 by an
integer add and shift, beside astype's F2FP, P truncated, and the output normalised by one
reciprocal a row; verify_timeline-6315e1a ran --rescale at 6315e1a, whose kernel moved a row's max
only past a slack and skipped the output's rescale in warps whose rows' max stayed: level;
verify_timeline-e1aab6e ran --stale at e1aab6e, whose redo the whole warpgroup decided (a named
barrier's reduction) and took from the scores computed again: 7% slower than 3466605's, spilling.)

    python bench/verify_timeline.py [--undo] [--out] [--softmax] [--tiles] [--stale] [--baseline=FILE] [--tokens=N]
                                  [--heads=HQ,HKV,D] [--cuts=A,B]   (GPU)
"""
from __future__ import annotations

import glob
import json
import os
import tempfile
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

import jax
import numpy as np

from common import print_table, write_results
from jaxspec.pallas import verify_hopper
from jaxspec.pallas.attention_ref import paged_attention_ref
from jaxspec.pallas.paged_attention import paged_attention
from jaxspec.pallas.tree_mask import tree_attention_mask
import kernels
from kernels import device_time, rel_err, random_tree, setup
from verify_probe import CUTS, patched

UNDO = [  # (name, edits): the kernel as it was before each change
    ("last tile at full width", [("half_kv = 64 if block_kv == 128", "half_kv = 0 if block_kv == 128")]),
    ("output writes awaited each item", [("plgpu.wait_smem_to_gmem(0, wait_read_only=True)",
                                          "plgpu.wait_smem_to_gmem(0)")]),
    ("page table loaded in line", [("        load_page_table(0)\n", ""),
                                   ("pl.when(n + 1 < n_items)(lambda: load_page_table(n + 1))", "load_page_table(n)")]),
]
UNDO.append(("all three undone", [e for _, edits in UNDO for e in edits]))
# the output through the query buffer (two of them where they fit), not the last tile's K slot
OUT_VIA_QUERIES = ("output through the query buffer", [("stage_in_ring = not overlap and 2 * wg_rows <= block_kv",
                                                         "stage_in_ring = False")])
# variants of the stale-max softmax (run with stale_max=True at any token count, beside the row max
# each tile, stale_max=False): the turn's arrival after it, a smaller slack, the redo's P packed as
# the kept P
STALE = [("arrival after the softmax",
          [("                    plgpu.barrier_arrive(turn)\n                    with jax.named_scope(\"softmax\"):\n"
            "                        p16, m_new, l, acc = softmax_stale(s, i, m, l, acc, masked)\n",
            "                    with jax.named_scope(\"softmax\"):\n"
            "                        p16, m_new, l, acc = softmax_stale(s, i, m, l, acc, masked)\n"
            "                    plgpu.barrier_arrive(turn)\n")]),
         ("slack 8", [("STALE_SLACK = 64", "STALE_SLACK = 8")]),
         ("redo packs P by cvt too (3466605)",
          [("redone = (_to_half_by_integer(p, p16.mlir_dtype),", "redone = (p.astype(p16.mlir_dtype),")])]
ROLES = ("consumer 0", "consumer 1", "producer")


def options(name: str) -> list[str]:
    """The values of each --name=VALUE on the command line, in order."""
    return [a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")]


def summarize(path: str) -> dict:
    """{role: {region: [share of the warpgroup's span, mean kilocycles], 'span_kcycles': ..}} from
    a Mosaic GPU trace (its 'ts' differences are clock cycles / 1000 within one warpgroup)."""
    events = json.load(open(path))["traceEvents"]
    by_tid = {}
    for e in events:
        by_tid.setdefault(e["tid"], []).append(e)
    sums = {r: {} for r in ROLES}
    spans = {r: [] for r in ROLES}
    for tid, evs in by_tid.items():
        role = ROLES[(tid - 1) % 3]
        stack, outer = [], 0.0
        for e in evs:
            if e["ph"] == "B":
                stack.append(e)
                continue
            b = stack.pop()
            if any(s["name"] == b["name"] for s in stack):  # a region's own inner eqns: counted once
                continue
            d = e["ts"] - b["ts"]
            tot, n = sums[role].get(b["name"], (0.0, 0))
            sums[role][b["name"]] = (tot + d, n + 1)
            if not stack:
                outer += d
        span = evs[-1]["ts"] - evs[0]["ts"]
        spans[role].append(span)
        tot, n = sums[role].get("(outside regions)", (0.0, 0))
        sums[role]["(outside regions)"] = (tot + span - outer, n + 1)
    out = {}
    for role in ROLES:
        total = sum(spans[role]) or 1.0
        out[role] = {name: [tot / total, tot / n] for name, (tot, n) in sorted(sums[role].items())}
        out[role]["span_kcycles_mean"] = float(np.mean(spans[role])) if spans[role] else None
    return out


def main():
    n_sm = jax.devices()[0].core_count
    b, ctx = 64, 2048
    t = int((options("tokens") or [64])[-1])
    for value in options("heads"):  # kernels.setup's shapes (the verify's and the decode's)
        kernels.HQ, kernels.HKV, kernels.D = map(int, value.split(","))
    heads = f"{kernels.HQ}/{kernels.HKV}/{kernels.D}"  # query heads / KV heads / head_dim
    q, k, v, pt, kv_lens, q_lens = setup(b, t, ctx)
    mask, _ = tree_attention_mask(random_tree(b, t), q_lens)
    ref = jax.jit(lambda q, k, v: paged_attention_ref(q, k[0], v[0], pt, kv_lens, q_lens, mask))(q, k, v)
    vh = verify_hopper.verify_tree_hopper
    # (name, kernel, options, profiled); the trace's shared memory leaves no room for a ring of
    # three tiles: the profiled rows have two
    variants = [("now", vh, {}, False), ("two stages", vh, dict(stages=2), True)]
    if "--tiles" in sys.argv:  # (463c3e4's comparison)
        # 192-key tiles: 2112 keys in 11 tiles (no half tile), fewer turns between the consumers;
        # one CTA a head: each K/V tile read once for its 256 rows
        variants += [("192-key tiles", vh, dict(block_kv=192), False),
                     ("128 rows a consumer, 64-key tiles", vh, dict(wg_rows=128), False),
                     ("128 rows a consumer, 64-key tiles, four stages", vh, dict(wg_rows=128, stages=4), False)]
    if "--out" in sys.argv:  # (0515872's comparison)
        via_queries = patched(*OUT_VIA_QUERIES)
        variants += [("two stages, output via two query buffers", via_queries, dict(stages=2), False),
                     ("three stages, output via one query buffer", via_queries, dict(stages=3), False)]
    if "--softmax" in sys.argv:  # how much of a tile's time the softmax holds, in either loop
        no_softmax = patched(*next(c for c in CUTS if c[0].startswith("no softmax")))
        variants += [("overlap", vh, dict(overlap=True), True), ("cut: no softmax", no_softmax, {}, True),
                     ("overlap, cut: no softmax", no_softmax, dict(overlap=True), True)]
    if "--stale" in sys.argv:
        variants += [("stale max", vh, dict(stale_max=True), False),
                     ("row max every tile", vh, dict(stale_max=False), False)]
        variants += [(name, patched(name, edits), dict(stale_max=True), False) for name, edits in STALE]
        variants.append(("row max every tile, two stages", vh, dict(stages=2, stale_max=False), True))
    for path in options("baseline"):  # another version of the kernel's source, side by side
        variants.insert(1, (f"baseline {os.path.basename(path)}", patched(path, [], path), {}, False))
    for value in options("cuts"):  # verify_probe's CUTS whose names start so, timed beside the kernel
        keep = tuple(value.split(","))
        variants += [(f"cut: {name}", patched(name, edits), {}, False) for name, edits in CUTS
                     if name.startswith(keep)]
    if "--undo" in sys.argv:
        variants += [(f"undo: {n}", patched(n, e), {}, False) for n, e in UNDO]
    fns, rows = {}, []
    for name, fn, kw, _ in variants:
        f = jax.jit(lambda q, k, v, fn=fn, kw=kw: fn(q, k, v, 0, pt, kv_lens, q_lens, mask, persistent=n_sm, **kw))
        rows.append(dict(kernel="verify", impl=f"mosaic[{name}]", batch=b, q_tokens=t, context=ctx, heads=heads,
                         rel_err=rel_err(f(q, k, v), ref)))
        fns[name] = f
    qd, kd, vd, ptd, kvd, qld = setup(b, 1, ctx)
    decode = jax.jit(lambda q, k, v: paged_attention(q, k, v, 0, ptd, kvd, qld))
    jax.block_until_ready(decode(qd, kd, vd))
    dev = {name: [] for name in fns}
    dev["decode"] = []
    for _ in range(5):  # rounds in turns: each a trace of 10 calls
        for name, f in fns.items():
            dev[name].append(device_time(f, q, k, v)[0])
        dev["decode"].append(device_time(decode, qd, kd, vd)[0])
    med = {name: float(np.median(ts)) * 1e6 for name, ts in dev.items()}
    for r, name in zip(rows, fns):
        r.update(device_us=med[name], over_now=med[name] / med["now"], over_decode=med[name] / med["decode"],
                 device_us_rounds=[x * 1e6 for x in dev[name]])
    rows.append(dict(kernel="decode", impl="pallas[auto]", batch=b, q_tokens=1, context=ctx, heads=heads,
                     device_us=med["decode"], device_us_rounds=[x * 1e6 for x in dev["decode"]]))
    print_table(rows, ["kernel", "impl", "device_us", "over_now", "over_decode", "rel_err"])

    # the timeline: batch 32 (four items a CTA) so that the trace fits beside the ring in shared memory
    timeline = {}
    qs, ks, vs, pts, kvs, qls = setup(32, t, ctx)
    masks, _ = tree_attention_mask(random_tree(32, t), qls)
    for name, fn, kw, profiled in variants:
        if not profiled:
            continue
        d = os.path.join(tempfile.gettempdir(), "verify_timeline",
                         name.replace(' ', '_').replace(',', '').replace(':', ''))
        os.makedirs(d, exist_ok=True)
        try:
            jax.block_until_ready(fn(qs, ks, vs, 0, pts, kvs, qls, masks, persistent=n_sm, profile_dir=d,
                                     profile_space=600, **kw))
            path = max(glob.glob(os.path.join(d, "*.json")), key=os.path.getmtime)
            timeline[name] = summarize(path)
        except Exception as e:  # noqa: BLE001 - report and go on
            timeline[name] = f"{type(e).__name__}: {str(e)[:400]}"
        print(name, json.dumps(timeline[name], indent=1))
    extra = {"timing": "device time: median of 5 rounds in turns, each a profiler trace of 10 calls",
             "timeline_batch32": timeline}
    if "--undo" in sys.argv:
        extra["undo"] = {n: e for n, e in UNDO}
    print(write_results("verify_timeline", rows, extra))


if __name__ == "__main__":
    main()
