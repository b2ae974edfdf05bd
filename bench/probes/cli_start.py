"""The CLI's time to its first answer, from a cold and then a warm cache, under the auto tree policy
(AUTO's default given no tree numbers) and the fixed 6:4:24 tree: the cost of building auto's
program set (every shape at each batch bucket) at start-up. One process a run, each policy with
a compilation cache (and program store) of its own, empty before its cold run.

    python bench/probes/cli_start.py [--policies auto,fixed] [--max-tokens 16]
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
from common import print_table, write_results  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", default="auto,fixed")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    rows = []
    for policy in args.policies.split(","):
        cache = tempfile.mkdtemp(prefix="jaxspec-cli-")
        for start in ("cold", "warm"):
            cmd = [sys.executable, "-m", "jaxspec", "generate", "--prompt", "What is the capital of France?",
                   "--max-tokens", str(args.max_tokens), "--json", "--speculative-policy", policy]
            t0 = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                 env={**os.environ, "JAX_COMPILATION_CACHE_DIR": cache})
            secs = time.perf_counter() - t0
            if out.returncode:
                raise SystemExit(out.stderr[-2000:])
            reply = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(dict(policy=policy, start=start, seconds=round(secs, 2), text=reply["text"],
                             accept_length=reply["accept_length"]))
            print_table(rows[-1:], ["policy", "start", "seconds", "accept_length", "text"])
    print(write_results("cli_start", rows))


if __name__ == "__main__":
    main()
