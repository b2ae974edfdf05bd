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
for the host between steps. A request that stops in step t on the device (max_tokens, a stop id)
has no budget left in step t+1, which skips its row; one stopped by the host (a stop string)
wastes its row of step t+1, which is dropped: its K/V writes land past its committed tokens, in
pages that later programs (dispatched after it, so ordered after it on the device) may reuse."""
from __future__ import annotations

import itertools
import os
import time

import jax
import numpy as np

from jaxspec.kv_cache import KVCache
from jaxspec import spec_policy as spec_policy_module
from jaxspec.paging import PagePool, pages_that_fit
from jaxspec.drafters.eagle_step import MAX_VERIFY_STEPS
from jaxspec.program_store import enable_compilation_cache
from jaxspec.programs import BATCH_BUCKETS, MAX_DECODE_STEPS, TREE_BUCKETS, Programs, bucket, prefill_shapes
from jaxspec.sampling import SamplingParams
from jaxspec.scheduler.admission import Admission
from jaxspec.scheduler.chaining import Chaining
from jaxspec.scheduler.dispatch import Dispatch
from jaxspec.scheduler.joining import Joining, RowJoin
from jaxspec.scheduler.outputs import Outputs
from jaxspec.scheduler.trees import PLAIN, TreeSizing
from jaxspec.sharding import cache_sharding
from jaxspec.scheduler.request import InFlight, Request
from jaxspec.scheduler.startup import StartUp


VERIFY_STEPS = 4  # a verify call's steps while the batch is steady (launch cost against tokens past a stop)
AUTO_MAX_VERIFY_TOKENS = 4096  # spec_policy 'auto''s tree-node budget a verify step (see Scheduler.__init__)
DEFAULT_SPEC_MIN_GAIN = 1.1  # see Scheduler.__init__ (tests set it to 0: drafting always pays)


class Scheduler(Admission, Dispatch, Chaining, Joining, Outputs, TreeSizing, StartUp):
    clock = staticmethod(time.perf_counter)  # times steps for the drafting policy (tests drive it)

    def __init__(self, model, tokenizer, *, num_pages=None, page_size=16, max_batch=64, max_seq_len=None,
                 prefill_chunk=512, drafter=None, attn_impl="auto", jit=True, kv_dtype=None,
                 spec_max_verify_tokens=None, spec_max_host_verify_tokens=16, spec_min_nodes=None, spec_min_accept=2.0,
                 spec_probe_every=32, spec_min_gain=None, overlap=True, decode_steps=MAX_DECODE_STEPS, warmup=False,
                 verify_steps=VERIFY_STEPS, warmup_flags=None, compile_cache=None, build_workers=None, mesh=None,
                 mem_fraction=None, spec_policy="fixed", spec_trees=None, scheduler_delay_factor=0.0,
                 join_newcomers=False):
        """mesh: a tensor-parallel mesh (sharding.tp_mesh) the model is laid out and sharded for:
        the caches are sharded by KV head, the programs partitioned over it. mem_fraction: with
        num_pages None, the KV pool takes this share of the device memory left free after the
        weights (SGLang's --mem-fraction-static), where the device reports its memory, up to twice
        what max_batch sequences of max_seq_len tokens take.
        spec_policy: 'fixed' (a device drafter verifies its tree, cut to fit its batch bucket) or
        'auto' (trees.py: one of several tree shapes chosen every call, where the fixed rule
        verifies, by the step costs seen and the accept lengths seen); spec_trees: the shapes
        'auto' chooses among (default: the drafter's auto_trees()). spec_max_verify_tokens: tree
        nodes a verify step may take over its batch bucket (default 128 under 'fixed', 4096 under
        'auto'). scheduler_delay_factor: vLLM's; see Admission._admission_due. join_newcomers: a request
        is admitted into a row of the running batch's chain that has ended, without a drafter or with a
        device drafter (joining.py; off until timed on a GPU: on the CPU it cut the calls launched after
        a read-back 4-5x, and ran batch 64 faster, batch 8 slower: join_calls-smoke-*-cpu.json)."""
        cfg = model.cfg
        self.mesh = mesh
        self.cfg, self.tokenizer = cfg, tokenizer
        self.page_size, self.max_batch = page_size, max_batch
        rows_max = bucket(max_batch, BATCH_BUCKETS)  # no prefill program wider than the batch can be
        self.prefill_shapes = prefill_shapes(prefill_chunk, rows_max)
        self.max_seq_len = min(max_seq_len or cfg.max_position, cfg.max_position)
        # a verify step writes a whole (padded) draft tree past the sequence's end, and DFLASH's
        # draft its block after the accepted tokens
        self.draft_slots = getattr(drafter, "draft_slots", 0)
        auto_trees = (tuple(spec_trees or drafter.auto_trees())
                      if spec_policy == "auto" and getattr(drafter, "head", None) is not None else None)
        if auto_trees and spec_policy_module.USE_LINKS:  # its verify calls also count what their trees' cuts would emit
            drafter = drafter.with_policy_shapes(auto_trees)
        nodes = max(t.num_draft_tokens for t in auto_trees) if auto_trees else getattr(drafter, "num_nodes", 1)
        slack = bucket(nodes, TREE_BUCKETS) + self.draft_slots
        self.max_pages_per_seq = -(-(self.max_seq_len + slack) // page_size)
        dtype = kv_dtype or model.embed[...].dtype
        if num_pages is None:
            fit = mem_fraction and pages_that_fit(cfg, drafter, page_size, dtype, mem_fraction, mesh)
            # at most twice what max_batch full-length sequences hold (the rest serves as prefix
            # cache): a pool of most of an H100 ran EAGLE-3 at 0.92x, plain at 0.97x, the speed of
            # one of 2049 pages at batch 1 (pool_size-NVIDIA-H100-80GB-HBM3.json)
            fit = fit and min(fit, 1 + 2 * max_batch * self.max_pages_per_seq)
            num_pages = fit or max(self.max_pages_per_seq + 1, 1 + max_batch * 256 // page_size)
        if num_pages - 1 < self.max_pages_per_seq:
            raise ValueError(f"num_pages={num_pages} cannot hold one sequence of max_seq_len={self.max_seq_len} "
                             f"({self.max_pages_per_seq} pages of {page_size}); raise num_pages or lower max_seq_len")
        self.pool = PagePool(num_pages, page_size)
        self.cache = KVCache.create(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype,
                                    cache_sharding(mesh, cfg.num_kv_heads))
        # a device drafter (EAGLE head) keeps its own cache in the same pages
        self.device_drafter = getattr(drafter, "head", None) is not None
        if self.device_drafter:
            self.cache = (self.cache, drafter.create_cache(num_pages, page_size, dtype, mesh))
        folder = enable_compilation_cache(compile_cache) if jit else None
        # exported programs beside XLA's entries (not for a mesh: its programs are traced each start)
        store = os.path.join(folder, "jaxspec-programs") if folder and mesh is None else None
        programs_kw = dict(attn_impl=attn_impl, jit=jit, store=store, mesh=mesh)
        self.programs = Programs(model, drafter=drafter, **programs_kw)
        # a device drafter's large-batch fallback: the target alone, no head catch-up
        self.plain_programs = Programs(model, **programs_kw) if self.device_drafter else None
        self.drafter = drafter
        self.row_join = RowJoin(jit) if join_newcomers and (drafter is None or self.device_drafter) else None
        self.first_runs = jax.default_backend() == "gpu"  # warmup() runs each program once (_run_once)
        self.build_workers = build_workers  # processes for a cold start's programs (None: program_workers decides)
        # Large batches are compute-bound already: verifying big trees there costs more than it saves.
        # The tree shrinks to fit spec_max_verify_tokens per step, and below spec_min_nodes the step
        # falls back to plain decoding. A host drafter still sees every token; an EAGLE head is
        # left behind (its catch-up made the fallback 5-11% slower than plain on the H100,
        # spec-v3-mtbench), so a request decoded plainly once stays plain to its end.
        # A device drafter's tree cut to fit drafts as deep as the whole tree but accepts less: 4-node
        # trees at batch 32 ran at 0.74x plain on MT-bench and 0.83x on HumanEval (spec-policy-NVIDIA-H200
        # .json), the 64 + 16 MT-bench waves with 8-node trees for the 16 at 0.88x (spec-b64-), while
        # 16-node trees at batch 8 won (1.07-1.2x). So by default it verifies no tree below 16 nodes
        # (4 for a host drafter, whose budget is spec_max_host_verify_tokens); a drafter's own smaller
        # tree is kept whole.
        # Under 'auto' the budget only bounds the shapes built, and the policy picks among them: served
        # on the H200 (MT-bench, 256 tokens) it ran at 1.11x / 1.12x plain at concurrency 32 / 128 with
        # 4096 nodes, where the fixed tree under 128 decoded plainly from 16 rows: 0.90x / 1.04x
        # (serve-auto-NVIDIA-H200.json)
        if spec_max_verify_tokens is None:
            spec_max_verify_tokens = AUTO_MAX_VERIFY_TOKENS if spec_policy == "auto" else 128
        if spec_min_nodes is None:
            spec_min_nodes = 16 if self.device_drafter else 4
        self.spec_max_verify_tokens, self.spec_min_nodes = spec_max_verify_tokens, spec_min_nodes
        # A host drafter's steps cannot chain (it drafts from the tokens just emitted), so their host time adds to the
        # device's: one costs about 1.5 plain steps on the H100 at batch 1, and more at larger batch, where NGRAM lost
        # while EAGLE won (MT-bench batch 8: 0.82x vs 1.75x, spec-v13-*; 0.78x under the gate below, spec-v17-b8). Its
        # trees get a smaller budget, none from batch 8 by default, and a verify step must pay for itself:
        # the policy (spec_policy.py) verifies while the accept length expected at the requests' match lengths
        # x plain step / verify step >= spec_min_gain (above 1: the estimate is noisy, and every switch costs an
        # unchained step), and probes the match lengths that do not pay every spec_probe_every plain steps' worth of
        # time. A probe that fails costs about 0.7 / spec_probe_every of the time per match key: in two runs 8 ran
        # MT-bench at 0.90x and 0.91x plain, 32 at 0.94x both times; HumanEval 1.11x and 1.17x against 1.13x and
        # 1.08x (spec-ngram-probe- at 8f16ebb, spec-ngram-new- at this change; H100, batch 1).
        self.spec_max_host_verify_tokens = spec_max_host_verify_tokens
        host_policy = dict(min_gain=DEFAULT_SPEC_MIN_GAIN if spec_min_gain is None else spec_min_gain,
                           min_accept=spec_min_accept, probe_every=spec_probe_every)
        if scheduler_delay_factor < 0:
            raise ValueError(f"scheduler_delay_factor must be >= 0, got {scheduler_delay_factor}")
        self.delay_factor, self.last_prefill_s = scheduler_delay_factor, 0.0
        self.overlap = overlap
        if not 1 <= verify_steps <= MAX_VERIFY_STEPS:
            raise ValueError(f"verify_steps={verify_steps} must be in [1, {MAX_VERIFY_STEPS}]")
        self.verify_steps = verify_steps
        # Plain decoding runs up to decode_steps steps a call while the batch is steady (see
        # _decode_steps_now); 1 launches a call a step.
        if not 1 <= decode_steps <= MAX_DECODE_STEPS:
            raise ValueError(f"decode_steps={decode_steps} must be in [1, {MAX_DECODE_STEPS}]")
        self.decode_steps = decode_steps
        self._setup_trees(model, drafter, spec_policy, auto_trees, programs_kw, host_policy)
        self.inflight: InFlight | None = None
        self._sampling_sent: dict = {}  # (rows, request ids) -> their sampling parameters on the device
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._ids = itertools.count()
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = set(cfg.eos_token_ids) | ({tok_eos} if tok_eos is not None else set())
        self.stats = dict(steps=0, verify_steps=0, emitted=0, prefill_tokens=0, preemptions=0, verify_time=0.0,
                          draft_time=0.0, decode_time=0.0, prefill_time=0.0, chained_steps=0, wait_time=0.0,
                          behind_plain_steps=0, verified_rows=0, accepted=0, chained_switches=0,
                          closed_plain_calls=0, prefill_chains=0, joins=0)
        if warmup:
            self.warmup(warmup_flags, progress=warmup == "progress")

    def check(self, prompt_ids, params: SamplingParams) -> list:
        """The prompt as a list of ints, or a ValueError naming what the request gets wrong."""
        return check_request(prompt_ids, params, self.cfg.vocab_size, self.max_seq_len)

    def add(self, prompt_ids, params: SamplingParams, on_update=None) -> Request:
        prompt_ids = self.check(prompt_ids, params)
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

    def step(self):
        if self.device_drafter and self.drafter.refresh():  # e.g. an adaptive token map swapped in
            for progs in self.tree_programs.values():
                progs.replace_head(self.drafter.head)
        if self.inflight is not None:
            done, self.inflight = self.inflight, None
            nxt = self._chain(done) if self._reserve_chain(done) else self._join(done)
            self._collect(done)
            if nxt is not None:
                for prefill, chunk in nxt.joined_prefill or ():
                    self._collect(prefill, chunk)
                self.inflight = nxt
                self.stats["steps"] += 1
                self.stats["chained_steps"] += 1
                return
        self._admit()
        prefill = [r for r in self.running if r.todo > 1]
        if prefill:
            self._run_prefill(prefill)
            if self.inflight is not None:  # the prefilled batch's first call chained on it (_chain_on_prefill)
                self.stats["steps"] += 1
                return
        # a request whose prompt this chunk finished decodes in this step's call with the rest (the
        # chunk is read back before): a newcomer then costs a prefill call, not also a one-step
        # decode call beside the batch's chained ones
        decode = [r for r in self.running if r.todo == 1]
        if decode:
            tree, nodes = self._choice_for(decode)
            rows = bucket(len(decode), BATCH_BUCKETS)  # the bucket whose programs (tree, nodes) are
            # A request whose EAGLE head fell behind (head_len set) decodes plainly to its end. Where
            # such requests are most of the batch (after a large batch decoded plainly, or a plain
            # spell of the auto policy), all of it decodes plainly: mixing would run a verify
            # call and a decode call each step, one step a call, neither chained.
            if nodes > 1 and 2 * sum(r.head_len is not None for r in decode) > len(decode):
                tree, nodes = PLAIN
                self.stats["behind_plain_steps"] += 1
            all_plain = nodes == 1 or all(r.head_len is not None for r in decode)
            all_spec = nodes > 1 and all(r.head_len is None for r in decode)
            steps = self._decode_steps_now(decode) if all_plain else self._verify_steps_now(decode) if all_spec else 1
            decode = self._reserve(decode, self._span(tree, nodes, steps) if all_spec else max(nodes, steps))
            drafts = [nodes > 1 and r.head_len is None for r in decode]
            spec = [r for r, d in zip(decode, drafts) if d]
            plain = [r for r, d in zip(decode, drafts) if not d]
            alone = not (spec and plain)  # one step in flight at a time: two groups are read back at once
            if spec:
                # rows of the whole decode batch's bucket: its shapes are that bucket's, and
                # only (bucket, shape) pairs are built at start-up
                self._run_verify(spec, tree, nodes, rows, steps if all_spec else 1, overlap=alone)
            if plain:
                self._run_decode(plain, steps, overlap=alone)
        self.stats["steps"] += 1

    def _decode_steps_now(self, reqs) -> int:
        """Steps the next plain decode call runs: decode_steps while the batch is steady (every
        running request decoding, none waiting that could be admitted, so that no newcomer waits
        behind a long call) and without penalties (their token histories are built on the host);
        1 otherwise. Never more than the most tokens a request may still emit. A host drafter's
        policy decides again after each call, and runs one step a call only until it has timed
        plain steps at the bucket: always one made its plain decoding about half as fast as the
        plain engine's (NGRAM at batch 1 on the H100 ran 0.52-0.76x plain:
        spec-ngram-base-NVIDIA-H100-80GB-HBM3.json), and its trees had to beat that."""
        learning = (not self.device_drafter and self.spec_policy is not None
                    and not self.spec_policy.knows_plain(bucket(len(reqs), BATCH_BUCKETS)))
        if (self.decode_steps == 1 or learning
                or len(reqs) != len(self.running) or self._admission_due()
                or any(r.params.penalised for r in reqs)):
            return 1
        return max(1, min(self.decode_steps, max(r.params.max_tokens - len(r.output_ids) for r in reqs)))

    def _verify_steps_now(self, reqs) -> int:
        """Speculative steps the next verify call runs: a device drafter's steps chain on the
        device, up to verify_steps while the batch is steady (as _decode_steps_now)."""
        if not self.device_drafter or self.decode_steps == 1:
            return 1
        return min(self.verify_steps, self._decode_steps_now(reqs))


def check_request(prompt_ids, params: SamplingParams, vocab_size: int, max_seq_len: int) -> list:
    """The prompt as a list of ints, or a ValueError naming what the request gets wrong (a server
    checks before it queues; the scheduler again when it adds)."""
    params.validate(vocab_size)
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise ValueError("prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(prompt_ids) + params.max_tokens > max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                         f"maximum sequence length {max_seq_len}")
    return prompt_ids
