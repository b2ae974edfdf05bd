"""What the paged attention kernel does on the GPU, read by Nsight Compute: registers a thread,
occupancy limit, dynamic shared memory, tensor-core instructions (Hopper's warpgroup `gmma` or
the older `hmma` path) and kernel time, for decode and tree verify at the
kernels bench's shapes (Llama-3-8B heads, batch 64, context 2048), in several variants.

    python bench/ncu_probe.py          (runs itself under ncu with --run-only, parses, writes JSON)
    python bench/ncu_probe.py --mosaic (the Mosaic GPU verify kernel: where its time goes, stall
                                        reasons, L2 hits, tensor-pipe and DRAM use)
    python bench/ncu_probe.py --mosaic --stalls (the persistent kernel's stall reasons)
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

METRICS = ["gpu__time_duration.sum", "launch__registers_per_thread", "launch__occupancy_limit_registers",
           "launch__shared_mem_per_block_dynamic", "sm__inst_executed_pipe_tensor_op_gmma.sum",
           "sm__inst_executed_pipe_tensor_op_hmma.sum"]
# the v21 file compared the page gather (auto then) with gather_rows=True, now the only way
CONFIGS = [("decode", 1, {}), ("decode", 1, dict(num_warps=2)), ("verify", 64, {}), ("verify", 64, dict(num_warps=8))]
MOSAIC = "--mosaic" in sys.argv
if MOSAIC:  # why 128 rows a CTA take ~1.3x decode's time, and 256 rows (two CTAs a head) more
    METRICS = ["gpu__time_duration.sum", "launch__registers_per_thread", "launch__grid_size",
               "dram__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes_read.sum",
               "lts__t_sector_hit_rate.pct", "lts__t_bytes.sum",
               "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
               "sm__throughput.avg.pct_of_peak_sustained_elapsed", "smsp__cycles_active.avg",
               "sm__cycles_elapsed.avg", "smsp__inst_executed.sum",
               "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
               "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
               "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
               "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
               "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
               "smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio",
               "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio",
               "smsp__average_warps_issue_stalled_membar_per_issue_active.ratio",
               "smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio",
               "smsp__average_warps_issue_stalled_misc_per_issue_active.ratio",
               "smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio",
               "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio"]
    # v35 on: where the issue slots and pipes go, a short list (each metric group is a replay of
    # the kernel: the long list ran past 250 s); names this ncu lacks are dropped, see main
    METRICS = ["gpu__time_duration.sum", "sm__cycles_elapsed.avg", "smsp__inst_executed.sum",
               "smsp__issue_active.avg.pct_of_peak_sustained_active",
               "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
               "sm__inst_executed_pipe_xu.sum", "sm__inst_executed_pipe_fma.sum", "sm__inst_executed_pipe_alu.sum",
               "sm__inst_executed_pipe_uniform.sum"]
    CONFIGS = [("verify", 32, {}), ("verify", 64, {}), ("verify", 64, dict(overlap=True))]
STALLS = "--stalls" in sys.argv
if STALLS:  # (with --mosaic) why warps wait in the persistent kernel at 64 tokens, at unlocked clocks
    METRICS = ["gpu__time_duration.sum", "sm__cycles_elapsed.avg", "smsp__issue_active.avg.pct_of_peak_sustained_active",
               "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"] + [
        f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio" for r in
        ("barrier", "long_scoreboard", "wait", "math_pipe_throttle", "short_scoreboard", "sleeping", "selected")]
    # (21 metrics on two kernels ran past 250 s); --overlap: the intra-warpgroup overlapped loop
    CONFIGS = [("verify", 64, dict(persistent=132, **(dict(overlap=True) if "--overlap" in sys.argv else {})))]


def run_only():
    import jax
    from kernels import random_tree, setup
    from jaxspec.pallas.paged_attention import paged_attention
    from jaxspec.pallas.tree_mask import tree_attention_mask
    from jaxspec.pallas.verify_hopper import verify_tree_hopper
    attention = verify_tree_hopper if MOSAIC else paged_attention
    for kernel, t, kw in CONFIGS:  # one launch of the Pallas kernel each, in CONFIGS' order
        q, k, v, pt, kv_lens, q_lens = setup(64, t, 2048)
        mask = None if kernel == "decode" else tree_attention_mask(random_tree(64, t), q_lens)[0]
        f = jax.jit(lambda q, k, v, kw=kw: attention(q, k, v, 0, pt, kv_lens, q_lens, mask, **kw))
        jax.block_until_ready(f(q, k, v))


def parse(text: str) -> list[dict]:
    """ncu's default report: a '  _kernel (grid)x(block), ...' line, then '    metric unit value'."""
    kernels = []
    for line in text.splitlines():
        m = re.match(r"\s{2}(\S+) \((\d+), (\d+), (\d+)\)x\((\d+), 1, 1\)", line)
        if m:
            kernels.append(dict(entry=m.group(1), grid=[int(m.group(i)) for i in (2, 3, 4)], threads=int(m.group(5))))
            continue
        m = re.match(r"\s{4}(\S+)\s+(\S+)\s+([\d,.]+)$", line)
        if m and kernels:
            kernels[-1][m.group(1)] = float(m.group(3).replace(",", ""))
            kernels[-1][m.group(1) + ":unit"] = m.group(2)
    return kernels


def main():
    from common import print_table, write_results
    name = "regex:verify_tree_hopper" if MOSAIC else "regex:^_kernel$"
    # ncu refuses a metric it does not know: keep the names this ncu lists (first part, before '.')
    listed = subprocess.run(["ncu", "--query-metrics", "--chip", "gh100"], capture_output=True, text=True).stdout
    known = {line.split()[0] for line in listed.splitlines() if line.strip()}
    metrics = [m for m in METRICS if m.split(".")[0] in known] if known else METRICS
    print("metrics this ncu lacks:", [m for m in METRICS if m not in metrics])
    cmd = ["ncu", "-k", name, "-c", str(len(CONFIGS)), "--metrics", ",".join(metrics)]
    cmd += ["--clock-control", "none"] if STALLS else []
    cmd += [sys.executable, os.path.abspath(__file__), "--run-only"] + (["--mosaic"] if MOSAIC else [])
    cmd += ["--stalls"] if STALLS else []
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=250 if MOSAIC else 500)
    found = parse(r.stdout)
    if len(found) != len(CONFIGS):
        print(r.stdout[-3000:], r.stderr[-2000:])
        raise SystemExit(f"ncu reported {len(found)} kernels, expected {len(CONFIGS)}")
    rows = []
    for (kernel, t, kw), k in zip(CONFIGS, found):
        rows.append(dict(kernel=kernel, q_tokens=t, variant=" ".join(f"{a}={b}" for a, b in kw.items()) or "auto",
                         **{key.replace(".sum", ""): val for key, val in k.items()}))
    print_table(rows, ["kernel", "q_tokens", "variant", "gpu__time_duration", "launch__registers_per_thread",
                       "launch__occupancy_limit_registers", "sm__inst_executed_pipe_tensor_op_gmma"])
    if MOSAIC:
        for r in rows:
            print(r)
    tag = "-mosaic" * MOSAIC + "-stalls" * STALLS
    print(write_results("ncu_probe" + tag, rows, {"ncu_command": " ".join(cmd)}))


if __name__ == "__main__":
    run_only() if "--run-only" in sys.argv else main()
