"""What the paged attention kernel compiles to: instruction counts in its PTX and ptxas's register
and spill report, for decode and tree verify at the kernels bench's shapes.

XLA compiles Pallas' Triton kernels into the module it dumps (--xla_dump_to), so the PTX comes
from the same compile the engine runs. Matrix work should show `wgmma.mma_async` (Hopper's
warpgroup MMA); `mma.sync` alone means the older, slower tensor-core path.
    python bench/ptx_probe.py
    ncu -k regex:kernel --metrics launch__registers_per_thread python bench/ptx_probe.py --run-only
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

DUMP = tempfile.mkdtemp(prefix="xla-dump-")
# XLA dumps the LLVM IR it links the Triton kernels into (.ll); PTX too, where this XLA does
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} --xla_gpu_dump_llvmir=true"
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from common import print_table, write_results  # noqa: E402
from kernels import random_tree, setup  # noqa: E402
from jaxspec.pallas.paged_attention import paged_attention  # noqa: E402
from jaxspec.pallas.tree_mask import tree_attention_mask  # noqa: E402

RUN_ONLY = "--run-only" in sys.argv
PATTERNS = {"wgmma": r"wgmma\.mma_async", "mma_sync": r"\bmma\.sync", "cp_async": r"cp\.async\.(?:ca|cg)",
            "cp_async_bulk": r"cp\.async\.bulk", "ld_global": r"ld\.global", "ld_local": r"ld\.local",
            "st_local": r"st\.local", "ex2": r"ex2\.approx", "bar_sync": r"bar\.sync|barrier\.sync"}


def entries(text: str):
    """(name, body) of each kernel in a PTX file, or of each function in an LLVM IR file (where
    Triton's matrix instructions are inline PTX strings)."""
    heads = list(re.finditer(r"\.entry\s+(\S+?)\s*\(|\ndefine\s[^@\n]*@\"?([\w$.]+)", text))
    for i, m in enumerate(heads):
        yield m.group(1) or m.group(2), text[m.start():heads[i + 1].start() if i + 1 < len(heads) else len(text)]


def ptxas_report(ptx_path: str, name: str) -> str:
    try:
        ptxas = shutil.which("ptxas") or next(iter(glob.glob("/usr/local/cuda*/bin/ptxas")), "ptxas")
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", "-e", name, ptx_path, "-o", os.devnull],
                           capture_output=True, text=True, timeout=120)
        return " ".join(l.strip() for l in r.stderr.splitlines() if "registers" in l or "spill" in l)[:300]
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"ptxas: {e}"


def main():
    rows = []
    for kernel, t, kw in [("decode", 1, {}), ("verify", 16, {}), ("verify", 64, {}),
                          ("verify", 64, dict(block_rows=128, num_warps=8))]:
        before = set(glob.glob(os.path.join(DUMP, "*.ptx")) + glob.glob(os.path.join(DUMP, "*.ll")))
        q, k, v, pt, kv_lens, q_lens = setup(64, t, 2048)
        mask = None if kernel == "decode" else tree_attention_mask(random_tree(64, t), q_lens)[0]
        f = jax.jit(lambda q, k, v, kw=kw: paged_attention(q, k, v, 0, pt, kv_lens, q_lens, mask, **kw))
        jax.block_until_ready(f(q, k, v))
        if RUN_ONLY:  # under a profiler (ncu): the kernels' launches are all it needs
            continue
        new = sorted(set(glob.glob(os.path.join(DUMP, "*.ptx")) + glob.glob(os.path.join(DUMP, "*.ll"))) - before)
        if not new:
            print(kernel, t, "no new .ptx or .ll in the dump; files:", sorted(os.listdir(DUMP))[-10:])
        for path in new:
            for name, body in entries(open(path).read()):
                counts = {k: len(re.findall(p, body)) for k, p in PATTERNS.items()}
                if "kernel" not in name and not counts["wgmma"] + counts["mma_sync"]:
                    continue
                row = dict(kernel=kernel, file=os.path.basename(path)[-40:], q_tokens=t, variant=" ".join(f"{a}={b}" for a, b in kw.items()) or "auto",
                           entry=name[:40], lines=body.count("\n"), **counts)
                row["ptxas"] = ptxas_report(path, name) if path.endswith(".ptx") else ""
                rows.append(row)
    if RUN_ONLY:
        return
    print_table(rows, ["kernel", "q_tokens", "variant", "entry", "wgmma", "mma_sync", "cp_async", "cp_async_bulk",
                       "ld_local", "st_local", "ex2"])
    for r in rows:
        print(r["kernel"], r["q_tokens"], r["variant"], r["ptxas"])
    print(write_results("ptx_probe", rows))


if __name__ == "__main__":
    main()
