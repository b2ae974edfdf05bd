"""The chained call: the next decode or verify call launched from the last one's outputs on the
device before the host reads them (steady decoding: the same requests, nothing to admit or prefill),
a change of shape chained too, where the pages for both calls' worst case can be reserved.
A mixin of Scheduler (core.py), which owns the state these methods read."""
from __future__ import annotations

import time

import numpy as np

from jaxspec import closed_wave
from jaxspec.programs import BATCH_BUCKETS, bucket
from jaxspec.scheduler.dispatch import _to_device
from jaxspec.scheduler.request import InFlight
from jaxspec.scheduler.trees import PLAIN
from jaxspec.spec_shapes import PLAIN as POLICY_PLAIN  # (the policy's label for plain decoding's costs)


class Chaining:
    def _may_overlap(self, f: InFlight) -> bool:
        """Only steps whose successor needs nothing from the host but page-table rows: plain decode
        steps (also a drafter's large-batch fallback) and device drafters' verify steps (a host
        drafter such as NGRAM drafts from the emitted tokens); no penalties (their token histories
        are built on the host)."""
        if not self.overlap or f.flags.penalties:
            return False
        return f.kind == "decode" or (f.kind == "verify" and self.device_drafter)

    def _reserve_chain(self, f: InFlight) -> bool:
        """Whether the step after f may be launched from f's device outputs; if so, pages for both
        steps' worst case are reserved here."""
        # A request that ended on the device (its budget spent, or a stop id) rides on as a padding
        # row, which writes no K/V (its pages are already free): a request ending in every few calls
        # would otherwise break the chain each time, and the unchained call that follows costs its
        # launch and read-back (~5 ms at batch 32 on the H200, serve-head-NVIDIA-H200.json). One that
        # ended on the host alone (a stop string, an abort) would keep writing: the chain stops.
        live = [r for r in f.reqs if not r.finished]
        if (not self._may_overlap(f) or not live or f.ended_after_launch
                or not all(map(self._ended_on_device, f.reqs))):
            return False
        if len(self.running) != len(live) or self._admission_due():
            return False  # the batch changes: admissions, prefill chunks, preemptions
        rows = bucket(len(f.reqs), BATCH_BUCKETS)
        if bucket(len(live), BATCH_BUCKETS) != rows and not self._keeps_bucket(f, live, rows):
            return False  # the batch shrinks to a smaller bucket's programs
        now = shape = _shape_of(f)
        if not f.plain:  # (a plain step chains while the batch decodes plainly)
            choice = self._choice_for(live, rows)
            self._decided = (rows, choice)  # step() takes it: one decision a call
            if choice != shape and not self._change_chains(f, choice, rows):
                return False
            shape = choice
        steps = self._decode_steps_now(live) if shape == PLAIN else self._verify_steps_now(live)
        if _same_kind(now, shape) and steps != f.steps:  # (a call of the same kind reuses the last one's steps)
            return False
        # A request may reach max_tokens (or a stop) in call t: call t + 1 then holds its row as
        # padding (its token budget, counted on the device, is spent) and, where no row is left,
        # ends at once (programs.steps_while_alive). Pages for both calls' worst case, every step
        # accepting all it may (capped at a row's page-table width: the budget bounds its writes):
        span = (lambda tree, nodes, n: n if (tree, nodes) == PLAIN else self._span(tree, nodes, n))
        extra = span(*now, f.steps) + span(*shape, steps) - 1
        need = [0 if r.finished else self._pages_needed(r, extra) - len(r.pages) for r in f.reqs]
        if sum(max(0, x) for x in need) > self.pool.available:
            return False
        for r, x in zip(f.reqs, need):
            if x > 0:
                r.pages += self.pool.alloc(x)
        self._decided, f.next_shape, f.next_steps = None, shape, steps
        return True

    def _change_chains(self, f: InFlight, choice, rows) -> bool:
        """Whether a device drafter's call of another shape chains on f: a tree after a tree (its
        drafts cut to the next shape on the device), and between trees and plain decoding that keeps
        the heads in step (after plain steps each root is verified alone, as an unchained call
        would: the drafts are made from there). Plain decoding that leaves the heads behind does not."""
        if not self.device_drafter or self.cuts is None:
            return False
        return choice != PLAIN or (f.kind == "verify" and self._keeps_heads_at(rows))

    def _keeps_bucket(self, f: InFlight, live, rows: int) -> bool:
        """Whether a batch shrunk below bucket `rows` chains on in it, its ended rows riding as padding:
        where the auto policy's costs say a smaller bucket's programs would not pay their unchained
        call over the steps left (closed_wave.shrink_pays; the most tokens a row may still emit)."""
        policy = self.spec_policy
        if policy is None or not self.device_drafter:
            return False
        tree = f.tree if f.kind == "verify" else None
        per_step = 1.0 if tree is None else (policy.expected(tree) or 1.0)
        left = max(r.params.max_tokens - len(r.output_ids) for r in live) / per_step
        label = POLICY_PLAIN if tree is None else tree.label
        return not closed_wave.shrink_pays(policy, rows, bucket(len(live), BATCH_BUCKETS), label, left)

    def _chain(self, f: InFlight) -> InFlight:
        t0 = time.perf_counter()
        reqs, ins = f.reqs, f.inputs
        rows = f.outputs[1].shape[0]
        # The page table again unless pages were added: an input whose buffer is unchanged keeps
        # XLA's recorded command buffer as it is (the carried inputs reuse theirs: Programs donates them).
        pages = [len(r.pages) for r in reqs]
        pt = ins["pt"] if pages == ins["pages"] else _to_device(self._page_table(reqs, rows))
        now = _shape_of(f)
        switched = f.next_shape != now
        self.stats["chained_switches"] += switched
        num_steps = ins["num_steps"] if _same_kind(now, f.next_shape) else _to_device(np.int32(f.next_steps))
        if f.next_shape == PLAIN:
            if f.kind == "decode":
                tokens, kv_lens, sb, budget = f.outputs[6]  # computed by the call itself
            else:  # the heads kept in step; the trees drafted are dropped (_collect forgets them)
                tokens, kv_lens, sb, budget = self.cuts.roots(f.outputs[6][0]), *f.outputs[6][2:]
            args = (tokens, pt, kv_lens, budget, ins["stop_ids"], num_steps, sb)
            outputs = self._call("decode", f.plain, args, f.flags)
            g = InFlight("decode", reqs, outputs, dict(pt=pt, stop_ids=ins["stop_ids"], num_steps=num_steps, pages=pages),
                         f.flags, steps=f.next_steps, plain=f.plain)
        else:
            tree, nodes = f.next_shape
            if f.kind == "decode":  # each root verified alone (its drafts made from it), as unchained
                roots, kv_lens, sb, budget = f.outputs[6]
                tokens, parents, num_nodes = self.cuts.from_roots(roots, tree, nodes)
                next_nodes = None
            elif switched:  # the drafts cut to the next program's nodes and depth
                tokens, parents, num_nodes = self.cuts(*f.outputs[5], tree, nodes)
                _, _, kv_lens, sb, budget = f.outputs[6]
                next_nodes = None
            else:
                tokens, parents, kv_lens, sb, budget = f.outputs[6]  # computed by the call itself
                next_nodes = ins["next_nodes"]
                num_nodes = ins.get("chained_nodes")  # the drafted trees', for every row (the budget stops padding)
                if num_nodes is None:
                    num_nodes = np.full(rows, min(f.nodes, f.tree.num_draft_tokens), np.int32)
            g = self._launch_verify(reqs, tree, nodes, f.flags, tokens, parents, kv_lens, num_nodes, sb, pt, budget,
                                    ins["stop_ids"], f.next_steps, num_steps, next_nodes)
            if next_nodes is not None:  # (after a cut, the next call verifies whole drafts again)
                g.inputs["chained_nodes"] = g.inputs["num_nodes"]
            g.switched = switched
        self._host_work_while_device_runs(f)  # a paused host drafter keeps learning the emitted tokens
        g.host_s, g.chained = time.perf_counter() - t0, True
        return g


def _shape_of(f: InFlight) -> tuple:
    """(tree, nodes) a call verified, or PLAIN for a decode call."""
    return (f.tree, f.nodes) if f.kind == "verify" else PLAIN


def _same_kind(a, b) -> bool:  # two shapes both plain decoding, or both trees
    return (a == PLAIN) == (b == PLAIN)
