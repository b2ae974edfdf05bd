"""Where the 8B batch-1 decode step spends what its GEMMs do not: the step with one part of the layer
left out at a time, each variant in a fresh process (the layers' jitted function keeps its trace).

A step is the engine's `decode` program as bench/decode.py runs it (command buffers on). Inside
them a profile attributes little, and the profile without them times kernels that the command
buffers launch back to back: a residual add and norm fused into one kernel, three of the 0.4 ms
of small kernels there (decode-8b-nocb-), left the step's time as it was (decode-addnorm-). A
part's cost on the critical path is the step's time with it less its time without it, side by side:
  attention  the paged attention kernel (its output: the queries)
  norms      the RMS norms (identity)
  kv_write   the K/V writes into the pages
  rope       the rotary embedding
  gemms      all four left out: the GEMMs, residual adds and sampling that remain
  blocking:PxS  nothing left out, the attention kernel's blocking forced to P pages a tile and S
             splits (pallas/paged_attention.choose_blocking's choice at batch 1, context 1024: 4x16)
  kv_eager   nothing left out, each layer's K/V written into the pages before its attention, as before
             attention.defers_kv_write (the step attends with them beside the pages and writes them after
             its last layer)
  kv_inbounds  nothing left out, each K/V write a scatter promised in bounds (padding rows sent to the
             trash page) rather than kv_cache.write_layer's mode="drop": XLA's bounds check for a drop
             is a read, a select and a write a layer more
  xla_norm_rope  nothing left out, XLA's norm before a decode step's projection and rope after it, the
             new K/V passed to the kernel (llama.NORM_ROPE_IN_KERNEL off; the kernel takes both)
  xla_norm   nothing left out, XLA's norms at every batch, the kernel roping (llama.KERNEL_NORM_MAX_BATCH 0:
             at batch 1 the attention kernel and pallas/swiglu.py take neither norm's scale)
  xla_mlp_norm  nothing left out, XLA's MLP norm and gating (llama.MLP_NORM_IN_KERNEL off; at batch 1
             pallas/swiglu.py gates with the norm's scale in it)
  unfused    nothing left out, a one-row step of a small model in XLA's layers as one row (no padding row)
  fused_row  nothing left out, a one-row step of a small model through Block.fused's kernels (before llama.
             pads_one_row ran it as two rows, the second padding, 'auto''s one-row path: the 'full' of older runs)
  xla_merge  nothing left out, the attention kernel's split-K partials merged by XLA at batch 1 too
  a+b        variants a and b at once (e.g. unfused+xla_merge)
Outputs are wrong in every variant but full, blocking, kv_inbounds and the xla_*, unfused and fused_row ones: only times count.
The first process after the machine starts runs slower: `full` first took 4.64 ms and 4.61 ms
(layer_ablation-blocking-, layer_ablation- at 57afa8d), second on a warm machine 4.42
(layer_ablation-blocking2-, where blocking 8x8 ran level with the default 4x16, 8x4 0.06 ms slower).
So the first variant runs once unrecorded first (--no-throwaway skips it). The savings of 57afa8d's
run (its `full` first) neither add up (1.32 ms one at a time, 0.65 all together) nor predicted a
fusion's gain: the attention kernel roping and writing the new K/V itself (39c584d, in place of
XLA's rope and two scatters) ran batch 1 at 4.47 ms as the fresh machine's first process against
4.44 for XLA's path second, and lost 0.48 ms at batch 8 and 0.11 / 0.27 ms for SmolLM2 at 8 / 64
(layer_ablation-newkv-*, variant xla_kv: XLA's path), reverted; its batch-1 gain, if any, is
unmeasured. Its second version (35b2081: new rows roped once a program) with the norm weights folded into
the next GEMM's rows (fb90a0f) ran 8B batch 1 at 4.495 / 4.496 ms in two calls where main ran 4.651 (last of
the call) / 4.453 (first), batch 8 at 4.706 / 4.713 against 4.653 / 4.655, SmolLM2 batch 64 at 1.689 against
1.516 (layer_ablation-normfold*-): not merged. Run by run the same program's batch-1 time moved 0.2 ms with its
place in the call. On a warm machine (layer_ablation-kvwrite-, a6eb9b4) the K/V writes left out saved 0.146 ms
at batch 1 (1.127x floor against 1.153x) and 0.079 at batch 8; promised in bounds they saved nothing.
The kernel roping the projection itself (3573331) saved 0.21 / 0.07 / 0.15 ms at batch 1 / 8 / 64
(layer_ablation-rope-8b-; SmolLM2 0.08 / 0.11: -rope-smol-); taking the norm too (dc239bb) 0.28 at batch 1
and 0.06 at 8 but lost 0.36 at 64 (-normrope-8b-), so above 8 requests XLA norms (03ca4f6: -normrope-smol-,
-normrope-8b-b1-).
    python bench/probes/layer_ablation.py [--batches 1,8] [--model llama3-8b] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = {"full": (), "attention": ("attention",), "norms": ("norms",), "kv_write": ("kv_write",),
            "rope": ("rope",), "gemms": ("attention", "norms", "kv_write", "rope")}


def leave_out(variant):
    """Patch the model's module so that its layers skip the variant's parts (before anything is traced)."""
    import jax

    from common import one_row_layers
    from jaxspec import attention
    from jaxspec.models import llama
    from jaxspec.pallas import paged_attention
    if "+" in variant:  # several at once, e.g. unfused+xla_merge
        for part in variant.split("+"):
            leave_out(part)
        return
    if variant == "xla_merge":  # split-K partials merged by XLA at batch 1 too (the kernel merges them there)
        kernel = paged_attention.paged_attention
        paged_attention.paged_attention = lambda *a, merge_in_kernel=False, **kw: kernel(
            *a, merge_in_kernel=merge_in_kernel, **kw)
        return
    if variant == "kv_inbounds":  # the K/V write as a plain in-bounds scatter: padding to the trash page, no drop
        from jaxspec.kv_cache import DROP_PAGE, TRASH_PAGE

        def write_layer(pages, layer, new, page, offset):
            page = jax.numpy.where(page == DROP_PAGE, TRASH_PAGE, page)
            return pages.at[layer, page, offset].set(new.astype(pages.dtype), mode="promise_in_bounds",
                                                     unique_indices=True)
        llama.write_layer = write_layer
        return
    if variant == "xla_norm_rope":  # XLA's norm before a decode step's projection and rope after it (the kernel's)
        llama.NORM_ROPE_IN_KERNEL = False
        return
    if variant in ("unfused", "fused_row"):  # a one-row step as one row: XLA's layers, or the fused kernels
        one_row_layers("xla" if variant == "unfused" else "fused")
        return
    if variant == "xla_norm":  # XLA's norms at batch 1 too, the kernel's rope kept
        llama.KERNEL_NORM_MAX_BATCH = 0
        return
    if variant == "xla_mlp_norm":  # XLA's MLP norm and gating in a decode step (pallas/swiglu.py's)
        llama.MLP_NORM_IN_KERNEL = False
        return
    if variant == "kv_eager":  # each layer's K/V written before its attention (the decode step wrote them after the last)
        llama.DEFER_KV_WRITE = False
        return
    if variant.startswith("blocking:"):
        ppb, splits = map(int, variant.split(":")[1].split("x"))
        paged_attention.choose_blocking = lambda *a: (ppb, splits)
        return
    parts = VARIANTS[variant]
    if "attention" in parts:
        attention.paged_attention = lambda q, *a, counts=None, **kw: q if counts is None else (q, counts)
    if "norms" in parts:
        llama.rms_norm = lambda x, w, eps: x
    if "kv_write" in parts:
        llama.write_layer = lambda pages, layer, kv, page, offset: pages
    if "rope" in parts:
        llama.rotate = lambda x, table: x


def child(variant, model_name, batches, context, steps, out, smoke):
    import jax
    import numpy as np

    from common import LLAMA3_8B, QWEN3_06B, SMOLLM2, copy_bandwidth, param_bytes, random_model, step_times
    from decode import decode_steps
    from jaxspec.models import ModelConfig
    leave_out(variant)
    shape = dict({"smollm2-135m": SMOLLM2, "qwen3-0.6b": QWEN3_06B}.get(model_name, LLAMA3_8B))
    if smoke:
        shape.update(num_layers=2, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32,
                     vocab_size=512)
    cfg = ModelConfig(**shape)
    model = random_model(cfg, jax.numpy.bfloat16)
    bw = copy_bandwidth()
    rows = []
    for b in batches:
        kv_bytes = b * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
        floor = (param_bytes(model) + kv_bytes) / bw
        run = decode_steps(model, b, context, 8192, 16, "auto")
        times = step_times(run, steps)
        t = float(np.median(times))
        rows.append(dict(model=model_name, batch=b, context=context, variant=variant, left_out=list(VARIANTS.get(variant, ())),
                         ms_per_step=t * 1e3, floor_ms=floor * 1e3, floor_ratio=t / floor,
                         ms_per_step_runs=[x * 1e3 for x in times]))
        print(variant, b, f"{t * 1e3:.3f} ms", flush=True)
    json.dump(rows, open(out, "w"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--smoke", action="store_true", help="a two-layer toy of the model's shape (to check the script)")
    ap.add_argument("--no-throwaway", action="store_true",
                    help="skip the first variant's unrecorded run (the first process on a fresh machine runs slower)")
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        return child(args.child[0], args.model, batches, args.context, args.steps, args.child[1], args.smoke)
    from common import print_table, write_results
    rows, path = [], None
    variants = args.variants.split(",")
    for i, variant in enumerate(variants[:1] * (not args.no_throwaway) + variants):
        out = os.path.join(tempfile.mkdtemp(), "rows.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, out, "--model", args.model,
               "--batches", args.batches, "--context", str(args.context), "--steps", str(args.steps)]
        r = subprocess.run(cmd + (["--smoke"] if args.smoke else []))
        if r.returncode != 0 or not os.path.exists(out):
            print(f"{variant}: the child failed (exit {r.returncode})")
            continue
        if i == 0 and not args.no_throwaway:
            continue  # (its compiles land in the cache: the recorded run of the same variant skips them)
        rows += json.load(open(out))
        full = {x["batch"]: x["ms_per_step"] for x in rows if x["variant"] == "full"}
        for x in rows:
            if x["batch"] in full:
                x["saved_ms"] = full[x["batch"]] - x["ms_per_step"]
        # written after each variant: a call cut off at its limit keeps what it measured
        path = write_results("layer_ablation" + ("-smoke" if args.smoke else "") + args.tag, rows)
    print_table(rows, ["model", "batch", "variant", "ms_per_step", "saved_ms", "floor_ms", "floor_ratio"])
    print(path)


if __name__ == "__main__":
    main()
