"""Serving under load: the real HTTP server on loopback, streamed chat completions, per algorithm.

    python bench/serve.py [--model smollm2-135m] [--algos plain,eagle3:6:4:24,eagle3:6:4:24/auto/4096,ngram:8]
        [--datasets mt-bench,humaneval] [--concurrency 1,8,32,128] [--rates 4,16,64] [--max-tokens 256]

Closed loop: `c` clients, each sending its next request when the last one ends. Open loop:
Poisson arrivals at `r` requests/s (a seeded schedule, the same for every algorithm), whatever
the server's pace. Each request streams (SSE, with `stream_options` `include_usage` and vLLM's
`continuous_usage_stats`: every chunk carries the completion tokens so far): TTFT = first content
chunk after sending; ITL = the gaps between content chunks (vLLM's benchmark: a speculative step
can deliver several tokens in one, and a multi-step call of plain decoding up to 8); ITL-token =
each gap divided among the tokens its chunk brought (SGLang's bench_serving); TPOT = a request's
(latency - TTFT) / (tokens - 1). A row: output tokens/s and requests/s over the load's wall time,
TTFT / ITL / ITL-token / TPOT / latency p50 and p99. `--client-procs N` spreads the closed loop's
clients over N processes. One server per algorithm: server.py in its own process
with its defaults (the load's client threads hold this process's GIL, not the server's), its
programs built before the port opens; every load point warmed once untimed. `--rounds N`: all
servers up at once, each load point measured N times with the algorithms taking turns.
`--plot` draws throughput against p50 ITL (closed loop) and against p50 TTFT (open loop).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx
import numpy as np

import server as srv
from common import RESULTS, device_name, humaneval_prompts, mt_bench_prompts, print_table, results_tag, write_results


def stream_one(client, url, messages, max_tokens):
    """One streamed chat completion: (ttft, chunk gaps, per-token gaps, latency, completion tokens)."""
    t0 = time.perf_counter()
    times, counts, tokens = [], [], 0
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in chunk["choices"]):
                times.append(time.perf_counter())
                counts.append(tokens)
    end = time.perf_counter()
    # SGLang's bench_serving convention: a chunk's gap spread over the tokens it brought
    per_token = [g / (b - a) for g, a, b in zip(np.diff(times), counts, counts[1:]) for _ in range(max(b - a, 0))]
    return dict(ttft=(times[0] - t0) if times else end - t0, itl=list(np.diff(times)), itl_token=per_token,
                latency=end - t0, tokens=tokens, start=t0, end=end)


def summarize(results, wall):
    ttft = [r["ttft"] for r in results]
    itl = [g for r in results for g in r["itl"]] or [0.0]
    itl_token = [g for r in results for g in r["itl_token"]] or [0.0]
    lat = [r["latency"] for r in results]
    tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1] or [0.0]
    tokens = sum(r["tokens"] for r in results)
    pct = lambda xs, q: float(np.percentile(xs, q))
    return dict(requests=len(results), tokens=tokens, wall_s=wall, output_tokens_per_s=tokens / wall,
                requests_per_s=len(results) / wall, ttft_p50_s=pct(ttft, 50), ttft_p99_s=pct(ttft, 99),
                itl_p50_s=pct(itl, 50), itl_p99_s=pct(itl, 99), itl_token_p50_s=pct(itl_token, 50),
                itl_token_p99_s=pct(itl_token, 99), tpot_p50_s=pct(tpot, 50), tpot_p99_s=pct(tpot, 99),
                latency_p50_s=pct(lat, 50), latency_p99_s=pct(lat, 99))


def closed_loop(url, chats, concurrency, max_tokens, procs=1):
    """`concurrency` clients over all chats, each sending its next when the last one ended. procs > 1:
    the clients spread over that many processes (one process's GIL can cap the load it generates)."""
    results = (_clients_in_processes(url, chats, concurrency, max_tokens, procs) if procs > 1 else
               _clients(url, chats, concurrency, max_tokens))
    # perf_counter is CLOCK_MONOTONIC on Linux, one clock for all processes
    return summarize(results, max(r["end"] for r in results) - min(r["start"] for r in results))


def _clients(url, chats, concurrency, max_tokens):
    todo = iter(chats)
    lock = threading.Lock()
    results = []

    def client_loop():
        with httpx.Client() as client:
            while True:
                with lock:
                    msgs = next(todo, None)
                if msgs is None:
                    return
                res = stream_one(client, url, msgs, max_tokens)
                with lock:
                    results.append(res)

    with concurrent.futures.ThreadPoolExecutor(concurrency) as ex:
        for f in [ex.submit(client_loop) for _ in range(concurrency)]:
            f.result()
    return results


def _clients_in_processes(url, chats, concurrency, max_tokens, procs):
    """Process k runs every procs-th client and chat: the results of all."""
    import multiprocessing
    procs = min(procs, concurrency)
    shares = [(url, chats[k::procs], len(range(k, concurrency, procs)), max_tokens) for k in range(procs)]
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as ex:
        return [r for part in ex.map(_clients_star, shares) for r in part]


def _clients_star(share):
    return _clients(*share)


def open_loop(url, chats, rate, max_tokens, seed=0):
    """Poisson arrivals at `rate` requests/s: each chat is sent at its arrival time."""
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, len(chats)))
    client = httpx.Client(limits=httpx.Limits(max_connections=len(chats)))
    t0 = time.perf_counter()

    def at(i):
        time.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        return stream_one(client, url, chats[i], max_tokens)

    with concurrent.futures.ThreadPoolExecutor(len(chats)) as ex:
        results = list(ex.map(at, range(len(chats))))
    client.close()
    return summarize(results, time.perf_counter() - t0)


