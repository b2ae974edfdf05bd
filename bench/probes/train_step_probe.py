"""Where an EAGLE-3 training step's time goes: the target's forward alone and the whole step (bf16
and float32 head compute, ttt 1 and 6), one sequence a row against packed rows (text tokens a
second), and a shipped head's held-out accept length (walked as the engine walks).

    python bench/probes/train_step_probe.py --data data/smollm2-135m-selfgen-seed0/data.npz [--head DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo
from common import print_table, time_fn, write_results  # noqa: E402

from jaxspec import train_eagle  # noqa: E402
from jaxspec.models.loading import load  # noqa: E402
from jaxspec.train import held_out  # noqa: E402
from jaxspec.train_data import answer_temperatures, pack_rows  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--head", default=None, help="a trained head: its held-out accept length")
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    target, _ = load("smollm2-135m", jnp.bfloat16)
    d = np.load(args.data)
    tokens, lengths, plens = d["tokens"], d["lengths"], d["prompt_lengths"]
    b = args.batch
    flags = types.SimpleNamespace(init_from=None, kind="eagle3", draft_vocab=8192, capture_layers=None,
                                  intermediate_size=None, seed=0)
    head, hot, _ = train_eagle.head_for_run(flags, target, tokens[:4096], lengths[:4096])
    tx = optax.adamw(1e-4)
    rows = []
    t_graph, t_state = nnx.split(target)
    # the same last sequences as a step reads them: one a row, or packed (rows of 384, or half as many of 768)
    tail = slice(len(tokens) - 16 * b, len(tokens))
    last = (tokens[tail], lengths[tail], plens[tail])
    one = (last[0][-b:], last[1][-b:], last[2][-b:])
    layouts = {"one a row": (one[0],) + tuple(train_eagle.unpacked(*map(jnp.asarray, one))),
               "packed 384": tuple(a[:b] for a in pack_rows(*last, 384)),
               "packed 768": tuple(a[:max(b // 2, 1)] for a in pack_rows(*last, 768))}
    @jax.jit
    def target_only(t_state, tokens, segments, positions):
        return train_eagle.target_outputs(nnx.merge(t_graph, t_state), tokens, segments, positions, head.cfg,
                                          jnp.asarray(hot))

    for layout, batch in layouts.items():
        batch = tuple(map(jnp.asarray, batch))
        ntok = int((batch[1] > 0).sum())
        ms = time_fn(target_only, t_state, *batch[:3], iters=10) * 1e3
        rows.append(dict(layout=layout, part="target forward + logits", ttt="", compute="bfloat16", ms=ms,
                         tokens_per_s=ntok / ms * 1e3))
        for compute, ttt in ((jnp.bfloat16, 6), (jnp.float32, 6), (jnp.bfloat16, 1)):
            if layout != "one a row" and (compute, ttt) != (jnp.bfloat16, 6):
                continue
            graph, params, rest = nnx.split(head, nnx.Param, ...)
            step, _, ts = train_eagle.make_train_step(target, graph, rest, tx, jnp.asarray(hot), head.cfg, ttt, compute)
            opt = tx.init(params)
            ms = time_fn(lambda: step(params, opt, ts, *batch, 0), iters=10) * 1e3
            rows.append(dict(layout=layout, part="train step", ttt=ttt, compute=jnp.dtype(compute).name, ms=ms,
                             tokens_per_s=ntok / ms * 1e3))
    print_table(rows, ["layout", "part", "ttt", "compute", "ms", "tokens_per_s"])
    if args.head:
        from jaxspec.drafters.eagle import load_head
        shipped = load_head(args.head, target.cfg, target)
        n_val = max(1, int(len(tokens) * 0.02))
        greedy = np.flatnonzero(answer_temperatures(len(tokens), 0.25)[:n_val] == 0)
        hot = np.asarray(shipped.draft_to_target[...])
        graph, params, rest = nnx.split(shipped, nnx.Param, ...)
        _, evaluate, ts = train_eagle.make_train_step(target, graph, rest, tx, jnp.asarray(hot), shipped.cfg, 6,
                                                      jnp.bfloat16)
        r = held_out(evaluate, params, ts, tokens[greedy], lengths[greedy], plens[greedy], b)
        print({k: v for k, v in r.items()})
        rows.append(dict(part="shipped head, held-out greedy answers", ttt=6, compute="bfloat16",
                         accept_length=r["accept_length"], walk_accept_length=r["walk_accept_length"], acc=r["acc"]))
    write_results("train_step_probe", rows)


if __name__ == "__main__":
    main()
