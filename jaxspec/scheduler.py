"""Host-side scheduler: continuous batching over the jitted programs.

Each `step()`: admit waiting requests while pages allow; run one batch of prefill chunks; run one
decode (or speculative verify) step over every request whose prompt is in the cache; append
tokens, apply stop conditions, release finished requests' pages. A request that cannot get a page
is preempted (pages released, recomputed later from prompt + output, mostly from the prefix cache)
instead of the pool running dry.

Overlap: in steady decoding (same requests, nothing to prefill or admit) the step for t+1 is
launched from step t's outputs still on the device (the pending token, or EAGLE's next tree, and
the kv lengths advanced by the accepted counts) before step t's tokens are read back. The host's
reading, stop checks and streaming then run while the device computes, and the device never waits
for the host between steps. A request that stops in step t wastes its row of step t+1, which is
dropped; its K/V writes land past its committed tokens, in pages that later programs (dispatched
after it, so ordered after it on the device) may reuse.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable

import jax
import numpy as np

from jaxspec.draft_policy import DraftPolicy
from jaxspec.kv_cache import KVCache
from jaxspec.paging import PagePool
from jaxspec.drafters.eagle_step import MAX_VERIFY_STEPS
from jaxspec.programs import (BATCH_BUCKETS, MAX_DECODE_STEPS, STOP_ID_SLOTS, TREE_BUCKETS, Programs, bucket,
                              enable_compilation_cache, prefill_shapes)
from jaxspec.sampling import SamplerFlags, SamplingBatch, SamplingParams


DEFAULT_SPEC_MIN_GAIN = 1.1  # see Scheduler.__init__ (tests set it to 0: drafting always pays)


@dataclasses.dataclass(eq=False)  # identity: requests are looked up in lists every step
class Request:
    rid: int
    prompt_ids: list
    params: SamplingParams
    seed: int
    on_update: Callable | None = None  # called with (request, new token ids) as tokens arrive
    output_ids: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    top_logprobs: list = dataclasses.field(default_factory=list)
    pages: list = dataclasses.field(default_factory=list)
    kv_len: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    stop_text_len: int | None = None  # where a stop string cut the text
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    accept_lengths: list = dataclasses.field(default_factory=list)
    aborted: bool = False
    draft: tuple | None = None  # (tokens, parents) drafted on device for the next step (EAGLE)
    head_len: int | None = None  # EAGLE: the head's cache stops here (decoded plainly since)

    @property
    def tokens(self):
        return self.prompt_ids + self.output_ids

    def token_slice(self, start, end):
        """tokens[start:end] without building prompt + output (this runs every step)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:end] + self.output_ids[:max(0, end - p)]

    @property
    def todo(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) - self.kv_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class InFlight:
    """A decode or verify step launched and not yet read back."""
    kind: str  # "extend" (a prefill chunk), "decode" (up to `nodes` tokens a request) or "verify" (a draft tree)
    reqs: list
    outputs: tuple  # the program's outputs, on the device
    inputs: dict  # device inputs a chained next step derives its own from
    flags: SamplerFlags
    nodes: int = 1  # a verify step's tree nodes (1 for decode)
    steps: int = 1  # steps in the call
    plain: bool = False  # decode by the target alone (EAGLE's large-batch fallback)
    host_s: float = 0.0  # host time spent launching
    match_keys: list | None = None  # a host drafter's: DraftPolicy keys its requests drafted at


