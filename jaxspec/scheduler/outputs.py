"""Reading a call's outputs back and emitting tokens: stop ids, stop strings, max_tokens, and the
release of a finished request's pages.
A mixin of Scheduler (core.py), which owns the state these methods read."""
from __future__ import annotations

import time

import jax
import numpy as np

from jaxspec.detokenize import IncrementalText
from jaxspec.scheduler.request import DraftRow, InFlight, DraftsOnDevice
from jaxspec.scheduler.trees import PLAIN


class Outputs:
    def _collect(self, f: InFlight, chunk=None):
        """Read a call's outputs back (one transfer) and emit; rows of requests that finished since
        it was launched are dropped. chunk: a prefill call's tokens fed a row."""
        t0 = time.perf_counter()
        jax.block_until_ready(f.outputs[:2])
        arrived = self.clock()
        self.stats["wait_time"] += time.perf_counter() - t0  # the host idle: a device-bound step
        # read what the host needs: tokens and counts, logprobs only if asked for; the drafted trees
        # stay on the device, where the next (chained) step takes them from
        want_lp = any(r.params.logprobs is not None for r in f.reqs)
        drafts = f.outputs[5 if f.kind == "verify" else 4]
        shared = None if drafts is None else DraftsOnDevice(drafts, f.tree if f.kind == "verify" else None)
        if f.kind == "decode":
            toks, count, lp, top_v, top_i = jax.device_get((*f.outputs[:2], f.outputs[2] if want_lp else None,
                                                            *f.outputs[3:5]))
            counts, rows = count.tolist(), toks.tolist()
            for i, r in enumerate(f.reqs):
                if r.finished:
                    continue
                c = counts[i]
                r.kv_len += c
                self._emit(r, rows[i][:c], None if lp is None else lp[i, :c].tolist(),
                           None if top_i is None else [(top_v[i, j], top_i[i, j]) for j in range(c)])
            self._arrived(f, arrived, int(count.max(initial=0)))
            self.stats["decode_time"] += f.host_s + time.perf_counter() - t0
            return
        if f.kind == "extend":
            nxt, lp, top_v, top_i = jax.device_get((f.outputs[0], f.outputs[1] if want_lp else None, *f.outputs[2:4]))
            for i, r in enumerate(f.reqs):
                if r.finished:
                    continue
                r.kv_len += chunk[i]
                if r.todo == 0:
                    r.draft = None if shared is None else DraftRow(shared, i)
                    self._emit(r, [int(nxt[i])], None if lp is None else [float(lp[i])],
                               None if top_i is None else [(top_v[i], top_i[i])])
            self._arrived(f, arrived, prefill=True)
            self.stats["prefill_time"] += f.host_s + time.perf_counter() - t0
            return
        cut_shapes = self.cut_shapes.get(f.tree, ()) if self.spec_policy is not None else ()
        toks, count, lp, top_v, top_i, cut = jax.device_get((*f.outputs[:2], f.outputs[2] if want_lp else None,
                                                             *f.outputs[3:5], f.outputs[7] if cut_shapes else None))
        if toks.ndim == 2:  # verify_tree: one step; as verify_steps' [B, steps, N]
            toks, count = toks[:, None], count[:, None]
            lp, top_v, top_i = (None if x is None else x[:, None] for x in (lp, top_v, top_i))
        counts, rows = count.tolist(), (toks.tolist() if lp is None and top_i is None else None)
        if self.spec_policy is not None:
            # a first step that verified no draft of this shape tells nothing of it (the root alone emits
            # one token whatever the shape; another shape's drafts, cut, what that one accepts), nor of its cuts
            live = [(i, s, c) for i, (r, cs) in enumerate(zip(f.reqs, counts)) if not r.finished
                    for s, c in enumerate(cs) if c and not (s == 0 and (f.switched or i in f.borrowed))]
            keys = None if f.match_keys is None else [f.match_keys[i] for i, _, _ in live]
            if cut_shapes:  # what the cuts of the same trees would have emitted
                same = [(i, s) for i, s, _ in live]
                cut = (cut_shapes, np.concatenate([count[:, :, None], cut], axis=2)[tuple(zip(*same))]) if same else None
            tree = self._policy_tree(f)
            if self.device_drafter and self.closed_batch_rule and (e := self.spec_policy.expected(tree)) is not None:
                for i, _, c in live:  # each row's drafts against the policy's expectation (closed_wave.row_factors)
                    f.reqs[i].drafts[0] += c - 1
                    f.reqs[i].drafts[1] += e - 1
            self.spec_policy.verified(tree, [c for _, _, c in live], keys, count.shape[0], cut)
            self._arrived(f, arrived, int((count > 0).sum(axis=1).max(initial=0)))
        for i, r in enumerate(f.reqs):
            if shared is not None and not r.finished:  # (plain steps chained on: its trees are never verified)
                r.draft = None if f.next_shape == PLAIN else DraftRow(shared, i)
            cs = counts[i]
            k = cs.index(0) if 0 in cs else len(cs)
            if r.finished or k == 0:
                continue
            if rows is not None:  # the row's steps' tokens at once
                n0 = len(r.output_ids)
                r.kv_len += sum(cs[:k])  # (before a stop among them releases the pages: a page is cached by its tokens)
                self._emit(r, [t for s, c in zip(rows[i][:k], cs) for t in s[:c]], None, None)
                self._accepted(r, cs[:self._steps_covering(cs, len(r.output_ids) - n0, k)])
                continue
            for s in range(k):
                if r.finished:
                    break
                c = cs[s]
                r.kv_len += c
                self._accepted(r, [c])
                self._emit(r, toks[i, s, :c].tolist(), None if lp is None else lp[i, s, :c].tolist(),
                           None if top_i is None else [(top_v[i, s, j], top_i[i, s, j]) for j in range(c)])
        self.stats["verify_steps"] += 1
        self.stats["verify_time"] += f.host_s + time.perf_counter() - t0

    @staticmethod
    def _steps_covering(counts, emitted, k):
        """How many of a row's first k steps its `emitted` tokens came from (a stop ends it inside one)."""
        total = 0
        for s, c in enumerate(counts[:k]):
            total += c
            if total >= emitted:
                return s + 1
        return k

    def _accepted(self, req, counts):
        """A row's verify steps' accept lengths."""
        req.accept_lengths.extend(counts)
        self.stats["verified_rows"] += len(counts)
        self.stats["accepted"] += sum(counts)

    def mean_accept_length(self) -> float:
        """Tokens a request emits per verify step, over every request's steps so far (0 before any):
        a verify call runs several steps over many rows."""
        return self.stats["accepted"] / max(self.stats["verified_rows"], 1)

    def _emit(self, req, toks, lps, tops):
        """Append tokens; the first stop condition met ends the request there. Without logprobs or
        stop strings there is nothing to do token by token: the stop ids are looked for at once."""
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        p = req.params
        stops = self._stop_ids(req)
        if p.logprobs is None and not p.stop:
            room = p.max_tokens - len(req.output_ids)
            new, reason = (toks, None) if len(toks) < room else (toks[:room], "length")
            if not stops.isdisjoint(new):
                new, reason = new[:next(j for j, t in enumerate(new) if t in stops) + 1], "stop"
            req.output_ids.extend(new)
            self.stats["emitted"] += len(new)
            if req.on_update:
                req.on_update(req, new)
            if reason:
                self._finish(req, reason)
            return
        new = []
        for j, tok in enumerate(toks):
            req.output_ids.append(tok)
            new.append(tok)
            if p.logprobs is not None:
                req.logprobs.append(lps[j])
                if p.logprobs > 0 and tops is not None:
                    v, ids = tops[j]
                    req.top_logprobs.append({int(a): float(b) for a, b in zip(ids[:p.logprobs], v[:p.logprobs])})
            self.stats["emitted"] += 1
            reason = None
            if tok in stops:
                reason = "stop"
            elif p.stop and self._hits_stop_string(req):
                reason = "stop"
            elif len(req.output_ids) >= p.max_tokens:
                reason = "length"
            if reason:
                if req.on_update:
                    req.on_update(req, new)
                self._finish(req, reason)
                return
        if req.on_update:
            req.on_update(req, new)

    def _stop_ids(self, req) -> frozenset:
        """The token ids that end a request: its stop_token_ids, and EOS unless it ignores EOS."""
        if req.stop_ids is None:
            p = req.params
            req.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(self.eos_ids))
        return req.stop_ids

    def _hits_stop_string(self, req):
        """Whether the text the last token completed ends a stop string: only that text and the
        few characters before it are searched (a stop string may span them)."""
        if req.text is None:
            req.text = IncrementalText(self.tokenizer)
        old = len(req.text.text)
        if not req.text.update(req.output_ids):
            return False
        start = max(0, old - max(len(s) for s in req.params.stop) + 1)
        cut = [c for c in (req.text.text.find(s, start) for s in req.params.stop) if c >= 0]
        if cut:
            req.stop_text_len = min(cut)
            return True
        return False

    def _finish(self, req, reason):
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        if req in self.running:
            self.running.remove(req)
            self._release(req)
            req.pages = []
        if self.drafter is not None:
            self.drafter.finish(req)
        if req.on_update:
            req.on_update(req, [])
