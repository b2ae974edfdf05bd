"""Drafter training runs side by side on one GPU, judged on held-out greedy answers.

    python bench/train_ablation.py --runs-dir runs/abl --minutes 7 \\
        --common "--kind eagle3 --data data/smollm2-135m-selfgen-seed0/data.npz --steps 6000 --ttt 6" \\
        --configs "3k=--train-sequences 3000;12k=--train-sequences 12000;48k="

Each config is `python -m jaxspec.train` with the common flags plus its own, in its own process
(all at once, or one after another with --sequential; at once, runs share the GPU's tokens/s rather
than add to it: train_ablation-corpus-*'s first leg, in git), stopped after --minutes and resumed by the
next call with the same --runs-dir. Rows: every held-out evaluation of every run (step, loss,
top-1 agreement per draft position, accept length from every position and walked as the engine
walks), with the run's training tokens/s. Writes bench/results/train_ablation<tag>-<device>.json
and a plot of walked accept length against training step.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, results_tag, write_results  # noqa: E402


def parse_configs(text: str) -> dict:
    configs = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, flags = part.partition("=")
        configs[name.strip()] = shlex.split(flags)
    return configs


def launch(name, flags, common, runs_dir, minutes, env):
    run = os.path.join(runs_dir, name)
    os.makedirs(run, exist_ok=True)
    cmd = [sys.executable, "-m", "jaxspec.train", *common, *flags, "--run", run, "--max-minutes", str(minutes),
           "--export", os.path.join(run, "head")]
    log = open(os.path.join(run, "log.txt"), "a")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def rows_of(name, flags, runs_dir):
    path = os.path.join(runs_dir, name, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    metrics = [json.loads(line) for line in open(path)]
    speeds = [r["tokens_per_s"] for r in metrics if r["split"] == "train" and "tokens_per_s" in r]
    speed = sorted(speeds)[len(speeds) // 2] if speeds else None
    evals = [r for r in metrics if r["split"] == "val"]
    card = os.path.join(runs_dir, name, "head", "card.json")
    if os.path.exists(card):  # the exported head on every held-out sequence (its held_out_* figures)
        c = json.load(open(card))
        evals.append(dict({k.removeprefix("held_out_"): v for k, v in c.items() if k.startswith("held_out_")},
                          step=c["steps"]))
    rows = [dict(config=name, flags=" ".join(flags), step=r["step"], held_out=r.get("sequences"),
                 loss=round(r["loss"], 4), acc1=r["acc"][0], acc_last=r["acc"][-1], accept_length=r.get("accept_length"),
                 walk_accept_length=r.get("walk_accept_length"), train_tokens_per_s=speed) for r in evals]
    return rows


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name and r["walk_accept_length"] is not None]
        if not mine:
            continue
        logged = [r for r in mine if r["held_out"] == min(r["held_out"] for r in mine)]  # the logged subset
        line, = ax.plot([r["step"] for r in logged], [r["walk_accept_length"] for r in logged], "o-", ms=3, label=name)
        final = [r for r in mine if r not in logged]  # the exported head on every held-out sequence
        ax.plot([r["step"] for r in final], [r["walk_accept_length"] for r in final], "*", ms=10, color=line.get_color())
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out accept length (greedy chain, walked)")
    ax.set_title("lines: logged held-out subset; stars: all held-out sequences", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs-dir", required=True)
    ap.add_argument("--common", default="", help="flags every run gets")
    ap.add_argument("--configs", required=True, help="name=flags;name=flags")
    ap.add_argument("--minutes", type=float, default=7.0, help="each run's --max-minutes this call")
    ap.add_argument("--sequential", action="store_true", help="one run after another (for clean tokens/s)")
    ap.add_argument("--tag", type=results_tag, default="")
    args = ap.parse_args()
    configs = parse_configs(args.configs)
    common = shlex.split(args.common)
    env = dict(os.environ)
    if not args.sequential:  # processes share the GPU: none may take most of its memory up front
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / len(configs):.2f}")
    t0 = time.time()
    if args.sequential:
        codes = [launch(n, f, common, args.runs_dir, args.minutes, env).wait() for n, f in configs.items()]
    else:
        procs = [launch(n, f, common, args.runs_dir, args.minutes, env) for n, f in configs.items()]
        codes = [p.wait() for p in procs]
    for (name, _), code in zip(configs.items(), codes):
        if code:
            tail = open(os.path.join(args.runs_dir, name, "log.txt")).read()[-2000:]
            print(f"run {name} exited {code}:\n{tail}")
    rows = [r for name, flags in configs.items() for r in rows_of(name, flags, args.runs_dir)]
    last = {}
    for r in rows:
        last[r["config"]] = r
    print_table(list(last.values()), ["config", "step", "held_out", "loss", "acc1", "acc_last", "accept_length",
                                      "walk_accept_length", "train_tokens_per_s"])
    print(f"{time.time() - t0:.0f} s")
    path = write_results(f"train_ablation{args.tag}", rows, extra=dict(common=args.common, concurrent=not args.sequential))
    plot(rows, path.replace(".json", ".png"))


if __name__ == "__main__":
    main()
