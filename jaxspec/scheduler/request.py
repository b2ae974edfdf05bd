"""A request's state, a launched call not yet read back, and the drafted trees left on the device."""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax

from jaxspec.detokenize import IncrementalText
from jaxspec.sampling import SamplerFlags, SamplingParams


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
    text: IncrementalText | None = None  # the output's text as stop strings see it (the engine thread's own)
    stop_text_len: int | None = None  # where a stop string cut the text
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    accept_lengths: list = dataclasses.field(default_factory=list)
    drafts: list = dataclasses.field(default_factory=lambda: [0.0, 0.0])  # accepted, expected by the auto policy (closed_wave)
    group: object = None  # the requests of one Generator.generate call, whose caller waits for them all (closed_wave)
    aborted: bool = False
    draft: tuple | None = None  # (tokens, parents) drafted on device for the next step (EAGLE)
    head_len: int | None = None  # EAGLE: the head's cache stops here (decoded plainly since)
    stop_ids: frozenset | None = None  # the token ids that end it (its stop_token_ids, EOS unless ignored)

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
    tree: object = None  # the TreeShape a device drafter's verify program drafts
    chained: bool = False  # launched from the last call's device outputs, before they were read
    # a row ended on the host after launch (its first token, read from the prefill this call chained on):
    # its device row runs on, not stopped, so no call chains on this one
    ended_after_launch: bool = False
    switched: bool = False  # chained on a call of another shape: its first step verifies that one's drafts, cut
    steps: int = 1  # steps in the call
    plain: bool = False  # decode by the target alone (EAGLE's large-batch fallback)
    host_s: float = 0.0  # host time spent launching
    launched: float | None = None  # the policy's clock as a device drafter's unchained call began its launch
    match_keys: list | None = None  # a host drafter's: the match keys (spec_policy.match_key) its requests drafted at
    next_shape: tuple | None = None  # (tree, nodes) of the call chained on this one (PLAIN: a decode call)
    next_steps: int = 1  # the steps of the call chained on this one
    # rows whose first step verified no draft of this shape: the root alone (after plain decoding), or
    # another shape's drafts, cut (the call before was of another shape; chained ones: `switched`)
    borrowed: frozenset = frozenset()
    # a call joining newcomers into a chain (joining.py): their prefill calls, launched before it and read
    # back after the call it chained on, each with the prompt tokens it fed each of its requests
    joined_prefill: list | None = None


class DraftsOnDevice:
    """A step's drafted trees, copied to the host only when a step that is not chained asks, and
    the shape whose program drafted them (None: a prefill's)."""
    __slots__ = ("arrays", "host", "tree")

    def __init__(self, arrays, tree=None):
        self.arrays, self.host, self.tree = arrays, None, tree

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

    tree = property(lambda self: self.shared.tree)  # the shape that drafted it (None: a prefill)
