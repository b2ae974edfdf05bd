"""What the scheduler sees of a drafter that runs on the device inside the fused step (EAGLE,
EAGLE-3, DFLASH): the module and draft shape its programs are built from, its cache, and the
draft each request's last step produced (kept on the request) handed to the next verify."""
from __future__ import annotations

import copy
import functools

from jaxspec.kv_cache import KVCache


class DeviceDrafter:
    draft_slots = 0  # cache slots past the verified tokens that drafting writes (DFLASH's block)

    def __init__(self, head, tree):
        self.head, self.tree = head, tree
        self.num_nodes = tree.num_draft_tokens

    def cache_shape(self) -> tuple:
        """(layers, kv heads, head dim) of the drafter's own paged cache."""
        raise NotImplementedError

    def step_module(self):
        """The module with this drafter's `extend` and one-step `verify` (drafters/*_step.py)."""
        raise NotImplementedError

    def step_functions(self, graphs, attn_impl) -> dict:
        """{'extend', 'verify' (one step), 'verify_steps' (up to MAX_VERIFY_STEPS a call)}: the fused
        programs' functions (see programs.py), each taking (state, cache, ...)."""
        from jaxspec.drafters import eagle_step
        mod = self.step_module()
        verify = functools.partial(mod.verify, graphs, self.tree, attn_impl)
        return {"extend": functools.partial(mod.extend, graphs, self.tree, attn_impl), "verify": verify,
                "verify_steps": functools.partial(eagle_step.verify_steps, verify, self.tree)}

    def create_cache(self, num_pages, page_size, dtype, mesh=None):
        from jaxspec.sharding import cache_sharding
        layers, kv_heads, head_dim = self.cache_shape()
        return KVCache.create(layers, num_pages, page_size, kv_heads, head_dim, dtype, cache_sharding(mesh, kv_heads))

    def with_tree(self, tree):
        """This drafter drafting `tree` (same head and cache): one of auto_trees' programs."""
        other = copy.copy(self)
        other.tree, other.num_nodes = tree, tree.num_draft_tokens
        return other

    def auto_trees(self) -> tuple:
        """The draft shapes spec_policy='auto' chooses among (each one verify program a bucket)."""
        raise NotImplementedError

    def propose(self, req, max_nodes, max_depth=None):
        """The request's drafted tree cut to max_nodes nodes, none deeper than max_depth: a tree
        drafted by another shape (the prefill's, or before the policy changed shape) verified by a
        program that draws its sampling noise for max_depth + 1 depths."""
        if req.draft is None:  # e.g. the whole prompt came from the prefix cache: verify the root alone
            return [], []
        tokens, parents = req.draft
        m = min(max_nodes, len(tokens))  # nodes are parent-first, so any prefix is a tree
        if max_depth is None or max_depth + 1 >= m:  # m nodes are at most m - 1 deep
            return tokens[1:m], parents[1:m]
        depth, index, keep = [0] * len(tokens), [0] * len(tokens), [0]  # kept nodes' new indices, parents first
        for i in range(1, len(tokens)):
            depth[i] = depth[parents[i]] + 1
            if depth[i] <= max_depth and len(keep) < m and (parents[i] == 0 or index[parents[i]]):
                index[i] = len(keep)
                keep.append(i)
        return [tokens[i] for i in keep[1:]], [index[parents[i]] for i in keep[1:]]

    def finish(self, req):
        req.draft = None

    def refresh(self) -> bool:
        """Between steps: whether the head's weights changed (an adaptive token map swapped in),
        so that the programs take them again."""
        return False
