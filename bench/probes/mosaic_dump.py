"""What ptxas made of the Mosaic GPU verify kernel: registers, spills and the SASS of each variant
at the kernel bench's 64-token shape (batch 64, 2k context, 8B heads), through Mosaic GPU's dump
switches. Prints each variant's ptxas report and the instruction mix of its SASS (by opcode); the
files go to $BENCH_OUT/mosaic_dump/<variant>/ for reading, and all of them (the PTX too) into
$BENCH_OUT/mosaic_dump.tar.gz.

    python bench/mosaic_dump.py [--variants=pers,...]   (GPU; ptxas and nvdisasm from the CUDA install JAX uses)
"""
from __future__ import annotations

import collections
import glob
import os
import tempfile
import re
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

import jax

from jaxspec.pallas.verify_hopper import verify_tree_hopper
from kernels import random_tree, setup
from jaxspec.pallas.tree_mask import tree_attention_mask

DUMP = dict(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS="1", MOSAIC_GPU_DUMP_PTX="1")  # Mosaic GPU's switches
VARIANTS = [("pers", dict(persistent=132)), ("pers ovl", dict(persistent=132, overlap=True))]


def opcode_mix(sass: str) -> collections.Counter:
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def wgmma_order(sass: str) -> list[str]:
    """The SASS's wgmma issues, fences and waits in program order, runs of one opcode counted:
    does a wait or fence fall between two products meant to run back to back?"""
    seq = []
    for line in sass.splitlines():
        m = re.search(r"\b(HGMMA\S*|WARPGROUP\.\S+|WARPSYNC\S*)", line)
        if m:
            op = m.group(1).split(".")[0] if m.group(1).startswith("HGMMA") else m.group(1)
            if seq and seq[-1][0] == op:
                seq[-1][1] += 1
            else:
                seq.append([op, 1])
    return [f"{op}x{n}" if n > 1 else op for op, n in seq]


def main():
    out_root = os.path.join(os.environ.get("BENCH_OUT") or tempfile.gettempdir(), "mosaic_dump")
    q, k, v, pt, kv_lens, q_lens = setup(64, 64, 2048)
    mask, _ = tree_attention_mask(random_tree(64, 64), q_lens)
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--variants=")), None)
    for name, kw in VARIANTS:
        if only and name not in only:
            continue
        d = os.path.join(out_root, name.replace(" ", "_"))
        os.makedirs(d, exist_ok=True)
        os.environ.update(MOSAIC_GPU_DUMP_TO=d, **DUMP)
        try:
            jax.block_until_ready(verify_tree_hopper(q, k, v, 0, pt, kv_lens, q_lens, mask, **kw))
        except Exception as e:  # noqa: BLE001 - report and go on to the next variant
            print(f"{name}: {type(e).__name__}: {str(e)[:400]}")
        for key in ("MOSAIC_GPU_DUMP_TO", *DUMP):
            os.environ.pop(key)
        print(f"== {name} {kw}: {sorted(os.listdir(d))}")
        for f in sorted(glob.glob(os.path.join(d, "*"))):
            text = open(f, errors="replace").read()
            if "ptxas" in f:
                print("\n".join(l for l in text.splitlines() if re.search(r"registers|spill|smem|C7\d\d\d|wgmma", l)))
            if f.endswith(".sass") or "sass" in os.path.basename(f):
                mix = opcode_mix(text)
                print(f"{sum(mix.values())} instructions:", ", ".join(f"{o} {n}" for o, n in mix.most_common(28)))
                print("wgmma order:", " ".join(wgmma_order(text)))
    # the PTX (and SASS where nvdisasm exists) in one archive: a device's $OUT returns few files;
    # without nvdisasm there, `ptxas -arch=sm_90a` and `nvdisasm` from NVIDIA's pip wheels
    # nvidia-cuda-nvcc and nvidia-cuda-nvdisasm (13.x: JAX 0.11.2 writes PTX 9.0, which the cu12
    # ptxas refuses) disassemble the PTX elsewhere (bench/results/mosaic_sass-f8f4d9e.txt)
    shutil.make_archive(out_root, "gztar", out_root)


if __name__ == "__main__":
    main()
