"""The server under faults: a few thousand requests that mix well-formed ones with what a public
endpoint meets, against the real HTTP server on loopback.

    python bench/serve_faults.py [--requests 2000] [--algorithm AUTO] [--concurrency 64]

The kinds, drawn with fixed weights from a seeded generator: greedy chat completions (streamed or
not, over a small pool of prompts, so identical prompts run side by side and share cached
prefixes), n = 2, clients that disconnect after their first chunk, malformed JSON, wrong types,
prompts over the context limit, max_tokens over it, invalid sampling values, unknown model names,
stop lists past the limit, and bursts that overrun the queue. Every well-formed answer must carry
exactly the text an isolated request for its prompt got (each prompt run alone first), every bad
one a 4xx naming the problem, a burst's overflow a 503; afterwards the KV pages in use return to
their idle count and nothing is left running, and the server never went down (its
process start time, from /v1/models, must not change). A request that got no HTTP answer at all
(a keep-alive connection closed under it) counts as a transport error. One row: requests,
completed, rejected by cause, outputs_differed, pages_leaked, stuck, restarts, transport_errors.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx
import numpy as np

KINDS = {  # kind: weight
    "normal": 30, "stream": 20, "n2": 5, "disconnect": 8, "malformed_json": 5, "wrong_type": 5,
    "prompt_too_long": 4, "max_tokens_too_big": 4, "bad_sampling": 5, "unknown_model": 4, "huge_stop_list": 4,
    "burst": 6,
}
PROMPTS = ["What is the capital of France?", "Name three colours.", "Count to five.", "Say hello in Spanish.",
           "What is 2 + 2?", "Write a haiku about rain.", "Give me a synonym for happy.", "Spell the word cat."]


def metrics(client, url) -> dict:
    out = {}
    for line in client.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.split()
            out[k] = float(v)
    return out


def chat_body(prompt, max_tokens, **extra):
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0, **extra}


def streamed_text(client, url, body, disconnect=False):
    """(status, text of choice 0, error message) of a streamed chat completion; with disconnect,
    the client closes the connection after its first content chunk."""
    text = ""
    with client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=600) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, None, r.json()["error"]["message"]
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return 500, None, chunk["error"]["message"]
            text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
            if disconnect and text:
                return 0, text, None  # closing the stream here drops the connection
    return 200, text, None


def one(client, url, kind, prompt, max_tokens, max_seq_len):
    """(kind, status, texts or None, error message); status 0 for a client that left on purpose."""
    post = lambda body, **kw: client.post(url + "/v1/chat/completions", json=body, timeout=600, **kw)
    if kind in ("normal", "burst"):
        r = post(chat_body(prompt, max_tokens))
    elif kind == "stream":
        status, text, err = streamed_text(client, url, chat_body(prompt, max_tokens))
        return kind, status, None if text is None else [text], err
    elif kind == "disconnect":
        status, text, err = streamed_text(client, url, chat_body(prompt, max_tokens), disconnect=True)
        return kind, status, None, err
    elif kind == "n2":
        r = post(chat_body(prompt, max_tokens, n=2))
    elif kind == "malformed_json":
        r = client.post(url + "/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "hi"}',
                        headers={"content-type": "application/json"}, timeout=60)
    elif kind == "wrong_type":
        r = post({**chat_body(prompt, max_tokens), "max_tokens": "many"})
    elif kind == "prompt_too_long":
        r = post(chat_body("word " * (max_seq_len + 10), max_tokens))
    elif kind == "max_tokens_too_big":
        r = post(chat_body(prompt, max_seq_len + 1))
    elif kind == "bad_sampling":
        r = post({**chat_body(prompt, max_tokens), "temperature": -0.5, "top_p": 3})
    elif kind == "unknown_model":
        r = post({**chat_body(prompt, max_tokens), "model": "no-such-model"})
    elif kind == "huge_stop_list":
        r = post({**chat_body(prompt, max_tokens), "stop": [f"s{i}" for i in range(1000)]})
    else:
        raise ValueError(kind)
    body = r.json()
    if r.status_code != 200:
        return kind, r.status_code, None, body["error"]["message"]
    return kind, 200, [c["message"]["content"] for c in body["choices"]], None


EXPECTED = {"malformed_json": 400, "wrong_type": 400, "prompt_too_long": 400, "max_tokens_too_big": 400,
            "bad_sampling": 400, "unknown_model": 404, "huge_stop_list": 400}


def fault_run(url, requests=2000, concurrency=64, max_tokens=24, max_seq_len=2048, burst=128, seed=0) -> dict:
    """The run against a server already up at url (its queue limit small enough for a burst of
    `burst` requests to overrun it)."""
    client = httpx.Client(limits=httpx.Limits(max_connections=concurrency + burst + 8))
    idle = metrics(client, url)["jaxspec_kv_pages_in_use"]
    reference = {p: one(client, url, "normal", p, max_tokens, max_seq_len)[2][0] for p in PROMPTS}
    rng = np.random.default_rng(seed)
    names, weights = list(KINDS), np.array(list(KINDS.values()), float)
    kinds = [str(k) for k in rng.choice(names, requests, p=weights / weights.sum())]
    prompts = [PROMPTS[i] for i in rng.integers(0, len(PROMPTS), requests)]
    bursts = [i for i, k in enumerate(kinds) if k == "burst"]
    plain = [i for i, k in enumerate(kinds) if k != "burst"]
    results = [None] * requests
    started = client.get(url + "/v1/models", timeout=30).json()["data"][0]["created"]  # a new process: a new value

    def call(i):
        try:
            results[i] = one(client, url, kinds[i], prompts[i], max_tokens, max_seq_len)
        except httpx.TransportError as e:  # no HTTP answer (a reused keep-alive connection closed under it, ...)
            results[i] = (kinds[i], -1, None, repr(e))

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(call, i) for i in plain[:len(plain) // 2]]
        with concurrent.futures.ThreadPoolExecutor(burst) as wave:  # every burst request at once, mid-run
            list(wave.map(call, bursts))
        futures += [pool.submit(call, i) for i in plain[len(plain) // 2:]]
        for f in futures:
            f.result()
    wall = time.perf_counter() - t0
    for _ in range(300):  # aborted requests leave at their next step
        m = metrics(client, url)
        if m["jaxspec_kv_pages_in_use"] == idle and m["jaxspec_running_requests"] == 0:
            break
        time.sleep(0.1)
    rejected, differed, wrong_status, completed, transport = {}, {}, [], 0, []
    for (kind, status, texts, err), prompt in zip(results, prompts):
        if status == -1:
            transport.append((kind, err))
        elif status == 200:
            completed += 1
            if any(t != reference[prompt] for t in texts):
                differed[kind] = differed.get(kind, 0) + 1
        elif status == 0:
            rejected["disconnected"] = rejected.get("disconnected", 0) + 1
        else:
            cause = "queue_full" if status == 503 else kind
            rejected[cause] = rejected.get(cause, 0) + 1
            if status != EXPECTED.get(kind, 503) or not err:
                wrong_status.append((kind, status, err))
    m = metrics(client, url)
    alive = client.get(url + "/health", timeout=30).status_code == 200
    restarts = int(not alive or client.get(url + "/v1/models", timeout=30).json()["data"][0]["created"] != started)
    return dict(requests=requests, completed=completed, rejected=rejected, outputs_differed=sum(differed.values()),
                differed_by_kind=differed,
                wrong_status=len(wrong_status), wrong_status_examples=wrong_status[:5],
                pages_leaked=int(m["jaxspec_kv_pages_in_use"] - idle),
                stuck=int(m["jaxspec_running_requests"] + m["jaxspec_queue_depth"]), restarts=restarts,
                transport_errors=len(transport), transport_error_examples=transport[:3],
                wall_s=wall, late_compiles=int(m["jaxspec_late_compiles_total"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--algorithm", default="AUTO", help="as server.py's --speculative-algorithm")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--max-queued-requests", type=int, default=96, help="small, so that a burst overruns it")
    ap.add_argument("--burst", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--dtypes", default="default", help="a row each: default (bfloat16 on GPU), bfloat16, float32")
    args = ap.parse_args()
    import server as srv
    from common import print_table, write_results
    rows = []
    for dtype in args.dtypes.split(","):
        app, _ = srv.build_app(["--model", args.model, "--speculative-algorithm", args.algorithm,
                                "--max-running-requests", str(args.max_running_requests),
                                "--max-queued-requests", str(args.max_queued_requests),
                                "--context-length", str(args.max_seq_len), "--served-model-name", args.model]
                               + ([] if dtype == "default" else ["--dtype", dtype]))
        url, server, th = srv.start_in_thread(app)
        try:
            row = fault_run(url, args.requests, args.concurrency, args.max_tokens, args.max_seq_len, args.burst)
            rows.append(dict(algorithm=args.algorithm, dtype=dtype, **row))
        finally:
            server.should_exit = True
            th.join(timeout=30)
        del app
    print_table(rows, ["algorithm", "dtype", "requests", "completed", "rejected", "outputs_differed", "wrong_status",
                        "pages_leaked", "stuck", "restarts", "transport_errors", "wall_s"])
    print(write_results("serve_faults", rows))


if __name__ == "__main__":
    main()
