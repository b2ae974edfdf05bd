"""The draft tree's top-k: each row's k most probable ids and their log-probs, in one kernel.

EAGLE's tree drafting takes, at every depth, the k best children of each frontier node from the
head's logits over its draft vocabulary. XLA ran that as log_softmax and then its TopK kernel,
12 us a call at SmolLM2's 8,192-id draft vocabulary on the H100; this kernel takes 5 us, and an
EAGLE-3 6:4:24 step at batch 1 (six calls) lost 5 kernels and 55 us of kernel time
(step_profile-topk-base- against step_profile-topk-NVIDIA-H100-80GB-HBM3.json, same machine).

One program a row: the row sits in registers (padded to a power of two with -inf), its log-softmax
is formed there, and k rounds each take the largest value and its first index, then mask it out.
Ties go to the lower id, as lax.top_k's do. `promote` (a sampled row's coupled draw,
eagle_step.draft_tree) ranks one id first, at the row's best log-prob plus PROMOTE_MARGIN.
`top_k_log_softmax_ref` is the reference.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.rows import full, triton_params

MAX_VOCAB = 16384  # a whole row in registers: 64 floats a thread at 8 warps
PROMOTE_MARGIN = 1e-3


def _top_k_kernel(x_ref, promote_ref, v_ref, i_ref, *, k, kp, vocab, vp):
    r = pl.program_id(0)
    ids = jnp.arange(vp)
    x = plgpu.load(x_ref.at[r, pl.ds(0, vp)], mask=ids < vocab, other=-jnp.inf).astype(jnp.float32)
    shifted = x - jnp.max(x)
    log_sum = jnp.log(jnp.sum(jnp.exp(shifted)))
    lp = shifted - log_sum
    lp = jnp.where(ids == promote_ref[r], PROMOTE_MARGIN - log_sum, lp)  # the best log-prob is -log_sum
    slot = jnp.arange(kp)
    vals = jnp.full((kp,), -jnp.inf, jnp.float32)
    idx = jnp.zeros((kp,), jnp.int32)
    for j in range(k):
        best = jnp.max(lp)
        at = jnp.minimum(jnp.min(jnp.where(lp == best, ids, vp)), vocab - 1)  # (a NaN row: the last id)
        vals = jnp.where(slot == j, best, vals)
        idx = jnp.where(slot == j, at, idx)
        lp = jnp.where(ids == at, -jnp.inf, lp)
    v_ref[pl.ds(r, 1), :] = vals[None]
    i_ref[pl.ds(r, 1), :] = idx[None].astype(jnp.int32)


def top_k_log_softmax(x, k: int, promote=None, *, interpret=False):
    """x [..., V] logits -> (log_softmax(x)'s k largest [..., k] float32, their ids [..., k] int32).
    promote [...] int32 or None: an id ranked first (-1: none). The kernel on one GPU (or
    interpreted), for rows it holds; the reference elsewhere (under a mesh the kernel would see
    whole arrays)."""
    one_gpu = jax.default_backend() == "gpu" and jax.sharding.get_abstract_mesh().size <= 1
    if (interpret or one_gpu) and x.shape[-1] <= MAX_VOCAB:
        return _top_k_pallas(x, k, promote, interpret=interpret)
    return top_k_log_softmax_ref(x, k, promote)


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def _top_k_pallas(x, k: int, promote, *, interpret):
    lead, vocab = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, vocab)
    r = rows.shape[0]
    promote = jnp.full((r,), -1, jnp.int32) if promote is None else promote.reshape(r).astype(jnp.int32)
    vp, kp = 1 << (vocab - 1).bit_length(), max(2, 1 << (k - 1).bit_length())
    vals, ids = pl.pallas_call(
        functools.partial(_top_k_kernel, k=k, kp=kp, vocab=vocab, vp=vp),
        grid=(r,),
        in_specs=[full(rows), full(promote)],
        out_specs=[pl.BlockSpec((r, kp), lambda i: (0, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((r, kp), jnp.float32), jax.ShapeDtypeStruct((r, kp), jnp.int32)],
        compiler_params=triton_params(num_warps=4 if vp <= 8192 else 8, num_stages=1),
        interpret=interpret,
        name="top_k_log_softmax",
    )(rows, promote)
    return vals[:, :k].reshape(*lead, k), ids[:, :k].reshape(*lead, k)


def top_k_log_softmax_ref(x, k: int, promote=None):
    lp = jax.nn.log_softmax(x.astype(jnp.float32))
    if promote is not None:
        lp = jnp.where(jnp.arange(x.shape[-1]) == promote[..., None], jnp.max(lp, axis=-1, keepdims=True) + PROMOTE_MARGIN, lp)
    return jax.lax.top_k(lp, k)
