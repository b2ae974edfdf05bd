"""Tensor parallel: the engine's decode step and an EAGLE-3-shaped verify step over 1, 2, 4 devices.

    python bench/tp.py [--model llama3-8b] [--tp 1,2,4] [--batches 1,8,64] [--context 1024] [--verify-nodes 24]
    python bench/tp.py --memory-only      # the per-device bytes table for those TP sizes (tp_memory-*.json)

Random bf16 weights of the model's shape, created in their shards (sharding.py). `plain`: the
engine's decode program (8 steps a call, each call chained on the last, as steady decoding runs);
`verify:N`: one verify_tree call of N nodes a request (a chain, the shape EAGLE-3 6:4:24 verifies).
floor_ratio = the step's time / (bytes one device reads a step: its weight and K/V shards, over
its measured copy bandwidth). `--check` also decodes a few prompts greedily at each TP size with
the TP-1 model's own weights and reports whether the tokens equal TP 1's (`identical_to_tp1`).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from common import LLAMA3_8B, SMOLLM2, copy_bandwidth, print_table, random_model, results_tag, step_times, write_results
from decode import decode_steps, paged_cache
from jaxspec import sharding
from jaxspec.models import ModelConfig
from jaxspec.programs import Programs
from jaxspec.sampling import SamplerFlags, SamplingBatch, SamplingParams

MODELS = {"llama3-8b": LLAMA3_8B, "smollm2-135m": SMOLLM2,
          "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16)}


def memory(cfg: ModelConfig, tp: int, batch: int, context: int, dtype_bytes: int = 2) -> dict:
    """Bytes one device holds at tp shards, from shapes alone: weights and the K/V of `batch`
    sequences of `context` tokens."""
    from flax import nnx

    from jaxspec.models import Llama
    laid = sharding.tp_config(cfg, tp)
    abstract = nnx.eval_shape(lambda: Llama(laid, dtype=jnp.bfloat16))
    weights = 0
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        shape = var.get_value().shape
        spec = sharding.weight_spec("/".join(map(str, path)), shape, tp)
        weights += int(np.prod([n // (tp if axis else 1) for n, axis in zip(shape, tuple(spec) + (None,) * 9)]))
    kv_heads = laid.num_kv_heads // tp if laid.num_kv_heads % tp == 0 else laid.num_kv_heads
    kv = 2 * laid.num_layers * batch * context * kv_heads * laid.head_dim
    return dict(tp=tp, batch=batch, context=context, weight_bytes_per_device=weights * dtype_bytes,
                kv_bytes_per_device=kv * dtype_bytes)


def verify_step(model, batch, context, nodes, page_size, mesh):
    """A function running one verify_tree call of `nodes` chained nodes a request; warmed."""
    cfg = model.cfg
    progs = Programs(model, mesh=mesh)
    pages = -(-(context + nodes + 16) // page_size)
    cache = [paged_cache(cfg, batch * pages + 1, page_size, model.dtype, mesh)]
    pt = jnp.asarray(1 + np.arange(batch * pages, dtype=np.int32).reshape(batch, pages))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, nodes)), jnp.int32)
    parents = jnp.broadcast_to(jnp.arange(-1, nodes - 1, dtype=jnp.int32), (batch, nodes))
    args = (pt, jnp.full(batch, context, jnp.int32), jnp.full(batch, nodes, jnp.int32),
            SamplingBatch.build([SamplingParams()] * batch, [0] * batch, [0] * batch))
    flags = SamplerFlags()

    def run(n):
        for _ in range(n):
            out = progs.verify_tree(cache[0], tokens, parents, *args, flags=flags)
            cache[0] = out[-1]
        return out[0]

    jax.block_until_ready(run(2))
    return run


def outputs(model, mesh, tp):
    """Greedy tokens of a few random prompts through the Generator at this TP size."""
    from jaxspec import Generator
    gen = Generator(model, None, tp_size=tp, max_batch=4, max_seq_len=256, num_pages=4 * 16 + 1)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, model.cfg.vocab_size, n))) for n in (5, 17, 33, 60)]
    return [o.token_ids for o in gen.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b", choices=list(MODELS))
    ap.add_argument("--tp", default="1,2,4")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--verify-nodes", type=int, default=24, help="0: no verify rows")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--check", action="store_true", help="also compare greedy outputs with TP 1's")
    ap.add_argument("--memory-only", action="store_true")
    ap.add_argument("--bandwidth-bytes", type=int, default=1 << 30)
    ap.add_argument("--tag", type=results_tag, default="", help="suffix of the results file name")
    args = ap.parse_args(argv)
    cfg = ModelConfig(**MODELS[args.model])
    tps, batches = [int(x) for x in args.tp.split(",")], [int(x) for x in args.batches.split(",")]
    table = [memory(cfg, tp, b, args.context) for tp in tps for b in batches]
    print_table(table, ["tp", "batch", "context", "weight_bytes_per_device", "kv_bytes_per_device"])
    if args.memory_only:  # shapes only: the same on any machine
        print(write_results("tp_memory", table, {"model": args.model, "dtype": "bfloat16"}))
        return table
    bw = copy_bandwidth(args.bandwidth_bytes)  # one device's

    def save(rows, checks):
        for r in rows:  # against the first TP size's step (TP 1 by default), where measured
            base = [x for x in rows if (x["tp"], x["batch"], x["algorithm"]) == (tps[0], r["batch"], r["algorithm"])]
            r["speedup"] = base[0]["ms_per_step"] / r["ms_per_step"] if base else None
        return write_results("tp" + args.tag, rows, {"model": args.model, "memory": table, "copy_bandwidth_GBps": bw / 1e9,
                                          "identical_to_tp1": {str(k): v for k, v in checks.items()}})
    rows = []
    reference = None
    for tp in tps:
        mesh = sharding.tp_mesh(tp) if tp > 1 else None
        model = random_model(cfg, jnp.bfloat16, mesh=mesh)
        for b in batches:
            mem = next(m for m in table if (m["tp"], m["batch"]) == (tp, b))
            floor = (mem["weight_bytes_per_device"] + mem["kv_bytes_per_device"]) / bw
            runs = [("plain", decode_steps(model, b, args.context, args.max_seq_len, args.page_size, "auto", mesh=mesh),
                     args.steps, 1)]
            if args.verify_nodes:
                runs.append((f"verify:{args.verify_nodes}",
                             verify_step(model, b, args.context, args.verify_nodes, args.page_size, mesh),
                             max(1, args.steps // 8), args.verify_nodes))
            for algo, run, n, tokens in runs:
                t = float(np.median(step_times(run, n, repeats=3)))
                rows.append(dict(tp=tp, batch=b, algorithm=algo, context=args.context, ms_per_step=t * 1e3,
                                 tokens_per_s=b / t if algo == "plain" else None,
                                 nodes_per_s=b * tokens / t, floor_ms=floor * 1e3, floor_ratio=t / floor))
                print_table(rows[-1:], ["tp", "batch", "algorithm", "ms_per_step", "tokens_per_s", "floor_ratio"])
                save(rows, {})  # as it goes: a call cut short keeps what it measured
        del model
    checks = {}
    if args.check:
        model = random_model(cfg, jnp.bfloat16)
        for tp in tps:
            toks = outputs(model, sharding.tp_mesh(tp) if tp > 1 else None, tp)
            reference = reference or toks
            checks[tp] = toks == reference
            print(f"tp {tp}: greedy tokens identical to TP {tps[0]}: {checks[tp]}")
            save(rows, checks)
    print()
    print_table(rows, ["tp", "batch", "algorithm", "ms_per_step", "tokens_per_s", "floor_ratio", "speedup"])
    print(save(rows, checks))
    return rows


if __name__ == "__main__":
    main()
