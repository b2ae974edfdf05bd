"""Speculation sized by measured costs, for every drafter family: the draft tree a decode batch
verifies, or plain decoding, chosen every call among the shapes whose programs were built at
start-up, as the one that emits the most tokens per ms of a step. Each rule's measurements (what
went wrong without it) are in bench/probes/spec_policy_notes.md.

Costs. At warm-up the engine times every decode and verify program of its set (StepCosts: ms a
step by kind, batch bucket and tree) and keeps the table beside its programs in the program store:
a later start of the same engine on the same device reads it back rather than timing again. While
serving, the policy adds the wall time steps were seen to take (`arrived`: a call chained on the
last, of any shape, and any call of a host drafter, whose calls cannot chain, from the last outputs
at the same bucket; the host's share counts): the median of a shape's last RECENT_CALLS calls' ms a
step (a few stalled calls must not price a shape), weighed against PRIOR_CALLS calls of the table's
cost, scaled by the median of how the costs seen compare with the table's (the table runs steady
calls with nothing else to do). A device drafter's call that is not chained (after an admission, a
prefill, a change of batch) also pays its launch and read-back: what it took past its steps' cost
is a bucket's launch cost, whatever the shape, and a shape's step costs its share of it: the
bucket's fraction of calls not chained x the launch cost / the steps a call of its kind runs (steps_a_call till seen).

Acceptance. For each shape and match key, the tokens rows emitted over the row-steps they took (sums halved past
`kept` row-steps, so that they follow the requests), pooled over batch sizes (what a tree accepts depends on the
drafter and the text, not on the batch), and a histogram. A device drafter has one key; a host drafter (NGRAM) keys
each request by how many of its latest tokens matched (1, 2-3, 4-7, 8 or more; 0, no match, drafts nothing and expects
1): a request continuing a long stretch seen before (a repeated line of code) accepts several tokens, one whose last
token alone matches rarely more than the bonus token, and code alternates the two. A tree that contains another's
shape (as deep, as wide, as many nodes) is expected to accept at least what that one did: on few calls, an unlucky
first average would keep a good shape from being chosen again. A host drafter's expectation is optimistic by one
standard error while its samples are few. A device drafter's shapes are compared on the same requests, by the drafts a
row-step accepts (its tokens past the one every step emits), whose log is the requests' level plus the shape's
difference: a shape accepts a multiple of what another does, whatever the requests. The difference is the log of its
drafts over the level's, summed over its calls (an average of their logs fell below what a shape whose calls vary
accepted); the level is the log of a moving average (LEVEL_RATE per LEVEL_ROW_STEPS row-steps) of every call's drafts
over its shape's multiple (one of logs sank on the calls that accept nothing: spec_policy_notes.md); over plain steps,
where nothing is verified, it moves back toward the drafts' long-run mean at that rate. Plain averages (level_rate 0)
compare shapes on whatever requests each met. Differences counted on the same steps by its trees' cuts
(shape_links.py) replace them once known, unless use_links is unset. The level's unit is then the links' smallest
shape (it restarts at the first call the links place), else the shape whose calls first set it; a run (compared over its
first PROBE_CALLS calls and TRUSTED_LEVEL_ROW_STEPS row-steps) before a level of that many row-steps counts no difference
(a level of one row-step that accepted nothing placed a tree at 30x it), and a shape without one expects its own average.

The choice. A call at bucket `rows` verifies the shape with the most expected tokens per ms, the mean over its
requests of expected(tree, key) / cost(rows, tree), where plain decoding emits one token per plain step. Every shape a
bucket has runs `explore` calls (4 for a device drafter; a host drafter tries each match key once) before any is
preferred. A shape whose nodes a bigger one of the same depth and branching drafts too is left out where that one
costs at most NESTED_COST as much a step: it accepts at least as much on every step. A bucket that moved to a tree
keeps it for HOLD_CALLS calls, then takes the fastest again (near-tied shapes would trade places call after call);
plain decoding is left as soon as a tree looks faster. After probe_every calls another shape runs PROBE_CALLS calls
(the contenders in turn) so that the averages follow the requests and the costs; the interval doubles (up to 8x) after
each probe that leaves the bucket on its shape and falls back when the bucket moves. A shape the bucket has not
verified for STALE_PROBES probe intervals is probed first, whatever it is expected to emit (a shape judged on a few
early calls could otherwise never be verified again), unless nothing of it goes stale: a cut of the held tree, whose
link the held tree's calls count. Plain decoding is never probed: it emits one token a step, at the table's cost
scaled. A device drafter's change of shape chains on the last call on the device, to and from plain decoding too.

For a host drafter plain decoding is a choice a tree must look min_gain faster than (above 1: the
estimate is noisy, and every switch costs an unchained step); a match key that does not pay is
probed again after probe_every verify steps' worth of plain steps (at least probe_every), the
interval doubling after each probe that does not pay (up to 8x). For a device drafter it is one
shape among the trees (PLAIN_CHOICE, one token a step): its plain steps keep the drafter in step
(eagle_step.decode, dflash_step.decode). Which of its buckets verify at all is the fixed rule's
(scheduler/trees.py); the target alone decodes the others, leaving the drafter behind.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from statistics import median  # (numpy's has a fixed overhead many times a few dozen floats' sort; this runs every call)
from typing import Hashable

from jaxspec.shape_links import ShapeLinks
from jaxspec import spec_policy_summary
from jaxspec.spec_shapes import PLAIN, PLAIN_CHOICE, HostTree, contains, match_key, nested  # noqa: F401 (re-exported)
from jaxspec.step_costs import StepCosts, time_call  # noqa: F401  (the policy's cost table, and how it is timed)

EXPLORE_CALLS = 4  # calls each shape runs before any is preferred (one call's accept length is noise)
PROBE_CALLS = 3  # calls a probe of another shape runs
STALE_PROBES = 4  # probe intervals after which a shape the bucket has not verified is probed first
PRIOR_CALLS = 4  # calls of the table's (scaled) cost a shape's seen cost is weighed against
RECENT_CALLS = 64  # a (bucket, shape)'s last calls whose median ms a step is its seen cost
KEPT_STEPS = 512  # a (bucket, shape)'s seen steps beyond which its sums are halved (the costs move)
HOST_KEPT_STEPS = 64  # a host drafter's: its verify calls are rare, each one step
KEPT_ROW_STEPS = 2048  # a shape's row-steps beyond which its accept sums are halved (the requests move)
HOLD_CALLS = 8  # calls a bucket keeps a shape it moved to
LEVEL_RATE, LEVEL_ROW_STEPS = 0.5, 8  # weight of 8 of a device drafter's row-steps in the requests' level (0: plain averages)
TRUSTED_LEVEL_ROW_STEPS = 2 * LEVEL_ROW_STEPS  # row-steps behind a level that places a run, and a run compares (Acceptance)
MIN_DRAFTS = 0.05  # a call's drafts accepted a row-step, floored before its log (a call may accept none)
NESTED_COST = 1.03  # a bigger shape of the same depth and branching costing at most this much more replaces a smaller
USE_LINKS = True  # shapes compared by their cuts' counts where known (shape_links.py; spec-policy-links-, spec-s86-)
LINKED = "links"  # the level's unit once a shape's link difference placed a call (shape_links.py)
CALL_RATE = 0.1  # weight of a call in a bucket's moving fraction of calls not chained, and in its steps a call


def _add(sums: list, *values, kept: float) -> list:
    """sums += values (the last a count), all halved past `kept` of it: a moving average's sums, older calls fading."""
    sums[:] = [s + v for s, v in zip(sums, values)]
    if sums[-1] > kept:
        sums[:] = [s / 2 for s in sums]
    return sums


