"""What a decode batch verifies each call: a draft tree's shape and node count, or plain decoding.

spec_policy 'fixed': the drafter's one tree, cut by batch bucket to fit spec_max_verify_tokens
(below spec_min_nodes the batch decodes plainly). 'auto' (device drafters): every bucket where the
fixed rule verifies has one verify program per shape of the drafter's auto_trees() that fits
spec_max_verify_tokens over the bucket's rows (as the fixed rule's cut: at batch 8 on the H100 a
32-node tree cost 20% more a step than a 16-node one for 9% more tokens, spec-auto-*.json at
9ecd17e). spec_policy.SpecPolicy picks among them every call from the costs seen (and timed at
warm-up) and the accept lengths seen; for a host drafter (NGRAM), whose buckets have one tree size
each, it picks between that tree and plain decoding from the same costs and the accept lengths
seen at the requests' match lengths. A choice is (tree, nodes); plain decoding is (None, 1).
A mixin of Scheduler (core.py), which owns the state these methods read."""
from __future__ import annotations

import concurrent.futures
import functools
import os

import jax
import numpy as np

from jaxspec import closed_wave
from jaxspec.drafters.device import cut_drafts
from jaxspec.drafters.eagle_step import nodes_that_fit
from jaxspec.programs import BATCH_BUCKETS, TREE_BUCKETS, Programs, bucket
from jaxspec.spec_policy import PLAIN as PLAIN_LABEL
from jaxspec.spec_policy import PLAIN_CHOICE, HostTree, SpecPolicy, StepCosts, match_key

PLAIN = (None, 1)
TIMING_CONTEXT = 256  # tokens of context each row attends to while the step costs are timed
SPIN_CALLS = 50
TIMED_CALLS = 4  # calls a timing run launches back to back (step_costs.time_call)


