"""Newcomers joined into a running batch's chain of plain decode calls, instead of breaking it.

Where a request has ended and another waits, the unchained path reads the running call back, admits,
prefills the newcomer, reads that back too and launches the batch's next call from the host: the
device waits twice, once a newcomer. Here, before the running call f is read, the newcomers' prompts
but their last tokens are prefilled (the call is launched), and the batch's next call is launched at
once from f's device outputs, with each newcomer in a row that has ended (or a padding row): its
pending token is its prompt's last token, which the host knows, so that row's inputs are the
host's, merged into f's on the device (RowJoin, built at start-up). The device runs f, the
prefill and the joined call back to back; the host reads f and the prefill back meanwhile.

Plain engines only (a drafter's next call verifies trees the prefill drafts); a newcomer whose
prompt takes more than one prefill chunk, or penalties, go the unchained way.
A mixin of Scheduler (core.py), which owns the state these methods read."""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.programs import STOP_ID_SLOTS
from jaxspec.sampling import SamplerFlags, SamplingBatch, SamplingParams
from jaxspec.scheduler.dispatch import _to_device
from jaxspec.scheduler.request import InFlight


# a newcomer's row as the host sends it: three arrays a call, whatever the sampling batch's fields
INT_COLS = ("token", "kv_len", "budget", "top_k", "step", "joined")
FLOAT_COLS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def merge_rows(chained, ints, floats, seeds):
    """A decode call's inputs (pending tokens [R, 1], kv lengths, sampling batch, token budgets):
    the host's packed values (ints [R, INT_COLS], floats [R, FLOAT_COLS], seeds [R]) in the rows it
    marks `joined`, chained's elsewhere. A joined row has no penalties: its history is empty."""
    tok, kv, sb, budget = chained
    col = dict(zip(INT_COLS, ints.T)) | dict(zip(FLOAT_COLS, floats.T)) | {"seed": seeds}
    joined = col["joined"] != 0

    def pick(new, old):  # new [R], old [R] or [R, 1]
        shape = (-1,) + (1,) * (old.ndim - 1)
        return jnp.where(joined.reshape(shape), new.astype(old.dtype).reshape(shape), old)
    sb = dataclasses.replace(sb, **{k: pick(col[k], getattr(sb, k)) for k in FLOAT_COLS + ("top_k", "step", "seed")},
                             history=pick(jnp.full_like(kv, -1), sb.history), num_prompt=pick(jnp.zeros_like(kv), sb.num_prompt))
    return pick(col["token"], tok), pick(col["kv_len"], kv), sb, pick(col["budget"], budget)


def packed_rows(rows: int):
    """Zeros as the host's packed rows (merge_rows' ints, floats, seeds)."""
    return np.zeros((rows, len(INT_COLS)), np.int32), np.zeros((rows, len(FLOAT_COLS)), np.float32), np.zeros(rows, np.uint32)


class RowJoin:
    """merge_rows compiled for each batch bucket's decode inputs (pending tokens [R, 1], kv lengths,
    sampling batch, token budgets), at warm-up; one compiled after it is late."""

    def __init__(self, jit: bool = True):
        self.jit, self.table, self.warm, self.late_compiles = jit, {}, False, []

    @staticmethod
    def dummy(rows: int):
        """Zeros shaped as a bucket's (decode inputs, packed rows)."""
        z = np.zeros(rows, np.int32)
        ins = (np.zeros((rows, 1), np.int32), z, SamplingBatch.build([SamplingParams()] * rows, [0] * rows, [0] * rows), z)
        return (ins, *packed_rows(rows))

    def _get(self, rows: int):
        if not self.jit:
            return merge_rows
        if rows not in self.table:
            self.table[rows] = jax.jit(merge_rows).lower(*self.dummy(rows)).compile()
            if self.warm:
                self.late_compiles.append(rows)
        return self.table[rows]

    def build(self, buckets, run: bool):
        """Compile each bucket's merge; run each once (run: a GPU executable's first run loads it)."""
        for rows in buckets:
            merge = self._get(rows)
            if run:
                jax.block_until_ready(merge(*self.dummy(rows)))
        self.warm = True

    def __call__(self, chained, ints, floats, seeds):
        return self._get(seeds.shape[0])(chained, ints, floats, seeds)


