"""Why a batch-1 decode call still waited for its loop (dispatch_probe-NVIDIA-H200.json: launch
10.6 ms of a 9.9 ms call at batch 1, 2.1 of 7.6 at batch 8, loops as command buffers). For the
engine's decode program at each batch:

  launch_ms / call_ms   host time until a call returns / a call's time, calls chained
  outside               op counts of the optimized HLO's entry computation and of its while loops'
                        bodies, the copies inside those bodies as written, and the module's
                        custom calls by target (at 1a0384a batch 1 had a CUB sort, in the
                        sampler's conditional)

SmolLM2-shaped target, random bf16 weights, context 256. At 06aa066 (rows `dynamic`; `static`
fixed the trip count at 8, which changed nothing) the batch-1 loop body held one copy, of the
carried [1] kv lengths the kernels read, and batch 8's none.

    python bench/probes/cmdbuf_probe.py [--batches 1,8]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import jax.numpy as jnp

from common import SMOLLM2, print_table, random_model, write_results
from decode import decode_steps
from dispatch_probe import launch_and_call_ms
from jaxspec import compile_options
from jaxspec.models import ModelConfig

TRIVIAL = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "ROOT"}


def computations(hlo: str) -> dict:
    """name -> instruction lines of each computation in an HLO module's text."""
    comps, name = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            name = "ENTRY" if m.group(1) else m.group(2)
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None and "=" in line:
            comps[name].append(line.strip())
    return comps


def opcode(line: str) -> str:
    rhs = line.split("=", 1)[1].strip()
    m = re.search(r"\b([a-z][a-z\-]*)\(", rhs)
    op = m.group(1) if m else "?"
    if op == "custom-call":
        t = re.search(r'custom_call_target="([^"]+)"', line)
        op += f"[{t.group(1) if t else '?'}]"
    if op == "call" and "command_buffer" in line:
        op = "command_buffer"
    return op


def outside(hlo: str) -> dict:
    comps = computations(hlo)
    out = {"entry": collections.Counter(o for o in map(opcode, comps.get("ENTRY", [])) if o not in TRIVIAL)}
    for line in comps.get("ENTRY", []) + [l for c in comps.values() for l in c]:
        m = re.search(r"while\(.*body=%?([\w.\-]+)", line)
        if m and m.group(1) in comps and f"while:{m.group(1)}" not in out and len(out) < 8:
            out[f"while:{m.group(1)}"] = collections.Counter(
                o for o in map(opcode, comps[m.group(1)]) if o not in TRIVIAL)
    res = {k: dict(v.most_common(12)) for k, v in out.items()}
    res["custom_calls"] = dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo)))
    # the copies inside loop bodies, as written (one may be what keeps a loop on the host)
    res["copies_in_loops"] = [l[:400] for k in out if k.startswith("while:")
                              for l in comps[k[len("while:"):]] if opcode(l) == "copy"][:4]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    args = ap.parse_args()
    model = random_model(ModelConfig(**SMOLLM2, max_position=8192),
                         jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)
    rows = []
    for b in map(int, args.batches.split(",")):
        run = decode_steps(model, b, 256, 2048, 16, "auto")
        launch_ms, call_ms = launch_and_call_ms(run)
        [exe] = [e for k, e in run.programs.table.items() if k[0] == "decode"]
        rows.append(dict(batch=b, variant="engine", command_buffers=compile_options.COMMAND_BUFFERS,
                         launch_ms=launch_ms, call_ms=call_ms, outside=outside(exe.as_text())))
        print_table(rows[-1:], ["batch", "variant", "launch_ms", "call_ms"])
        print(rows[-1]["outside"])
    print_table(rows, ["batch", "variant", "launch_ms", "call_ms"])
    print(write_results("cmdbuf_probe", rows))


if __name__ == "__main__":
    main()
