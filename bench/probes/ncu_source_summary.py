"""Sums bench/ncu_source.sh's per-instruction stall samples (Nsight Compute's source page, SASS)
into where the warps of the Mosaic verify kernel spend their time: by instruction family, for all
warps and for the consumers' main loop (the instructions run as often as its wgmma), and the
busiest instructions. Writes bench/results/ncu_source-<tag>-<device>.json.

    python bench/ncu_source_summary.py ncu_source.csv --tag=pers --commit=<sha> [--device=...]
"""
from __future__ import annotations

import collections
import csv
import datetime
import json
import os
import sys

FAMILIES = [  # (family, opcode prefixes): the first that matches
    ("wait for own wgmma (WARPGROUP.DEPBAR)", ("WARPGROUP.DEPBAR",)),
    ("wgmma issue (HGMMA, WARPGROUP.ARRIVE)", ("HGMMA", "WARPGROUP.ARRIVE")),
    ("mbarrier wait (SYNCS.PHASECHK and its retry branch)", ("SYNCS.PHASECHK", "BRA")),
    ("mbarrier arrive", ("SYNCS.ARRIVE",)),
    ("TMA issue (UTMALDG, UTMASTG)", ("UTMALDG", "UTMASTG", "UTMACMDFLUSH")),
    ("exp2 (MUFU)", ("MUFU",)),
    ("row max (FMNMX)", ("FMNMX",)),
    ("float add/mul/fma", ("FADD", "FMUL", "FFMA")),
    ("shuffles", ("SHFL",)),
    ("bf16 packing (F2FP)", ("F2FP",)),
]


def num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def family(sass: str) -> str:
    op = sass.split()
    op = op[1] if op and op[0].startswith("@") and len(op) > 1 else (op[0] if op else "")
    return next((name for name, prefixes in FAMILIES if op.startswith(prefixes)), "other")


def main():
    path = sys.argv[1]
    args = dict(a[2:].split("=", 1) for a in sys.argv[2:] if a.startswith("--") and "=" in a)
    rows = list(csv.reader(open(path)))
    hdr, data = rows[1], rows[2:]
    ix = {h: i for i, h in enumerate(hdr)}
    samples, executed = ix["Warp Stall Sampling (All Samples)"], ix["Instructions Executed"]
    total = sum(num(r[samples]) for r in data)
    loop_count = max(num(r[executed]) for r in data if "HGMMA" in r[1])

    def shares(rs):
        fam = collections.Counter()
        for r in rs:
            fam[family(r[1])] += num(r[samples])
        return {k: round(100 * v / total, 1) for k, v in fam.most_common()}

    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    by_reason = {s: round(100 * sum(num(r[ix[s]]) for r in data) / total, 1) for s in stalls}
    top = sorted(data, key=lambda r: -num(r[samples]))[:20]
    out = {"bench": f"ncu_source-{args.get('tag', '')}", "device": args.get("device", "NVIDIA-H100-80GB-HBM3"),
           "date": datetime.date.today().isoformat(), "commit": args.get("commit", "unknown"),
           "command": "bash bench/ncu_source.sh; python bench/ncu_source_summary.py " + " ".join(sys.argv[1:]),
           "samples": total, "instructions": len(data),
           "percent_of_all_samples_by_family": shares(data),
           "consumer_main_loop": {"executions": loop_count,
                                  "percent_of_all_samples_by_family":
                                      shares([r for r in data if num(r[executed]) == loop_count])},
           "percent_by_stall_reason": dict(sorted(by_reason.items(), key=lambda kv: -kv[1])),
           "top_instructions": [dict(sass=r[1].strip(), percent=round(100 * num(r[samples]) / total, 2),
                                     executed=num(r[executed])) for r in top]}
    for k in ("percent_of_all_samples_by_family", "consumer_main_loop", "percent_by_stall_reason"):
        print(k, out[k])
    dest = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                        f"{out['bench']}-{out['device']}.json")
    json.dump(out, open(dest, "w"), indent=1)
    print(dest)


if __name__ == "__main__":
    main()
