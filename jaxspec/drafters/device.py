"""What the scheduler sees of a drafter that runs on the device inside the fused step (EAGLE,
EAGLE-3, DFLASH): the module and draft shape its programs are built from, its cache, and the
draft each request's last step produced (kept on the request) handed to the next verify."""
from __future__ import annotations

import copy
import functools

import jax.numpy as jnp

from jaxspec.kv_cache import KVCache
from jaxspec.pallas.tree_mask import capped_depths


class DeviceDrafter:
    draft_slots = 0  # cache slots past the verified tokens that drafting writes (DFLASH's block)
    policy_shapes: tuple = ()  # the auto policy's shapes (with_policy_shapes): see cut_shapes

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
        """{'extend', 'verify' (one step), 'verify_steps' (up to MAX_VERIFY_STEPS a call), and
        'decode' where the drafter keeps its head in step while decoding plainly}: the fused
        programs' functions (see programs.py), each taking (state, cache, ...)."""
        from jaxspec.drafters import eagle_step
        mod = self.step_module()
        verify = functools.partial(mod.verify, graphs, self.tree, attn_impl)
        fns = {"extend": functools.partial(mod.extend, graphs, self.tree, attn_impl), "verify": verify,
               "verify_steps": functools.partial(eagle_step.verify_steps, verify, self.tree,
                                                 tuple((s.steps, s.num_draft_tokens) for s in self.cut_shapes()))}
        if self.keeps_head_in_decode:
            fns["decode"] = functools.partial(mod.decode, graphs, attn_impl)
        return fns

    @property
    def keeps_head_in_decode(self) -> bool:
        """Whether plain decode steps can keep this drafter's head in step (its module's `decode`):
        then the auto policy may decode plainly a while and verify again."""
        return hasattr(self.step_module(), "decode")

    def create_cache(self, num_pages, page_size, dtype, mesh=None):
        from jaxspec.sharding import cache_sharding
        layers, kv_heads, head_dim = self.cache_shape()
        return KVCache.create(layers, num_pages, page_size, kv_heads, head_dim, dtype, cache_sharding(mesh, kv_heads))

    def with_tree(self, tree):
        """This drafter drafting `tree` (same head and cache): one of auto_trees' programs."""
        other = copy.copy(self)
        other.tree, other.num_nodes = tree, tree.num_draft_tokens
        return other

    def with_policy_shapes(self, shapes):
        """This drafter, its verify calls also counting what each of `shapes` that fits in its tree
        would have emitted (cut_shapes): the auto policy's."""
        other = copy.copy(self)
        other.policy_shapes = tuple(shapes)
        return other

    def cut_shapes(self) -> tuple:
        """The policy's shapes a cut of this drafter's tree stands for (as deep and as many nodes at
        most; the tree itself left out: its own count says it), in the columns of verify_steps' cut
        counts. The policy compares two shapes on the same steps by them (spec_policy.py)."""
        t = self.tree
        return tuple(s for s in self.policy_shapes
                     if s != t and s.steps <= t.steps and s.num_draft_tokens <= t.num_draft_tokens)

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


def cut_drafts(tokens, parents, *, max_nodes: int, max_depth: int, width: int):
    """DeviceDrafter.propose's cut on the device, for a batch: the drafted trees (tokens, parents
    [B, n], parent-first, the root at 0) cut to their first max_nodes nodes no deeper than
    max_depth, in `width` columns (token 0 and parent -1 past a row's nodes, as the host pads).
    Returns (tokens, parents, num_nodes [B]): the inputs of a call of another shape chained on
    the call that drafted them, with no read back."""
    b, n = tokens.shape
    node = jnp.arange(n)[None]
    up = jnp.where(node > 0, parents, 0)
    shallow = capped_depths(parents, max_depth) <= max_depth
    rank = jnp.cumsum(shallow, axis=1)  # a kept node's new index + 1
    # A too deep node's children are too deep, and once max_nodes are kept no later node is: a
    # kept node's parent (an earlier node) is kept, so the rank renumbers parents too.
    keep = shallow & (rank <= max_nodes)
    col = jnp.where(keep, rank - 1, width)  # past the last column: dropped
    new_parents = jnp.where(node > 0, jnp.take_along_axis(rank - 1, up, axis=1), -1)
    rows = jnp.arange(b)[:, None]
    out_tokens = jnp.zeros((b, width), tokens.dtype).at[rows, col].set(tokens, mode="drop")
    out_parents = jnp.full((b, width), -1, parents.dtype).at[rows, col].set(new_parents, mode="drop")
    return out_tokens, out_parents, keep.sum(axis=1, dtype=jnp.int32)
