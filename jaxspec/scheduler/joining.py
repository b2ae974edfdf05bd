"""Newcomers joined into a running batch's chain of calls, instead of breaking it.

Where a request has ended and another waits, the unchained path reads the running call back, admits,
prefills the newcomer, reads that back too and launches the batch's next call from the host: the
device waits twice, once a newcomer. Here, before the running call f is read, the newcomers' prompts
but their last tokens are prefilled (the call is launched), and the batch's next call is launched at
once from f's device outputs, with each newcomer in a row that has ended (or a padding row): its
pending token is its prompt's last token, which the host knows, so that row's inputs are the
host's, merged into f's on the device (RowJoin, built at start-up). The device runs f, the
prefill and the joined call back to back; the host reads f and the prefill back meanwhile.

Plain decode chains, and a device drafter's verify chains, whose newcomer rows verify their roots
alone in the joined call's first step (the prefill kept the head in step up to the root), as after
plain steps. A newcomer whose prompt takes more than one prefill chunk, or penalties, or whose head
is behind (target-only prefix pages), goes the unchained way. Scheduler(join_newcomers=True).
A mixin of Scheduler (core.py), which owns the state these methods read."""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.programs import TREE_BUCKETS, bucket
from jaxspec.sampling import SamplerFlags, SamplingBatch, SamplingParams
from jaxspec.scheduler.dispatch import _to_device
from jaxspec.scheduler.request import InFlight
from jaxspec.scheduler.trees import WarmTable


# a newcomer's row as the host sends it: three arrays a call, whatever the sampling batch's fields
INT_COLS = ("token", "kv_len", "budget", "top_k", "step", "joined")
FLOAT_COLS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def merge_rows(chained, ints, floats, seeds):
    """A chained call's inputs ((pending tokens [R, 1]) for decode, (trees' tokens, parents [R, N]) for
    verify; then kv lengths, sampling batch, token budgets): the host's packed values (ints [R,
    INT_COLS], floats [R, FLOAT_COLS], seeds [R]) in the rows it marks `joined`, chained's elsewhere.
    A joined row's tree is its root alone; it has no penalties: its history is empty."""
    *trees, kv, sb, budget = chained
    col = dict(zip(INT_COLS, ints.T)) | dict(zip(FLOAT_COLS, floats.T)) | {"seed": seeds}
    joined = col["joined"] != 0

    def pick(new, old):  # new [R] or as old
        shape = (-1,) + (1,) * (old.ndim - 1)
        return jnp.where(joined.reshape(shape), new.astype(old.dtype).reshape(shape) if new.ndim == 1 else new, old)
    roots = jnp.zeros_like(trees[0]).at[:, 0].set(col["token"])
    trees = [pick(roots, trees[0])] + [pick(jnp.full_like(t, -1), t) for t in trees[1:]]  # (parents: -1)
    sb = dataclasses.replace(sb, **{k: pick(col[k], getattr(sb, k)) for k in FLOAT_COLS + ("top_k", "step", "seed")},
                             history=pick(jnp.full_like(kv, -1), sb.history), num_prompt=pick(jnp.zeros_like(kv), sb.num_prompt))
    return (*trees, pick(col["kv_len"], kv), sb, pick(col["budget"], budget))


def packed_rows(rows: int):
    """Zeros as the host's packed rows (merge_rows' ints, floats, seeds)."""
    return np.zeros((rows, len(INT_COLS)), np.int32), np.zeros((rows, len(FLOAT_COLS)), np.float32), np.zeros(rows, np.uint32)


class RowJoin(WarmTable):
    """merge_rows compiled for each (batch bucket, tree width: None for decode calls) a chain may
    take newcomers in, at warm-up; one compiled after it is late."""

    @staticmethod
    def dummy(rows: int, width: int | None = None):
        """Zeros shaped as a bucket's (chained inputs, packed rows)."""
        z = np.zeros(rows, np.int32)
        trees = (np.zeros((rows, 1), np.int32),) if width is None else (np.zeros((rows, width), np.int32),) * 2
        sb = SamplingBatch.build([SamplingParams()] * rows, [0] * rows, [0] * rows)
        return ((*trees, z, sb, z), *packed_rows(rows))

    def _get(self, rows: int, width: int | None):
        if not self.jit:
            return merge_rows
        return self._compiled((rows, width), lambda: jax.jit(merge_rows).lower(*self.dummy(rows, width)))

    def build(self, specs, run: bool):
        """Compile each (rows, width)'s merge; run each once (run: a GPU executable's first run loads it)."""
        for spec in specs:
            merge = self._get(*spec)
            if run:
                jax.block_until_ready(merge(*self.dummy(*spec)))
        self.warm = True

    def __call__(self, chained, ints, floats, seeds):
        width = None if len(chained) == 4 else chained[0].shape[1]
        return self._get(seeds.shape[0], width)(chained, ints, floats, seeds)


