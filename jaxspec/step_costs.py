"""The step costs the policy starts from: ms a step of every decode and verify program of an
engine's start-up set, timed at warm-up (scheduler/startup.py) and kept in the program store."""
from __future__ import annotations

import dataclasses
import json
import os
import time

import jax


@dataclasses.dataclass
class StepCosts:
    """ms a step of each program: ('decode', rows, None) and ('verify', rows, tree label)."""
    ms: dict = dataclasses.field(default_factory=dict)

    def save(self, path: str) -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump([[kind, rows, tree, ms] for (kind, rows, tree), ms in sorted(self.ms.items(), key=str)], f)
        os.replace(tmp, path)  # whole or not at all: another process may be reading it

    @classmethod
    def load(cls, path: str) -> "StepCosts | None":
        """The table saved at path, or None where there is none or it is unreadable."""
        try:
            with open(path) as f:
                return cls({(kind, int(rows), tree): float(ms) for kind, rows, tree, ms in json.load(f)})
        except (OSError, ValueError, TypeError):
            return None

    def table(self) -> str:
        """ms a step: a row per batch bucket, plain decoding then each tree's verify step."""
        rows = sorted({r for _, r, _ in self.ms})
        trees = sorted({t for k, _, t in self.ms if k == "verify"}, key=lambda t: [int(x) for x in t.split(":")])
        lines = ["rows  " + "  ".join(f"{c:>9s}" for c in ["decode"] + trees)]
        for r in rows:
            cells = [self.ms.get(("decode", r, None))] + [self.ms.get(("verify", r, t)) for t in trees]
            lines.append(f"{r:4d}  " + "  ".join(" " * 9 if c is None else f"{c:9.3f}" for c in cells))
        return "\n".join(lines)


def time_call(call, reps: int = 3, calls: int = 1) -> float:
    """Median ms of a call (its outputs waited for), after one untimed call: `reps` times `calls`
    calls launched back to back, each run's time over its calls. Launched back to back, as a steady
    batch's chained calls are, each call's launch and read-back hide behind the last one's steps;
    one at a time they add to every call, by as much as its steps take at batch 1 and unevenly
    from program to program (spec_policy_notes.md)."""
    jax.block_until_ready(call())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready([call() for _ in range(calls)])
        times.append(1e3 * (time.perf_counter() - t0) / calls)
    return sorted(times)[len(times) // 2]