class TreeSizing:
    def _setup_trees(self, model, drafter, spec_policy, auto_trees, programs_kw, host_policy):
        """The trees this engine verifies and a Programs for each (the drafter's own tree's is
        self.programs, which also runs its prefill chunks), and the policy choosing among them.
        auto_trees: 'auto''s shapes, or None; host_policy: a host drafter's SpecPolicy options."""
        if spec_policy not in ("fixed", "auto"):
            raise ValueError(f"spec_policy must be 'fixed' or 'auto', got {spec_policy!r}")
        self.auto = bool(auto_trees)  # a host drafter has one tree size a bucket: its policy gates it
        # auto's plain decoding keeps the drafter in step (eagle_step / dflash_step.decode): one of the shapes
        self.keeps_heads = self.auto and drafter.keeps_head_in_decode
        self._decided = None  # (bucket, choice) the last call's chain check took
        self.closed_batch_rule = True  # one generate call's batch, nobody waiting: the tree where it ends sooner (closed_wave)
        trees = (auto_trees if self.auto else (drafter.tree,)) if self.device_drafter else ()
        self.tree_programs = {t: self.programs if t == drafter.tree else
                              Programs(model, drafter=drafter.with_tree(t), **programs_kw) for t in trees}
        # the shapes whose emitted counts a verify call of each tree also returns (the policy's)
        self.cut_shapes = {t: p.cut_shapes for t, p in self.tree_programs.items()}
        # a change of shape, and a prefill's first verify call, chain on the last call's drafts through
        # a cut (not under a mesh: the cut's executables are built for one device's arrays)
        self.cuts = DraftCuts(programs_kw["jit"]) if self.device_drafter and programs_kw["mesh"] is None else None
        self.spec_costs = StepCosts()  # timed by warmup()
        self.spec_policy = None
        if self.auto:
            self.spec_policy = SpecPolicy(self.spec_costs, {rows: [t for t, _ in self._verify_shapes(rows)]
                                                            + [PLAIN_CHOICE] * self._keeps_heads_at(rows)
                                                            for rows in BATCH_BUCKETS},
                                          steps_a_call=(self.decode_steps, self.verify_steps))
        elif drafter is not None and not self.device_drafter:
            # each match key tried once; its mean over about its last 16 verify steps (code alternates
            # fresh text and repeats: a long memory missed the repeats that followed fresh text)
            self.spec_policy = SpecPolicy(self.spec_costs, {rows: [HostTree(n) for _, n in self._verify_shapes(rows)]
                                                            for rows in BATCH_BUCKETS},
                                          plain=True, explore=1, kept=16, **host_policy)

    @property
    def program_groups(self) -> list:
        """Every Programs of this engine, each once."""
        groups = [self.programs, *self.tree_programs.values()] + ([self.plain_programs] if self.plain_programs else [])
        return list({id(g): g for g in groups}.values())

    @property
    def row_buckets(self) -> list:
        """The batch buckets this engine builds programs for (up to max_batch's)."""
        return [b for b in BATCH_BUCKETS if b <= bucket(self.max_batch, BATCH_BUCKETS)]

    def cut_specs(self) -> list:
        """(rows, drafted nodes, tree, nodes) of every cut a chained change of shape may take (drafted
        1: the roots after plain steps that kept the heads in step; the drafter's own tree: a prefill
        chunk's drafts, in the prefill shapes' rows), and (rows, width) of every verify call's next
        roots a chained plain call may take."""
        out = []
        prefill_rows = {r for r, _ in self.prefill_shapes}
        for rows in self.row_buckets:
            shapes = self._verify_shapes(rows)
            out += [(rows, a.num_draft_tokens, b, n) for a, _ in shapes for b, n in shapes if b != a]
            if rows in prefill_rows:
                out += [(rows, self.drafter.tree.num_draft_tokens, b, n) for b, n in shapes]
            if self._keeps_heads_at(rows):
                out += [(rows, 1, b, n) for b, n in shapes] + [(rows, bucket(n, TREE_BUCKETS)) for _, n in shapes]
        return list(dict.fromkeys(out))

    def tree_size(self, batch: int) -> int:
        """Nodes a step of the fixed policy verifies at this batch size: by its batch bucket, so
        that each bucket has one verify program."""
        if self.drafter is None:
            return 1
        budget = self.spec_max_verify_tokens if self.device_drafter else self.spec_max_host_verify_tokens
        return nodes_that_fit(self.drafter.num_nodes, budget, bucket(max(batch, 1), BATCH_BUCKETS), self.spec_min_nodes)

    def _verify_shapes(self, rows: int) -> list:
        """(tree, nodes) of each verify program built for this batch bucket."""
        n = self.tree_size(rows)
        if self.auto:
            return [(t, t.num_draft_tokens) for t in self.tree_programs
                    if n > 1 and rows * bucket(t.num_draft_tokens, TREE_BUCKETS) <= self.spec_max_verify_tokens]
        return [(self.drafter.tree if self.device_drafter else None, n)] if n > 1 else []

    def _keeps_heads_at(self, rows: int) -> bool:
        """Whether plain decoding at this batch bucket keeps the device drafter's heads in step (a
        bucket with trees, under the auto policy, whose plain decoding is then a choice)."""
        return self.keeps_heads and bool(self._verify_shapes(rows))

    def _no_tree_at(self, batch: int) -> bool:
        """Whether a device drafter's batch of this size never verifies (its bucket has no verify
        program): its prefill chunks run the target alone, leaving heads behind."""
        return self.device_drafter and not self._verify_shapes(bucket(max(batch, 1), BATCH_BUCKETS))

    def _choice_for(self, reqs, rows: int | None = None) -> tuple:
        """(tree, nodes) a call over these decoding requests verifies now, or PLAIN (rows: the bucket
        whose programs run it, if not theirs: a shrunk batch chaining on in its bucket)."""
        rows = rows or bucket(len(reqs), BATCH_BUCKETS)
        decided, self._decided = self._decided, None
        if self.auto and decided is not None and decided[0] == rows:
            return decided[1]  # taken when the last call could not chain on (e.g. short of pages)
        shapes = self._verify_shapes(rows)
        if not shapes or self._no_tree_at(len(self.running)):
            return PLAIN  # (the batch fills to a bucket without trees: its early decoders would verify in vain)
        if self.spec_policy is None:
            return shapes[0]
        tree = self.spec_policy.choose(rows, None if self.device_drafter else self._match_keys(reqs))
        if tree is None:
            return PLAIN
        if (self.closed_batch_rule and self.device_drafter and not self.waiting and closed_wave.closed(reqs)
                and PLAIN_CHOICE in self.spec_policy.trees_at[rows]
                and closed_wave.plain_finishes_first(self.spec_policy, rows, tree, reqs)):
            self.spec_policy.overruled(rows, tree)
            self.stats["closed_plain_calls"] += 1
            return PLAIN
        return (tree if self.device_drafter else None), tree.num_draft_tokens

    def _span(self, tree, nodes, steps) -> int:
        """Cache slots past a request's kv length that a call of `steps` verify steps may write:
        every step but the last accepts at most the tree's depth + 1 tokens."""
        depth = nodes if tree is None else tree.steps
        return (steps - 1) * min(nodes, depth + 1) + nodes + self.draft_slots

    def _policy_tree(self, f):
        """The shape the policy knows a verify call by (a host drafter's: its tree size, whose
        accept lengths are kept apart: 8-node trees at batch 1 overstate 4-node trees' at batch 8)."""
        return f.tree if self.device_drafter else HostTree(f.nodes)

    def _arrived(self, f, now: float, steps: int = 1, prefill: bool = False) -> None:
        """Tell the policy that a call's outputs (`steps` steps) arrived at `now`: its step costs.
        A device drafter's call chained on the last (a change of shape chains too) measures its
        steps from the last call's outputs (the device busy from one to the next); one not chained
        measures from its launch the bucket's launch cost, which every shape's steps share
        (SpecPolicy.cost). A host drafter's calls never chain: each is timed from the last
        outputs, the host's share part of every step's cost."""
        if self.spec_policy is None:
            return
        rows = f.outputs[0].shape[0]  # the program's bucket
        label = None if prefill else PLAIN_LABEL if f.kind == "decode" else self._policy_tree(f).label
        self.spec_policy.arrived(rows, label, now, steps, f.chained or not self.device_drafter, f.launched)

    def _match_keys(self, reqs) -> list:
        """Each request's match key (spec_policy.match_key of how many of its latest tokens the
        host drafter matched; 0 where none)."""
        match_length = getattr(self.drafter, "match_length", None)
        return [match_key(match_length(r)) if match_length else 1 for r in reqs]