class Scheduler:
    clock = staticmethod(time.perf_counter)  # times steps for the drafting policy (tests drive it)

    def __init__(self, model, tokenizer, *, num_pages=None, page_size=16, max_batch=64, max_seq_len=None,
                 prefill_chunk=512, drafter=None, attn_impl="auto", jit=True, kv_dtype=None,
                 spec_max_verify_tokens=128, spec_max_host_verify_tokens=16, spec_min_nodes=4, spec_min_accept=2.0,
                 spec_probe_every=8, spec_min_gain=None, overlap=True, decode_steps=MAX_DECODE_STEPS, warmup=False,
                 warmup_flags=None, compile_cache=None):
        cfg = model.cfg
        self.cfg, self.tokenizer = cfg, tokenizer
        self.page_size, self.max_batch = page_size, max_batch
        rows_max = bucket(max_batch, BATCH_BUCKETS)  # no prefill program wider than the batch can be
        self.prefill_shapes = sorted({(min(r, rows_max), t) for r, t in prefill_shapes(prefill_chunk)})
        self.max_seq_len = min(max_seq_len or cfg.max_position, cfg.max_position)
        # a verify step writes a whole (padded) draft tree past the sequence's end
        slack = bucket(drafter.num_nodes, TREE_BUCKETS) if drafter is not None else 1
        self.max_pages_per_seq = -(-(self.max_seq_len + slack) // page_size)
        if num_pages is None:
            num_pages = max(self.max_pages_per_seq + 1, 1 + max_batch * 256 // page_size)
        if num_pages - 1 < self.max_pages_per_seq:
            raise ValueError(f"num_pages={num_pages} cannot hold one sequence of max_seq_len={self.max_seq_len} "
                             f"({self.max_pages_per_seq} pages of {page_size}); raise num_pages or lower max_seq_len")
        self.pool = PagePool(num_pages, page_size)
        dtype = kv_dtype or model.embed[...].dtype
        self.cache = KVCache.create(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype)
        # a device drafter (EAGLE head) keeps its own one-layer cache in the same pages
        self.device_drafter = getattr(drafter, "head", None) is not None
        if self.device_drafter:
            self.cache = (self.cache, drafter.create_cache(num_pages, page_size, dtype))
        if jit:
            enable_compilation_cache(compile_cache)
        self.programs = Programs(model, attn_impl=attn_impl, jit=jit, drafter=drafter)
        # a device drafter's large-batch fallback: the target alone, no head catch-up
        self.plain_programs = Programs(model, attn_impl=attn_impl, jit=jit) if self.device_drafter else None
        self.drafter = drafter
        # Large batches are compute-bound already: verifying big trees there costs more than it saves.
        # The tree shrinks to fit spec_max_verify_tokens per step, and below spec_min_nodes the step
        # falls back to plain decoding. A host drafter still sees every token; an EAGLE head is
        # left behind (its catch-up made the fallback 5-11% slower than plain on the H100,
        # spec-v3-mtbench), so a request decoded plainly once stays plain to its end.
        self.spec_max_verify_tokens, self.spec_min_nodes = spec_max_verify_tokens, spec_min_nodes
        # A host drafter's steps cannot chain (it drafts from the tokens just emitted), so their host time adds to the
        # device's: one costs about 1.5 plain steps on the H100 at batch 1, and more at larger batch, where NGRAM lost
        # while EAGLE won (MT-bench batch 8: 0.82x vs 1.75x, spec-v13-*; 0.78x under DraftPolicy, spec-v17-b8). Its
        # trees get a smaller budget, none from batch 8 by default, and a verify step must pay for itself:
        # DraftPolicy (draft_policy.py) verifies while the accept length expected at the requests' match lengths
        # x plain step / verify step >= spec_min_gain (above 1: the estimate is noisy, and every switch costs an
        # unchained step), and probes the match lengths that do not pay every spec_probe_every plain steps.
        self.spec_max_host_verify_tokens = spec_max_host_verify_tokens
        min_gain = DEFAULT_SPEC_MIN_GAIN if spec_min_gain is None else spec_min_gain
        self.policy = (DraftPolicy(min_gain, spec_min_accept, spec_probe_every)
                       if drafter is not None and not self.device_drafter else None)
        self.overlap = overlap
        # Plain decoding runs up to decode_steps steps a call while the batch is steady (see
        # _decode_steps_now); 1 launches a call a step.
        if not 1 <= decode_steps <= MAX_DECODE_STEPS:
            raise ValueError(f"decode_steps={decode_steps} must be in [1, {MAX_DECODE_STEPS}]")
        self.decode_steps = decode_steps
        self.inflight: InFlight | None = None
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._ids = itertools.count()
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = set(cfg.eos_token_ids) | ({tok_eos} if tok_eos is not None else set())
        self.stats = dict(steps=0, verify_steps=0, emitted=0, prefill_tokens=0, preemptions=0, verify_time=0.0,
                          draft_time=0.0, decode_time=0.0, prefill_time=0.0, chained_steps=0, wait_time=0.0)
        if warmup:
            self.warmup(warmup_flags, progress=warmup == "progress")

    # -- the program set, built before the first request -------------------------------------------
    def program_specs(self, flag_sets=None) -> list:
        """(programs, name, flags, cache, args) of every program this engine can launch with the
        given sampler flags (default: greedy, and sampling with filters): prefill shapes, a decode
        step per batch bucket, and a verify step per batch bucket that gets a tree. Penalties and
        top logprobs add programs that are compiled when first asked for."""
        flag_sets = flag_sets or (SamplerFlags(), SamplerFlags(sample=True, filter=True))
        rows_all = [b for b in BATCH_BUCKETS if b <= bucket(self.max_batch, BATCH_BUCKETS)]
        decode, target_cache = self.programs, self.cache
        if self.device_drafter:
            decode, target_cache = self.plain_programs, self.cache[0]
        specs = []
        for flags in flag_sets:
            for rows, t in self.prefill_shapes:
                specs.append((self.programs, "extend", flags, self.cache, self._dummy_inputs(rows, t)))
            for rows in rows_all:
                specs.append((decode, "decode", flags, target_cache, self._dummy_decode(rows)))
                if self.tree_size(rows) > 1:
                    n = bucket(self.tree_size(rows), TREE_BUCKETS)
                    specs.append((self.programs, self._verify_name, flags, self.cache, self._dummy_verify(rows, n)))
        return specs

    def _dummy_inputs(self, rows, t, tree=False):
        """Zeros shaped as an extend call's inputs of rows x t tokens (or, with tree, a verify_tree
        call's): what the programs are built for."""
        z = lambda *shape: np.zeros(shape, np.int32)
        second = z(rows, t) if tree else z(rows)  # parents, or next_tokens
        return (z(rows, t), second, z(rows, self.max_pages_per_seq), z(rows), z(rows),
                SamplingBatch.build([SamplingParams()] * rows, [0] * rows, [0] * rows))

    @property
    def _verify_name(self):
        return "verify_steps" if self.device_drafter else "verify_tree"

    def _dummy_verify(self, rows, n):
        args = self._dummy_inputs(rows, n, tree=True)
        if not self.device_drafter:
            return args
        z = lambda *shape: np.zeros(shape, np.int32)
        return args[:5] + (z(rows), z(rows, STOP_ID_SLOTS), np.int32(1), np.int32(1)) + args[5:]

    def _dummy_decode(self, rows):
        z = lambda *shape: np.zeros(shape, np.int32)
        return (z(rows, 1), z(rows, self.max_pages_per_seq), z(rows), z(rows), z(rows, STOP_ID_SLOTS), np.int32(1),
                SamplingBatch.build([SamplingParams()] * rows, [0] * rows, [0] * rows))

    def warmup(self, flag_sets=None, progress=False) -> dict:
        """Compile the whole program set now (see program_specs); a compile after this is counted
        in late_compiles. Returns {programs, seconds}."""
        specs = self.program_specs(flag_sets)
        groups = {id(p): p for p, *_ in specs}.values()
        seconds = sum(progs.build([s[1:] for s in specs if s[0] is progs], progress=progress) for progs in groups)
        return dict(programs=sum(len(p.table) for p in groups), seconds=seconds)

    @property
    def late_compiles(self) -> list:
        """Programs compiled after warm-up: each made some request wait for a compile."""
        return self.programs.late_compiles + (self.plain_programs.late_compiles if self.plain_programs else [])

    # -- requests ----------------------------------------------------------------------------
    def add(self, prompt_ids, params: SamplingParams, on_update=None) -> Request:
        params.validate(self.cfg.vocab_size)
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if len(prompt_ids) + params.max_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"maximum sequence length {self.max_seq_len}")
        rid = next(self._ids)
        seed = params.seed if params.seed is not None else int(np.random.randint(0, 2**31))
        req = Request(rid, prompt_ids, params, seed, on_update)
        self.waiting.append(req)
        return req

    def abort(self, req: Request):
        if req.finished:
            return
        req.aborted = True
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the loop ------------------------------------------------------------------------------
    def step(self):
        if self.inflight is not None:
            done, self.inflight = self.inflight, None
            nxt = self._chain(done) if self._reserve_chain(done) else None
            self._collect(done)
            if nxt is not None:
                self.inflight = nxt
                self.stats["steps"] += 1
                self.stats["chained_steps"] += 1
                return
        self._admit()
        prefill = [r for r in self.running if r.todo > 1]
        decode = [r for r in self.running if r.todo == 1]
        if prefill:
            self._run_prefill(prefill)
        if decode:
            nodes = self._nodes_for(decode)
            rows = bucket(len(decode), BATCH_BUCKETS)  # the bucket whose tree size `nodes` is
            # a request whose EAGLE head fell behind (head_len set) decodes plainly to its end
            all_plain = nodes == 1 or all(r.head_len is not None for r in decode)
            all_spec = nodes > 1 and all(r.head_len is None for r in decode)
            steps = self._decode_steps_now(decode) if all_plain else self._verify_steps_now(decode) if all_spec else 1
            decode = self._reserve(decode, self._span(nodes, steps) if all_spec else max(nodes, steps))
            drafts = [nodes > 1 and r.head_len is None for r in decode]
            spec = [r for r, d in zip(decode, drafts) if d]
            plain = [r for r, d in zip(decode, drafts) if not d]
            alone = not (spec and plain)  # one step in flight at a time: two groups are read back at once
            if spec:
                # rows of the whole decode batch's bucket: its tree size is that bucket's, and
                # only (bucket, its tree) pairs are built at start-up
                self._run_verify(spec, nodes, rows, steps if all_spec else 1, overlap=alone)
            if plain:
                self._run_decode(plain, steps, overlap=alone)
        self.stats["steps"] += 1

    def tree_size(self, batch: int) -> int:
        """Nodes a step verifies at this batch size: by its batch bucket, so that each bucket has one
        verify program."""
        if self.drafter is None:
            return 1
        budget = self.spec_max_verify_tokens if self.device_drafter else self.spec_max_host_verify_tokens
        nodes = min(self.drafter.num_nodes, budget // bucket(max(batch, 1), BATCH_BUCKETS))
        return nodes if nodes >= min(self.spec_min_nodes, self.drafter.num_nodes) else 1

    def _nodes_for(self, reqs) -> int:
        """Nodes a step verifies now: the tree that fits, or 1 where a host drafter's policy says
        the batch decodes plainly."""
        nodes = self.tree_size(len(reqs))
        if nodes > 1 and self.policy is not None and not self.policy.should_verify(self._match_keys(reqs, nodes),
                                                                                   len(reqs)):
            return 1
        return nodes

    def _decode_steps_now(self, reqs) -> int:
        """Steps the next plain decode call runs: decode_steps while the batch is steady (every
        running request decoding, none waiting that could be admitted, so that no newcomer waits
        behind a long call), without penalties (their token histories are built on the host) and
        without a host drafter (its policy decides step by step); 1 otherwise. Never more than the
        most tokens a request may still emit."""
        if (self.decode_steps == 1 or (self.drafter is not None and not self.device_drafter)
                or len(reqs) != len(self.running) or (self.waiting and len(self.running) < self.max_batch)
                or any(r.params.penalised for r in reqs)):
            return 1
        return max(1, min(self.decode_steps, max(r.params.max_tokens - len(r.output_ids) for r in reqs)))

    def _verify_steps_now(self, reqs) -> int:
        """Speculative steps the next verify call runs: a device drafter's steps chain on the
        device, up to MAX_VERIFY_STEPS while the batch is steady (as _decode_steps_now)."""
        if not self.device_drafter or self.decode_steps == 1:
            return 1
        return min(MAX_VERIFY_STEPS, self._decode_steps_now(reqs))

    def _span(self, nodes, steps) -> int:
        """Cache slots past a request's kv length that a call of `steps` verify steps may write:
        every step but the last accepts at most the tree's depth + 1 tokens."""
        depth = getattr(getattr(self.drafter, "tree", None), "steps", nodes)
        return (steps - 1) * min(nodes, depth + 1) + nodes

    def _stop_ids(self, req) -> list:
        p = req.params
        return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids))

    def _match_keys(self, reqs, nodes) -> list:
        """Each request's DraftPolicy key: (tree size, bucket of how many of its latest tokens the
        host drafter matched), or 0 where it matched none. The tree size is part of the key because
        the accept length learned with 8-node trees at batch 1 overstates 4-node trees' at batch 8."""
        match_length = getattr(self.drafter, "match_length", None)
        keys = [DraftPolicy.key(match_length(r)) if match_length else 1 for r in reqs]
        return [(nodes, k) if k else 0 for k in keys]

    def _time_step(self, kind, batch, now, prefill=False):
        if self.policy is not None:  # only a host drafter's policy reads the step times
            self.policy.timed(kind, batch, now, prefill)

    def _pages_needed(self, req, extra):
        """Pages for the request's tokens and `extra` slots past them; a row never holds more than
        the page table's width (a request's writes stop at max_seq_len + the tree's slack)."""
        return min(-(-(req.kv_len + req.todo + extra) // self.page_size), self.max_pages_per_seq)

    def _admit(self):
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            toks = req.tokens
            matched = self.pool.match_prefix(toks)
            need = -(-(len(toks) + 1) // self.page_size) - len(matched)
            # keep a page per running request in hand so admission does not starve decoding
            if need + len(self.running) > self.pool.available:
                self.pool.release(matched)
                break
            self.waiting.pop(0)
            req.pages = matched + self.pool.alloc(need)
            req.kv_len = len(matched) * self.page_size
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

    def _cached_tokens(self, req):
        """The tokens whose pages may serve later requests as a prefix: with an EAGLE head, only
        those the head's cache holds too."""
        return req.tokens[:req.kv_len if req.head_len is None else min(req.kv_len, req.head_len)]

    def _preempt(self, req):
        self.pool.release(req.pages, self._cached_tokens(req))
        req.pages, req.kv_len, req.draft, req.head_len = [], 0, None, None  # recomputed with the head
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.stats["preemptions"] += 1

    def _page_table(self, reqs, rows):
        pt = np.zeros((rows, self.max_pages_per_seq), np.int32)
        for i, r in enumerate(reqs):
            pt[i, :len(r.pages)] = r.pages
        return pt

    def _sampling(self, reqs, rows, flags):
        hist = num_prompt = None
        if flags.penalties:
            hist = [r.tokens[:r.kv_len + r.todo] for r in reqs]
            num_prompt = [len(r.prompt_ids) for r in reqs]
        return SamplingBatch.build([r.params for r in reqs], [r.seed for r in reqs],
                                   [len(r.output_ids) for r in reqs], hist, num_prompt, pad_to=rows)

    def _host_work_while_device_runs(self, waits_for: InFlight):
        """Dispatch is asynchronous: until the outputs the host waits for next are ready, it is free."""
        prepare = getattr(self.drafter, "prepare", None)
        # at a batch that decodes plainly no draft is needed: a host drafter's backlog (NGRAM's
        # trie insertion) waits until trees come back, instead of taxing every plain step
        if prepare is not None and self.tree_size(len(self.running)) > 1:
            prepare(self.running, busy=lambda: not waits_for.outputs[0].is_ready())

    def _run_prefill(self, reqs):
        """One chunk of prefill in the prefill shape that takes the most prompt tokens now."""
        best = None
        for rows, t in self.prefill_shapes:
            batch = [(r, min(r.todo, t)) for r in reqs[:rows]]
            got = sum(n for _, n in batch)
            if best is None or got > best[0]:
                best = (got, rows, t, batch)
        got, rows, t, batch = best
        self.stats["prefill_tokens"] += got
        self._run_extend(batch, rows, t, "prefill_time")

    def _run_decode(self, reqs, steps, overlap=True):
        """Up to `steps` plain decode steps over reqs in one call (by the target alone where a
        device drafter falls back: its head is left behind)."""
        t0 = time.perf_counter()
        if self.device_drafter:
            for r in reqs:
                r.draft = None
                if r.head_len is None:
                    r.head_len = r.kv_len
        rows = bucket(len(reqs), BATCH_BUCKETS)
        tokens = np.zeros((rows, 1), np.int32)
        kv_lens, budget = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        stop_ids = np.full((rows, STOP_ID_SLOTS), -1, np.int32)
        for i, r in enumerate(reqs):
            tokens[i, 0] = r.token_slice(r.kv_len, r.kv_len + 1)[0]
            kv_lens[i], budget[i] = r.kv_len, r.params.max_tokens - len(r.output_ids)
            ids = self._stop_ids(r)[:STOP_ID_SLOTS]
            stop_ids[i, :len(ids)] = ids
        flags = SamplerFlags.of([r.params for r in reqs])
        sb = self._sampling(reqs, rows, flags)
        pt = self._page_table(reqs, rows)
        args = _to_device((tokens, pt, kv_lens, budget, stop_ids, np.int32(steps), sb))
        outputs = self._call_decode(self.device_drafter, args, flags)
        f = InFlight("decode", reqs, outputs, dict(pt=args[1], stop_ids=args[4], num_steps=args[5],
                                                   pages=[len(r.pages) for r in reqs]),
                     flags, steps=steps, plain=self.device_drafter, host_s=time.perf_counter() - t0)
        self._host_work_while_device_runs(f)
        if overlap and self._may_overlap(f):
            self.inflight = f  # read back in the next step, after the call that follows it is launched
        else:
            self._collect(f)

    def _call_decode(self, plain, args, flags):
        """Launch a decode program (the target alone when plain); returns its outputs, cache aside."""
        if plain:  # the target's cache alone
            *outputs, tcache = self.plain_programs.decode(self.cache[0], *args, flags=flags)
            self.cache = (tcache, self.cache[1])
        else:
            *outputs, self.cache = self.programs.decode(self.cache, *args, flags=flags)
        return tuple(outputs)

    def _run_extend(self, batch, rows, t, timer):
        """Feed n new tokens per request (a [rows, t] program: a prefill chunk); a request whose
        tokens are then all cached gets the sampled next token."""
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
        sb = self._sampling(reqs, rows, flags)
        args = _to_device((tokens, next_tokens, pt, kv_lens, q_lens, sb))  # one transfer
        *outputs, self.cache = self.programs.extend(self.cache, *args, flags=flags)
        f = InFlight("extend", reqs, tuple(outputs), {}, flags, host_s=time.perf_counter() - t0)
        self._host_work_while_device_runs(f)
        self._collect(f, [n for _, n in batch], timer)

    def _run_verify(self, reqs, nodes, rows, steps=1, overlap=True):
        t0 = time.perf_counter()
        n = bucket(nodes, TREE_BUCKETS)
        tokens = np.zeros((rows, n), np.int32)
        parents = np.full((rows, n), -1, np.int32)
        num_nodes = np.ones(rows, np.int32)
        kv_lens = np.zeros(rows, np.int32)
        for i, r in enumerate(reqs):
            d_tok, d_par = self.drafter.propose(r, nodes)
            m = 1 + len(d_tok)
            tokens[i, 0] = r.token_slice(r.kv_len, r.kv_len + 1)[0]
            tokens[i, 1:m] = d_tok
            parents[i, 1:m] = d_par
            num_nodes[i], kv_lens[i] = m, r.kv_len
        self.stats["draft_time"] += time.perf_counter() - t0
        flags = SamplerFlags.of([r.params for r in reqs])
        budget = np.zeros(rows, np.int32)
        stop_ids = np.full((rows, STOP_ID_SLOTS), -1, np.int32)
        for i, r in enumerate(reqs):
            budget[i] = r.params.max_tokens - len(r.output_ids)
            ids = self._stop_ids(r)[:STOP_ID_SLOTS]
            stop_ids[i, :len(ids)] = ids
        f = self._launch_verify(reqs, nodes, flags, tokens, parents, kv_lens, num_nodes,
                                self._sampling(reqs, rows, flags), budget=budget, stop_ids=stop_ids, steps=steps)
        if self.policy is not None:
            f.match_keys = self._match_keys(reqs, nodes)
        self._host_work_while_device_runs(f)
        f.host_s += time.perf_counter() - t0
        if overlap and self._may_overlap(f):
            self.inflight = f
        else:
            self._collect(f)

    def _launch_verify(self, reqs, nodes, flags, tokens, parents, kv_lens, num_nodes, sb, pt=None, budget=None,
                       stop_ids=None, steps=1, next_nodes=None):
        """Launch a verify program: verify_tree for a host drafter's trees; a device drafter's
        verify_steps, which also takes the token budgets, stop ids, its number of steps and the
        size of the trees it drafts itself (given as device arrays by a chained call)."""
        t0 = time.perf_counter()
        pt = self._page_table(reqs, tokens.shape[0]) if pt is None else pt
        if not self.device_drafter:
            args = _to_device((tokens, parents, pt, kv_lens, num_nodes, sb))  # one transfer
            *outputs, self.cache = self.programs.verify_tree(self.cache, *args, flags=flags)
            return InFlight("verify", reqs, tuple(outputs), {}, flags, nodes=nodes, host_s=time.perf_counter() - t0)
        if next_nodes is None:
            next_nodes = np.int32(min(nodes, self.drafter.num_nodes))
        args = _to_device((tokens, parents, pt, kv_lens, num_nodes, budget, stop_ids, np.int32(steps)
                           if isinstance(steps, int) else steps, next_nodes, sb))
        *outputs, self.cache = self.programs.verify_steps(self.cache, *args, flags=flags)
        # a chained call reuses the page table, node counts, stop ids, steps (their buffers unchanged)
        ins = dict(zip(("pt", "num_nodes", "stop_ids", "num_steps", "next_nodes"), args[2:3] + args[4:5] + args[6:9]))
        return InFlight("verify", reqs, tuple(outputs), dict(ins, pages=[len(r.pages) for r in reqs]), flags,
                        nodes=nodes, steps=int(steps), host_s=time.perf_counter() - t0)

    # -- overlap: the next step launched from the last one's device outputs ------------------------
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
        if not self._may_overlap(f) or any(r.finished for r in f.reqs):
            return False
        if len(self.running) != len(f.reqs) or (self.waiting and len(self.running) < self.max_batch):
            return False  # the batch changes: admissions, prefill chunks, preemptions
        if self._nodes_for(f.reqs) != (f.nodes if f.kind == "verify" else 1) and not f.plain:
            return False  # trees fit again or a probe is due (a plain step chains while the batch decodes plainly)
        if f.steps != (self._decode_steps_now(f.reqs) if f.kind == "decode" else self._verify_steps_now(f.reqs)):
            return False
        # a request that may reach max_tokens in call t would waste call t + 1 (and may run past its
        # pages' slack): end the chain there. A step emits at most the tree's depth + 1 tokens.
        most = f.steps * (1 if f.kind == "decode" else min(f.nodes, self.drafter.tree.steps + 1))
        if any(len(r.output_ids) + most >= r.params.max_tokens for r in f.reqs):
            return False
        # pages for both calls' worst case: every step accepting all it may
        span = f.steps if f.kind == "decode" else self._span(f.nodes, f.steps)
        need = [self._pages_needed(r, 2 * span - 1) - len(r.pages) for r in f.reqs]
        if sum(max(0, x) for x in need) > self.pool.available:
            return False
        for r, x in zip(f.reqs, need):
            if x > 0:
                r.pages += self.pool.alloc(x)
        return True

    def _chain(self, f: InFlight) -> InFlight:
        t0 = time.perf_counter()
        reqs, ins = f.reqs, f.inputs
        rows = f.outputs[1].shape[0]
        # The page table again unless pages were added: an input whose buffer is unchanged keeps
        # XLA's recorded command buffer as it is (the carried inputs reuse theirs: Programs donates them).
        pages = [len(r.pages) for r in reqs]
        pt = ins["pt"] if pages == ins["pages"] else jax.device_put(self._page_table(reqs, rows))
        if f.kind == "decode":
            tokens, kv_lens, sb, budget = f.outputs[6]  # computed by the call itself
            args = (tokens, pt, kv_lens, budget, ins["stop_ids"], ins["num_steps"], sb)
            outputs = self._call_decode(f.plain, args, f.flags)
            g = InFlight("decode", reqs, outputs, dict(ins, pt=pt, pages=pages), f.flags, steps=f.steps,
                         plain=f.plain)
        else:
            tokens, parents, kv_lens, sb, budget = f.outputs[6]  # computed by the call itself
            num_nodes = ins.get("chained_nodes")  # the drafted trees', for every row (the budget stops padding)
            if num_nodes is None:
                num_nodes = np.full(rows, min(f.nodes, self.drafter.num_nodes), np.int32)
            g = self._launch_verify(reqs, f.nodes, f.flags, tokens, parents, kv_lens, num_nodes, sb, pt, budget,
                                    ins["stop_ids"], ins["num_steps"], ins["next_nodes"])
            g.inputs["chained_nodes"] = g.inputs["num_nodes"]
        self._host_work_while_device_runs(f)  # a paused host drafter keeps learning the emitted tokens
        g.host_s = time.perf_counter() - t0
        return g

    def _collect(self, f: InFlight, chunk=None, timer=None):
        """Read a step's outputs back (one transfer) and emit; rows of requests that finished since
        it was launched are dropped."""
        t0 = time.perf_counter()
        jax.block_until_ready(f.outputs[:2])
        arrived = self.clock()
        self.stats["wait_time"] += time.perf_counter() - t0  # the host idle: a device-bound step
        # read what the host needs: tokens and counts, logprobs only if asked for; the drafted trees
        # stay on the device, where the next (chained) step takes them from
        want_lp = any(r.params.logprobs is not None for r in f.reqs)
        tree = f.outputs[5 if f.kind == "verify" else 4]
        shared = None if tree is None else _OnDevice(tree)
        if f.kind == "decode":
            toks, count, lp, top_v, top_i = jax.device_get((*f.outputs[:2], f.outputs[2] if want_lp else None,
                                                            *f.outputs[3:5]))
            for i, r in enumerate(f.reqs):
                if r.finished:
                    continue
                c = int(count[i])
                r.kv_len += c
                self._emit(r, toks[i, :c].tolist(), None if lp is None else lp[i, :c].tolist(),
                           None if top_i is None else [(top_v[i, j], top_i[i, j]) for j in range(c)])
            self._time_step("decode", len(f.reqs), arrived)
            self.stats["decode_time"] += f.host_s + time.perf_counter() - t0
            return
        if f.kind == "extend":
            nxt, lp, top_v, top_i = jax.device_get((f.outputs[0], f.outputs[1] if want_lp else None, *f.outputs[2:4]))
            for i, r in enumerate(f.reqs):
                if r.finished:
                    continue
                r.kv_len += 1 if chunk is None else chunk[i]
                if r.todo == 0:
                    r.draft = None if shared is None else DraftRow(shared, i)
                    self._emit(r, [int(nxt[i])], None if lp is None else [float(lp[i])],
                               None if top_i is None else [(top_v[i], top_i[i])])
            self._time_step("decode", len(f.reqs), arrived, prefill=timer == "prefill_time")
            self.stats[timer or "decode_time"] += f.host_s + time.perf_counter() - t0
            return
        toks, count, lp, top_v, top_i = jax.device_get((*f.outputs[:2], f.outputs[2] if want_lp else None,
                                                        *f.outputs[3:5]))
        if self.policy is not None:
            live = [i for i, r in enumerate(f.reqs) if not r.finished]
            self.policy.verified([f.match_keys[i] for i in live], [int(count[i]) for i in live], len(f.reqs))
        self._time_step("verify", len(f.reqs), arrived)
        if toks.ndim == 2:  # verify_tree: one step; as verify_steps' [B, steps, N]
            toks, count = toks[:, None], count[:, None]
            lp, top_v, top_i = (None if x is None else x[:, None] for x in (lp, top_v, top_i))
        for i, r in enumerate(f.reqs):
            if shared is not None and not r.finished:
                r.draft = DraftRow(shared, i)
            for s in range(count.shape[1]):
                c = int(count[i, s])
                if r.finished or c == 0:
                    break
                r.kv_len += c
                r.accept_lengths.append(c)
                self._emit(r, toks[i, s, :c].tolist(), None if lp is None else lp[i, s, :c].tolist(),
                           None if top_i is None else [(top_v[i, s, j], top_i[i, s, j]) for j in range(c)])
        self.stats["verify_steps"] += 1
        self.stats["verify_time"] += f.host_s + time.perf_counter() - t0


    # -- outputs -------------------------------------------------------------------------------
    def _emit(self, req, toks, lps, tops):
        """Append tokens one by one; the first stop condition met ends the request there."""
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        p = req.params
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
            if tok in p.stop_token_ids or (tok in self.eos_ids and not p.ignore_eos):
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

    def _hits_stop_string(self, req):
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        tail = max(len(s) for s in req.params.stop) + 16
        start = max(0, len(req.text) - tail)
        req.text = text
        cut = [text.find(s, start) for s in req.params.stop]
        cut = [c for c in cut if c >= 0]
        if cut:
            req.stop_text_len = min(cut)
            return True
        return False

    def _finish(self, req, reason):
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        if req in self.running:
            self.running.remove(req)
            self.pool.release(req.pages, self._cached_tokens(req))
            req.pages = []
        if self.drafter is not None:
            self.drafter.finish(req)
        if req.on_update:
            req.on_update(req, [])


def _to_device(tree):
    """jax.device_put of a tree's numpy leaves in one call; device arrays (a chained step's inputs
    are mostly the last step's outputs) pass as they are."""
    leaves, treedef = jax.tree.flatten(tree)
    host = [i for i, x in enumerate(leaves) if isinstance(x, np.ndarray)]
    for i, x in zip(host, jax.device_put([leaves[i] for i in host])):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


class _OnDevice:
    """A step's drafted trees, copied to the host only when a step that is not chained asks."""
    __slots__ = ("arrays", "host")

    def __init__(self, arrays):
        self.arrays, self.host = arrays, None

    def get(self):
        if self.host is None:
            self.host = jax.device_get(self.arrays)
        return self.host


class DraftRow:
    """Row i of a step's drafted trees: unpacks as (tokens, parents), fetched on first use."""
    __slots__ = ("shared", "i")

    def __init__(self, shared, i):
        self.shared, self.i = shared, i

    def __iter__(self):
        tokens, parents = self.shared.get()
        return iter((tokens[self.i], parents[self.i]))
