"""How much of a token's time is the HTTP server's own? server.py's app over a Generator whose
target is tiny (SmolLM2's tokenizer and vocabulary, 2 layers of width 64, random weights: a step
costs little, so the server's per-token host work shows), against the same Generator driven
directly at the same concurrency. The server runs in this process (in a thread, as server.py
runs it); the load's clients run in a child process, so their GIL is not the server's. Rows:
concurrency, tokens/s through the server and through generate(), and their ratio.

    python bench/probes/server_overhead.py [--concurrency 1,8,32] [--requests 64] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

from common import print_table, write_results

CHATS = [[{"role": "user", "content": f"Question {i}: tell me something about the number {i}."}] for i in range(256)]


def clients(url, concurrency, requests, max_tokens):
    """The child process: closed-loop streamed chats; prints the summary row as JSON."""
    import serve
    print(json.dumps(serve.closed_loop(url, CHATS[:requests], concurrency, max_tokens)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tag", default="")
    ap.add_argument("--clients", nargs=4, metavar=("URL", "C", "N", "T"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.clients:
        url, c, n, t = args.clients
        return clients(url, int(c), int(n), int(t))
    from flax import nnx

    import server as srv
    from jaxspec import SamplingParams
    from jaxspec.generator import Generator
    from jaxspec.models import Llama
    from jaxspec.models.loading import load
    big, tok = load("smollm2-135m")
    cfg = dataclasses.replace(big.cfg, num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
                              num_kv_heads=2, head_dim=16)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    levels = list(map(int, args.concurrency.split(",")))
    gen = Generator(model, tok, max_batch=max(levels), max_seq_len=512, page_size=16, warmup=True)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    chats = CHATS[:args.requests]
    direct = {}
    for c in levels:  # before the server starts: its engine thread then owns the scheduler
        gen.generate(chats[:c], params)  # warm
        t0 = time.perf_counter()
        outs = [o for i in range(0, len(chats), c) for o in gen.generate(chats[i:i + c], params)]
        direct[c] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
    url, server, th = srv.start_in_thread(srv.create_app(gen, "tiny"))
    rows = []
    try:
        for c in levels:
            cmd = [sys.executable, __file__, "--clients", url, str(c), str(len(chats)), str(args.max_tokens)]
            subprocess.run(cmd, check=True, capture_output=True, timeout=600)  # warm
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
            res = json.loads(out.splitlines()[-1])
            rows.append(dict(concurrency=c, requests=len(chats), max_tokens=args.max_tokens,
                             server_tokens_per_s=res["tokens_per_s"], generate_tokens_per_s=direct[c],
                             server_vs_generate=res["tokens_per_s"] / direct[c], itl_p50_s=res["itl_p50_s"],
                             tpot_p50_s=res["tpot_p50_s"], ttft_p50_s=res["ttft_p50_s"]))
            print_table(rows[-1:], ["concurrency", "server_tokens_per_s", "generate_tokens_per_s", "server_vs_generate",
                                    "itl_p50_s", "tpot_p50_s"])
    finally:
        server.should_exit = True
        th.join(timeout=30)
    print(write_results("server_overhead" + args.tag, rows, {"target": "SmolLM2 vocabulary, 2 layers x 64, random"}))


if __name__ == "__main__":
    main()
