"""The shapes a speculation policy chooses among (spec_policy.py): EAGLE-style trees (steps, top-k,
draft tokens), a host drafter's node count, plain decoding as one more shape, and how two trees'
drafts compare."""
from __future__ import annotations

import dataclasses
import functools

# EAGLE-3's tree (steps, topk, draft tokens) where AUTO is given no tree numbers (speculative.py); one of
# the auto policy's shapes too (EagleDrafter.auto_trees), so that sizing the first draft builds no other program
DEFAULT_TREE = (6, 4, 32)
MAX_MATCH_KEY = 8  # a host drafter's matches of 8 tokens and more share one key
PLAIN = "plain"  # the label plain decoding's costs are kept under


class _PlainChoice:
    """Plain decoding as one of a device drafter's shapes (its heads kept in step)."""
    label = PLAIN


PLAIN_CHOICE = _PlainChoice()


@dataclasses.dataclass(frozen=True)
class HostTree:
    """A host drafter's draft of up to `num_draft_tokens` nodes: its shape is the match's."""
    num_draft_tokens: int

    @property
    def label(self) -> str:
        return f"{self.num_draft_tokens} nodes"


def match_key(match_len: int) -> int:
    """A host drafter's match length as a key: 0 (none), 1, 2 (2-3), 4 (4-7) or 8 (8 and more):
    coarse, so that each mean gathers samples fast."""
    return min(MAX_MATCH_KEY, 1 << (match_len.bit_length() - 1)) if match_len > 0 else 0


_SHAPE = ("steps", "topk", "num_draft_tokens")


def is_tree(*shapes) -> bool:
    """Whether each is an EAGLE-style tree shape (a HostTree has only a node count)."""
    return all(hasattr(x, a) for x in shapes for a in _SHAPE)


@functools.cache  # the policy asks about the same few pairs many times a call (bench/probes/policy_cost.py)
def contains(tree, other) -> bool:
    """Whether `tree` drafts everything `other` does (as deep, as wide, as many nodes)."""
    return tree == other or is_tree(tree, other) and all(getattr(other, a) <= getattr(tree, a) for a in _SHAPE)


@functools.cache
def nested(big, small) -> bool:
    """Whether `big` drafts every node `small` does and more: the same depth and branching (the
    same candidates, of which each keeps its most probable), more nodes."""
    return (is_tree(big, small) and (big.steps, big.topk) == (small.steps, small.topk)
            and big.num_draft_tokens > small.num_draft_tokens)
