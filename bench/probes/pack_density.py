"""How much of a training batch is text: the committed corpora one sequence a row, and packed into
rows of 384 / 768 / 1024 tokens (train_data.pack_rows, as `python -m jaxspec.train --pack-len`).

    python bench/probes/pack_density.py [--corpora data/smollm2-135m-selfgen-seed0/data.npz,...]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

import numpy as np  # noqa: E402

from common import print_table, write_results  # noqa: E402
from jaxspec.train_data import pack_rows  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpora", default="data/smollm2-135m-selfgen-seed0/data.npz,data/smollm2-135m-selfgen-seed2/data.npz")
    ap.add_argument("--pack-lens", default="384,768,1024")
    args = ap.parse_args()
    rows = []
    for path in args.corpora.split(","):
        d = np.load(path)
        tokens, lengths, starts = d["tokens"], d["lengths"], d["prompt_lengths"]
        name = os.path.basename(os.path.dirname(path))
        rows.append(dict(corpus=name, pack_len=0, rows=len(lengths), text_share=round(float(lengths.sum()) / tokens.size, 3),
                         rows_vs_unpacked=1.0))
        for n in map(int, args.pack_lens.split(",")):
            segments = pack_rows(tokens, lengths, starts, n)[1]
            rows.append(dict(corpus=name, pack_len=n, rows=len(segments),
                             text_share=round(float((segments > 0).mean()), 3),
                             rows_vs_unpacked=round(segments.size / tokens.size, 3)))
    print_table(rows, ["corpus", "pack_len", "rows", "text_share", "rows_vs_unpacked"])
    write_results("pack_density", rows)


if __name__ == "__main__":
    main()