class Joining:
    def _join(self, f: InFlight) -> InFlight | None:
        """Admit waiting requests into the rows of call f that have ended, prefill them and launch
        the batch's next call chained on f (module docstring); None where it cannot: a newcomer
        admitted then goes the unchained way."""
        live = self._joinable_rows(f)
        if live is None:
            return None
        rows = f.outputs[1].shape[0]
        if self.spec_policy is not None and f.kind == "verify":  # a join keeps the chain's shape: the policy's too?
            choice = self._choice_for(live, rows)
            if choice != (f.tree, f.nodes):
                self._decided = (rows, choice)  # the unchained call's (one decision a call)
                return None
        free = [i for i, r in enumerate(f.reqs) if r.finished] + list(range(len(f.reqs), rows))
        before = len(self.running)
        self._admit(limit=len(free))
        new = self.running[before:]
        if not new or any(r.params.penalised or r.head_len is not None for r in new):
            return None
        pre = [(r, r.todo - 1) for r in new if r.todo > 1]  # the last prompt token is the joined call's
        calls = self._prefill_calls(pre)
        if calls is None:
            return None
        verify = f.kind == "verify"
        steps = self._verify_steps_now(live + new) if verify else self._decode_steps_now(live + new)
        span = (lambda n: self._span(f.tree, f.nodes, n)) if verify else (lambda n: n)
        need = ([self._pages_needed(r, span(f.steps) + span(steps) - 1) - len(r.pages) for r in live]
                + [self._pages_needed(r, span(steps)) - len(r.pages) for r in new])
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
        _, stop_ids = self._budgets_and_stops(reqs, rows)  # (the budgets: the chained call's and the packed rows')
        ints, floats, seeds = packed_rows(rows)
        for j, r in zip(slots, new):
            p, last = r.params, len(r.prompt_ids) + len(r.output_ids) - 1
            ints[j] = (r.token_slice(last, last + 1)[0], last, p.max_tokens - len(r.output_ids), max(p.top_k, 0),
                       len(r.output_ids), 1)
            floats[j] = [getattr(p, k) for k in FLOAT_COLS]
            seeds[j] = r.seed
        packed, pt, stop_ids = _to_device(((ints, floats, seeds), self._page_table(reqs, rows), stop_ids))
        *inputs, kv_lens, sb, budget = self.row_join(f.outputs[6], *packed)
        flags = SamplerFlags.of([r.params for r in live + new])
        num_steps = _to_device(np.int32(steps))
        if verify:
            nodes = np.full(rows, min(f.nodes, f.tree.num_draft_tokens), np.int32)
            roots = nodes.copy()
            roots[slots] = 1  # (the newcomers' first step verifies their roots alone)
            g = self._launch_verify(reqs, f.tree, f.nodes, flags, *inputs, kv_lens, roots, sb, pt, budget, stop_ids,
                                    steps, num_steps, f.inputs["next_nodes"])
            g.inputs["chained_nodes"] = _to_device(nodes)  # (the next call verifies every row's drafted tree)
            g.borrowed = frozenset(slots)
        else:
            outputs = self._call("decode", False, (*inputs, pt, kv_lens, budget, stop_ids, num_steps, sb), flags)
            g = InFlight("decode", reqs, outputs, dict(pt=pt, stop_ids=stop_ids, num_steps=num_steps,
                                                       pages=[len(r.pages) for r in reqs]), flags, steps=steps)
        g.chained, g.host_s, g.joined_prefill = True, time.perf_counter() - t0, prefills
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

    def _joinable_rows(self, f: InFlight) -> list | None:
        """f's live requests where f is a steady call of a plain engine's decode chain or a device
        drafter's verify chain (every row ended on the device or running, nobody else running) with
        requests due for admission and a row of its bucket to put them in; else None."""
        if (self.row_join is None or not self.overlap or f.flags.penalties or f.ended_after_launch
                or not self._admission_due()):
            return None
        if f.kind != ("verify" if self.device_drafter else "decode") or (self.device_drafter and f.tree is None):
            return None
        live = [r for r in f.reqs if not r.finished]
        # (a chain whose rows all ended: its newcomers' prefill chains their first call instead, _chain_on_prefill)
        ok = 0 < len(live) == len(self.running) < f.outputs[1].shape[0] and all(map(self._ended_on_device, f.reqs))
        return live if ok else None

    def join_specs(self) -> list:
        """(rows, tree width or None) of every chain a newcomer may join: RowJoin's start-up set."""
        if not self.device_drafter:
            return [(rows, None) for rows in self.row_buckets]
        return list(dict.fromkeys((rows, bucket(n, TREE_BUCKETS)) for rows in self.row_buckets
                                  for _, n in self._verify_shapes(rows)))
