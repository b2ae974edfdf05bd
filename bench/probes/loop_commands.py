"""Whether each device drafter's batch-1 verify_steps program keeps its step loop on the device.

XLA holds a while loop in a command buffer (a CUDA graph conditional node) only if everything
inside it is a command (compile_options.py); an asynchronous op (`*-start` / `*-done` pairs) is
not one, and then XLA runs the loop from the host: the launch holds the host until the call's
steps are done and the host's work between calls leaves the GPU idle. For each tree the probe
builds the engine's batch-1 verify_steps program (SmolLM2-shaped target, random bf16 weights; an
EAGLE-3 head or a DFLASH drafter), counts the asynchronous ops in its optimized HLO, and times 24
calls launched back to back as the scheduler chains them (engine_step_gap's pipelined way): ms a
step and the launch's host time a call. --max-batch B also builds the whole start-up set of an
engine of B rows and counts each verify_steps program's async ops (by batch bucket and sampler).

    python bench/probes/loop_commands.py [--trees 3:1:4,6:1:7,6:4:24,dflash:15:1:16] [--max-batch 8] [--tag=]
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax.numpy as jnp
from flax import nnx

from common import print_table, smollm2_and_head, write_results
from engine_step_gap import pipelined_rows
from jaxspec import Generator
from jaxspec.drafters.dflash import DFlashConfig, DFlashDrafter, DFlashHead
from jaxspec.drafters.eagle import EagleDrafter
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.programs import flags_label

COLS = ["drafter", "tree", "batch", "sampler", "async_ops", "whiles", "ms_per_step", "launch_ms_per_call"]


def drafter_for(spec: str, cfg, head):
    """'3:1:4' (the EAGLE-3 head) or 'dflash:15:1:16' (a random DFLASH drafter of SmolLM2's shape)."""
    if spec.startswith("dflash:"):
        dflash = DFlashHead(DFlashConfig.for_target(cfg), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        return "dflash", DFlashDrafter(dflash, TreeShape.parse(spec.split(":", 1)[1]))
    return "eagle3", EagleDrafter(head, TreeShape.parse(spec))


def hlo_counts(exe) -> dict:
    """An executable's asynchronous ops (`*-start`) and while loops, from its optimized HLO."""
    hlo = exe.as_text()
    return dict(async_ops=len(re.findall(r" [a-z-]+-start\(", hlo)), whiles=len(re.findall(r" while\(", hlo)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", default="3:1:4,6:1:7,6:4:24,dflash:15:1:16,dflash:15:4:32")
    ap.add_argument("--max-batch", type=int, default=1, help="above 1: also count the async ops of every bucket's programs")
    ap.add_argument("--layers", type=int, default=None, help="fewer target layers (a CPU smoke run)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    cfg, model, head = smollm2_and_head(args.layers)
    rows = []
    for spec in args.trees.split(","):
        kind, drafter = drafter_for(spec, cfg, head)
        tree = spec.split(":", 1)[1] if kind == "dflash" else spec
        gen = Generator(model, None, drafter=drafter, max_batch=1, max_seq_len=1024, warmup=False, compile_cache="off")
        timed = pipelined_rows(gen, spec, calls=24)
        key, exe = next((key, exe) for key, exe in gen.scheduler.programs.table.items() if key[0] == "verify_steps")
        rows.append(dict(drafter=kind, tree=tree, batch=1, sampler=flags_label(key[1]), **hlo_counts(exe),
                         ms_per_step=timed["ms_per_step"], launch_ms_per_call=timed["launch_ms_per_call"]))
        print_table(rows[-1:], COLS)
        if args.max_batch > 1:
            gen = Generator(model, None, drafter=drafter, max_batch=args.max_batch, max_seq_len=1024, warmup=True,
                            compile_cache="off")
            built = {}
            for progs, name, flags, cache, a in gen.scheduler.program_specs():
                if name == "verify_steps":
                    key = progs.key(name, flags, cache, a)
                    built[key] = dict(drafter=kind, tree=tree, batch=a[0].shape[0], sampler=flags_label(key[1]),
                                      **hlo_counts(progs.table[key]))
            rows += built.values()
            print_table(list(built.values()), COLS)
    print_table(rows, COLS)
    write_results(f"loop_commands{args.tag}", rows, {"calls": 24, "context": 256, "max_seq_len": 1024})


if __name__ == "__main__":
    main()
