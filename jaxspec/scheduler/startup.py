"""The program set an engine builds at start-up (compile once): every program it can launch, built
or read back from the program store before the first request (workers in other processes build
what the store lacks: program_workers.py); each run once on a GPU; and the auto policy's step-cost
table, the decode and verify programs timed (or the store's table of an earlier start read back).
A compile after warm-up is late (late_compiles). A mixin of Scheduler (core.py), which owns the
state these methods read."""
from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np

from jaxspec import program_store, program_workers
from jaxspec.programs import MAX_DECODE_STEPS, STOP_ID_SLOTS, TREE_BUCKETS, bucket
from jaxspec.sampling import SamplerFlags, SamplingBatch, SamplingParams
from jaxspec.spec_policy import HostTree, StepCosts, time_call

TIMING_CONTEXT = 256  # tokens of context each row attends to while the step costs are timed
SPIN_CALLS = 50
TIMED_CALLS = 4  # calls a timing run launches back to back (step_costs.time_call)


class StartUp:
    def program_specs(self, flag_sets=None) -> list:
        """(programs, name, flags, cache, args) of every program this engine can launch with the
        given sampler flags (default: greedy, and sampling with filters; programs.SHARED_SAMPLER
        serve both with one): prefill shapes, a decode step per batch bucket, and a verify step per
        batch bucket that gets a tree. Penalties and top logprobs add programs that are compiled
        when first asked for."""
        flag_sets = flag_sets or (SamplerFlags(), SamplerFlags(sample=True, filter=True))
        decode, target_cache = self.programs, self.cache
        if self.device_drafter:
            decode, target_cache = self.plain_programs, self.cache[0]
        specs = []
        # a bucket without trees (the largest lack them first): a prefill may run the target alone, and
        # requests whose heads fell behind there decode on by the target alone in whatever bucket the
        # batch shrinks to, one whose plain decoding otherwise keeps the heads in step
        plain_prefill = self._no_tree_at(self.max_batch)
        for flags in flag_sets:
            for rows, t in self.prefill_shapes:
                specs.append((self.programs, "extend", flags, self.cache, self._dummy_inputs(rows, t)))
                if plain_prefill:
                    specs.append((decode, "extend", flags, target_cache, self._dummy_inputs(rows, t)))
            for rows in self.row_buckets:
                keep = self._keeps_heads_at(rows)  # (its plain decoding keeps the heads in step)
                specs.append((self.programs if keep else decode, "decode", flags, self.cache if keep else target_cache,
                              self._dummy_decode(rows)))
                if keep and plain_prefill:
                    specs.append((decode, "decode", flags, target_cache, self._dummy_decode(rows)))
                for tree, nodes in self._verify_shapes(rows):
                    specs.append((self.tree_programs.get(tree, self.programs), self._verify_name, flags, self.cache,
                                  self._dummy_verify(rows, bucket(nodes, TREE_BUCKETS))))
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

    def _dummy_verify(self, rows, n, num_steps=1, alive=False):
        """alive: every row verifies n nodes a step, budget to spare (a call leaves its loop once no
        row is alive: idle rows timed a launch). Else zeros."""
        args, full = self._dummy_inputs(rows, n, tree=True), lambda v: np.full(rows, v * alive, np.int32)
        if not self.device_drafter:  # verify_tree's: alive, a tree of n nodes, each drafted below the root
            parents = np.zeros((rows, n), np.int32)
            parents[:, 0] = -1
            return args if not alive else (args[0], parents, *args[2:4], full(n), args[5])
        return args[:4] + (
            full(n), full(1 << 20), np.full((rows, STOP_ID_SLOTS), -1, np.int32), np.int32(num_steps),
            np.int32(n if alive else 1)) + args[5:]

    def _dummy_decode(self, rows, num_steps=1, alive=False):
        tokens, _, page_table, kv_lens, _, sb = self._dummy_inputs(rows, 1)
        return (tokens, page_table, kv_lens, np.full(rows, (1 << 20) * alive, np.int32),
                np.full((rows, STOP_ID_SLOTS), -1, np.int32), np.int32(num_steps), sb)

    def warmup(self, flag_sets=None, progress=False) -> dict:
        """Compile the whole program set now (see program_specs); a compile after this is counted
        in late_compiles. Programs the store lacks are first built by worker processes, when
        there are enough of them (program_workers.py). Returns {programs, seconds, and each
        phase's seconds}; with progress, also says them on stderr."""
        t0 = time.perf_counter()
        specs = self.program_specs(flag_sets)
        groups = list({id(p): p for p, *_ in specs}.values())
        missing, workers = {}, 0
        if groups[0].jit and groups[0].store:
            missing = {progs.entry(*spec): (groups.index(progs), *spec)
                       for progs, *spec in specs if not progs.stored(*spec)}
            workers = program_workers.default_workers(len(missing)) if self.build_workers is None else self.build_workers
            if workers and missing:
                program_workers.build(groups, list(missing.values()), workers)
        t1 = time.perf_counter()
        for progs in groups:
            progs.build([s[1:] for s in specs if s[0] is progs], progress=progress)
        if self.cuts is not None:
            self.cuts.build(self.cut_specs())
        if self.row_join is not None and groups[0].jit:
            self.row_join.build(self.join_specs(), run=self.first_runs)
        if self.first_runs and groups[0].jit:
            self._run_once(specs)
        t2 = time.perf_counter()
        if self.spec_policy is not None and groups[0].jit:
            self.spec_costs.ms.update(self._step_costs(specs).ms)  # the table the policy reads
        t3 = time.perf_counter()
        out = dict(programs=sum(len(p.table) for p in groups), seconds=t3 - t0, workers_s=t1 - t0, build_s=t2 - t1,
                   costs_s=t3 - t2)
        if progress:
            print(f"{out['programs']} programs ready in {t3 - t0:.1f} s: {len(missing)} missing from the store built "
                  f"by {workers if missing else 0} worker processes in {t1 - t0:.1f} s, the set built or loaded in "
                  f"{t2 - t1:.1f} s, step costs in {t3 - t2:.1f} s", file=sys.stderr, flush=True)
        return out

    def _run_once(self, specs) -> None:
        """Each program of the set once, a step of live rows on zeros (their K/V to the trash page): a
        GPU executable's first run also loads its kernels and records its command buffers, a stall the
        first call to meet it would pay. Where the step costs came from the store no program ran at
        warm-up: DFLASH's calls not chained at batch 64 took 69.5 / 27.2 ms past their steps at buckets
        4 / 32 without these runs, 4.8-7.5 ms at every bucket with them (spec-dflash-s85-base-b64-, -s85-)."""
        for progs, name, flags, _, args in specs:
            rows, n = args[0].shape
            if name == "decode":
                args = self._dummy_decode(rows, 1, alive=True)
            elif name != "extend":
                args = self._dummy_verify(rows, n, 1, alive=True)
            target_only = self.device_drafter and progs is self.plain_programs
            *_, cache = progs.run(name, flags, self.cache[0] if target_only else self.cache, args)
            self.cache = (cache, self.cache[1]) if target_only else cache
        jax.block_until_ready(self.cache)

    @property
    def late_compiles(self) -> list:
        """Programs compiled after warm-up: each made some request wait for a compile."""
        cuts = [] if self.cuts is None else self.cuts.late_compiles
        joins = [] if self.row_join is None else [("join", *spec) for spec in self.row_join.late_compiles]
        return [key for g in self.program_groups for key in g.late_compiles] + cuts + joins


    # -- the cost table ----------------------------------------------------------------------------------
    def _step_costs(self, specs) -> StepCosts:
        """The step costs an earlier start of this engine kept in the program store (same source,
        jax, device, configs and program shapes), or timed now and kept there."""
        store = self.programs.store
        if store is None:
            return self._time_steps(specs)
        shapes = sorted((name, str(getattr(progs.tree, "label", "")), tuple(args[0].shape))
                        for progs, name, _, _, args in specs)
        path = os.path.join(store, program_store.entry_name(self.programs.config_key, "step_costs", shapes,
                                                             self.max_pages_per_seq) + ".costs.json")
        costs = StepCosts.load(path)
        if costs is None:
            costs = self._time_steps(specs)
            os.makedirs(store, exist_ok=True)
            costs.save(path)
        return costs

    def _time_steps(self, specs) -> StepCosts:
        """ms a step of each greedy decode and verify program of the set, every row live on zeros
        over a context of TIMING_CONTEXT tokens (the programs' work does not depend on the values),
        timed at the most steps a call runs and divided: a steady batch runs that many, and one
        step a call also timed the call's launch and read-back (which made verifying look cheap
        against decoding at batch 32: spec-policy-NVIDIA-H200.json, 0091df7). A device drafter's
        calls are timed TIMED_CALLS at a time, launched back to back as its chained calls run, so
        that no launch is in its costs. A host drafter's verify_tree runs one step a call and
        cannot chain (its calls are timed one at a time); without this table its policy priced
        verify calls from the first few it saw (SpecPolicy.arrived says how that went wrong).
        Buckets that never verify are not timed (no choice is made there)."""
        costs, reps, calls = StepCosts(), 3, TIMED_CALLS if self.device_drafter else 1
        # pages no request holds (at a warm-up: any), else no context
        context = min(TIMING_CONTEXT, self.max_seq_len // 2) if not (self.running or self.pool.cached) else 0
        pages = min(-(-(context + 2 * self._span(None, 64, self.verify_steps)) // self.page_size), self.pool.num_pages - 1,
                    self.max_pages_per_seq) if context else 0
        for progs, name, flags, cache, args in specs:
            rows, n = args[0].shape
            if flags.sample or name not in ("decode", "verify_steps", "verify_tree"):
                continue
            if name == "decode" and not self._verify_shapes(rows):
                continue  # a bucket without trees decodes plainly: no choice reads its cost
            steps = {"decode": MAX_DECODE_STEPS, "verify_steps": self.verify_steps}.get(name, 1)
            args = list(self._dummy_decode(rows, steps, alive=True) if name == "decode"
                        else self._dummy_verify(rows, n, steps, alive=True))
            at = 1 if name == "decode" else 2  # the page table, then the kv lengths
            args[at] = args[at].copy()
            args[at][:, :pages] = 1 + np.arange(pages)  # no request holds a page at warm-up
            args[at + 1] = np.full_like(args[at + 1], context)
            args = tuple(args)

            def call(progs=progs, name=name, flags=flags):
                if name != "verify_steps":  # a device drafter's decode runs the target alone, or keeps its heads
                    plain = name == "decode" and self.device_drafter and not self._keeps_heads_at(rows)
                    return self._call(name, plain, inputs.pop(), flags)
                *out, self.cache = progs.verify_steps(self.cache, *inputs.pop(), flags=flags)
                return out
            # the programs donate some inputs: a copy a call. The first program runs SPIN_CALLS more
            # first, so that no program is timed on a GPU idle since its compiles
            spin = 0 if costs.ms or jax.default_backend() == "cpu" else SPIN_CALLS  # (a GPU's clocks)
            inputs = [jax.device_put(args) for _ in range(reps * calls + 1 + spin)]
            for _ in range(spin):
                jax.block_until_ready(call())
            if name == "decode":
                key = ("decode", rows, None)
            else:
                key = ("verify", rows, (progs.tree if self.device_drafter else HostTree(self.tree_size(rows))).label)
            costs.ms[key] = time_call(call, reps=reps, calls=calls) / steps
        return costs
