#!/bin/bash
# Per-instruction warp stall samples of the persistent Mosaic verify kernel at 64 tokens (Nsight
# Compute's source page, SASS): where the warps of each role wait. Writes $BENCH_OUT/ncu_source$1.csv.
#   bash bench/ncu_source.sh [--overlap]     (GPU; PYTHONPATH holding the repo and bench/)
# The default run took about a minute on the H100 (0e66d34); with --overlap the run (and a default
# one queued after it) had not finished after 540 s at 626a998, unexplained: give it its own call.
set -e
tmp=$(mktemp -d)
out=${BENCH_OUT:-$tmp}
ncu -f -k regex:verify_tree_hopper -c 1 --section WarpStateStats --section SourceCounters --clock-control none \
    -o "$tmp/verify_source" "$(which python)" bench/probes/ncu_probe.py --run-only --mosaic --stalls "$@"
ncu --import "$tmp/verify_source.ncu-rep" --page source --csv --print-source sass > "$out/ncu_source$1.csv"
wc -l "$out/ncu_source$1.csv"
