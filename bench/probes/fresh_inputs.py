"""Does a call's launch cost depend on whether its small inputs are new device buffers? The
engine's verify call took 2.7 ms of host time to launch at batch 1 on the H200 (host_probe-
NVIDIA-H200.json: stages.__call__), about as long as the device runs two steps; a program run as
command buffers (CUDA graphs) must update its recorded graph when an argument's address changes.

For the `decode` program (8 steps a call, SmolLM2-shaped target, random bf16 weights, context
256), host ms until a call returns, calls chained on the last one's outputs, with:

  same    the page table, stop ids and step count: the same device arrays every call (as
          bench/decode.py runs it)
  fresh   those three put on the device anew before every call (as the scheduler does)

each with the engine's command buffers and without (JAXSPEC_COMMAND_BUFFERS="", a child process).

    python bench/probes/fresh_inputs.py [--batches 1,8]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def child(batches):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from common import SMOLLM2, random_model
    from decode import paged_cache
    from jaxspec import compile_options
    from jaxspec.models import ModelConfig
    from jaxspec.programs import STOP_ID_SLOTS, Programs
    from jaxspec.sampling import SamplerFlags, SamplingBatch, SamplingParams

    model = random_model(ModelConfig(**SMOLLM2, max_position=8192), jnp.bfloat16)
    rows = []
    for b in batches:
        progs = Programs(model, attn_impl="auto")
        pages_per, width = 64, 128  # 256 + 40 calls x 8 tokens fit
        cache = paged_cache(model.cfg, b * pages_per + 1, 16, model.dtype)
        pt_np = np.zeros((b, width), np.int32)
        pt_np[:, :pages_per] = 1 + np.arange(b * pages_per).reshape(b, pages_per)
        flags = SamplerFlags.of([SamplingParams()])
        host = (pt_np, np.full((b, STOP_ID_SLOTS), -1, np.int32), np.int32(8))
        same = jax.device_put(host)
        for variant in ("same", "fresh", "same", "fresh"):
            carry = jax.device_put((np.ones((b, 1), np.int32), np.full(b, 256, np.int32), np.full(b, 10_000, np.int32),
                                    SamplingBatch.build([SamplingParams()] * b, [0] * b, [0] * b)))
            tok, kv, budget, sb = carry
            launch, last = [], None
            for _ in range(40):
                t0 = time.perf_counter()
                pt, stop_ids, num_steps = same if variant == "same" else jax.device_put(host)
                out = progs.decode(cache, tok, pt, kv, budget, stop_ids, num_steps, sb, flags=flags)
                launch.append(time.perf_counter() - t0)
                cache = out[-1]
                tok, kv, sb, budget = out[6]
                if last is not None:  # as the engine: call t + 1 launched, then call t's outputs read
                    jax.device_get(last)
                last = out[0]
            jax.block_until_ready(tok)
            rows.append(dict(batch=b, inputs=variant, command_buffers=compile_options.COMMAND_BUFFERS or "off",
                             launch_ms=1e3 * float(np.median(launch[8:]))))
            print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    if args.child:
        print("ROWS " + json.dumps(child(batches)))
        return
    from common import print_table, write_results
    rows = []
    for cb in (None, ""):
        env = dict(os.environ) if cb is None else dict(os.environ, JAXSPEC_COMMAND_BUFFERS=cb)
        out = subprocess.run([sys.executable, __file__, "--child", "--batches", args.batches], env=env,
                             capture_output=True, text=True)
        line = [l for l in out.stdout.splitlines() if l.startswith("ROWS ")]
        if not line:
            print(out.stdout[-2000:], out.stderr[-3000:])
            continue
        rows += json.loads(line[0][5:])
    print_table(rows, ["batch", "inputs", "command_buffers", "launch_ms"])
    print(write_results("fresh_inputs", rows))


if __name__ == "__main__":
    main()
