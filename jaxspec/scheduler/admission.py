"""Pages for requests: admission while pages allow, reservation for the next call, preemption (pages
released, recomputed later mostly from the prefix cache) rather than the pool running dry.
A mixin of Scheduler (core.py), which owns the state these methods read."""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jaxspec.sampling import SamplingBatch


SAMPLING_BATCHES_KEPT = 8  # device copies of the sampling parameters of recent batches


class Admission:
    def _pages_needed(self, req, extra):
        """Pages for the request's tokens and `extra` slots past them; a row never holds more than
        the page table's width (a request's writes stop at max_seq_len + the tree's slack)."""
        return min(-(-(req.kv_len + req.todo + extra) // self.page_size), self.max_pages_per_seq)

    def _admission_due(self) -> bool:
        """Whether waiting requests are admitted now (and the running batch's chained calls stop
        for their prefill). With scheduler_delay_factor > 0 (vLLM's), a running batch takes them
        once the oldest has waited that many times the last prefill call's time, or they fill its
        free rows: a newcomer at a time would cost a prefill call, and break the chain of
        decode calls, per arrival."""
        free = self.max_batch - len(self.running)
        if not self.waiting or free <= 0:
            return False
        if not self.running or not self.delay_factor or len(self.waiting) >= free:
            return True
        return time.perf_counter() - self.waiting[0].arrival >= self.delay_factor * self.last_prefill_s

    def _admit(self, limit=None):
        """Admit waiting requests, oldest first, while pages allow (at most `limit`)."""
        if not self._admission_due():
            return
        limit = self.max_batch if limit is None else min(self.max_batch, len(self.running) + limit)
        while self.waiting and len(self.running) < limit:
            req = self.waiting[0]
            toks = req.tokens
            # a request that will decode plainly (its batch's bucket gets no tree) takes pages without
            # the drafter's K/V too; one that may draft only pages with both
            plain = self._no_tree_at(min(self.max_batch, len(self.running) + len(self.waiting)))
            matched = self.pool.match_prefix(toks, target_only_ok=plain or not self.device_drafter)
            need = min(-(-(len(toks) + 1 + self.draft_slots) // self.page_size), self.max_pages_per_seq) - len(matched)
            # keep a page per running request in hand so admission does not starve decoding
            if need + len(self.running) > self.pool.available:
                self.pool.release(matched)
                break
            self.waiting.pop(0)
            req.pages = matched + self.pool.alloc(need)
            req.kv_len = len(matched) * self.page_size
            full = self.pool.full_prefix(matched)
            if full < len(matched):  # target-only pages: the head is behind from the start
                req.head_len = full * self.page_size
            self.running.append(req)

    def _reserve(self, reqs, extra):
        """Give every decoding request pages for `extra` more tokens, preempting the newest if short."""
        out = []
        for req in sorted(reqs, key=lambda r: r.arrival):
            if req.finished or req not in self.running:
                continue
            need = self._pages_needed(req, extra - 1) - len(req.pages)
            while need > self.pool.available:
                victim = max((r for r in self.running if r is not req), key=lambda r: r.arrival, default=None)
                if victim is None:
                    break
                self._preempt(victim)
                if victim in out:
                    out.remove(victim)
            if need > self.pool.available:
                self._preempt(req)
                continue
            if need > 0:
                req.pages += self.pool.alloc(need)
            out.append(req)
        return out

    def _release(self, req):
        """Give the request's pages back; those of its cached tokens serve later requests as a
        prefix (target-only past where an EAGLE head fell behind)."""
        head = None if req.head_len is None else min(req.kv_len, req.head_len)
        self.pool.release(req.pages, req.tokens[:req.kv_len], head)

    def _preempt(self, req):
        self._release(req)
        req.pages, req.kv_len, req.draft, req.head_len = [], 0, None, None  # recomputed with the head
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.stats["preemptions"] += 1

    def _page_table(self, reqs, rows):
        pt = np.zeros((rows, self.max_pages_per_seq), np.int32)
        for i, r in enumerate(reqs):
            pt[i, :len(r.pages)] = r.pages
        return pt

    def _sampling(self, reqs, rows, flags, reuse=False, ahead=0):
        """The call's SamplingBatch. reuse (a program that does not donate it): without penalties
        only `step` changes from call to call for the same requests in the same rows, so the other
        ten fields are sent once and reused from the device, for the last few such batches (ahead:
        tokens each row emits before this call that the host has not read yet): under
        cProfile on the H100, jax.device_put took 2.0-2.4 ms of an NGRAM verify call's ~5 for its 16
        arrays (ngram_step-base-, -nocb-). (Packing them into one copy and splitting it on the
        device also cut the copies, 3.94 -> 3.53 ms a call, but compiled a split program per
        input layout, after warm-up too.)"""
        if flags.penalties or not reuse:
            hist = num_prompt = None
            if flags.penalties:
                hist = [r.tokens[:r.kv_len + r.todo] for r in reqs]
                num_prompt = [len(r.prompt_ids) for r in reqs]
            return SamplingBatch.build([r.params for r in reqs], [r.seed for r in reqs],
                                       [len(r.output_ids) + ahead for r in reqs], hist, num_prompt, pad_to=rows)
        steps = np.zeros(rows, np.int32)
        steps[:len(reqs)] = [len(r.output_ids) + ahead for r in reqs]
        key = (rows, tuple(r.rid for r in reqs))
        sent = self._sampling_sent.get(key)
        if sent is None:
            if len(self._sampling_sent) >= SAMPLING_BATCHES_KEPT:
                self._sampling_sent.pop(next(iter(self._sampling_sent)))
            sb = SamplingBatch.build([r.params for r in reqs], [r.seed for r in reqs], [0] * len(reqs), pad_to=rows)
            sent = self._sampling_sent[key] = jax.device_put(sb)
        return dataclasses.replace(sent, step=steps)