def algo_parts(algo):
    """(name, tree numbers, scheduler options) of a bench algorithm name: 'eagle3:6:4:24/auto/4096'
    is EAGLE-3 under the auto policy (the tree sizing the prefill's first draft) with a verify
    budget of 4096 nodes a step (--speculative-max-verify-tokens); '/delay0' adds
    --scheduler-delay-factor 0 (server.py's default is 2). 'default': server.py's own defaults (for SmolLM2 the shipped
    EAGLE-3 head under the auto policy), options after it too."""
    head, *opts = algo.split("/")
    kw = {}
    for o in opts:
        if o == "auto":
            kw["spec_policy"] = "auto"
        elif o.isdigit():
            kw["spec_max_verify_tokens"] = int(o)
        elif o.startswith("delay"):
            kw["scheduler_delay_factor"] = float(o[len("delay"):])
        else:
            raise SystemExit(f"unknown option {o!r} in algorithm {algo!r} (auto, a verify budget, or delayF)")
    if head == "default":
        return "eagle3", ["6", "4", "24"], {"spec_policy": "auto", **kw}
    name, *nums = head.split(":")
    return name, nums, kw


def spec_of(algo):
    from jaxspec import SpecConfig
    name, nums, _ = algo_parts(algo)
    if name == "plain":
        return None
    if name == "ngram":
        return SpecConfig("NGRAM", num_draft_tokens=int(nums[0]) if nums else 8)
    return SpecConfig(name.upper(), num_steps=int(nums[0]), eagle_topk=int(nums[1]), num_draft_tokens=int(nums[2]))


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, load, lat in ((axes[0], "closed", "itl_p50_s"), (axes[1], "open", "ttft_p50_s")):
        for (algo, ds) in dict.fromkeys((r["algorithm"], r["dataset"]) for r in rows):
            pts = [r for r in rows if (r["algorithm"], r["dataset"], r["load"]) == (algo, ds, load)]
            if pts:
                ax.plot([1e3 * r[lat] for r in pts], [r["output_tokens_per_s"] for r in pts], "o-", label=f"{algo} {ds}")
        ax.set_xlabel(f"{lat[:-6].upper()} p50 (ms)")
        ax.set_ylabel("output tokens/s")
        ax.set_title("closed loop (concurrency sweep)" if load == "closed" else "open loop (Poisson rates)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def server_flags(algo) -> list:
    """server.py's flags for a bench algorithm name."""
    name, nums, kw = algo_parts(algo)
    if algo.split("/")[0] == "default":
        kw.pop("spec_policy")  # (the server's own)
        chosen = []
    elif name == "plain":
        chosen = ["--speculative-algorithm", "NONE"]
    elif name == "ngram":
        chosen = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", nums[0] if nums else "8"]
    else:
        chosen = ["--speculative-algorithm", name.upper(), "--speculative-num-steps", nums[0],
                  "--speculative-eagle-topk", nums[1], "--speculative-num-draft-tokens", nums[2]]
    opts = {"spec_policy": "--speculative-policy", "spec_max_verify_tokens": "--speculative-max-verify-tokens",
            "scheduler_delay_factor": "--scheduler-delay-factor"}
    return chosen + [x for k, v in kw.items() for x in (opts[k], str(v))]


@contextlib.contextmanager
def server_process(model, algo, max_running, log_path, start_timeout=900, extra_args=()):
    """server.py in a process of its own (its GIL not shared with the load's client threads) on a
    free loopback port; yields its url once /health answers (its programs are built before the
    port opens), and stops it after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, os.path.join(repo, "server.py"), "--model", model,
           "--port", str(port), "--max-running-requests", str(max_running), "--context-length", "1024",
           *server_flags(algo), *extra_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            t0 = time.perf_counter()
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server.py exited with {proc.returncode}; see {log_path}")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > start_timeout:
                    raise RuntimeError(f"server.py did not answer in {start_timeout} s; see {log_path}")
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def run(serve, algos, datasets, concurrency, rates, max_tokens, requests, client_procs=1, served=None, rounds=1):
    """Rows for every (algorithm, dataset, load point, round); serve(algo) is a context manager
    yielding that algorithm's server's url. With rounds > 1 every algorithm's server is up at once
    and each load point is measured algorithm after algorithm, round after round: the ratios come
    from measurements taken side by side (plain's own tok/s at concurrency 128 moved 20-27k between
    runs of the same server: serve-diag-, serve-delay-, serve-plaindelay-). served(rows) is called
    after each load point: a run cut short keeps what it finished."""
    rows = []
    points = [(ds, kind, p) for ds in datasets for kind, ps in (("closed", concurrency), ("open", rates)) for p in ps]

    def measure(algo, url, ds, kind, p, rnd):
        chats = datasets[ds]
        n = max(requests, 2 * p) if kind == "closed" else requests
        batch = [chats[i % len(chats)] for i in range(n)]
        load = (lambda b: closed_loop(url, b, p, max_tokens, client_procs)) if kind == "closed" else (
            lambda b: open_loop(url, b, p, max_tokens))
        load(batch[:min(len(batch), max(p, 4))] if kind == "closed" else batch[:4])  # warm this shape
        before = server_state(url)
        row = load(batch)
        after = server_state(url)
        rows.append(dict(algorithm=algo, dataset=ds, load=kind, client_procs=client_procs,
                         **({"concurrency": p} if kind == "closed" else {"rate": p}),
                         **({"round": rnd} if rounds > 1 else {}), **row, **growth(before, after)))
        print_table(rows[-1:], ["algorithm", "dataset", "load", "concurrency", "rate", "output_tokens_per_s",
                                "ttft_p50_s", "itl_p50_s", "itl_token_p50_s", "tpot_p50_s"])

    # one server at a time, or (rounds > 1) all of them at once, taking turns
    for group in ([algo] for algo in algos) if rounds == 1 else [algos]:
        with contextlib.ExitStack() as stack:
            urls = {algo: stack.enter_context(serve(algo)) for algo in group}
            for point in points:
                for rnd in range(rounds):
                    for algo in group:
                        measure(algo, urls[algo], *point, rnd)
                if served is not None:
                    served(rows)
    return rows


COUNTERS = ("late_compiles", "preemptions", "verify_steps")


def server_state(url) -> dict:
    """The server's /server_info: /metrics' counters, the scheduler's step counters and the
    speculation policy's state."""
    return httpx.get(url + "/server_info", timeout=30).json()


def growth(before: dict, after: dict) -> dict:
    """A load point's share of the server's counters: COUNTERS (compiles a request waited for and
    preemptions are stalls its latencies include); `scheduler`, its step counters and seconds;
    `chosen`, the speculation policy's calls per batch bucket and shape, `recent_ms`, the ms a step
    it saw lately per bucket and shape (p50, p90, max), and `launch`, what a call not chained adds per
    bucket and the share of such calls; the KV pool's pages."""
    out = {k: after[k] - before[k] for k in COUNTERS}
    out["kv_pages_total"] = after["kv_pages_total"]  # (a pool too small for the load preempts)
    out["scheduler"] = {k: round(v - before["scheduler"].get(k, 0), 4) for k, v in after["scheduler"].items()}
    if after.get("spec_policy"):
        was = (before.get("spec_policy") or {}).get("chosen", {})
        chosen = {r: {k: n - was.get(r, {}).get(k, 0) for k, n in d.items()} for r, d in after["spec_policy"]["chosen"].items()}
        out["chosen"] = {r: {k: n for k, n in d.items() if n} for r, d in chosen.items() if any(d.values())}
        out["recent_ms"] = after["spec_policy"]["recent_ms"]
        out["launch"] = after["spec_policy"].get("launch", {})  # per bucket: ms a call not chained adds, their share
    return out


@contextlib.contextmanager
def in_thread(gen):
    """The app over gen on a loopback port in this process (tests: no second process to start)."""
    url, server, th = srv.start_in_thread(srv.create_app(gen, "bench"))
    try:
        yield url
    finally:
        server.should_exit = True
        th.join(timeout=30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--algos", default="plain,eagle3:6:4:24,ngram:8")
    ap.add_argument("--datasets", default="mt-bench,humaneval")
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--rates", default="4,16,64", help="open-loop request rates (requests/s)")
    ap.add_argument("--requests", type=int, default=128, help="requests a load point (closed loop: at least 2x clients)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--client-procs", type=int, default=1,
                    help="processes the closed loop's clients spread over (each process's GIL caps its clients)")
    ap.add_argument("--server-args", default="", help="more server.py flags, for every server of the run")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure each load point this many times, the algorithms' servers up at once and taking "
                         "turns (ratios side by side); each server's KV pool then takes 0.8 / algorithms of the "
                         "memory free as it starts, unless --server-args sets --mem-fraction-static")
    ap.add_argument("--tag", type=results_tag, default="")
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--in-process", action="store_true",
                    help="serve from a thread of this process, as before 0b426f6 (its GIL shared with the clients' "
                         "threads: at concurrency 32-128 both algorithms flattened near 6k tok/s, serve-NVIDIA-H100-*"
                         ".json at ffda8ed), rather than from server.py in a process of its own with its defaults")
    args = ap.parse_args()
    conc = [int(x) for x in args.concurrency.split(",") if x]
    rates = [float(x) for x in args.rates.split(",") if x]
    datasets = {}
    for ds in args.datasets.split(","):
        qs = mt_bench_prompts() if ds == "mt-bench" else humaneval_prompts()
        datasets[ds] = [q if isinstance(q, list) else [{"role": "user", "content": q}] for q in qs]

    if args.in_process:
        from jaxspec import Generator
        from jaxspec.models.loading import load
        model, tok = load(args.model)

        def serve(algo):
            spec = spec_of(algo)
            drafter = spec.build(model, "smollm2-135m" if "smol" in args.model.lower() else args.model) if spec else None
            return in_thread(Generator(model, tok, drafter=drafter, max_batch=max(conc), max_seq_len=1024,
                                       num_pages=None, warmup=True, **algo_parts(algo)[2]))
    else:
        # the results name the device, which starts a JAX client here: a small one, the same for
        # every server after it (each sizes its KV pool from the memory it finds free)
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        device_name()

        extra = args.server_args.split()
        if args.rounds > 1 and "--mem-fraction-static" not in extra:  # the servers share the GPU
            extra += ["--mem-fraction-static", f"{0.8 / len(args.algos.split(',')):.3f}"]

        def serve(algo):
            log = os.path.join(tempfile.gettempdir(), f"jaxspec-serve-{algo.replace(':', '_').replace('/', '_')}.log")
            return server_process(args.model, algo, max(conc), log, extra_args=extra)

    meta = {"max_tokens": args.max_tokens, "server_args": args.server_args, "rounds": args.rounds}
    rows = run(serve, args.algos.split(","), datasets, conc, rates, args.max_tokens, args.requests, args.client_procs,
               served=lambda rows: write_results("serve" + args.tag, rows, meta), rounds=args.rounds)
    print()
    print_table(rows, ["algorithm", "dataset", "load", "concurrency", "rate", "round", "output_tokens_per_s", "requests_per_s",
                       "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_token_p50_s", "itl_token_p99_s", "tpot_p50_s"])
    print()
    print_table(vs_plain(rows), ["algorithm", "dataset", "load", "concurrency", "rate", "round", "vs_plain",
                                 "ttft_p50_vs_plain", "preemptions", "kv_pages_total"])
    if args.plot:
        print(plot(rows, os.path.join(RESULTS, f"serve{args.tag}-{device_name()}.png")))
    print(write_results("serve" + args.tag, rows, meta))


def vs_plain(rows) -> list:
    """Each non-plain row's output tok/s and TTFT p50 over plain's at the same load point and round
    (of this run: ratios are taken side by side)."""
    point = lambda r: (r["dataset"], r["load"], r.get("concurrency"), r.get("rate"), r.get("round"))
    plain = {point(r): r for r in rows if r["algorithm"] == "plain"}
    return [dict(r, vs_plain=r["output_tokens_per_s"] / p["output_tokens_per_s"],
                 ttft_p50_vs_plain=r["ttft_p50_s"] / p["ttft_p50_s"])
            for r in rows if r["algorithm"] != "plain" and (p := plain.get(point(r)))]


if __name__ == "__main__":
    main()
