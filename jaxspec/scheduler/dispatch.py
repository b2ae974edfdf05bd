"""Launching the programs: prefill chunks, decode and verify calls (the call chained on the last one's
device outputs: chaining.py).
A mixin of Scheduler (core.py), which owns the state these methods read."""
from __future__ import annotations

import time

import jax
import numpy as np

from jaxspec.programs import BATCH_BUCKETS, STOP_ID_SLOTS, TREE_BUCKETS, bucket
from jaxspec.sampling import SamplerFlags
from jaxspec.scheduler.request import InFlight


class Dispatch:
    def _host_work_while_device_runs(self, waits_for: InFlight, chained_next: bool = False):
        """Dispatch is asynchronous: until the outputs the host waits for next are ready, it is free.
        chained_next: the call just launched is the one the next call chains on, which the host
        must launch before this one ends, or the device idles: only the least work is done here."""
        prepare = getattr(self.drafter, "prepare", None)
        # at a batch that decodes plainly no draft is needed: a host drafter's backlog (NGRAM's
        # trie insertion) waits until trees come back, instead of taxing every plain step
        if prepare is not None and self.tree_size(len(self.running)) > 1:
            prepare(self.running, busy=None if chained_next else lambda: not waits_for.outputs[0].is_ready())

    def _budgets_and_stops(self, reqs, rows, ahead=0):
        """What a multi-step call checks on the device: each row's tokens left before max_tokens
        (0: padding, which then does nothing; ahead: tokens emitted before the call that the host has
        not read yet), and its stop ids (-1 padded; past STOP_ID_SLOTS only the host stops on them,
        after the call)."""
        budget = np.zeros(rows, np.int32)
        stop_ids = np.full((rows, STOP_ID_SLOTS), -1, np.int32)
        for i, r in enumerate(reqs):
            budget[i] = r.params.max_tokens - len(r.output_ids) - ahead
            ids = self._device_stop_ids(r)
            stop_ids[i, :len(ids)] = ids
        return budget, stop_ids

    def _device_stop_ids(self, r) -> list:
        """The stop ids a call checks on the device for this request (the first STOP_ID_SLOTS)."""
        return sorted(self._stop_ids(r))[:STOP_ID_SLOTS]

    def _ended_on_device(self, r) -> bool:
        """Whether a request that ended has its row stopped on the device too (its token budget
        spent, or its last token one of the stop ids the call checks); True while it runs."""
        return (not r.finished or r.finish_reason == "length"
                or (r.finish_reason == "stop" and bool(r.output_ids)
                    and r.output_ids[-1] in self._device_stop_ids(r)))

    def _run_prefill(self, reqs):
        """One chunk of prefill in the prefill shape that takes the most prompt tokens now (of
        those, the smallest)."""
        best = None
        for rows, t in self.prefill_shapes:
            batch = [(r, min(r.todo, t)) for r in reqs[:rows]]
            got = sum(n for _, n in batch)
            if best is None or got > best[0] or (got == best[0] and rows * t < best[1] * best[2]):
                best = (got, rows, t, batch)
        got, rows, t, batch = best
        self.stats["prefill_tokens"] += got
        t0 = time.perf_counter()
        self._run_extend(batch, rows, t)
        self.last_prefill_s = time.perf_counter() - t0  # (read back: the call's wall time)

    def _run_decode(self, reqs, steps, overlap=True, after=None):
        """Up to `steps` plain decode steps over reqs in one call (by the target alone where a
        device drafter falls back: its head is left behind; where the auto policy chose plain
        decoding, with the heads kept in step: no draft is made, so their next verify call verifies
        each root alone). after: the prefill call whose sampled tokens it decodes from (_chain_on_prefill)."""
        t0, launched = time.perf_counter(), self._launch_clock()
        rows = bucket(len(reqs), BATCH_BUCKETS)
        plain = self.device_drafter and not (self._keeps_heads_at(rows) and all(r.head_len is None for r in reqs))
        if plain:
            self._leave_heads_behind(reqs)
        elif self.device_drafter:  # the heads kept in step, but no draft is made
            for r in reqs:
                r.draft = None
        pad = [0] * (rows - len(reqs))
        kv_lens = np.array([r.kv_len for r in reqs] + pad, np.int32)
        tokens = (after.outputs[5] if after is not None else  # (the prefill's sampled tokens, on the device)
                  np.array([r.token_slice(r.kv_len, r.kv_len + 1)[0] for r in reqs] + pad, np.int32)[:, None])
        budget, stop_ids = self._budgets_and_stops(reqs, rows, ahead=after is not None)
        flags = SamplerFlags.of([r.params for r in reqs])
        sb = self._sampling(reqs, rows, flags, ahead=after is not None)
        pt = self._page_table(reqs, rows)
        args = _to_device((tokens, pt, kv_lens, budget, stop_ids, np.int32(steps), sb))
        outputs = self._call("decode", plain, args, flags)
        f = InFlight("decode", reqs, outputs, dict(pt=args[1], stop_ids=args[4], num_steps=args[5],
                                                   pages=[len(r.pages) for r in reqs]),
                     flags, steps=steps, plain=plain, host_s=time.perf_counter() - t0, launched=launched)
        overlapped = overlap and self._may_overlap(f)
        self._host_work_while_device_runs(f, chained_next=overlapped)
        if overlapped:
            self.inflight = f  # read back in the next step, after the call that follows it is launched
        else:
            self._collect(f)

    def _launch_clock(self):
        """The policy's clock as a device drafter's call that is not chained begins: its wall time
        from here to its outputs is its steps' cost (SpecPolicy.arrived)."""
        return self.clock() if self.spec_policy is not None and self.device_drafter else None

    def _call(self, name, plain, args, flags):
        """Launch a decode or extend program (the target alone on its own cache when plain);
        returns its outputs, cache aside."""
        if plain:
            *outputs, tcache = getattr(self.plain_programs, name)(self.cache[0], *args, flags=flags)
            self.cache = (tcache, self.cache[1])
        else:
            *outputs, self.cache = getattr(self.programs, name)(self.cache, *args, flags=flags)
        return tuple(outputs)

    @staticmethod
    def _leave_heads_behind(reqs):
        """The target alone runs these requests' tokens: their heads' caches stop where they are,
        and they decode plainly to their ends."""
        for r in reqs:
            r.draft = None
            if r.head_len is None:
                r.head_len = r.kv_len

    def _run_extend(self, batch, rows, t):
        """Feed n new tokens per request (a [rows, t] program: a prefill chunk); a request whose
        tokens are then all cached gets the sampled next token."""
        f = self._launch_extend(batch, rows, t)
        reqs = f.reqs
        chained = self._chain_on_prefill(f, batch, rows)
        if not chained:
            self._host_work_while_device_runs(f)
        self._collect(f, [0 if chained else n for _, n in batch])  # (a chained call's kv lengths moved on before it)
        if chained:
            self.inflight.ended_after_launch = any(r.finished for r in reqs)
            if self.inflight.kind == "decode":
                for r in reqs:
                    r.draft = None  # (the prefill's drafts are behind once plain steps follow)

    def _launch_extend(self, batch, rows, t) -> InFlight:
        """Launch the prefill chunk of (request, n tokens) pairs in a [rows, t] program."""
        t0 = time.perf_counter()
        reqs = [r for r, _ in batch]
        tokens = np.zeros((rows, t), np.int32)
        kv_lens = np.zeros(rows, np.int32)
        q_lens = np.zeros(rows, np.int32)
        next_tokens = np.full(rows, -1, np.int32)  # the token after a chunk that does not end the prompt
        for i, (r, n) in enumerate(batch):
            tokens[i, :n] = r.token_slice(r.kv_len, r.kv_len + n)
            kv_lens[i], q_lens[i] = r.kv_len, n
            if r.todo > n:
                next_tokens[i] = r.token_slice(r.kv_len + n, r.kv_len + n + 1)[0]
        flags = SamplerFlags.of([r.params for r in reqs])
        pt = self._page_table(reqs, rows)
        sb = self._sampling(reqs, rows, flags, reuse=True)  # (extend donates only the cache)
        args = _to_device((tokens, next_tokens, pt, kv_lens, q_lens, sb))  # one transfer
        plain = self._prefills_plainly(reqs)
        if plain:
            self._leave_heads_behind(reqs)
        outputs = self._call("extend", plain, args, flags)
        return InFlight("extend", reqs, outputs, {}, flags, host_s=time.perf_counter() - t0)

    def _chain_on_prefill(self, f: InFlight, batch, rows: int) -> bool:
        """Launch the first decode or verify call of requests whose prompts prefill call f ends from its
        device outputs (its sampled tokens, its drafted trees cut on the device), before they are read
        back: where they are the whole running batch, in f's rows, nobody to admit. Unchained, that call
        paid its launch after the read-back, 3.4-4.1 ms at batch 1 on the H200 (spec-policy-s84's
        auto_launch), once a request. A host drafter drafts from the sampled token: not here."""
        reqs = f.reqs
        if (not self.overlap or f.flags.penalties or len(self.running) != len(reqs) or self._admission_due()
                or bucket(len(reqs), BATCH_BUCKETS) != rows or any(r.todo != n for r, n in batch)
                or any(r.params.max_tokens < 2 for r in reqs) or (self.drafter is not None and not self.device_drafter)):
            return False
        tree, nodes = self._choice_for(reqs)
        verify = nodes > 1 and f.outputs[4] is not None and self.cuts is not None
        steps = self._verify_steps_now(reqs) if verify else self._decode_steps_now(reqs)
        # (kv_len + todo: the same before and after the chunk, every request's todo being its chunk)
        need = [self._pages_needed(r, self._span(tree, nodes, steps) if verify else steps) - len(r.pages) for r in reqs]
        if (nodes > 1 and not verify) or sum(max(0, x) for x in need) > self.pool.available:
            self._decided = (rows, (tree, nodes))  # the next step's: one decision a call
            return False
        for (r, n), x in zip(batch, need):
            r.kv_len += n  # the host's bookkeeping of the chunk, ahead of its read-back
            if x > 0:
                r.pages += self.pool.alloc(x)
        if verify:
            self._run_verify(reqs, tree, nodes, rows, steps, after=f)
        else:
            self._run_decode(reqs, steps, after=f)
        self.inflight.chained = True  # (timed from the prefill's read-back: not a launch the policy prices)
        self.stats["prefill_chains"] += 1
        return True

    def _prefills_plainly(self, reqs) -> bool:
        """Whether a device drafter's prefill chunk runs the target alone, leaving the head behind:
        where the running batch's bucket gets no tree (it decodes plainly next, which leaves the
        head behind anyway: its catch-up and first draft would be thrown away; at batch 64 they
        made EAGLE-3 0.84x plain, spec-cmdbuf-NVIDIA-H200.json), or where every head in the chunk
        is behind already."""
        return self.device_drafter and (self._no_tree_at(len(self.running))
                                        or all(r.head_len is not None for r in reqs))

    def _run_verify(self, reqs, tree, nodes, rows, steps=1, overlap=True, after=None):
        """A verify call of `nodes`-node trees over reqs (a device drafter's programs draft `tree`).
        after: the prefill call whose drafted trees it verifies, cut on the device (_chain_on_prefill)."""
        t0, launched = time.perf_counter(), self._launch_clock()
        kv_lens = np.array([r.kv_len for r in reqs] + [0] * (rows - len(reqs)), np.int32)
        if after is not None:  # the prefill's drafted trees, cut on the device
            tokens, parents, num_nodes = self.cuts(*after.outputs[4], tree, nodes)
        else:
            n = bucket(nodes, TREE_BUCKETS)
            tokens, parents, num_nodes = np.zeros((rows, n), np.int32), np.full((rows, n), -1, np.int32), np.ones(rows, np.int32)
            depth = {} if tree is None else {"max_depth": tree.steps}
            for i, r in enumerate(reqs):
                d_tok, d_par = self.drafter.propose(r, nodes, **depth)
                m = 1 + len(d_tok)
                tokens[i, 0] = r.token_slice(r.kv_len, r.kv_len + 1)[0]
                tokens[i, 1:m] = d_tok
                parents[i, 1:m] = d_par
                num_nodes[i] = m
        self.stats["draft_time"] += time.perf_counter() - t0
        flags = SamplerFlags.of([r.params for r in reqs])
        budget, stop_ids = self._budgets_and_stops(reqs, rows, ahead=after is not None)
        sb = self._sampling(reqs, rows, flags, reuse=not self.device_drafter,  # verify_tree donates only the cache
                            ahead=after is not None)
        f = self._launch_verify(reqs, tree, nodes, flags, tokens, parents, kv_lens, num_nodes, sb,
                                budget=budget, stop_ids=stop_ids, steps=steps)
        if not self.device_drafter and self.spec_policy is not None:
            f.match_keys = self._match_keys(reqs)
        f.launched = launched  # (None but for a device drafter's call)
        if self.device_drafter and after is None:  # (a prefill's drafts are counted as the call's shape's)
            f.borrowed = frozenset(i for i, r in enumerate(reqs)
                                   if num_nodes[i] == 1 or r.draft is not None and r.draft.tree not in (None, tree))
        self._host_work_while_device_runs(f)
        f.host_s += time.perf_counter() - t0
        if overlap and self._may_overlap(f):
            self.inflight = f
        else:
            self._collect(f)

    def _launch_verify(self, reqs, tree, nodes, flags, tokens, parents, kv_lens, num_nodes, sb, pt=None, budget=None,
                       stop_ids=None, steps=1, num_steps=None, next_nodes=None):
        """Launch a verify program: verify_tree for a host drafter's trees; a device drafter's
        verify_steps, which also takes the token budgets, stop ids, its number of steps and the
        size of the trees it drafts itself (a chained call passes the last call's device arrays
        for these: num_steps holds `steps`)."""
        t0 = time.perf_counter()
        pt = self._page_table(reqs, tokens.shape[0]) if pt is None else pt
        if not self.device_drafter:
            args = _to_device((tokens, parents, pt, kv_lens, num_nodes, sb))  # one transfer
            *outputs, self.cache = self.programs.verify_tree(self.cache, *args, flags=flags)
            return InFlight("verify", reqs, tuple(outputs), {}, flags, nodes=nodes, host_s=time.perf_counter() - t0)
        if next_nodes is None:
            next_nodes = np.int32(min(nodes, tree.num_draft_tokens))
        num_steps = np.int32(steps) if num_steps is None else num_steps
        args = _to_device((tokens, parents, pt, kv_lens, num_nodes, budget, stop_ids, num_steps, next_nodes, sb))
        *outputs, self.cache = self.tree_programs[tree].verify_steps(self.cache, *args, flags=flags)
        # a chained call reuses the page table, node counts, stop ids, steps (their buffers unchanged)
        ins = dict(zip(("pt", "num_nodes", "stop_ids", "num_steps", "next_nodes"), args[2:3] + args[4:5] + args[6:9]))
        return InFlight("verify", reqs, tuple(outputs), dict(ins, pages=[len(r.pages) for r in reqs]), flags,
                        nodes=nodes, tree=tree, steps=steps, host_s=time.perf_counter() - t0)


def _to_device(tree):
    """jax.device_put of a tree's numpy leaves in one call; device arrays (a chained step's inputs
    are mostly the last step's outputs) pass as they are."""
    leaves, treedef = jax.tree.flatten(tree)
    host = [i for i, x in enumerate(leaves) if isinstance(x, np.ndarray | np.generic)]
    for i, x in zip(host, jax.device_put([leaves[i] for i in host])):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)
