"""When a host drafter's batch verifies a draft tree and when it decodes plainly.

A host drafter (NGRAM) cannot chain its steps on the device, and its verify step costs more than a
plain one (about 1.5x at batch 1 on the H100, spec-v15-humaneval-b1-gain0), so a verify step must
be accepted far enough to pay. How far depends mostly on the match the draft grows from: a request
whose latest tokens continue a long stretch seen before (a repeated line of code) accepts several
tokens, one whose last token alone matches rarely more than the bonus token. A single average over
recent steps mixes the two, and code alternates them: it paused drafting in fresh text and missed
the repeats that followed (HumanEval batch 1: 1.54x paused as it was vs 1.85x drafting every step).

So the policy keeps the mean accept length per match length (1, 2-3, 4-7 and 8 or more tokens:
coarse, so that each mean gathers samples fast; a request with no match drafts nothing and expects
1) and tree size (the scheduler's keys are (nodes, match bucket) pairs; any hashable works here),
learned from the steps that verified at it, and
verifies a batch while the mean of its requests' expected accepts x plain step / verify step
>= min_gain. The expectation is optimistic while samples are few (upper confidence bound): a mean
judged on a handful of probes shut match lengths that paid when drafted every time. A match
length that does not pay is probed again after probe_every plain steps, the
interval doubling after each probe that does not pay (up to 8x), so that a mean gone stale can
reopen. Step times are per (kind, batch bucket): the wall time between two read-backs of the same
kind (a lone step of a kind not yet timed is followed by a second); until both kinds are timed,
1 / min_accept stands in for plain step / verify step.
"""
from __future__ import annotations

from typing import Hashable

from jaxspec.programs import BATCH_BUCKETS, bucket

MAX_MATCH_KEY = 8  # matches of 8 tokens and more share one mean


class DraftPolicy:
    def __init__(self, min_gain: float, min_accept: float = 2.0, probe_every: int = 8):
        self.min_gain, self.min_accept, self.probe_every = min_gain, min_accept, probe_every
        # keys: whatever the caller buckets requests by (0: no match); the scheduler's are (nodes, key(m))
        self.accept: dict[Hashable, tuple[float, int]] = {}  # key -> (mean accept length, samples)
        self.backoff: dict[Hashable, int] = {}  # key -> probe interval multiplier
        self.last_verified: dict[Hashable, int] = {}  # key -> plain_steps when it last verified
        self.plain_steps = 0  # plain steps read back so far
        self.step_time: dict[tuple, float] = {}  # (kind, batch bucket) -> seconds a step (EWMA)
        self._last_read: tuple | None = None  # (kind, bucket, time) of the last read-back
        self.run = (None, 0)  # (kind, how many in a row) of the latest read-backs

    @staticmethod
    def key(match_len: int) -> int:
        """A match length's bucket: 0 (none), 1, 2 (2-3), 4 (4-7) or 8 (8 and more)."""
        return min(MAX_MATCH_KEY, 1 << (match_len.bit_length() - 1)) if match_len > 0 else 0

    def cost_ratio(self, batch: int) -> float:
        """A plain step's time over a verify step's, at this batch size."""
        b = bucket(batch, BATCH_BUCKETS)
        tv, tp = self.step_time.get(("verify", b)), self.step_time.get(("decode", b))
        return tp / tv if tv and tp else 1.0 / self.min_accept

    def expected(self, key: Hashable) -> float | None:
        """Accept length to expect of a request drafting at this match key, optimistic by one
        standard error of the mean (taking accept lengths' spread as about one token): a match
        length judged on a few samples keeps verifying until they are many (up to the mean's
        window of 16). None until one is seen."""
        if key == 0:
            return 1.0
        a = self.accept.get(key)
        return None if a is None else a[0] + 1.0 / min(a[1], 16) ** 0.5

    def gain(self, keys, batch: int) -> float | None:
        exp = [self.expected(k) for k in keys]
        if any(e is None for e in exp):
            return None
        return sum(exp) / len(exp) * self.cost_ratio(batch)

    def should_verify(self, keys, batch: int) -> bool:
        """Whether a batch whose requests match at `keys` verifies a tree (True) or decodes plainly."""
        if not any(keys):
            return False  # nothing to draft from
        b = bucket(batch, BATCH_BUCKETS)
        kind, n = self.run
        if n == 1 and (kind, b) not in self.step_time:
            return kind == "verify"  # a lone step of an untimed kind: one more, so that it is timed
        if ("decode", b) not in self.step_time:
            return False  # time plain steps first: every gain is relative to them
        g = self.gain(keys, batch)
        if g is None or g >= self.min_gain:
            return True  # a match length never verified yet is tried
        return any(k and self.plain_steps - self.last_verified.get(k, 0) >= self.probe_every * self.backoff.get(k, 1)
                   for k in keys)

    def verified(self, keys, counts, batch: int):
        """A verify step read back: request i matched at keys[i] and emitted counts[i] tokens."""
        for k, c in zip(keys, counts):
            if not k:
                continue
            mean, n = self.accept.get(k, (0.0, 0))
            n += 1
            self.accept[k] = (mean + (c - mean) * max(1.0 / n, 1 / 16), n)
            self.last_verified[k] = self.plain_steps
        ratio = self.cost_ratio(batch)
        for k in set(keys) - {0}:
            pays = self.expected(k) * ratio >= self.min_gain
            self.backoff[k] = 1 if pays else min(8, 2 * self.backoff.get(k, 1))

    def timed(self, kind: str, batch: int, now: float, prefill: bool = False):
        """A step's outputs arrived at `now`: the interval since the last read-back of the same kind
        and batch bucket is one step's wall time (a prefill in between voids it)."""
        if prefill:
            self._last_read, self.run = None, (None, 0)
            return
        b = bucket(batch, BATCH_BUCKETS)
        if self._last_read is not None and self._last_read[:2] == (kind, b):
            dt = now - self._last_read[2]
            old = self.step_time.get((kind, b))
            self.step_time[(kind, b)] = dt if old is None else 0.75 * old + 0.25 * dt
        self._last_read = (kind, b, now)
        self.run = (kind, self.run[1] + 1 if self.run[0] == kind else 1)
        if kind == "decode":
            self.plain_steps += 1
