"""The README's result tables, generated from bench/results/ (never typed by hand).

    python bench/tables.py            # print them
    python bench/tables.py --write    # replace each <!-- table:NAME --> ... <!-- /table --> block in README.md
"""
from __future__ import annotations

import argparse
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
DEVICE = "NVIDIA-H100-80GB-HBM3"


def _load(name):
    return json.load(open(os.path.join(RESULTS, f"{name}-{DEVICE}.json")))


def decode() -> str:
    d = _load("decode")
    rows = {(r["model"], r["batch"], r["engine"]): r for r in d["rows"]}
    out = [f"`decode-{DEVICE}.json`, commit {d['commit'][:7]}: `{d['command']}`", "",
           "| model | batch | jaxspec ms (floor ratio) | torch.compile ms (floor ratio) | jaxspec vs torch | kernels a step |",
           "| --- | --- | --- | --- | --- | --- |"]
    for (model, batch, engine), j in rows.items():
        t = rows.get((model, batch, "torch-compile"))
        if engine != "jaxspec" or t is None:
            continue
        out.append(f"| {model} | {batch} | {j['ms_per_step']:.2f} ({j['floor_ratio']:.3f}) | {t['ms_per_step']:.2f} "
                   f"({t['floor_ratio']:.3f}) | {j['vs_torch']:.2f}x | {int(j['kernels_per_step'])} |")
    return "\n".join(out)


def startup() -> str:
    d = _load("startup")
    out = [f"`startup-{DEVICE}.json`, commit {d['commit'][:7]}: `{d['command']}`", "",
           "| algorithm | cache | programs | warm-up s | process start to first token s |", "| --- | --- | --- | --- | --- |"]
    for r in d["rows"]:
        if "cache" in r and "run" not in r:
            out.append(f"| {r['algorithm']} | {r['cache']} | {r['programs']} | {r['warmup_s']:.1f} | {r['first_token_s']:.1f} |")
    mixed = [r for r in d["rows"] if r.get("workload") == "mixed"]
    out += ["", "Mixed workload after warm-up, run twice: " + "; ".join(
        f"{r['algorithm']} pass {r['passno']} {r['tokens_per_s']:.0f} tok/s with {r['compiles']} compiles" for r in mixed)
        + "."]
    return "\n".join(out)


def spec() -> str:
    d = _load("spec")
    out = [f"`spec-{DEVICE}.json`, commit {d['commit'][:7]}: `{d['command']}`", "",
           "| algorithm | batch | tok/s | vs plain (median of rounds) | accept length | vs torch.compile plain |",
           "| --- | --- | --- | --- | --- | --- |"]
    for r in d["rows"]:
        if r["config"] == "torch-compile":
            continue
        speed = f"{r['speedup']:.2f}x" if "speedup" in r else ""
        acc = f"{r['accept_length']:.2f}" if "accept_length" in r else ""
        out.append(f"| {r['config']} | {r['batch']} | {r['tokens_per_s']:.0f} | {speed} | {acc} | {r['vs_torch']:.2f}x |")
    return "\n".join(out)


TABLES = {"decode": decode, "startup": startup, "spec": spec}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    if not args.write:
        for name, fn in TABLES.items():
            print(f"## {name}\n{fn()}\n")
        return
    path = os.path.join(ROOT, "README.md")
    text = open(path).read()
    for name, fn in TABLES.items():
        text = re.sub(rf"(<!-- table:{name} -->\n).*?(<!-- /table -->)", lambda m: m.group(1) + fn() + "\n" + m.group(2),
                      text, flags=re.S)
    open(path, "w").write(text)


if __name__ == "__main__":
    main()
