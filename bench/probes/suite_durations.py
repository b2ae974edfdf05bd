"""The test suite's time from a pytest log (run with --durations=N; N=0 gives every test): wall
seconds, tests passed, seconds per test file (summed over its tests' setup, call and teardown)
and the slowest tests (with --durations=N < all, the file sums hold only the N listed). Writes
suite_durations-<tag>-cpu.json.

    python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=0 tests > suite.log
    JAXSPEC_COMMIT=<tested commit> python bench/probes/suite_durations.py suite.log --tag cold --cache empty
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(text: str) -> dict:
    tests, files = [], collections.Counter()
    for m in re.finditer(r"^([\d.]+)s (setup|call|teardown)\s+(\S+)", text, re.M):
        t, phase, test = float(m.group(1)), m.group(2), m.group(3)
        tests.append(dict(test=test, phase=phase, seconds=t))
        files[test.split("::")[0]] += t
    summary = re.search(r"(\d+) passed.* in ([\d.]+)s", text)
    failed = re.findall(r"^FAILED (\S+)", text, re.M) + re.findall(r"^ERROR (\S+)", text, re.M)
    return dict(passed=int(summary.group(1)), wall_s=float(summary.group(2)), files=files, tests=tests, failed=failed)


def main(argv=None):
    from common import print_table, write_results
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--tag", required=True)
    ap.add_argument("--cache", required=True, help="what the compilation cache held: empty, warm")
    ap.add_argument("--xla-flags", default="", help="the XLA_FLAGS the tests ran with")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    got = parse(open(args.log).read())
    rows = [dict(file=f, seconds=s) for f, s in got["files"].most_common()]
    print_table(rows, ["file", "seconds"])
    print(f"{got['passed']} passed, {len(got['failed'])} failed or errors in {got['wall_s']} s; "
          f"test time summed {sum(got['files'].values()):.0f} s")
    slowest = sorted(got["tests"], key=lambda t: -t["seconds"])[:args.top]
    print(write_results(f"suite_durations-{args.tag}", rows, dict(
        cache=args.cache, xla_flags=args.xla_flags, passed=got["passed"], failed=got["failed"], wall_s=got["wall_s"],
        tests_listed=len(got["tests"]), test_seconds_summed=sum(got["files"].values()), slowest=slowest)))


if __name__ == "__main__":
    main()