class Joining:
    def _join(self, f: InFlight) -> InFlight | None:
        """Admit waiting requests into the rows of plain decode call f that have ended, prefill them
        and launch the batch's next call chained on f (module docstring); None where it cannot: a
        newcomer admitted then goes the unchained way."""
        if not self._may_join(f):
            return None
        rows = f.outputs[1].shape[0]
        free = [i for i, r in enumerate(f.reqs) if r.finished] + list(range(len(f.reqs), rows))
        before = len(self.running)
        self._admit(limit=len(free))
        new = self.running[before:]
        if not new or any(r.params.penalised for r in new):
            return None
        pre = [(r, r.todo - 1) for r in new if r.todo > 1]  # the last prompt token is the joined call's
        calls = self._prefill_calls(pre)
        if calls is None:
            return None
        live = [r for r in f.reqs if not r.finished]
        steps = self._decode_steps_now(live + new)
        need = ([self._pages_needed(r, f.steps + steps - 1) - len(r.pages) for r in live]
                + [self._pages_needed(r, steps - 1) - len(r.pages) for r in new])
        if sum(max(0, x) for x in need) > self.pool.available:
            return None
        for r, x in zip(live + new, need):
            if x > 0:
                r.pages += self.pool.alloc(x)
        t0 = time.perf_counter()
        prefills = [(self._launch_extend(batch, *shape), [n for _, n in batch]) for batch, shape in calls]
        self.stats["prefill_tokens"] += sum(n for _, n in pre)
        reqs = list(f.reqs) + [None] * (rows - len(f.reqs))
        slots = free[:len(new)]
        for j, r in zip(slots, new):
            reqs[j] = r
        reqs = reqs[:max(len(f.reqs), slots[-1] + 1)]
        stop_ids = np.full((rows, STOP_ID_SLOTS), -1, np.int32)
        for j, r in enumerate(reqs):
            ids = self._device_stop_ids(r)
            stop_ids[j, :len(ids)] = ids
        ints, floats, seeds = packed_rows(rows)
        for j, r in zip(slots, new):
            p, last = r.params, len(r.prompt_ids) + len(r.output_ids) - 1
            ints[j] = (r.token_slice(last, last + 1)[0], last, p.max_tokens - len(r.output_ids), max(p.top_k, 0),
                       len(r.output_ids), 1)
            floats[j] = [getattr(p, k) for k in FLOAT_COLS]
            seeds[j] = r.seed
        packed, pt, stop_ids = _to_device(((ints, floats, seeds), self._page_table(reqs, rows), stop_ids))
        tokens, kv_lens, sb, budget = self.row_join(f.outputs[6], *packed)
        flags = SamplerFlags.of([r.params for r in live + new])
        num_steps = _to_device(np.int32(steps))
        outputs = self._call("decode", False, (tokens, pt, kv_lens, budget, stop_ids, num_steps, sb), flags)
        g = InFlight("decode", reqs, outputs, dict(pt=pt, stop_ids=stop_ids, num_steps=num_steps,
                                                   pages=[len(r.pages) for r in reqs]),
                     flags, steps=steps, chained=True, host_s=time.perf_counter() - t0)
        g.joined_prefill = prefills
        self.stats["joins"] += 1
        return g

    def _prefill_calls(self, pre) -> list | None:
        """[(batch, (rows, t))]: (request, tokens) pairs in prefill programs, the longest first, each
        call in the shape that holds most of those left (then the least padded); None where a prompt
        fits no shape (it takes chunks: the unchained way)."""
        calls, left = [], sorted(pre, key=lambda x: -x[1])
        while left:
            fits = [(r, t) for r, t in self.prefill_shapes if t >= left[0][1]]
            if not fits:
                return None
            rows, t = max(fits, key=lambda s: (min(s[0], len(left)), -s[0] * s[1]))
            calls.append((left[:rows], (rows, t)))
            left = left[rows:]
        return calls

    def _may_join(self, f: InFlight) -> bool:
        """A plain engine's steady decode call (every row ended on the device or running, nobody
        else running) with requests due for admission and a row of its bucket to put them in."""
        if (self.row_join is None or not self.overlap or f.kind != "decode" or f.flags.penalties
                or f.ended_after_launch or not self._admission_due()):
            return False
        live = [r for r in f.reqs if not r.finished]
        rows = f.outputs[1].shape[0]
        return len(self.running) == len(live) < rows and all(map(self._ended_on_device, f.reqs))
