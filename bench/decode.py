"""Plain decoding: the engine's decode step beside its memory floor and beside the PyTorch anchor.

The step is the engine's own `decode` program (8 steps a call, each call chained on the last one's
device outputs, as the engine runs steady decoding) on a paged cache holding `--context` tokens a
request, with the engine's fixed page-table width (`--max-seq-len`); ms per step = a call's time / 8.
floor = (weight bytes + K/V bytes read a step) / measured copy bandwidth, the weights all of them
as the engine issue states its floors; read_floor counts only the input embedding's looked-up rows
(8B: 1.05 GB of 16.06 GB less), the bytes a step reads.
`bench/torch_anchor.py` then runs the same shapes in a fresh process (same device call); rows
carry `vs_torch` = torch's ms / jaxspec's ms (above 1: jaxspec is faster).
The first process of a fresh machine to run the 8B model ran its batch-1 step slower: 4.389 ms here
(decode- at 03ca4f6, after SmolLM2 processes) against 4.240 / 4.262 in two processes of the same
program after it (layer_ablation-normrope-8b-b1-); where a process of it ran first, this bench and
that probe agreed (4.323 against 4.308 / 4.322: decode-rope-, layer_ablation-rope-8b-). So a
throwaway process of the first model runs a few steps first, unrecorded (--no-throwaway skips it).
    python bench/decode.py [--models llama3-8b,smollm2-135m] [--batches 1,8,64] [--context 1024] [--impls auto,pallas,fused]
"""
from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from flax import nnx

from common import (LLAMA3_8B, SMOLLM2, copy_bandwidth, device_kernels, param_bytes, print_table, read_weight_bytes,
                    results_tag, random_model, run_torch_anchor, step_times, write_results)
from jaxspec.kv_cache import KVCache
from jaxspec.models import ModelConfig
from jaxspec.models.llama import fused_layers
from jaxspec.programs import MAX_DECODE_STEPS, STOP_ID_SLOTS, Programs
from jaxspec.sampling import SamplerFlags, SamplingBatch, SamplingParams


