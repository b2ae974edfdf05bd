"""Speculation sized by measured costs: whether a device drafter's batch verifies its tree or
decodes plainly, from what each precompiled program costs on this device and what the drafts
have been earning.

At warm-up the engine times every decode and verify program of its set once built (StepCosts:
ms a step per batch bucket), and keeps the table beside its programs in the program store: a
later start of the same engine on the same device reads it back rather than timing again. While
serving, SpecPolicy keeps per bucket an average of the tokens a row emits per verify step. A
batch verifies while

    emitted per verify step x decode ms / verify ms >= min_gain,

that is while a verify step brings more tokens per millisecond than plain steps would; before
any verify step at a bucket it verifies (to learn). A bucket that decodes plainly still verifies
every probe_every-th decision, so that its estimate follows the requests that arrive later (an
EAGLE head left behind by a plain step cannot draft again: only newer requests can be probed).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import jax


@dataclasses.dataclass
class StepCosts:
    """ms a step of each program kind ('decode', 'verify') at each batch bucket."""
    ms: dict = dataclasses.field(default_factory=dict)

    def save(self, path: str) -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump([[kind, rows, ms] for (kind, rows), ms in sorted(self.ms.items())], f)
        os.replace(tmp, path)  # whole or not at all: another process may be reading it

    @classmethod
    def load(cls, path: str) -> "StepCosts | None":
        """The table saved at path, or None where there is none or it is unreadable."""
        try:
            with open(path) as f:
                return cls({(kind, int(rows)): float(ms) for kind, rows, ms in json.load(f)})
        except (OSError, ValueError, TypeError):
            return None

    def table(self) -> str:
        rows = sorted({r for _, r in self.ms})
        lines = ["rows  decode ms  verify ms  verify/decode"]
        for r in rows:
            d, v = self.ms.get(("decode", r)), self.ms.get(("verify", r))
            ratio = f"{v / d:13.2f}" if d and v else " " * 13
            lines.append(f"{r:4d}  {d or float('nan'):9.3f}  {v or float('nan'):9.3f}  {ratio}")
        return "\n".join(lines)


def time_call(call, reps: int = 3) -> float:
    """Median ms of call() (its outputs waited for), after one untimed call."""
    jax.block_until_ready(call())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


class SpecPolicy:
    def __init__(self, costs: StepCosts, min_gain: float = 1.0, probe_every: int = 32, alpha: float = 0.2):
        self.costs, self.min_gain, self.probe_every, self.alpha = costs, min_gain, probe_every, alpha
        self.emitted: dict[int, float] = {}  # bucket -> average tokens a row emits per verify step
        self.plain_decisions: dict[int, int] = {}

    def gain(self, rows: int) -> float | None:
        """Tokens per ms of a verify step over a plain step's at this bucket, or None if unknown."""
        d, v, e = self.costs.ms.get(("decode", rows)), self.costs.ms.get(("verify", rows)), self.emitted.get(rows)
        if d is None or v is None or e is None:
            return None
        return e * d / v

    def should_verify(self, rows: int) -> bool:
        g = self.gain(rows)
        if g is None or g >= self.min_gain:
            return True
        n = self.plain_decisions[rows] = self.plain_decisions.get(rows, 0) + 1
        return n % self.probe_every == 0

    def verified(self, rows: int, emitted: list[int]) -> None:
        """A verify call at this bucket: the tokens each live row emitted at each of its steps."""
        if not emitted:
            return
        mean = sum(emitted) / len(emitted)
        old = self.emitted.get(rows)
        self.emitted[rows] = mean if old is None else (1 - self.alpha) * old + self.alpha * mean
