"""Does the host wait out a decode call? The engine's `decode` program loops on the device for up to
8 steps (a while loop whose trip count is a device value). XLA runs such a loop from the host:
it reads the loop's condition back every iteration, so the launch may not return before the
loop ends, and the host's work for the next call then runs while the GPU idles. Per XLA flag
setting (each its own process: flags are read when the backend starts), SmolLM2-shaped target,
random bf16 weights:

  launch_ms      host time until a decode call returns (8 steps a call)
  call_ms        a call's time to its outputs, calls chained as the engine chains them
  gen_tok_s      Generator tokens/s, batch 1 and 8, 64-token prompts, 128 new tokens (greedy)
  gen_ms_token   1000 / gen_tok_s * batch: the end-to-end time a decoding step costs

    python bench/probes/dispatch_probe.py [--variants default,while,unfused,prog-while,prog-while-unfused]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

WHILE = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"
# name: (XLA_FLAGS, compile_options.COMMAND_BUFFERS, one-row forwards through the fused layer kernels)
VARIANTS = {
    "default": ("", None, True),
    # the loop and the sampler's cond as CUDA graph conditional nodes: no host round trip a step
    "while": (f"--xla_gpu_enable_command_buffer={WHILE}", None, True),
    "while-min1": (f"--xla_gpu_enable_command_buffer={WHILE} --xla_gpu_graph_min_graph_size=1", None, True),
    "unfused": ("", None, False),
    "prog-while": ("", WHILE, True),  # the same as a compile option of each program
    "prog-while-unfused": ("", WHILE, False),
}


def launch_and_call_ms(run, reps=5):
    """(ms until one 8-step decode call returns, ms a call takes with calls chained), medians;
    run(n): n decode steps as decode.decode_steps issues them, 8 a call."""
    import jax
    import numpy as np
    launch, call = [], []
    for _ in range(reps):
        jax.block_until_ready(run(8))
        t0 = time.perf_counter()
        out = run(8)  # one call: returns when the host is free again
        launch.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        jax.block_until_ready(run(64))  # eight chained calls
        call.append((time.perf_counter() - t0) / 8)
    return 1e3 * float(np.median(launch)), 1e3 * float(np.median(call))


def child(variant, batches, out):
    import jax.numpy as jnp
    import numpy as np

    from common import SMOLLM2, one_row_layers, random_model
    from jaxspec import compile_options
    _, compile_options.COMMAND_BUFFERS, fused = VARIANTS[variant]
    one_row_layers("fused" if fused else "xla")  # (as 'auto' ran one-row forwards when these variants were made)

    from decode import decode_steps
    from jaxspec import Generator, SamplingParams
    from jaxspec.models import ModelConfig
    model = random_model(ModelConfig(**SMOLLM2, max_position=8192), jnp.bfloat16)
    rows = []
    for b in batches:
        launch_ms, call_ms = launch_and_call_ms(decode_steps(model, b, 256, 2048, 16, "auto"))
        # a program store of the variant's own: its entries' names do not see the probe's patches
        gen = Generator(model, None, max_batch=8, max_seq_len=2048, warmup=True,
                        compile_cache=os.path.join(tempfile.gettempdir(), f"dispatch-probe-{variant}"))
        rng = np.random.default_rng(0)
        prompts = [[int(t) for t in rng.integers(3, SMOLLM2["vocab_size"], 64)] for _ in range(b)]
        params = SamplingParams(max_tokens=128, ignore_eos=True)
        gen.generate(prompts, params)
        walls = []
        for _ in range(3):
            t0 = time.perf_counter()
            outs = gen.generate(prompts, params)
            walls.append(time.perf_counter() - t0)
        tokens = sum(len(o.token_ids) for o in outs)
        tok_s = tokens / float(np.median(walls))
        rows.append(dict(variant=variant, xla_flags=os.environ.get("XLA_FLAGS", ""),
                         command_buffers=compile_options.COMMAND_BUFFERS, fused_one_row=fused, batch=b,
                         launch_ms=launch_ms, call_ms=call_ms,
                         gen_tok_s=tok_s, gen_ms_token=1e3 * b / tok_s))
    json.dump(rows, open(out, "w"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="default,while")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--child", nargs=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        return child(args.child[0], batches, args.out)
    from common import print_table, write_results
    rows = []
    for v in args.variants.split(","):
        out = os.path.join(tempfile.mkdtemp(), "rows.json")
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + VARIANTS[v][0]).strip())
        r = subprocess.run([sys.executable, __file__, "--child", v, "x", "--out", out, "--batches", args.batches],
                           env=env)
        if r.returncode != 0:
            rows.append(dict(variant=v, error=f"exit {r.returncode}"))
            continue
        rows += json.load(open(out))
        print_table(rows[-len(batches):], ["variant", "batch", "launch_ms", "call_ms", "gen_tok_s", "gen_ms_token"])
    print()
    print_table(rows, ["variant", "batch", "launch_ms", "call_ms", "gen_tok_s", "gen_ms_token", "error"])
    print(write_results("dispatch_probe", rows))


if __name__ == "__main__":
    main()