def decode_steps(model, batch, context, max_seq_len, page_size, attn_impl, per_call=MAX_DECODE_STEPS, mesh=None):
    """A function running n decode steps as the engine runs them (the `decode` program, per_call
    steps a call, each call chained on the last one's outputs), from `context` cached tokens a
    request; built and warmed. Returns the last call's tokens. mesh: the tensor-parallel mesh the
    model is sharded over (the cache is sharded by KV head, as the engine's)."""
    cfg = model.cfg
    progs = Programs(model, attn_impl=attn_impl, mesh=mesh)
    pages_per = -(-(context + 200) // page_size)
    width = max(-(-max_seq_len // page_size), pages_per)
    cache = [paged_cache(cfg, batch * pages_per + 1, page_size, model.dtype, mesh)]
    pt = np.zeros((batch, width), np.int32)
    pt[:, :pages_per] = 1 + np.arange(batch * pages_per).reshape(batch, pages_per)
    flags = SamplerFlags.of([SamplingParams()])
    pt, stop_ids, num_steps = jax.device_put((pt, np.full((batch, STOP_ID_SLOTS), -1, np.int32), np.int32(per_call)))

    def run(n):
        # the carried inputs (donated by the program) start fresh: the context stays near `context`
        carry = jax.device_put((np.ones((batch, 1), np.int32), np.full(batch, context, np.int32), np.full(batch, n, np.int32),
                                SamplingBatch.build([SamplingParams()] * batch, [0] * batch, [0] * batch)))
        tok, kv, budget, sb = carry
        for _ in range(-(-n // per_call)):
            out = progs.decode(cache[0], tok, pt, kv, budget, stop_ids, num_steps, sb, flags=flags)
            cache[0] = out[-1]
            tok, kv, sb, budget = out[6]
        return tok

    jax.block_until_ready(run(3 * per_call))
    run.programs = progs  # probes read the built executables
    return run


def forward_difference(model, batch, context, page_size, impl, reference="pallas"):
    """Largest |a - b| / max|b| between one decode forward's final hidden under `impl` and under
    `reference`, from the same random cache (bf16: rounding, not a wrong kernel, is ~1e-2)."""
    if impl == reference:
        return 0.0
    cfg = model.cfg
    pages = -(-(context + 1) // page_size)
    rng = np.random.default_rng(0)
    k = jax.numpy.asarray(rng.standard_normal((cfg.num_layers, batch * pages + 1, page_size, cfg.num_kv_heads,
                                               cfg.head_dim)), model.dtype)
    pt = jax.numpy.asarray(1 + np.arange(batch * pages).reshape(batch, pages), np.int32)
    tokens = jax.numpy.asarray(rng.integers(0, cfg.vocab_size, (batch, 1)), np.int32)
    kv = jax.numpy.full((batch,), context, np.int32)
    one = jax.numpy.ones((batch,), np.int32)
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnums=0)
    def fwd(i, state, cache):
        return nnx.merge(graphdef, state)(tokens, kv[:, None], cache, pt, kv, one, attn_impl=i)[0]
    a, b = (np.asarray(fwd(i, state, KVCache(k, k)), np.float32) for i in (impl, reference))
    return float(np.abs(a - b).max() / np.abs(b).max())


def paged_cache(cfg, num_pages, page_size, dtype, mesh=None):
    """The target's paged cache as the engine makes it (sharded by KV head under a mesh)."""
    from jaxspec.sharding import cache_sharding
    return KVCache.create(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype,
                          cache_sharding(mesh, cfg.num_kv_heads))


def with_anchor(rows: list, anchor: list) -> list:
    """jaxspec's rows so far and the torch anchor's rows for the same (model, batch), each side's ratio to the other."""
    out = [dict(x) for x in rows]
    for tr in anchor:
        mine = [x for x in out if (x["model"], x["batch"]) == (tr["model"], tr["batch"])]
        if not mine:
            continue
        tr = dict(tr, floor_ms=mine[0]["floor_ms"], floor_ratio=tr["ms_per_step"] / mine[0]["floor_ms"],
                  read_floor_ms=mine[0]["read_floor_ms"], read_floor_ratio=tr["ms_per_step"] / mine[0]["read_floor_ms"])
        for x in mine:
            x["vs_torch"] = tr["ms_per_step"] / x["ms_per_step"]
        out.append(tr)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama3-8b,smollm2-135m")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--impls", default="auto",
                    help="impls side by side, e.g. auto,pallas,fused: auto (models.llama.fused_layers decides), "
                         "pallas (XLA's layers around the attention kernels), fused (the fused layer kernels)")
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--tag", type=results_tag, default="", help="suffix of the results file name")
    ap.add_argument("--no-throwaway", action="store_true", help="skip the unrecorded first process (see above)")
    ap.add_argument("--throwaway", action="store_true", help=argparse.SUPPRESS)  # (that process: steps, nothing kept)
    args = ap.parse_args()
    first = args.models.split(",")[0], int(args.batches.split(",")[0])
    if args.throwaway:
        model = random_model(ModelConfig(**(SMOLLM2 if first[0] == "smollm2-135m" else LLAMA3_8B)), jax.numpy.bfloat16)
        step_times(decode_steps(model, first[1], args.context, args.max_seq_len, args.page_size, args.impls.split(",")[0]), 8)
        return
    if not args.no_throwaway:
        subprocess.run([sys.executable, os.path.abspath(__file__), "--models", first[0], "--batches", str(first[1]),
                        "--context", str(args.context), "--throwaway"], check=False)
    anchor = [] if args.no_torch else run_torch_anchor(args.models, args.batches, args.context)
    bw = copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}: copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    rows, path = [], None
    for name in args.models.split(","):
        cfg = ModelConfig(**(SMOLLM2 if name == "smollm2-135m" else LLAMA3_8B))
        model = random_model(cfg, jax.numpy.bfloat16)
        wbytes = param_bytes(model)
        for b, impl in [(b, i) for b in map(int, args.batches.split(",")) for i in args.impls.split(",")]:
            kv_bytes = b * args.context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
            floor = (wbytes + kv_bytes) / bw
            read_floor = (read_weight_bytes(model, b) + kv_bytes) / bw
            run = decode_steps(model, b, args.context, args.max_seq_len, args.page_size, impl)
            times = step_times(run, args.steps)
            t = float(np.median(times))
            prof = device_kernels(lambda: jax.block_until_ready(run(16)), 16, tempfile.mkdtemp(), top=24)
            rows.append(dict(model=name, batch=b, context=args.context, engine="jaxspec", algorithm="plain",
                             impl=impl, fused_layers=fused_layers(cfg, b, impl),
                             max_rel_diff=forward_difference(model, b, args.context, args.page_size, impl),
                             ms_per_step=t * 1e3, floor_ms=floor * 1e3, floor_ratio=t / floor, read_floor_ms=read_floor * 1e3,
                             read_floor_ratio=t / read_floor, tokens_per_s=b / t,
                             kernels_per_step=prof and prof["kernels"], kernel_ms=prof and prof["kernel_ms"],
                             most_launched=prof and prof["most_launched"], busiest=prof and prof["top"],
                             ms_per_step_runs=[x * 1e3 for x in times]))
            print_table(rows[-1:], ["model", "batch", "impl", "ms_per_step", "floor_ms", "floor_ratio",
                                    "kernels_per_step", "max_rel_diff"])
            # written after each row: a call cut off at its time limit keeps the rows it measured
            path = write_results("decode" + args.tag, with_anchor(rows, anchor),
                                 {"copy_bandwidth_GBps": bw / 1e9, "xla_flags": os.environ.get("XLA_FLAGS", "")})
        del model
    print(path)
    print()
    print_table(with_anchor(rows, anchor), ["model", "batch", "engine", "impl", "ms_per_step", "floor_ms", "floor_ratio",
                                            "read_floor_ratio", "vs_torch", "kernels_per_step", "max_rel_diff"])


if __name__ == "__main__":
    main()
