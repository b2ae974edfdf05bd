"""FR-Spec's small draft vocabulary (`--speculative-token-map`, seed 002).

A draft head with few layers spends most of a draft step in its vocabulary projection: SmolLM2's
tied 49152 x 576 embedding is three times the shipped EAGLE-3 head. A token map lists the K
target ids the head may propose (the most frequent ones); the head's projection is cut to those
K columns and its draft ids map back through the list. Verification still reads the target's
full distribution, so outputs do not change: only which tokens can be drafted.

Maps come as SGLang writes them (`torch.save` of a 1-D tensor, read here without torch), as a
.npy array, or as a JSON list of ids.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.models.loading import CheckpointError


def load_token_map(path: str, vocab_size: int) -> np.ndarray:
    """The map's ids as int32, checked against the target's vocabulary."""
    if not os.path.isfile(path):
        raise CheckpointError(f"token map {path!r}: no such file")
    try:
        if path.endswith(".npy"):
            ids = np.load(path, allow_pickle=False)
        elif path.endswith(".json"):
            with open(path) as f:
                ids = np.asarray(json.load(f))
        else:
            from jaxspec.models.torch_zip import read_torch_tensor
            ids = read_torch_tensor(path)
    except (ValueError, json.JSONDecodeError) as e:
        raise CheckpointError(f"token map {path}: unreadable ({e})") from None
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise CheckpointError(f"token map {path}: expected a non-empty 1-D list of integer token ids, "
                              f"got shape {ids.shape} of {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise CheckpointError(f"token map {path}: id {int(bad[0])} is outside the target's vocabulary "
                              f"[0, {vocab_size}) (a map built for another model?)")
    uniq, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise CheckpointError(f"token map {path}: id {int(uniq[counts > 1][0])} is listed more than once")
    return ids.astype(np.int32)


def apply_token_map(head, target, ids: np.ndarray):
    """Cut `head`'s vocabulary projection to the target ids `ids` (in place; returns the head).
    An EAGLE head borrows the target's projection: it gets its own, the target's columns for
    ids. A head with a draft vocabulary already (EAGLE-3's d2t) keeps the columns of the ids it
    has; an id outside it is an error."""
    cfg = head.cfg
    if cfg.kind == "eagle":
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError("this EAGLE head has a token map already")
        w = target.embed[...].T if target.cfg.tie_word_embeddings else target.lm_head[...]
        cols = ids
    else:
        d2t = np.asarray(head.draft_to_target[...])
        where = {int(t): j for j, t in enumerate(d2t)}
        missing = [int(t) for t in ids if int(t) not in where]
        if missing:
            raise CheckpointError(f"token map: {len(missing)} ids (first {missing[0]}) are outside the head's "
                                  f"{len(d2t)}-token draft vocabulary")
        w, cols = head.lm_head[...], np.array([where[int(t)] for t in ids])
    head.lm_head = nnx.Param(w[:, jnp.asarray(cols)])
    head.draft_to_target = nnx.Variable(jnp.asarray(ids, jnp.int32))
    head.cfg = dataclasses.replace(cfg, draft_vocab_size=len(ids))
    return head


class AdaptiveTokenMap:
    """A token map refreshed from the tokens the engine emits (the seed's TODO): a running count
    over finished requests; every `every` counted tokens the head's K columns become those of the
    K most counted ids. The map stays K ids (a device array of the same shape), so the compiled
    programs take the new one as an argument: no recompile. A refresh lands between steps, and a
    step's drafts leave it as target ids, so a step never mixes two maps; verification reads the
    target's full distribution, so outputs are the same under any map.

    The starting map's ids hold a count of 1/2 (ties kept in its order), so an id must be emitted
    once before it displaces one of them; an EAGLE-3 head can only choose among its own d2t ids."""

    def __init__(self, head, target, ids: np.ndarray, every: int):
        """Cut `head` to the starting map `ids` (apply_token_map) and keep what a refresh needs."""
        if every < 1:
            raise ValueError(f"token map refresh interval {every} must be >= 1 emitted token")
        cfg, self.every, self.head = head.cfg, every, head
        if cfg.kind == "eagle":  # candidates: the whole vocabulary, through the target's projection
            self.candidates = np.arange(cfg.vocab_size, dtype=np.int32)
            self.columns = target.embed[...].T if target.cfg.tie_word_embeddings else target.lm_head[...]
        else:  # an EAGLE-3 head's own vocabulary (its d2t), with its full projection
            self.candidates, self.columns = np.asarray(head.draft_to_target[...]), head.lm_head[...]
        apply_token_map(head, target, ids)  # checks ids against the candidates
        self.where = np.full(cfg.vocab_size, -1, np.int64)
        self.where[self.candidates] = np.arange(len(self.candidates))
        first = self.where[ids]
        self.size = len(ids)
        self.counts = np.zeros(len(self.candidates), np.float64)
        self.counts[first] = 0.5 + 1e-6 * (len(first) - np.arange(len(first))) / len(first)
        self.start, self.prior = first, self.counts.copy()
        self.current = np.sort(first)
        self.pending, self.refreshes, self.changed = 0, 0, False

    def observe(self, token_ids):
        idx = self.where[np.asarray(token_ids, np.int64)]
        np.add.at(self.counts, idx[idx >= 0], 1)
        self.pending += len(token_ids)

    def refresh(self) -> bool:
        """Swap in the top-K map when `every` tokens were counted since the last look; True when
        the head's weights changed (the caller hands them to its programs)."""
        changed, self.changed = self.changed, False
        if self.pending < self.every:
            return changed
        self.pending = 0
        top = np.argsort(-self.counts, kind="stable")[:self.size]
        if np.array_equal(np.sort(top), self.current):
            return changed
        self._swap(top)
        self.refreshes += 1
        return True

    def reset(self):
        """Back to the starting map and counts (benchmarks: each pass adapts from the start)."""
        self.counts, self.pending = self.prior.copy(), 0
        self._swap(self.start)
        self.changed = True

    def _swap(self, top):
        """The head's columns and ids for `top`, placed as the arrays they replace (the compiled
        programs expect that placement, e.g. replicated under a mesh)."""
        self.current = np.sort(top)
        old_w, old_ids = self.head.lm_head[...], self.head.draft_to_target[...]
        self.head.lm_head[...] = jax.device_put(self.columns[:, jnp.asarray(top)].astype(old_w.dtype), old_w.sharding)
        self.head.draft_to_target[...] = jax.device_put(jnp.asarray(self.candidates[top], jnp.int32), old_ids.sharding)
