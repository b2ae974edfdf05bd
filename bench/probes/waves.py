"""What the EAGLE engine does where its batch's bucket gets no tree, beside the plain engine: the
calls of spec.py's batch-64 MT-bench row (80 prompts, 64 at a time: a wave of 64 and one of 16,
every pass repeating the same prompts) on a tiny random target and head (CPU). Per wave: steps,
prefill tokens (the prefix cache's share), verify calls, chained calls, and wall ms (host-bound
here: the device is the CPU and the model tiny).

    python bench/probes/waves.py [--passes 3] [--baseline REV]

--baseline REV also runs this probe on the engine of commit REV (a temporary git worktree) and
reports its rows beside this tree's, each row naming its engine's commit.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np
from flax import nnx

from common import print_table, write_results
from jaxspec import Generator, SamplingParams
from jaxspec.drafters.eagle import DraftHead, EagleDrafter, HeadConfig
from jaxspec.drafters.eagle_step import TreeShape
from jaxspec.models import ModelConfig
from jaxspec.models.llama import Llama

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, max_position=2048, eos_token_ids=(63,))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=3, help="passes over the prompts; the last one is reported")
    ap.add_argument("--baseline", help="a commit whose engine runs the same probe, reported beside")
    ap.add_argument("--rows-to", help=argparse.SUPPRESS)  # a baseline run's rows, as JSON
    args = ap.parse_args()
    model = Llama(TINY, rngs=nnx.Rngs(3))
    head = DraftHead(HeadConfig.for_target(TINY, "eagle3"), rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 62, int(rng.integers(40, 200))))) for _ in range(80)]
    max_tokens = rng.integers(20, 129, 80)  # the waves' requests end at different steps, as EOS makes them
    kw = dict(max_batch=64, max_seq_len=1024, page_size=16, warmup=True)
    gens = {"plain": Generator(model, None, **kw),
            "eagle3:6:4:24": Generator(model, None, drafter=EagleDrafter(head, TreeShape(6, 4, 24)), **kw)}
    rows = []
    for p in range(args.passes):
        for name, gen in gens.items():
            stats = gen.scheduler.stats
            for start in (0, 64):
                before, t0 = dict(stats), time.perf_counter()
                gen.generate(prompts[start:start + 64], [SamplingParams(max_tokens=int(m), ignore_eos=True)
                                                         for m in max_tokens[start:start + 64]])
                ms = 1e3 * (time.perf_counter() - t0)
                if p == args.passes - 1:
                    d = {k: stats[k] - before[k] for k in ("steps", "prefill_tokens", "verify_steps", "chained_steps",
                                                           "emitted")}
                    rows.append(dict(algorithm=name, wave=min(64, len(prompts) - start), ms=ms, **d))
    if args.rows_to:
        json.dump(rows, open(args.rows_to, "w"))
        return
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root).stdout.strip()
    rows = [dict(engine=head, **r) for r in rows]
    if args.baseline:
        with tempfile.TemporaryDirectory() as tmp:
            tree = os.path.join(tmp, "tree")
            subprocess.run(["git", "worktree", "add", "--detach", "-q", tree, args.baseline], cwd=root, check=True)
            try:
                out, probe = os.path.join(tmp, "rows.json"), os.path.join(tree, "bench", "probes", "waves.py")
                shutil.copy(os.path.abspath(__file__), probe)  # imports the engine beside it: the baseline's
                subprocess.run([sys.executable, probe, "--passes", str(args.passes), "--rows-to", out], cwd=tree,
                               check=True)
                rows = [dict(engine=args.baseline, **r) for r in json.load(open(out))] + rows
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=root)
    print_table(rows, list(rows[0]))
    write_results("waves", rows, {"model": "tiny random (CPU)"})


if __name__ == "__main__":
    main()
