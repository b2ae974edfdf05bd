"""Where a speculative step's device time goes, by source: the rollout's loop (jaxspec.rollout:
the engine's fused EAGLE-3 verify step in a lax.while_loop, no host in the way) beside the plain
loop, SmolLM2-shaped target and EAGLE-3 head with random bf16 weights, at several batch sizes.

Each row: ms a step (wall time of the whole rollout / its steps; the tree forced at every batch),
then a profile without command buffers (JAXSPEC_COMMAND_BUFFERS="" in a child process, so that
each kernel is seen) whose kernels are attributed to the jaxspec function that emitted their HLO
op (the optimized HLO's metadata: source file and line -> the enclosing function).

    python bench/probes/step_profile.py [--batches 1,8,32] [--algos none,eagle3:6:4:24] [--attn-impls auto,pallas]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def hlo_sources(hlo_text: str, depth: int = 3) -> dict:
    """{instruction name: 'f > g > h'}: the Python call stack that made each op of an optimized HLO
    module (its stack-frame tables), from the loop body's callee down, `depth` frames deep."""
    sec, funcs, locs, frames, out = None, {}, {}, {}, {}
    lines = hlo_text.splitlines()
    for line in lines:
        if line in _SECTIONS:
            sec = line
            continue
        if sec and not line.strip():
            sec = None
        elif sec == "FunctionNames":
            i, name = line.split(" ", 1)
            funcs[int(i)] = name.strip('"')
        elif sec in ("FileLocations", "StackFrames"):
            (locs if sec == "FileLocations" else frames)[int(line.split()[0])] = dict(
                (k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", line))

    def chain(i):
        names, seen = [], set()
        while i and i in frames and i not in seen:  # the printed parent id is the parent's label + 1
            seen.add(i)
            names.append(funcs.get(locs[frames[i]["file_location_id"]]["function_name_id"], "?"))
            i = frames[i]["parent_frame_id"] - 1
        names = names[::-1]
        body = [j for j, n in enumerate(names) if n.endswith("<locals>.body")]
        return " > ".join(names[body[0] + 1 if body else 0:][:depth]) or "(loop)"

    for line in lines:
        m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*stack_frame_id=(\d+)", line)
        if m:
            out[m.group(1)] = chain(int(m.group(2)))
    return out


def attribute(events, sources: dict, steps: int):
    """Kernel µs a step and kernels a step by source, the kernels one by one (name, source, µs and
    launches a step), and a few unattributed kernels' profile args. XLA names a fusion's kernel
    after its instruction ('.' -> '_'); other kernels (cuBLAS, Pallas) carry it as the `hlo_op` arg."""
    norm = {k.replace(".", "_").replace("-", "_"): v for k, v in sources.items()}
    by, kernels, odd = {}, {}, []
    for e in events:
        args = e.get("args") or {}
        src = norm.get(e["name"]) or sources.get(args.get("hlo_op", "")) or norm.get(
            str(args.get("hlo_op", "")).replace(".", "_").replace("-", "_"))
        if src is None:
            src = "?"
            if len(odd) < 6:
                odd.append({k: str(v)[:80] for k, v in args.items() if k in ("hlo_op", "hlo_module", "tf_op")})
        t, c = by.get(src, (0.0, 0))
        by[src] = (t + e["dur"], c + 1)
        t, c = kernels.get((e["name"][:70], src), (0.0, 0))
        kernels[(e["name"][:70], src)] = (t + e["dur"], c + 1)
    rows = sorted(((k, t / steps, c / steps) for k, (t, c) in by.items()), key=lambda r: -r[1])
    each = sorted(((n, s, t / steps, c / steps) for (n, s), (t, c) in kernels.items()), key=lambda r: -r[2])
    return rows, each, odd


def child(args):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from common import gpu_kernels, smollm2_and_head, trace_events
    from jaxspec.rollout import jit_rollout

    cfg, model, head = smollm2_and_head()
    rows = []
    for b in map(int, args.batches.split(",")):
        rng = np.random.default_rng(b)
        prompts = jnp.asarray(rng.integers(100, cfg.vocab_size, (b, args.context)), jnp.int32)
        lengths = jnp.full((b,), args.context, jnp.int32)
        seeds = jnp.arange(b, dtype=jnp.uint32)
        stop = jnp.full((b, 1), -1, jnp.int32)  # random weights: no row stops before max_new_tokens
        for algo, impl in [(a, i) for a in args.algos.split(",") for i in args.attn_impls.split(",")
                           if a != "none" or i == args.attn_impls.split(",")[0]]:
            name, *tree = algo.split(":")
            conf = dict(algorithm=name, max_new_tokens=args.max_tokens, max_verify_tokens=None, attn_impl=impl)
            if tree:
                conf.update(zip(("num_steps", "topk", "num_draft_tokens"), map(int, tree)))
            fn, params, dparams = jit_rollout(model, head if name == "eagle3" else None, **conf)
            call = lambda: fn(params, dparams, prompts, lengths, seeds, stop_ids=stop)
            out = jax.block_until_ready(call())
            secs = []
            for _ in range(3):
                t0 = time.perf_counter()
                out = jax.block_until_ready(call())
                secs.append(time.perf_counter() - t0)
            n_steps = int(np.asarray(out.steps).max())
            row = dict(algorithm=algo, attn_impl=impl, batch=b,
                       context=args.context,
                       command_buffers=os.environ.get("JAXSPEC_COMMAND_BUFFERS", "engine"),
                       steps=n_steps, ms_per_step=float(np.median(secs)) / n_steps * 1e3)
            if args.profile and jax.default_backend() == "gpu":
                import jax.profiler
                text = fn.lower(params, dparams, prompts, lengths, seeds, stop_ids=stop).compile().as_text()
                sources = hlo_sources(text)
                if os.environ.get("STEP_PROFILE_HLO_DIR"):  # the optimized HLO beside the rows, to read later
                    with gzip.open(os.path.join(os.environ["STEP_PROFILE_HLO_DIR"], f"{name}-{impl}-b{b}.hlo.gz"), "wt") as f:
                        f.write(text)
                log = tempfile.mkdtemp()
                jax.profiler.start_trace(log)
                jax.block_until_ready(call())
                jax.profiler.stop_trace()
                ev = gpu_kernels(*trace_events(log))
                by, each, odd = attribute(ev, sources, n_steps)
                row.update(kernel_ms=sum(e["dur"] for e in ev) / n_steps / 1e3, kernels=len(ev) / n_steps,
                           by_source=[(k, round(t, 2), round(c, 2)) for k, t, c in by],
                           kernels_each=[(n, s, round(t, 2), round(c, 2)) for n, s, t, c in each[:200]],
                           unattributed_args=odd)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kernels_each"}), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--profile", action="store_true", help="(child) profile each row")
    ap.add_argument("--child-out", default=None)
    ap.add_argument("--only-profile", action="store_true", help="skip the run with the engine's command buffers")
    ap.add_argument("--timing-only", action="store_true", help="skip the profile (the run without command buffers)")
    ap.add_argument("--algos", default="none,eagle3:6:4:24")
    ap.add_argument("--attn-impls", default="auto", help="e.g. auto,pallas: the verify's Mosaic kernel against Triton's")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.child_out:
        json.dump(child(args), open(args.child_out, "w"))
        return
    from common import print_table, write_results
    rows = []
    passes = (("engine", False), ("", True))
    for cb, profile in passes[1:] if args.only_profile else passes[:1] if args.timing_only else passes:
        out = os.path.join(tempfile.mkdtemp(), "rows.json")
        env = dict(os.environ)
        if cb != "engine":
            env["JAXSPEC_COMMAND_BUFFERS"] = cb
        cmd = [sys.executable, __file__, "--batches", args.batches, "--context",
               str(args.context), "--max-tokens", str(args.max_tokens), "--algos", args.algos, "--child-out", out,
               "--attn-impls", args.attn_impls]
        cmd += ["--profile"] if profile else []
        subprocess.run(cmd, check=True, env=env)
        rows += json.load(open(out))
    print_table(rows, ["algorithm", "attn_impl", "batch", "command_buffers", "steps", "ms_per_step", "kernel_ms", "kernels"])
    for r in rows:
        if r.get("by_source"):
            print(f"\n{r['algorithm']} batch {r['batch']}: kernel µs a step by source (kernels a step)")
            for k, t, c in r["by_source"][:16]:
                print(f"  {t:9.1f}  {c:6.1f}  {k}")
            if r["unattributed_args"]:
                print("  unattributed:", r["unattributed_args"][:3])
    print(write_results("step_profile" + args.tag, rows))


if __name__ == "__main__":
    main()
