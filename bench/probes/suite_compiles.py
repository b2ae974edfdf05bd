"""Where the CPU test suite's time goes: JAX's tracing and XLA compiles, by program and by test file.

Compiling is most of the suite's time (conftest.py). As a pytest plugin this module turns on JAX's
compile log and records, for every test, each "Finished tracing / ... conversion / XLA compilation
of <program> in <s> sec" line (a compilation read back from the persistent cache, logged as a hit
just before, counted apart), then writes one JSON-lines file a worker; `report` sums them by test
file (beside the suite's per-file time, from a suite_durations results file of the same run), by
test and by program, and writes suite_compiles-<tag>-cpu.json. The engine's programs are compiled
from their exported form (program_store.py), all under the name `call`: their tracing and lowering
carry the program's own name (`with_leaves` for most). Seconds are summed over threads: a warm-up
compiles in several.

    JAX_COMPILATION_CACHE_DIR=$(mktemp -d) SUITE_COMPILES_OUT=compile-log PYTHONPATH=bench/probes \\
        python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -p suite_compiles tests
    python bench/probes/suite_compiles.py report compile-log --durations bench/results/suite_durations-TAG-cpu.json --tag TAG
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import logging
import os
import re
import sys
import threading

LINE = re.compile(r"Finished (tracing|jaxpr to MLIR module conversion|XLA compilation) (?:of )?(\S+).* in ([\d.]+) sec")
KIND = {"tracing": "trace", "jaxpr to MLIR module conversion": "lower", "XLA compilation": "compile"}


class _Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.test, self.rows, self.hits = "(outside tests)", [], set()

    def emit(self, record):
        msg, thread = record.getMessage(), threading.get_ident()
        if msg.startswith("Persistent compilation cache hit"):  # the thread's next "compilation" read it back
            self.hits.add(thread)
            return
        m = LINE.search(msg)
        if m:
            kind = KIND[m.group(1)]
            hit = kind == "compile" and thread in self.hits
            if kind == "compile":
                self.hits.discard(thread)
            self.rows.append(dict(test=self.test, kind=kind, program=m.group(2), seconds=float(m.group(3)), hit=hit))


_RECORDER = _Recorder()


def pytest_configure(config):
    import jax
    jax.config.update("jax_log_compiles", True)
    for name in ("jax._src.interpreters.pxla", "jax._src.pjit", "jax._src.dispatch", "jax._src.interpreters.mlir",
                 "jax._src.compiler"):
        logging.getLogger(name).addHandler(_RECORDER)


def pytest_runtest_logstart(nodeid, location):
    _RECORDER.test = nodeid


def pytest_unconfigure(config):
    out = os.environ.get("SUITE_COMPILES_OUT")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(out, f"{worker}.jsonl"), "w") as f:
        for row in _RECORDER.rows:
            f.write(json.dumps(row) + "\n")


def _program(name: str) -> str:
    """A program's name without the jit(...) wrapper."""
    return name[4:-1] if name.startswith("jit(") and name.endswith(")") else name


def report(args):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from common import print_table, write_results
    rows = [json.loads(line) for path in sorted(glob.glob(os.path.join(args.dir, "*.jsonl"))) for line in open(path)]
    files = json.load(open(args.durations))["rows"] if args.durations else []
    file_s = {r["file"]: r["seconds"] for r in files}
    by_file = collections.defaultdict(lambda: collections.Counter())
    by_program = collections.defaultdict(lambda: collections.Counter())
    by_test = collections.defaultdict(lambda: collections.Counter())
    for r in rows:
        f = r["test"].split("::")[0]
        key = "cache_hit" if r["hit"] else r["kind"]
        for table, k in ((by_file, f), (by_program, _program(r["program"])), (by_test, r["test"])):
            table[k][key + "_s"] += r["seconds"]
            table[k][key + "_n"] += 1

    def row(group, name, c, test_s=None):
        return dict(group=group, name=name, test_s=test_s, compile_s=round(c["compile_s"], 1), compiles=c["compile_n"],
                    cache_hits=c["cache_hit_n"], trace_s=round(c["trace_s"], 1), lower_s=round(c["lower_s"], 1))

    most = lambda table: sorted(table.items(), key=lambda kv: -kv[1]["compile_s"])
    total = collections.Counter()
    for c in by_file.values():
        total.update(c)
    out = [row("suite", "all", total, round(sum(file_s.values()), 1) if file_s else None)]
    out += [row("file", f, c, file_s.get(f)) for f, c in most(by_file)]
    out += [row("test", t, c) for t, c in most(by_test)[:args.top]]
    out += [row("program", p, c) for p, c in most(by_program)[:args.top]]
    print_table(out, list(out[0]))
    print(write_results("suite_compiles" + (f"-{args.tag}" if args.tag else ""), out,
                        {"durations": os.path.relpath(args.durations) if args.durations else None}))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report")
    r.add_argument("dir")
    r.add_argument("--durations", default=None, help="a suite_durations results file of the same run")
    r.add_argument("--top", type=int, default=25, help="programs listed")
    r.add_argument("--tag", default="")
    args = ap.parse_args()
    report(args)


if __name__ == "__main__":
    main()