@dataclasses.dataclass
class _Probes:
    """A bucket's probes: the next one's first call, the interval's multiplier, probes run, the shape before the last."""
    start: int
    mult: int = 1
    done: int = 0
    before: object = None
    shape: object = None  # the shape the probe runs
    why: str = ""  # why it runs that shape


class SpecPolicy:
    def __init__(self, costs: StepCosts, trees_at: dict, plain: bool = False, min_gain: float = 1.0,
                 probe_every: int = 32, explore: int | None = None, kept: int = KEPT_ROW_STEPS,
                 min_accept: float = 2.0, level_rate: float = LEVEL_RATE, steps_a_call: tuple = (1, 1)):
        """trees_at: batch bucket -> the tree shapes built for it (each with a .label). plain:
        plain decoding is a choice (a host drafter); min_gain: how much faster than plain decoding
        a tree must look; probe_every: calls between probes of rival shapes, or plain steps before
        a match key that does not pay is probed; explore: calls each shape (a host drafter: each
        key) runs before any is preferred (default EXPLORE_CALLS); kept: row-steps past which
        acceptance sums are halved; min_accept: plain step / verify step assumed until a host
        drafter's verify step is timed; level_rate: see Acceptance; steps_a_call: (plain, verify) steps a
        steady call of the engine's runs: a kind's share of a launch until its calls are seen."""
        self.costs, self.trees_at, self.plain, self.steps_a_call = costs, trees_at, plain, steps_a_call
        self.min_gain, self.probe_every, self.kept, self.min_accept = min_gain, probe_every, kept, min_accept
        self.explore = EXPLORE_CALLS if explore is None else explore
        self.emitted: dict = {}  # (tree, key) -> average tokens a live row emits per verify step
        self.totals: dict = {}  # (tree, key) -> [tokens, row-steps] the average is of
        self.drafts, self.level_rate = None, level_rate  # a device drafter's requests' drafts a row-step (level: Acceptance)
        self.long = [0.0, 0]  # the drafts its level averaged, over the last `kept` row-steps: [sum, row-steps]
        self.diffs: dict = {}  # tree -> [drafts accepted, the level's drafts, row-steps] summed over its compared calls
        self.unit = None  # the level's unit: the tree whose first calls set it, or LINKED (the links' smallest shape)
        self.links, self.use_links = ShapeLinks([t for ts in trees_at.values() for t in ts], kept, MIN_DRAFTS), USE_LINKS
        self._compared = (None, 0, None, 0)  # (the latest calls' tree, how many in a row, the level before them, row-steps)
        self.seen: collections.Counter = collections.Counter()  # tree -> verify calls averaged
        self.accepts: dict = collections.defaultdict(collections.Counter)  # tree -> {tokens a row-step: times}
        self.calls, self.chosen = collections.Counter(), collections.Counter()  # bucket / (bucket, label) -> decisions
        self.why = collections.Counter()  # (bucket, "label: reason") -> decisions (before closed_wave.py overrules one)
        self.observed: dict = {}  # (bucket, label) -> [ms, steps] seen
        self.recent, self.medians = {}, {}  # (bucket, label) -> the last calls' ms a step, and their median
        self.scale = 1.0  # the median over (bucket, label) of seen over table cost
        self.held: dict = {}  # bucket -> (the tree its calls verify between probes, the call it moved to it)
        self.probes: dict = {}  # bucket -> _Probes
        self.verified_at: dict = {}  # (bucket, tree) -> the bucket's decision that last took it
        self.backoff, self.last_verified = {}, {}  # key -> probe interval multiplier; plain steps at its last verify
        self.plain_steps, self._last = 0, None  # plain steps read back so far; (bucket, label, time) of the last outputs
        self.run = (None, 0)  # (label, how many in a row) of the latest calls' outputs
        self.launch, self.launch_ms = {}, {}  # bucket -> the last calls' ms not chained took past their steps' cost; the median
        self.unchained: dict = {}  # bucket -> moving fraction of a device drafter's calls not chained
        self.call_steps: dict = {}  # (bucket, plain or not) -> moving steps a call

    def arrived(self, rows: int, label: str | None, now: float, steps: int = 1, measured: bool = True,
                launched: float | None = None) -> None:
        """A call's outputs arrived at `now`: `steps` steps of `label` (a tree's or PLAIN; None: a
        prefill) at this bucket. measured: the interval since the last outputs at this bucket is
        this call's steps' wall time (the device was busy from one to the next: a device drafter's
        call chained on the last, a change of shape too); else, where `launched` is given (a call
        launched after the last outputs were read), its wall time is from then."""
        last, self._last = self._last, None if label is None else (rows, label, now)
        if label is None:
            self.run = (None, 0)
            return
        self.run = (label, self.run[1] + 1 if self.run[0] == label else 1)
        if label == PLAIN:
            self.plain_steps += steps
            if not (self.plain or PLAIN_CHOICE in self.trees_at.get(rows, ())):
                return  # plain decoding is not a choice at this bucket: nothing reads its cost
            # nothing verified: the level returns toward its long-run mean (over the bucket's row-steps)
            if self.drafts is not None and self.long[1]:
                mean = self.long[0] / self.long[1]
                self.drafts = mean + (1 - self.level_rate) ** (rows * steps / LEVEL_ROW_STEPS) * (self.drafts - mean)
        # A host drafter's calls (launched after the last outputs arrived) are all timed from them: timed
        # only after one of the same kind, its lone probes kept its first verify cost (spec_policy_notes.md).
        if steps < 1:
            return
        u, n = self.unchained.get(rows, 0.0), self.call_steps.get((rows, label == PLAIN), steps)
        self.unchained[rows] = u + CALL_RATE * ((not measured) - u)  # (a host drafter's calls: all measured)
        self.call_steps[(rows, label == PLAIN)] = n + CALL_RATE * (steps - n)
        if measured and last is not None and last[0] == rows:
            self.timed(rows, label, 1e3 * (now - last[2]), steps)
        elif not measured and launched is not None and (ms := self._step_cost(rows, label)):
            launch = self.launch.setdefault(rows, collections.deque(maxlen=RECENT_CALLS))
            launch.append(max(0.0, 1e3 * (now - launched) - steps * ms))
            self.launch_ms[rows] = median(launch)  # once a call, not at every cost()

    def forget_costs(self) -> None:
        """Drop the step costs seen (the table stays): taken under a load now gone (spec_policy_notes.md)."""
        for seen in (self.observed, self.recent, self.medians, self.launch, self.launch_ms):
            seen.clear()
        self.scale, self._last = 1.0, None

    def timed(self, rows: int, label: str, ms: float, steps: int) -> None:
        """Calls of a tree (or PLAIN) at this bucket took `ms` over `steps` steps."""
        recent = self.recent.setdefault((rows, label), collections.deque(maxlen=RECENT_CALLS))
        recent.append(ms / steps)
        self.medians[(rows, label)] = median(recent)
        ratios = [m / t for (r, k), m in self.medians.items() if (t := self._table(r, k))]
        self.scale = median(ratios) if ratios else 1.0
        _add(self.observed.setdefault((rows, label), [0.0, 0]), ms, steps, kept=HOST_KEPT_STEPS if self.plain else KEPT_STEPS)

    def verified(self, tree, emitted: list[int], keys: list | None = None, rows: int | None = None,
                 cut: tuple | None = None) -> None:
        """A verify call of `tree` at bucket `rows`: the tokens each live row emitted at each of its
        steps, drafted at keys[i] (a host drafter's match keys; None: a device drafter's one key).
        cut: (shapes, counts [row-steps, 1 + len(shapes)]): on the same row-steps, what the tree
        emitted and what each shape's cut of it would have (a device drafter's; see Acceptance)."""
        if not emitted:
            return
        self.accepts[tree].update(emitted)
        self.seen[tree] += 1
        if keys is None:  # one key: the call's sums at once (a device drafter's hundreds of row-steps)
            calls = {None: (sum(emitted), len(emitted))}
            if cut is not None:
                self.links.add(tree, *cut)
            self._relate(tree, sum(emitted) / len(emitted), len(emitted))
        else:
            calls = {}
            for k, c in zip(keys, emitted):
                if k != 0:  # no match: nothing was drafted
                    t, n = calls.get(k, (0, 0))
                    calls[k] = (t + c, n + 1)
        for k, (t, n) in calls.items():
            total = _add(self.totals.setdefault((tree, k), [0, 0]), t, n, kept=self.kept)
            self.emitted[(tree, k)] = total[0] / total[1]
            self.last_verified[k] = self.plain_steps
        if self.plain:  # a key whose verify did not pay is probed less often, one that did as before
            ratio = self._cost_ratio(rows, tree) if rows is not None else 1.0 / self.min_accept
            for k in calls:
                pays = self.expected(tree, k) * ratio >= self.min_gain
                self.backoff[k] = 1 if pays else min(8, 2 * self.backoff.get(k, 1))

    def _relate(self, tree, mean: float, n: int) -> None:
        """A device drafter's call of `tree` (mean over n row-steps) against the requests' level. A shape's
        difference is from the first PROBE_CALLS calls of each run of it, against the level where the run
        began; within a run the level follows the calls (a shape held alone would share every move of the requests)."""
        drafts = max(mean - 1.0, 0.0)
        chained = self._linked(tree)
        if chained is not None and self.unit is not LINKED:  # the level restarts in the links' unit (differences too)
            self.drafts, self.long, self._compared, self.diffs = None, [0.0, 0], (None, 0, None, 0), {}
        if self.drafts is None:  # the level's first call sets its unit
            self.unit = LINKED if chained is not None else tree
        last, calls, base, rows = self._compared
        if tree != last:  # no level (of enough row-steps) yet: the links place the run, or nothing but the run itself does
            calls, rows, base = 0, 0, (self.level if self.level is not None and self.long[1] >= TRUSTED_LEVEL_ROW_STEPS
                                       else None if chained is None else math.log(max(drafts, MIN_DRAFTS)) - chained)
        self._compared = (tree, calls + 1, base, rows + n)
        if base is not None and (calls < PROBE_CALLS or rows < TRUSTED_LEVEL_ROW_STEPS or tree not in self.diffs):
            _add(self.diffs.setdefault(tree, [0.0, 0.0, 0]), n * drafts, n * math.exp(base), n, kept=self.kept)
        own = self._diff(tree) if tree in self.diffs else 0.0
        y = drafts * math.exp(-(own if chained is None else chained))  # drafts, not logs: see above
        self.drafts = y if self.drafts is None else y + (1 - self.level_rate) ** (n / LEVEL_ROW_STEPS) * (self.drafts - y)
        _add(self.long, n * y, n, kept=self.kept)

    level = property(lambda self: None if self.drafts is None else math.log(max(self.drafts, MIN_DRAFTS)))  # (Acceptance)
    def _linked(self, tree) -> float | None: return self.links.diff(tree) if self.use_links else None  # (shape_links.py)

    def _diff(self, tree) -> float:  # the log of its drafts over the level's at its calls: sums, not logs (Acceptance)
        drafts, level, _ = self.diffs[tree]
        return math.log(max(drafts, MIN_DRAFTS * level) / level)

    def expected(self, tree, key: Hashable = None) -> float | None:
        """Tokens a row drafting at `key` is expected to emit per verify step of `tree`: the most
        that it or any shape it contains averaged (a host drafter's optimistic by one standard
        error while its samples are few), 1 for a request with no match, None before it was seen."""
        if key == 0 or tree is PLAIN_CHOICE:
            return 1.0
        if (tree, key) not in self.emitted:
            return None
        if key is None and self.level_rate and self.level is not None:  # a device drafter's: the level and the difference
            diff = self._linked(tree)
            if diff is None and tree in self.diffs:  # (a contained shape's own: its links' where known)
                diff = max(self._diff(t) if (d := self._linked(t)) is None else d for t in self.diffs if contains(tree, t))
            if diff is None and self.unit == tree:  # its calls alone set the level
                diff = 0.0
            if diff is not None:
                return 1.0 + min(math.exp(self.level + diff), tree.steps)  # (a step accepts at most one draft a level)
        e = max(e for (t, k), e in self.emitted.items() if k == key and contains(tree, t))
        return e + (min(self.totals[(tree, key)][1], 16) ** -0.5 if self.plain else 0.0)

    def cost(self, rows: int, label: str) -> float | None:
        """ms a step of a tree (or PLAIN) at this bucket, its share of the launch cost included."""
        ms, launch = self._step_cost(rows, label), self.launch_ms.get(rows)
        if ms is None or launch is None:
            return ms
        plain = label == PLAIN  # a kind not yet seen: the engine's steps a call (spec_policy_notes.md)
        return ms + self.unchained[rows] * launch / self.call_steps.get((rows, plain), self.steps_a_call[0 if plain else 1])

    def _step_cost(self, rows: int, label: str) -> float | None:
        """ms a step: the median seen, weighed against PRIOR_CALLS calls of the table's cost
        scaled by self.scale; None where neither."""
        table, seen = self._table(rows, label), self.medians.get((rows, label))
        if table is None:
            return seen
        n = len(self.recent[(rows, label)]) if seen is not None else 0
        return (n * (seen or 0.0) + PRIOR_CALLS * table * self.scale) / (n + PRIOR_CALLS)

    def knows_plain(self, rows: int) -> bool:  # a plain step's cost at this bucket (seen, or in the table)
        return (rows, PLAIN) in self.observed or self._table(rows, PLAIN) is not None

    def _table(self, rows, label):
        return self.costs.ms.get(("decode", rows, None) if label == PLAIN else ("verify", rows, label))

    def rate(self, rows: int, tree, keys=(None,), ms: float | None = None) -> float | None:
        """Tokens a row emits per ms (ms: of a step, if known) of `tree` here over the rows' keys; None before it was seen."""
        exp = [self.expected(tree, k) for k in keys]
        if any(e is None for e in exp):
            return None
        ms = self.cost(rows, tree.label) if ms is None else ms
        return sum(exp) / len(exp) / ms if ms else sum(exp) / len(exp)

    def _cost_ratio(self, rows, tree) -> float:
        """A plain step's cost over a verify step's at this bucket (1 / min_accept before both are known)."""
        tp, tv = self.cost(rows, PLAIN), self.cost(rows, tree.label)
        return tp / tv if tp and tv else 1.0 / self.min_accept

    def choose(self, rows: int, keys: list | None = None):
        """The tree a call at this bucket verifies, or None: plain decoding (where the bucket has no
        tree; with a host drafter, where no tree pays). keys: a host drafter's requests' match keys."""
        if not (trees := self.trees_at.get(rows, ())):
            return None
        pick, why = (self._gate(rows, trees, keys), "gate") if self.plain else self._rank(rows, trees)
        self.chosen[(rows, PLAIN if pick is None else pick.label)] += 1
        self.why[(rows, f"{PLAIN if pick is None else pick.label}: {why}")] += 1
        return None if pick is PLAIN_CHOICE else pick

    def overruled(self, rows: int, tree) -> None:
        """The call `choose` gave `tree` decodes plainly instead (closed_wave.py): counted as it ran."""
        self.chosen[(rows, tree.label)] -= 1
        self.chosen[(rows, PLAIN)] += 1

    def _rank(self, rows, trees):
        """Among the trees alone (a device drafter), those no nested bigger one replaces: explore,
        then the fastest, held HOLD_CALLS calls, and rivals probed after probe_every calls or more.
        Returns (the tree, why: explore, fastest, held, probe or stale probe)."""
        ms = {t: self.cost(rows, t.label) for t in trees}  # once a call: each sums every cost seen
        trees = [t for t in trees if not any(nested(u, t) and ms[u] is not None and ms[t] is not None
                                             and ms[u] <= NESTED_COST * ms[t] for u in trees)] or trees
        pick = next((t for t in trees if self.seen[t] < self.explore and t is not PLAIN_CHOICE), None)  # learn each
        if pick is not None:
            return pick, "explore"
        n = self.calls[rows] = self.calls[rows] + 1
        rate = {t: self.rate(rows, t, ms=ms[t]) for t in trees}
        ranked = sorted(trees, key=rate.get, reverse=True)
        pick, why = ranked[0], "fastest"
        held, since = self.held.get(rows, (None, 0))
        if held in trees and held is not PLAIN_CHOICE and pick != held and n - since < HOLD_CALLS:
            pick, why = held, "held"  # near-tied shapes would trade places call after call
        probe = self.probes.setdefault(rows, _Probes(self.probe_every))
        if pick != held:
            if held is not None:  # the estimates move: probe as often as at first
                probe.start, probe.mult = min(probe.start, n + self.probe_every), 1
            self.held[rows] = (pick, n)
        if n == probe.start + PROBE_CALLS:  # the probe is over: probe less often while it moves nothing
            probe.mult = 1 if pick != probe.before else min(8, 2 * probe.mult)
            probe.start, probe.done = n + self.probe_every * probe.mult, probe.done + 1
        elif probe.start <= n < probe.start + PROBE_CALLS and len(ranked) > 1:
            # the shapes within 25% of the best in turn (else the runner-up, unless its expectation is counted)
            if n == probe.start:
                probe.before = pick
                others = [t for t in ranked[1:] if t is not PLAIN_CHOICE]  # (plain decoding is never probed)
                last = {t: self.verified_at.get((rows, t), -1) for t in others}
                stale = [t for t in others if n - last[t] > STALE_PROBES * self.probe_every and not self._counted(t, pick)]
                rivals = ([t for t in others if rate[t] >= 0.75 * rate[pick]]
                          or [t for t in ranked[1:2] if t in others and not self._counted(t, pick)] or [pick])
                probe.shape = min(stale, key=last.get) if stale else rivals[probe.done % len(rivals)]
                probe.why = "stale probe" if stale else "probe"
            pick, why = probe.shape, probe.why
        self.verified_at[(rows, pick)] = n
        return pick, why

    def _counted(self, tree, held) -> bool:
        """Whether `held`'s own calls keep what `tree` is expected to emit current: a cut of it (links)."""
        chain = self.links.chain if self.use_links and self.level_rate else []
        return tree in chain and held in chain and chain.index(tree) < chain.index(held)

    def _gate(self, rows, trees, keys):
        """A tree, or plain decoding where none looks min_gain faster (a host drafter)."""
        keys = list(keys or [None])
        if not any(keys):
            return None  # nothing to draft from
        label, n = self.run
        if n == 1 and label is not None and self.observed.get((rows, label)) is None:
            return trees[0] if label != PLAIN else None  # a lone call of an untimed kind: one more, so that it is timed
        if self.cost(rows, PLAIN) is None:
            return None  # time plain steps first: every gain is relative to them
        tree = max(trees, key=lambda t: self.rate(rows, t, keys) or float("inf"))
        exp = [self.expected(tree, k) for k in keys]
        if any(e is None for e in exp):
            return tree  # a match key never verified yet is tried
        ratio = self._cost_ratio(rows, tree)
        if sum(exp) / len(exp) * ratio >= self.min_gain:
            return tree
        # probes spaced by time, not steps: a probe costs a verify step, 1 / ratio plain ones (NGRAM's cost 7-8
        # on the H100, where probes every 8-64 plain steps ran it at 0.84x plain: spec-ngram-new- at f131960)
        wait = self.probe_every * max(1.0, 1.0 / ratio)
        due = any(k and self.plain_steps - self.last_verified.get(k, 0) >= wait * self.backoff.get(k, 1) for k in keys)
        return tree if due else None

    def summary(self) -> dict:  # (what it learned and did: /server_info, the benches' rows)
        return spec_policy_summary.summary(self)
