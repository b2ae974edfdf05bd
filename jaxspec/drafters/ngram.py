"""NGRAM (lookahead) drafting: a trie of token sequences seen in prompts and outputs.

Every position of every sequence starts a path of up to `max_trie_depth` tokens; each trie node
counts how often its path occurred. To draft, the longest suffix of the request (within the match
window) found in the trie picks a node, and its subtree is read out as a draft tree, either level
by level keeping the most frequent children (BFS) or best-first by path frequency (PROB), until the
draft-token budget is spent. Siblings are distinct tokens by construction, as accept needs.

All of this is host work. Insertion overlaps the device step (`NgramDrafter.prepare`); the match
and the draft read-out run between steps, and both costs are measured per step.
"""
from __future__ import annotations

import array
import collections
import heapq
import time


# Edge keys pack (parent node, token) into one int: any vocabulary is below 2**32.
_TOKEN_BITS = 32


class NgramCache:
    """The trie as flat int arrays and one int-to-int dict, not a Python object a node: the
    garbage collector skips containers of plain ints, so a trie of a million nodes adds nothing
    to its pauses. (With a node object and a children dict each, a HumanEval-batch-64-sized trie
    of 311k nodes took 887 collections and 1.2-1.4 s of pauses to build on CPU:
    bench/results/ngram_trie-*.json.) Node 0 is the root; a node's children are a linked list
    through `first_child` / `next_sibling`, newest first."""

    def __init__(self, max_trie_depth=18, capacity=1_000_000):
        if max_trie_depth < 2:
            raise ValueError("max_trie_depth must be >= 2")
        self.depth, self.capacity = max_trie_depth, capacity
        self.generation = 0  # bumped by every clear: with the node count it dates a match
        self._clear()
        self.recent: collections.deque = collections.deque(maxlen=64)  # kept across evictions

    def _clear(self):
        self.generation += 1
        self.edges: dict[int, int] = {}  # (node << _TOKEN_BITS) | token -> child node
        self.token = array.array("q", [-1])
        self.counts = array.array("q", [0])
        self.first_child = array.array("q", [-1])
        self.next_sibling = array.array("q", [-1])

    @property
    def size(self) -> int:
        return len(self.counts) - 1  # the root aside

    def count(self, node: int) -> int:
        return self.counts[node]

    def children(self, node: int) -> dict[int, int]:
        """token -> child node, in insertion order."""
        out, c = [], self.first_child[node]
        while c >= 0:
            out.append(c)
            c = self.next_sibling[c]
        return {self.token[c]: c for c in reversed(out)}

    def _child(self, node, tok):
        key = (node << _TOKEN_BITS) | tok
        nxt = self.edges.get(key)
        if nxt is None:
            nxt = self.edges[key] = len(self.counts)
            self.token.append(tok)
            self.counts.append(0)
            self.first_child.append(-1)
            self.next_sibling.append(self.first_child[node])
            self.first_child[node] = nxt
        self.counts[nxt] += 1
        return nxt

    def advance(self, cursors: list, tok: int) -> list:
        """Extend every open path by tok and open a new one; returns the cursors still open."""
        out = [(self._child(c, tok), d + 1) for c, d in cursors if d < self.depth]
        out.append((self._child(0, tok), 1))
        return [(n, d) for n, d in out if d < self.depth]

    def insert(self, tokens) -> list:
        cursors = []
        for t in tokens:
            cursors = self.advance(cursors, int(t))
        self.recent.append(list(tokens))
        return cursors

    def evict_if_full(self):
        """Over capacity: drop everything but the most recent sequences (bounded memory)."""
        if self.size <= self.capacity:
            return False
        keep = list(self.recent)[len(self.recent) // 2:][-8:]  # a few, so that an eviction costs little
        self._clear()
        self.recent.clear()
        for seq in keep:
            self.insert(seq)
        return True

    def match(self, tokens, min_window=1, max_window=12):
        """The trie node after the longest suffix of tokens (min..max window) that has children."""
        for w in range(min(max_window, len(tokens), self.depth - 1), min_window - 1, -1):
            node = 0
            for t in tokens[len(tokens) - w:]:
                node = self.edges.get((node << _TOKEN_BITS) | int(t))
                if node is None:
                    break
            if node is not None and self.first_child[node] >= 0:
                return node, w
        return None, 0

    def draft(self, tokens, budget, *, min_window=1, max_window=12, match_type="BFS", breadth=8, branch_length=18):
        """Draft tree below the request's last token: (tokens, parents) with parents indexing the
        full tree (0 = the root, i.e. the last token), at most `budget` nodes."""
        node, _ = self.match(tokens, min_window, max_window)
        return self.draft_below(node, budget, match_type=match_type, breadth=breadth, branch_length=branch_length)

    def draft_below(self, node, budget, *, match_type="BFS", breadth=8, branch_length=18):
        out_tok, out_par = [], []
        if node is None or budget <= 0:
            return out_tok, out_par
        counts = self.counts
        if match_type == "PROB":
            heap = [(-counts[c] / counts[node], i, t, c, 0, 1) for i, (t, c) in enumerate(self.children(node).items())]
            heapq.heapify(heap)
            order = len(heap)
            while heap and len(out_tok) < budget:
                negp, _, t, c, parent, depth = heapq.heappop(heap)
                out_tok.append(t)
                out_par.append(parent)
                me = len(out_tok)
                if depth < branch_length:
                    for t2, c2 in self.children(c).items():
                        order += 1
                        heapq.heappush(heap, (negp * counts[c2] / counts[c], order, t2, c2, me, depth + 1))
            return out_tok, out_par
        level = [(node, 0)]
        for _ in range(branch_length):
            nxt = []
            for n, parent in level:
                for t, c in sorted(self.children(n).items(), key=lambda kv: -counts[kv[1]])[:breadth]:
                    if len(out_tok) == budget:
                        return out_tok, out_par
                    out_tok.append(t)
                    out_par.append(parent)
                    nxt.append((c, len(out_tok)))
            if not nxt:
                break
            level = nxt
        return out_tok, out_par


class NgramDrafter:
    """Host-side drafter for the scheduler: prepare / propose / finish (emitted tokens are read off
    the requests, so no per-token hook).

    The scheduler calls `prepare` after dispatching a device step and before waiting for it, so
    the trie work overlaps the device: each request's tokens not yet in the trie (a new prompt, or
    the tokens emitted since) are folded in there while the device is still busy, so that a wave
    of long prompts spreads over several steps instead of stalling one. What stays on the
    critical path (`host_time`) is per step: the match of each
    request's latest tokens (a walk from the root of at most max_match_window levels per window
    size) and the read-out of the draft. Counts therefore lag the newest tokens by a step or more;
    the match itself does not."""

    def __init__(self, num_draft_tokens=8, min_match_window=1, max_match_window=12, max_bfs_breadth=8,
                 branch_length=18, match_type="BFS", capacity=1_000_000, fold_budget_ms=20.0, min_fold_tokens=16):
        if match_type not in ("BFS", "PROB"):
            raise ValueError(f"ngram match_type must be 'BFS' or 'PROB', got {match_type!r}")
        if num_draft_tokens < 2:
            raise ValueError("num_draft_tokens must be >= 2 (the root plus at least one draft)")
        self.num_nodes = num_draft_tokens
        self.opts = dict(min_window=min_match_window, max_window=max_match_window, match_type=match_type,
                         breadth=max_bfs_breadth, branch_length=branch_length)
        self.cache = NgramCache(max_trie_depth=max(branch_length, max_match_window) + 1, capacity=capacity)
        self.fold_budget_s, self.min_fold_tokens = fold_budget_ms / 1e3, min_fold_tokens
        self.cursors: dict[int, list] = {}  # a request's open insertion paths
        self.folded: dict[int, int] = {}  # how many of its tokens are in the trie
        self._matched: dict[int, tuple] = {}  # a request's latest _match: (stamp, (node, window))
        self.host_time = 0.0  # between device steps
        self.overlapped_time = 0.0  # while a device step runs

    def reset(self):
        """Forget every sequence (a benchmark pass must not draft from an earlier pass's answers)."""
        c = self.cache
        self.cache = NgramCache(max_trie_depth=c.depth, capacity=c.capacity)
        self.cursors.clear()
        self.folded.clear()
        self._matched.clear()

    def prepare(self, reqs, busy=None):
        """Fold the requests' new tokens into the trie while `busy()` says the device is still
        running the step the host waits for (always at least min_fold_tokens, so every backlog
        shrinks even when the host is the bottleneck), within fold_budget_ms."""
        t0 = time.perf_counter()
        deadline, left = t0 + self.fold_budget_s, self.min_fold_tokens
        # requests a few tokens behind first (their matches stay current), then the long backlogs
        for r in sorted(reqs, key=lambda r: len(r.prompt_ids) + len(r.output_ids) - self.folded.get(r.rid, 0)):
            n = len(r.prompt_ids) + len(r.output_ids)
            done, cur = self.folded.get(r.rid, 0), self.cursors.get(r.rid, [])
            stop = False
            while done < n and not stop:
                end = min(n, done + 16)
                for t in r.token_slice(done, end):
                    cur = self.cache.advance(cur, int(t))
                left -= end - done
                done = end
                stop = left <= 0 and (busy is None or not busy() or time.perf_counter() >= deadline)
            self.cursors[r.rid], self.folded[r.rid] = cur, done
            if stop:
                break
        if self.cache.evict_if_full():
            # the old paths are gone; requests go on from their current end (no re-insertion storm)
            for r in reqs:
                if r.rid in self.cursors:
                    self.cursors[r.rid], self.folded[r.rid] = [], len(r.prompt_ids) + len(r.output_ids)
        self.overlapped_time += time.perf_counter() - t0

    def _match(self, req):
        """(trie node, window) of the longest suffix of the request's tokens that the trie continues.
        A step asks up to three times (the scheduler's policy, the draft, the policy's bookkeeping)
        with the same tokens and trie: the answer is kept until either changes (only new nodes
        change a match; counts do not)."""
        o = self.opts
        n = len(req.prompt_ids) + len(req.output_ids)
        stamp = (n, self.cache.generation, len(self.cache.counts))
        kept = self._matched.get(req.rid)
        if kept is not None and kept[0] == stamp:
            return kept[1]
        found = self.cache.match(req.token_slice(max(0, n - o["max_window"]), n), o["min_window"], o["max_window"])
        self._matched[req.rid] = (stamp, found)
        return found

    def propose(self, req, max_nodes=None):
        t0 = time.perf_counter()
        o = self.opts
        node, _ = self._match(req)
        out = self.cache.draft_below(node, (max_nodes or self.num_nodes) - 1, match_type=o["match_type"],
                                     breadth=o["breadth"], branch_length=o["branch_length"])
        self.host_time += time.perf_counter() - t0
        return out

    def match_length(self, req) -> int:
        return self._match(req)[1]

    def finish(self, req):
        self.folded.pop(req.rid, None)
        self._matched.pop(req.rid, None)
        if self.cursors.pop(req.rid, None) is not None:
            self.cache.recent.append(req.prompt_ids + req.output_ids)
