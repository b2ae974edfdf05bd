"""Does a chained call re-record its command buffer because its outputs land at new addresses?

XLA updates a program's recorded CUDA graph before a launch whenever an allocation its commands
use moved since the last launch (command_buffer_thunk.cc); bench/probes/launch_trace.py saw
`command_buffer::update` on every engine call (1.4 ms a call at batch 1, 2.8 at batch 8, H100).
A small program with a device-side loop (the engine's kind) is launched in chains, each call's
carry donated, in four ways:

  fresh      outputs are new buffers; the host reads call t after launching t + 1 (the engine)
  donated    the read-back outputs written into a donated buffer; the host reads call t before
             launching t + 1 (no overlap: the addresses cannot move)
  two-sets   two loaded copies of the program, each with its own donated read-back buffers, in
             turn: the host reads call t after launching t + 1 on the other copy
  two-fresh  two copies in turn, read-back outputs new buffers (does alternation alone help?)

Rows: host ms a launch takes to return, ms a call over the chain, and the command-buffer updates
seen in a profile of 40 more calls (a child process per way).

    python bench/probes/cmdbuf_update.py [--calls 200]
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

WAYS = ("fresh", "donated", "two-sets", "two-fresh")
COLS = ["way", "calls", "launch_ms", "call_ms", "updates_per_call", "updates_ms", "executes_ms", "graph_launch_ms"]


def child(way, calls, width, layers):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import serialize_executable

    from jaxspec.compile_options import loop_options

    ws = [jax.random.normal(jax.random.key(i), (width, width), jnp.bfloat16) / width ** 0.5 for i in range(layers)]
    steps = 4

    def loop(ws, x, n):
        def body(i, c):
            x, out = c
            for w in ws:
                x = jnp.tanh(x @ w)
            return x, out.at[i].set(x[:, :8].astype(jnp.float32))
        x, out = jax.lax.fori_loop(0, n, body, (x, jnp.zeros((steps,) + (x.shape[0], 8), jnp.float32)))
        for w in ws[:6]:  # commands beside the loop: XLA makes no command buffer of fewer than 5
            x = jnp.tanh(x @ w)
        return x, out

    if way in ("fresh", "two-fresh"):
        fn = jax.jit(lambda ws, x, n: loop(ws, x, n), donate_argnums=(1,), compiler_options=loop_options())
    else:
        def into(ws, x, n, out):
            x, o = loop(ws, x, n)
            return x, out.at[...].set(o)  # written into the donated buffer
        fn = jax.jit(into, donate_argnums=(1, 3), compiler_options=loop_options())
    x0 = jnp.ones((8, width), jnp.bfloat16)
    n = jnp.int32(steps)
    args = (ws, x0, n) + (() if way in ("fresh", "two-fresh") else (jnp.zeros((steps, 8, 8), jnp.float32),))
    compiled = fn.lower(*args).compile()
    copies = [compiled]
    if way.startswith("two"):
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        copies = [serialize_executable.deserialize_and_load(payload, in_tree, out_tree) for _ in range(2)]
    outs = [jnp.zeros((steps, 8, 8), jnp.float32) for _ in copies]
    x = jnp.ones((8, width), jnp.bfloat16)
    state = dict(x=x, pending=None, got=0.0)

    def chain(calls):
        launch = []
        x, pending, got = state["x"], state["pending"], state["got"]
        for i in range(calls):
            c = i % len(copies)
            t0 = time.perf_counter()
            if way in ("fresh", "two-fresh"):
                x, out = copies[c](ws, x, n)
            else:
                x, out = copies[c](ws, x, n, outs[c])
            launch.append(time.perf_counter() - t0)
            if way == "donated":
                got += float(np.asarray(out)[0, 0, 0])  # read before the next launch
                outs[c] = out
            else:
                if pending is not None:
                    got += float(np.asarray(pending[1])[0, 0, 0])  # read call t after launching t + 1
                    if way == "two-sets":
                        outs[pending[0]] = pending[1]
                pending = (c, out)
        state.update(x=x, pending=pending, got=got)
        jax.block_until_ready(x)
        return launch

    chain(20)
    t_start = time.perf_counter()
    launch = chain(calls)
    total = time.perf_counter() - t_start
    row = dict(way=way, calls=calls, launch_ms=1e3 * float(np.median(launch)), call_ms=1e3 * total / calls,
               checksum=state["got"])
    if jax.default_backend() == "gpu":  # the runtime's own events: updates and graph launches a call
        import tempfile

        from launch_trace import host_events
        log = tempfile.mkdtemp()
        jax.profiler.start_trace(log)
        chain(40)
        jax.profiler.stop_trace()
        ev = host_events(log)
        for key, name in (("updates", "command_buffer::update"), ("executes", "command_buffer::execute"),
                          ("initializes", "command_buffer::initialize")):
            hits = [d for nm, _, d in ev if nm == name]
            row[key + "_per_call"] = len(hits) / 40
            row[key + "_ms"] = sum(hits) / 1e3 / 40
        graph = [d for nm, _, d in ev if nm.startswith("cuGraphLaunch")]
        row["graph_launch_ms"] = sum(graph) / 1e3 / max(len(graph), 1)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--child", default=None)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.child:
        print("ROW " + json.dumps(child(args.child, args.calls, args.width, args.layers)), flush=True)
        return
    from common import print_table, write_results
    rows = []
    for way in WAYS:
        env = dict(os.environ)
        p = subprocess.run([sys.executable, __file__, "--child", way, "--calls", str(args.calls), "--width",
                            str(args.width), "--layers", str(args.layers)], env=env, capture_output=True, text=True)
        line = [l for l in p.stdout.splitlines() if l.startswith("ROW ")]
        if not line:
            print(p.stdout[-2000:], p.stderr[-4000:])
            continue
        row = json.loads(line[0][4:])
        rows.append(row)
        print_table(rows[-1:], COLS)
    print_table(rows, COLS)
    print(write_results("cmdbuf_update" + args.tag, rows))


if __name__ == "__main__":
    main()
