"""The README's result tables and bench/RESULTS.md, generated from bench/results/ (never typed).

    python bench/tables.py            # print the README's tables
    python bench/tables.py --write    # replace each <!-- table:NAME --> ... <!-- /table --> block in
                                      # README.md, and rewrite bench/RESULTS.md (every results file)
"""
from __future__ import annotations

import argparse
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
DEVICE = "NVIDIA-H100-80GB-HBM3"
H200 = "NVIDIA-H200"


def _load(name, device=DEVICE):
    return json.load(open(os.path.join(RESULTS, f"{name}-{device}.json")))


def _table(name, columns, device=DEVICE):
    """A results file and its table's first lines: where it came from, then the header."""
    d = _load(name, device)
    return d, [f"`{name}-{device}.json`, commit {d['commit'][:7]}: `{d['command']}`", "",
               "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]


def decode() -> str:
    # (no kernel count: under command buffers the profiler sees a few layers' kernels only)
    d, out = _table("decode-mlpnorm", ["model", "batch", "jaxspec ms (floor ratio)", "torch.compile ms (floor ratio)",
                               "jaxspec vs torch"], device="NVIDIA-H200")
    rows = {(r["model"], r["batch"], r["engine"]): r for r in d["rows"]}
    for (model, batch, engine), j in rows.items():
        t = rows.get((model, batch, "torch-compile"))
        if engine != "jaxspec" or t is None:
            continue
        out.append(f"| {model} | {batch} | {j['ms_per_step']:.2f} ({j['floor_ratio']:.3f}) | {t['ms_per_step']:.2f} "
                   f"({t['floor_ratio']:.3f}) | {j['vs_torch']:.2f}x |")
    return "\n".join(out)


def spec() -> str:
    d, out = _table("spec", ["dataset", "algorithm", "batch", "tok/s", "vs plain (median of rounds)", "accept length",
                             "vs torch.compile plain"])
    for r in d["rows"]:
        if r["config"] == "torch-compile":
            continue
        speed = f"{r['speedup']:.2f}x" if "speedup" in r else ""
        acc = f"{r['accept_length']:.2f}" if r.get("accept_length") else ""  # 0: the batch decoded plainly
        torch = f"{r['vs_torch']:.2f}x" if "vs_torch" in r else "not run"
        out.append(f"| {r['dataset']} | {r['config']} | {r['batch']} | {r['tokens_per_s']:.0f} | {speed} | {acc} | {torch} |")
    return "\n".join(out)


def _side_by_side(names, first: str, device: str = "NVIDIA-H200") -> str:
    """One row a configuration: vs plain (accept length) per dataset and batch, from one run a file."""
    runs = [_load(name, device) for name in names]
    cols = [(i, ds, b) for i, d in enumerate(runs)
            for ds, b in sorted({(r["dataset"], r["batch"]) for r in d["rows"]}, key=lambda c: (c[0] != "mt-bench", c[1]))]
    columns = [first] + [f"{ds} b{b}" for _, ds, b in cols]
    out = [f"`{name}-{device}.json`, commit {d['commit'][:7]}: `{d['command']}`" for name, d in zip(names, runs)]
    out = ["; ".join(out), "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for config in dict.fromkeys(r["config"] for d in runs for r in d["rows"]):
        if config == "plain":
            continue
        cells = []
        for i, ds, b in cols:
            r = next(r for r in runs[i]["rows"] if (r["config"], r["dataset"], r["batch"]) == (config, ds, b))
            acc = f"{r['accept_length']:.2f}" if r["accept_length"] else "decoded plainly"
            cells.append(f"{r['speedup']:.2f}x ({acc})")
        out.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def drafters() -> str:
    """The shipped DFLASH drafter (the auto policy over its shapes) beside EAGLE-3's default fixed tree, one run."""
    return _side_by_side(("spec-dflash-s90",), "drafter")


def policy() -> str:
    """Fixed trees beside the auto policy's choice among shapes, batch 1 to 64 (a run a dataset)."""
    return _side_by_side(("spec-s90-mt-bench", "spec-s90-humaneval"), "speculation")


def heads() -> str:
    """EAGLE-3 heads side by side in one run, per tree: the shipped one (no draft_model) and a candidate."""
    name, labels = "spec-wide-s91", {False: "stage 7 (shipped)", True: "stage 7 widened to 3,072 units"}
    d = _load(name, H200)
    rows = [r for r in d["rows"] if r["algorithm"] == "eagle3"]
    cols = sorted({(r["dataset"], r["batch"]) for r in rows}, key=lambda c: (c[0] != "mt-bench", c[1]))
    out = [f"`{name}-{H200}.json`, commit {d['commit'][:7]}: `{d['command']}`", "",
           "| head | tree | " + " | ".join(f"{ds} b{b}: vs plain (accept length)" for ds, b in cols) + " |",
           "|" + " --- |" * (len(cols) + 2)]
    for tree in dict.fromkeys(r["tree"] for r in rows):
        for candidate in (False, True):
            cells = [next(f"{r['speedup']:.2f}x ({r['accept_length']:.2f})" for r in rows if r["tree"] == tree
                          and (r["dataset"], r["batch"]) == c and bool(r.get("draft_model")) == candidate) for c in cols]
            out.append(f"| {labels[candidate]} | {tree} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def rollout() -> str:
    d, out = _table("rollout", ["engine", "algorithm", "batch", "tok/s", "vs the Generator's plain decoding"])
    for r in d["rows"]:
        vs = f"{r['vs_generator_plain']:.2f}x" if "vs_generator_plain" in r else ""
        out.append(f"| {r['engine']} | {r['algorithm']} | {r['batch']} | {r['tokens_per_s']:.0f} | {vs} |")
    return "\n".join(out)


TABLES = {"decode": decode, "spec": spec, "heads": heads, "drafters": drafters, "policy": policy,
          "rollout": rollout}


def _cell(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v).replace("|", "/")


def results_md(max_rows: int = 40, max_cols: int = 14) -> str:
    """Every results file: what ran (commit, date, command) and its rows' scalar fields."""
    out = ["# Results", "", "Generated by `python bench/tables.py --write` from `bench/results/` (one file per bench and "
           "device, overwritten by the next run; `python bench/diff.py FILE` compares a file with its last "
           "version in git, where the earlier runs are).", ""]
    for name in sorted(os.listdir(RESULTS)):
        path = os.path.join(RESULTS, name)
        if os.path.isdir(path):
            out += [f"## {name}/", "", f"A drafter's training record: see `bench/results/{name}/`.", ""]
            continue
        if not name.endswith(".json"):
            continue
        d = json.load(open(path))
        rows = d.get("rows", [])
        cols = []
        for r in rows:
            for k, v in r.items():
                if k not in cols and not isinstance(v, (list, dict)):
                    cols.append(k)
        cols = cols[:max_cols]
        out += [f"## {name[:-5]}", "", f"{d.get('device')}, {d.get('date')}, commit {str(d.get('commit'))[:40]}: "
                f"`{d.get('command')}`" + (f" (environment: {d['env']})" if d.get("env") else ""), ""]
        if cols:
            out += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
            out += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows[:max_rows]]
            if len(rows) > max_rows:
                out.append(f"\n({len(rows) - max_rows} more rows in the file)")
        out.append("")
    return "\n".join(out)


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
    open(os.path.join(ROOT, "bench", "RESULTS.md"), "w").write(results_md())


if __name__ == "__main__":
    main()
