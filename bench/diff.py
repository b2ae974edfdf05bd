"""Compare a results file with an earlier version of it (results files are overwritten; git keeps
their history). Rows are matched on their non-numeric fields; numeric fields print as old -> new
and their ratio.

    python bench/diff.py bench/results/spec-NVIDIA-H100-80GB-HBM3.json [--rev HEAD~1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


IDENTITY_NUMBERS = {"batch", "context", "draft_tokens", "t", "tokens_per_row", "kv_len", "rows", "passno"}


def _key(row):
    """The fields that name a row (what it measured), not what it measured."""
    return tuple(sorted((k, str(v)) for k, v in row.items() if k in IDENTITY_NUMBERS or isinstance(v, bool)
                        or not isinstance(v, (int, float, list, dict))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--rev", default=None, help="git revision of the older file (default: the last commit that changed it)")
    args = ap.parse_args()
    rel = os.path.relpath(os.path.abspath(args.path), ROOT)
    rev = args.rev
    if rev is None:
        log = subprocess.run(["git", "log", "--format=%H", "-2", "--", rel], cwd=ROOT, capture_output=True, text=True)
        revs = log.stdout.split()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", rel], cwd=ROOT).returncode != 0
        rev = revs[0] if dirty else (revs[1] if len(revs) > 1 else revs[0])
    old = json.loads(subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True, text=True,
                                    check=True).stdout)
    new = json.load(open(args.path))
    print(f"old: {rev[:9]} (commit {old.get('commit', '?')[:9]}, {old.get('date')})  new: commit "
          f"{new.get('commit', '?')[:9]}, {new.get('date')}")
    before = {_key(r): r for r in old["rows"]}
    for r in new["rows"]:
        o = before.get(_key(r))
        label = " ".join(v for _, v in _key(r))
        if o is None:
            print(f"{label}: new row")
            continue
        parts = []
        for k, v in r.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(o.get(k), (int, float)):
                ratio = f" ({v / o[k]:.2f}x)" if o[k] else ""
                parts.append(f"{k} {o[k]:.4g} -> {v:.4g}{ratio}")
        print(f"{label}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