class WarmTable:
    """Small jitted functions compiled per key at warm-up, beside the programs; one compiled after
    it is late (late_compiles)."""

    def __init__(self, jit: bool = True):
        self.jit, self.table, self.warm, self.late_compiles = jit, {}, False, []

    def _compiled(self, key, lower):
        """The executable of key, compiled from lower() (a jax Lowered) the first time it is asked for."""
        if key not in self.table:
            self.table[key] = lower().compile()
            if self.warm:
                self.late_compiles.append(key)
        return self.table[key]


class DraftCuts(WarmTable):
    """cut_drafts compiled for each (batch bucket, drafted nodes, next shape) a chained change of
    shape or a prefill's chained first verify call takes, and the roots of each (batch bucket, tree
    width) a chained plain call takes after a verify call: built at warm-up beside the programs; one
    compiled after it is late."""

    def __init__(self, jit: bool = True):
        super().__init__(jit)
        self.root_parents = {}  # rows -> [rows, 1] of -1 on the device: a root's parent

    @staticmethod
    def _key(rows, drafted, tree=None, nodes=None):
        return ("roots", rows, drafted) if tree is None else ("cut_drafts", rows, drafted, tree.steps, nodes)

    @staticmethod
    def _fn(tree=None, nodes=None):
        if tree is None:
            return lambda tokens: tokens[:, :1]
        return functools.partial(cut_drafts, max_nodes=nodes, max_depth=tree.steps, width=bucket(nodes, TREE_BUCKETS))

    def _lower(self, rows, drafted, *shape):
        spec = jax.ShapeDtypeStruct((rows, drafted), np.int32)
        return jax.jit(self._fn(*shape)).lower(*(spec,) * (2 if shape else 1))

    def _get(self, *spec):
        if not self.jit:
            return self._fn(*spec[2:])
        return self._compiled(self._key(*spec), lambda: self._lower(*spec))

    def build(self, specs):
        """Compile each (rows, drafted nodes, tree, nodes) (traced here, compiled in threads) and
        run it once: a GPU executable's first run also loads it, which would stall the first
        chained call that changes shape."""
        todo = {self._key(*spec): spec for spec in specs if self._key(*spec) not in self.table}
        if self.jit and todo:
            lowered = {key: self._lower(*spec) for key, spec in todo.items()}
            with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
                self.table.update(zip(lowered, pool.map(lambda low: low.compile(), lowered.values())))
        for rows, drafted, *shape in specs:
            zeros = np.zeros((rows, drafted), np.int32)
            jax.block_until_ready(self._get(rows, drafted, *shape)(*(zeros, zeros - 1)[:2 if shape else 1]))
        self.warm = True

    def __call__(self, tokens, parents, tree, nodes):
        """The drafts (tokens, parents [rows, drafted]) as the inputs of a call verifying
        `nodes`-node trees of `tree`'s depth: (tokens, parents, num_nodes)."""
        return self._get(*tokens.shape, tree, nodes)(tokens, parents)

    def from_roots(self, roots, tree, nodes):
        """Trees of the roots [rows, 1] alone as the inputs of a call verifying `nodes`-node trees of `tree`'s depth."""
        parents = self.root_parents.get(roots.shape[0])
        if parents is None:
            parents = self.root_parents[roots.shape[0]] = jax.device_put(np.full(roots.shape, -1, np.int32))
        return self(roots, parents, tree, nodes)

    def roots(self, tokens):
        """The roots [rows, 1] of a verify call's next trees [rows, width]: a chained plain call's tokens."""
        return self._get(*tokens.shape)(tokens)
