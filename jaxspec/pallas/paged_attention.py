"""Paged attention kernel: extend/prefill, decode and tree verify in one Pallas kernel.

Grid (request, kv head, query block, kv split). A program holds the query rows of one KV head's
whole GQA group, (token, group-member) flattened into rows, so each K/V page is read once per
group. It walks its split's share of the request's pages `pages_per_block` at a time (one
[pages_per_block * page_size, D] tile gathered row by row through the page table: several pages'
loads in flight per iteration) with an online softmax. With more than one split (split-K, for
small batches and long contexts) each split writes its unnormalised partial output and
log-sum-exp terms, merged by the last split of a group to finish (an atomic count) at batch 1,
by XLA after the kernel otherwise. Outputs are in token layout, [tokens, Hq * D], the next
projection's input (stored so by the kernel where it merges). The new tokens' visibility among
themselves is either causal (computed) or a draft tree, passed bit-packed: bit j of
tree_bits[b, t, j // 32] says query t may read new token j, so a [T, T] mask never leaves the
tree-mask program as bools.

A decode step (one new token a request) may leave its K/V out of the pages (`new_kv`): the kernel
reads the cached prefix and folds the new key in where it finishes the softmax, so that a model
writes every layer's new K/V in one scatter after its last layer rather than two a layer before
each attention (kv_cache.write_layers). Or it passes its layer's raw projection (`projection`), and
the kernel norms and ropes q and the new key itself and hands that K/V back for the write.

`paged_attention_ref` in attention_ref.py is the reference; tests run this with interpret=True.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.attention_ref import LOG2E, NEG_INF
from jaxspec.pallas.rows import full, row_rms_scale, triton_params
from jaxspec.pallas.tree_mask import pack_tree_mask

SMS = 132  # H100 SXM multiprocessors: split-K aims to give each of them work


def _exp2(x, approx):
    """2**x; with `approx` one ex2.approx (MUFU) instruction, where jnp.exp / jnp.exp2 lower to
    libdevice's expf / exp2f, which add range handling around it. Tiles of 128 query rows (trees
    of 32 tokens and more at GQA 4) are compute-bound and gain: a 32-token verify 329-339 -> 300
    us, a 64-token one 575-584 -> 524 us (kernels-focus-v23). Decode's 16-row tiles do not (exp2
    227 us, ex2.approx 246 / 238-268 in v23 / v24), nor 16-token trees' 64 rows (258 vs 271 us), so
    they keep exp2. A lazy rescale of the accumulator (FlashAttention-4's) was slower or no faster."""
    if not approx:
        return jnp.exp2(x)
    from jax.experimental.pallas import triton as plgpu
    [y] = plgpu.elementwise_inline_asm("ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
    return y


def _kernel(layer_ref, pt_ref, kv_lens_ref, q_lens_ref, bits_ref, q_ref, k_ref, v_ref, *out_refs,
            group, page_size, block_rows, pages_per_block, splits, scale, causal, softcap, grid_order,
            exp2_approx, num_tokens, num_q_heads, num_q_blocks, merge, interpret, fold_new, rope, norm_x, eps):
    if rope:  # q_ref holds a decode step's projection, [B * (Hq + 2 Hkv), D]: q, the new k and v, raw
        x_ref, cos_ref, sin_ref, *out_refs = out_refs if norm_x else [None, *out_refs]
        *out_refs, new_ref = out_refs  # the new K/V as the pages take them, [B, 2 Hkv, D]
    elif fold_new:  # the new token's key and value [B, Hkv, D], in no page (q_lens 0: the prefix alone)
        new_k_ref, new_v_ref, *out_refs = out_refs
    b, h, qb, split = _axes(grid_order, [pl.program_id(i) for i in range(4)])
    layer = layer_ref[0]
    kv_len, q_len = kv_lens_ref[b], q_lens_ref[b]
    rows = qb * block_rows + jnp.arange(block_rows)
    t = rows // group  # query token of each row
    # operands stay in the cache's dtype (bf16 tensor-core dots, f32 accumulation); float32 asks
    # for IEEE dots, not Triton's TF32 default, so float32 runs match the reference exactly
    precision = jax.lax.Precision.HIGHEST if k_ref.dtype == jnp.float32 else None
    # q in the token layout, [tokens * Hq, D], read from where the output is stored (padding rows
    # read the last token's): a [B, Hkv, rows, D] copy padded to the block cost a kernel a layer
    # (1.4 us a layer of the 8B batch-1 step on the H200), and so did the fused layers' slice of
    # their padded rows
    row = (b * num_tokens + t) * num_q_heads + h * group + rows % group
    # scores in base 2 (log2(e) folded into q's scale): exp2 is the hardware's exponential
    q_scale = scale if softcap is not None else scale * LOG2E
    d = q_ref.shape[1]
    if rope:
        norm = 1.0
        if x_ref is not None:  # the attention norm: its weight is in the projection's rows, 1 / rms(x) taken here
            norm = row_rms_scale(x_ref, b, eps)
        # rotate-half: x * [cos, cos] + x with its halves swapped * [-sin, sin], all gathered as loaded
        kv_heads = num_q_heads // group
        stride = num_q_heads + 2 * kv_heads
        cols = jnp.arange(d)
        swapped, half = (cols + d // 2) % d, cols % (d // 2)
        cos, sin = cos_ref[b, half] * norm, jnp.where(cols < d // 2, -norm, norm) * sin_ref[b, half]

        def roped(r):  # rows r [n] (or one row) of the projection, normed and roped, float32
            lift = (lambda a: a[None, :]) if r.ndim else (lambda a: a)  # (Triton broadcasts nothing itself)
            r = r[:, None] if r.ndim else r
            load = lambda c: q_ref[r, lift(c)].astype(jnp.float32)
            return load(cols) * lift(cos) + load(swapped) * lift(sin)
        q = roped(b * stride + h * group + rows % group)
        kv_row = b * stride + num_q_heads + h
        k_new, v_new = roped(kv_row), q_ref[kv_row + kv_heads, :].astype(jnp.float32) * norm

        @pl.when(split == 0)
        def _():
            new_ref[b, h, :] = k_new.astype(new_ref.dtype)
            new_ref[b, h + kv_heads, :] = v_new.astype(new_ref.dtype)
    else:
        q = q_ref[row - jnp.maximum(t - num_tokens + 1, 0) * num_q_heads, :].astype(jnp.float32)
    q = (q * q_scale).astype(k_ref.dtype)
    if not causal:
        w0 = bits_ref[b, :, 0]
        w1 = bits_ref[b, :, 1]
        num_t = w0.shape[0]
        tt = jnp.minimum(t, num_t - 1)
        # gather each row's words: one-hot over the (small) token axis keeps it to elementwise ops
        onehot = (tt[:, None] == jnp.arange(num_t)[None, :])
        rw0 = jnp.sum(jnp.where(onehot, w0[None, :], 0), axis=1)
        rw1 = jnp.sum(jnp.where(onehot, w1[None, :], 0), axis=1)
    block = pages_per_block * page_size
    # the request's pages shared evenly among the splits (whole blocks each): every split works on
    # a long sequence whatever the table's width, and the grid stays the same for every length
    used = (kv_len + q_len + page_size - 1) // page_size
    pages_per_split = (used + splits * pages_per_block - 1) // (splits * pages_per_block) * pages_per_block
    first = split * pages_per_split
    last = jnp.minimum(first + pages_per_split, used)
    num_blocks = (jnp.maximum(last - first, 0) + pages_per_block - 1) // pages_per_block

    def tile(i, carry, masked):
        m, l, acc = carry
        p0 = first + i * pages_per_block
        # pages past the sequence's end (table padding: page 0; past the table's width, its last
        # entry: padding the table instead cost a kernel a layer) are read but masked below; a split
        # is a whole number of blocks, so no block reaches into the next split's pages
        # each key's row in the cache seen as [L, pages * page_size, Hkv, D]: the tile is gathered
        # 2-D, as the dots take it. Gathering whole pages ([ppb, page_size, D]) and reshaping took
        # 281-291 us against 222-224 for decode at 64 x 2k, 622-632 against 579 for a 64-token
        # verify (kernels-focus-v21; decode under Nsight Compute 269 against 186 us, ncu_probe-*)
        kr = jnp.arange(block)
        row = pt_ref[b, jnp.minimum(p0 + kr // page_size, pt_ref.shape[1] - 1)] * page_size + kr % page_size
        k = k_ref[layer, row, h, :]
        v = v_ref[layer, row, h, :]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                precision=precision)
        if softcap is not None:
            s = (softcap * LOG2E) * jnp.tanh(s / softcap)
        if masked:
            rel = p0 * page_size + jnp.arange(block)[None, :] - kv_len
            if causal:
                among = rel <= t[:, None]
            else:
                word = jnp.where(rel < 32, rw0[:, None], rw1[:, None])
                among = ((word >> jnp.clip(rel % 32, 0, 31)) & 1) == 1
            ok = (rel < 0) | ((rel < q_len) & among)
            s = jnp.where(ok, s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=1))
        corr = _exp2(m - m_new, exp2_approx)
        pr = _exp2(s - m_new[:, None], exp2_approx)
        l = l * corr + pr.sum(axis=1)
        acc = acc * corr[:, None] + jax.lax.dot_general(pr.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                                        preferred_element_type=jnp.float32, precision=precision)
        return m_new, l, acc

    init = (jnp.full((block_rows,), NEG_INF, jnp.float32), jnp.zeros((block_rows,), jnp.float32),
            jnp.zeros((block_rows, d), jnp.float32))
    # tiles wholly inside the cached prefix need no mask (every query reads all of it): only the
    # last tiles, which hold the new tokens and the table's padding, pay for the mask
    unmasked = jnp.clip((kv_len - first * page_size) // block, 0, num_blocks)
    carry = jax.lax.fori_loop(0, unmasked, functools.partial(tile, masked=False), init)
    m, l, acc = jax.lax.fori_loop(unmasked, num_blocks, functools.partial(tile, masked=True), carry)

    def with_new_key(total, norm, m_total):
        """(total, norm, max) with the new key as one more score of each row (merged as a split's
        partial is); as they are without new_kv."""
        if not fold_new:
            return total, norm, m_total
        if rope:
            kn, vn = k_new, v_new
        else:
            kn, vn = new_k_ref[b, h, :].astype(jnp.float32), new_v_ref[b, h, :].astype(jnp.float32)
        s_new = jnp.sum(q.astype(jnp.float32) * kn[None, :], axis=1)
        if softcap is not None:
            s_new = (softcap * LOG2E) * jnp.tanh(s_new / softcap)
        m_all = jnp.maximum(m_total, s_new)
        w_old, w_new = jnp.exp2(m_total - m_all), jnp.exp2(s_new - m_all)
        return total * w_old[:, None] + w_new[:, None] * vn[None, :], norm * w_old + w_new, m_all

    def store(out_ref, total, norm):  # the rows of the real tokens, [tokens * Hq, D]
        out = (total / jnp.maximum(norm, 1e-30)[:, None]).astype(out_ref.dtype)
        plgpu.store(out_ref.at[row[:, None], jnp.arange(d)[None, :]], out, mask=(t < num_tokens)[:, None])

    if splits == 1:
        store(out_refs[0], *with_new_key(acc, l, m)[:2])
        return
    # split-K: each split leaves its partial result. With `merge`, the last of a group's splits to
    # finish merges them: at batch 1 the 8B decode step took 5.84 ms against 6.10 with XLA's merge
    # after the kernel (three kernels, 4.1 us a layer; here the kernel takes 1.8 us longer, plus a
    # 0.9 us memset of the counts), SmolLM2's 1.13 against 1.17 (Pallas's merge kernel, 4.5 us); at
    # batch 8 SmolLM2's took 1.09 against XLA's 1.05 (decode-merge-*.json)
    acc_ref, m_ref, l_ref = out_refs[2:5] if merge else out_refs
    r0 = qb * block_rows
    if fold_new and not merge:  # XLA merges the partials: the first split's carries the new key
        folded = with_new_key(acc, l, m)
        acc, l, m = (jnp.where(split == 0, x, y) for x, y in zip(folded, (acc, l, m)))
    acc_ref[b, h, split, pl.ds(r0, block_rows), :] = acc
    m_ref[b, h, split, pl.ds(r0, block_rows)] = m
    l_ref[b, h, split, pl.ds(r0, block_rows)] = l
    if not merge:
        return
    o_ref, count_ref = out_refs[1], out_refs[5]  # (count_ref aliases the counts passed in, out_refs[0])
    if not interpret:  # (the interpreter runs a program at a time)
        plgpu.debug_barrier()  # every thread's partials written before the (acquire-release) count
    group_id = (b * (num_q_heads // group) + h) * num_q_blocks + qb
    arrived = plgpu.atomic_add(count_ref, group_id, jnp.ones((), jnp.int32))

    @pl.when(arrived == splits - 1)
    def _merge():
        part = lambda ref, s, *tail: ref[b, h, jnp.int32(s), pl.ds(r0, block_rows), *tail]
        ms = [part(m_ref, s) for s in range(splits)]  # base-2 maxima; an empty split's is NEG_INF, its l 0
        m_all = functools.reduce(jnp.maximum, ms)
        total, norm = jnp.zeros_like(acc), jnp.zeros_like(l)
        for s in range(splits):  # unrolled: every split's loads in flight at once
            w = jnp.exp2(ms[s] - m_all)
            total = total + part(acc_ref, s, slice(None)) * w[:, None]
            norm = norm + part(l_ref, s) * w
        store(o_ref, *with_new_key(total, norm, m_all)[:2])
        count_ref[group_id] = 0  # ready for the next call


def _axes(grid_order, ids):
    """Grid indices (launch order) -> (request, kv head, query block, split)."""
    named = dict(zip(grid_order, ids))
    return named["b"], named["h"], named["q"], named["s"]


MAX_SPLITS = 16  # the merge reads every split's partial result, empty or not
COUNT_SLOTS = 2 * SMS  # arrival counts a merging call may need: it splits only while its programs are fewer


def choose_blocking(batch, kv_heads, q_blocks, table_pages, page_size):
    """(pages_per_block, splits): 64-key tiles (best of 16/64/128 on the H100 at batch 64 x 2k,
    bench/results/kernels-*.json); split-K only while the grid is short of two programs per
    multiprocessor, at most MAX_SPLITS, and never more splits than the table has tiles."""
    ppb = max(1, min(64 // page_size, table_pages))
    ppb = 1 << (ppb.bit_length() - 1)
    programs = batch * kv_heads * q_blocks
    splits = 1
    while programs * splits < 2 * SMS and (splits * 2) * ppb <= table_pages and splits < MAX_SPLITS:
        splits *= 2
    return ppb, splits


@functools.partial(jax.jit, static_argnames=("interpret", "block_rows", "softcap", "num_warps", "num_stages",
                                             "pages_per_block", "splits", "grid_order", "token_rows",
                                             "merge_in_kernel", "partials", "tokens", "eps"))
def paged_attention(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask=None, *,
                    interpret=False, block_rows=None, softcap=None, num_warps=4, num_stages=2,
                    pages_per_block=None, splits=None, grid_order=None, token_rows=None, merge_in_kernel=None,
                    partials=False, tokens=None, counts=None, new_kv=None, projection=None, eps=1e-5):
    """q [B, T, Hq, D], or with `tokens` = T the fused layers' token layout [rows, Hq * D] (row
    b * T + t; rows past B * T ignored); k_pages/v_pages [L, N, ps, Hkv, D]; layer: scalar ->
    [B, T, Hq, D], or with token_rows, [token_rows, Hq * D] (that layout; rows past B * T unspecified).
    counts: COUNT_SLOTS int32 zeros, the merging splits' arrival counts, which the kernel leaves zero:
    given, it returns (output, counts) for the next layer's call (zeroed anew, they cost a memset a
    layer: 0.9 us of the 8B batch-1 step's each).

    new_kv: (k, v) [B, Hkv, D] of a decode step's one new token (T = 1, causal), not in the pages:
    each request attends to its kv_lens cached keys and this one (q_lens only says which rows are live).
    projection: (x [B, H], cos, sin [B, D/2] float32), for a decode step whose q is its layer's fused
    projection of x [B, (Hq + 2 Hkv) * D] (heads [q | k | v]; no shard groups), not normed (the norm's
    weight folded into wqkv's rows; eps its epsilon; x None: normed already) and not roped: the kernel
    scales by 1 / rms(x), ropes q and the new key, reads that key and value from there (new_kv implied)
    and returns them as the pages take them, (out, (k, v) [B, Hkv, D]): no XLA kernel between the two.

    grid_order names the grid's axes (b request, h kv head, q query block, s split) in launch
    order, the first varying fastest: programs launched together share L2, so the query blocks
    of one request and head, which read the same pages, run side by side when q comes first.
    By default q comes first where there are several query blocks (a 64-token tree at GQA 4: 771 vs
    903 us and 745 vs 898 us on the H100, kernels-focus-v16/-v17), and requests first otherwise."""
    _, _, ps, hkv, d = k_pages.shape
    if projection is not None:
        b, t, hq = kv_lens.shape[0], 1, q.shape[-1] // d - 2 * hkv
    else:
        b, t, hq = (kv_lens.shape[0], tokens, q.shape[1] // d) if tokens else q.shape[:3]
    q = q.reshape(-1, d)  # [rows * Hq, D]: no copy of either layout
    g = hq // hkv
    rows = t * g
    if block_rows is None:  # 128-row tiles beat 64 for 32- and 64-token trees (kernels-focus-*.json)
        block_rows = max(16, min(128, 1 << (rows - 1).bit_length()))
    padded = -(-rows // block_rows) * block_rows
    q_blocks = padded // block_rows
    auto_ppb, auto_splits = choose_blocking(b, hkv, q_blocks, page_table.shape[1], ps)
    ppb = pages_per_block or auto_ppb
    splits = splits or auto_splits
    grid_order = grid_order or ("qhbs" if q_blocks > 1 else "bhqs")
    if partials:  # the split-K partials themselves (acc, m, l), unmerged: see prefix_attention
        splits = max(2, splits)
    # split-K partials merged by the kernel's last split (default: at batch 1, where it measured faster)
    merge = not partials and splits > 1 and (b == 1 if merge_in_kernel is None else merge_in_kernel)
    causal = tree_mask is None
    fold_new = new_kv is not None or projection is not None
    if fold_new:
        assert t == 1 and causal and not partials, "new_kv is a decode step's: one token a request, causal"
        q_lens = jnp.zeros_like(q_lens)  # the pages hold the prefix alone
    bits = jnp.zeros((b, 1, 2), jnp.int32) if causal else pack_tree_mask(tree_mask)
    # Triton takes power-of-two arrays only (a 40-token tree's [40] words failed to lower on the
    # H100); extra tokens repeat the last one's words, as the kernel's padding rows read them
    n_words = 1 << (bits.shape[1] - 1).bit_length()
    bits = jnp.pad(bits, ((0, 0), (0, n_words - bits.shape[1]), (0, 0)), mode="edge")
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    # [L, N, ps, Hkv, D] -> [L, N * ps, Hkv, D]: adjacent axes merged, no copy
    k_rows = k_pages.reshape(k_pages.shape[0], -1, *k_pages.shape[3:])
    v_rows = v_pages.reshape(v_pages.shape[0], -1, *v_pages.shape[3:])
    kernel = functools.partial(_kernel, group=g, page_size=ps, block_rows=block_rows, pages_per_block=ppb,
                               splits=splits, scale=d ** -0.5, causal=causal, softcap=softcap,
                               grid_order=grid_order, exp2_approx=block_rows >= 128 and not interpret,
                               num_tokens=t, num_q_heads=hq, num_q_blocks=q_blocks, merge=merge,
                               interpret=interpret, fold_new=fold_new, rope=projection is not None,
                               norm_x=projection is not None and projection[0] is not None, eps=eps)

    out_rows = token_rows or b * t
    out = jax.ShapeDtypeStruct((out_rows * hq, d), q.dtype)  # the token layout, stored by the kernel
    args = [layer, page_table, kv_lens, q_lens, bits, q, k_rows, v_rows]
    if projection is not None:
        x, cos, sin = projection
        args += [] if x is None else [x.reshape(b, -1)]
        args += [c.reshape(b, d // 2).astype(jnp.float32) for c in (cos, sin)]
    elif fold_new:
        args += [new_kv[0].astype(k_rows.dtype), new_kv[1].astype(v_rows.dtype)]
    outs = [out]
    if splits > 1:  # the partials (acc, m, l), in place of the output unless the kernel merges them
        part = (b, hkv, splits, padded)
        parts = [jax.ShapeDtypeStruct(part + (d,), jnp.float32)] + [jax.ShapeDtypeStruct(part, jnp.float32)] * 2
        outs = [out, *parts] if merge else parts
    given = counts
    if merge:  # and how many of each (request, head, query block)'s splits are done
        counts = jnp.zeros((b * hkv * q_blocks,), jnp.int32) if given is None else given
        assert counts.shape[0] >= b * hkv * q_blocks, (counts.shape, b * hkv * q_blocks)
        args.append(counts)
        outs.append(jax.ShapeDtypeStruct(counts.shape, counts.dtype))
    if projection is not None:
        outs.append(jax.ShapeDtypeStruct((b, 2 * hkv, d), k_rows.dtype))
    res = pl.pallas_call(
        kernel,
        grid=tuple(dict(b=b, h=hkv, q=q_blocks, s=splits)[a] for a in grid_order),
        in_specs=[full(a) for a in args],
        out_specs=[full(o) for o in outs],
        out_shape=outs,
        input_output_aliases={len(args) - 1: 4} if merge else {},
        interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
    )(*args)
    if partials:
        return tuple(res)
    if splits > 1 and not merge:
        merged = combine_splits(*res[:3])[:, :, :rows].astype(q.dtype)
        merged = merged.reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)
        out = merged if token_rows is None else token_layout(merged, token_rows)
    else:  # [out_rows, Hq * D]: row r * T + t holds token t of request r (rows past B * T are left unwritten)
        out = res[0].reshape(out_rows, hq * d) if token_rows else res[0].reshape(b, t, hq, d)
    if projection is not None:
        out = (out, (res[-1][:, :hkv], res[-1][:, hkv:]))
    return out if given is None else (out, res[4] if merge else given)


def combine_splits(acc, m, l, with_lse=False):
    """acc [..., S, R, D], m / l [..., S, R] partials of S key ranges -> [..., R, D] softmax output
    (with_lse: and [..., R] the base-2 log-sum-exp of the rows' scores, NEG_INF where no key)."""
    m_all = m.max(axis=-2, keepdims=True)
    # the kernel's maxima are in base 2; an empty split has m = NEG_INF, l = 0: weight 0 unless all are empty
    w = jnp.exp2(m - m_all)
    l_all = (l * w).sum(axis=-2)
    out = (acc * w[..., None]).sum(axis=-3) / jnp.maximum(l_all, 1e-30)[..., None]
    if not with_lse:
        return out
    return out, jnp.where(l_all > 0, m_all[..., 0, :] + jnp.log2(jnp.maximum(l_all, 1e-30)), NEG_INF)


def prefix_attention(q, k_pages, v_pages, layer, page_table, kv_lens, *, interpret=False):
    """q [B, T, Hq, D] over each request's first kv_lens cached keys, nothing else -> (out [B, T,
    Hq, D] float32, lse [B, T, Hq]: the base-2 log-sum-exp of the scores scaled by D ** -0.5,
    NEG_INF where a request has no key). The kernel's split-K partials merged here rather than in
    it, so that the caller can merge keys of its own: eagle_step.draft_tree's drafted rows, which
    are in no page. Reads only the pages in use, whatever the table's width.
    `prefix_attention_ref` in attention_ref.py is the reference."""
    b, t, hq, d = q.shape
    hkv = k_pages.shape[3]
    g = hq // hkv
    acc, m, l = paged_attention(q, k_pages, v_pages, layer, page_table, kv_lens, jnp.zeros_like(kv_lens),
                                interpret=interpret, partials=True)
    out, lse = combine_splits(acc, m, l, with_lse=True)  # [B, Hkv, rows (padded), D], [B, Hkv, rows]
    rows = t * g  # row r of a head's block: token r // g, group member r % g
    out = out[:, :, :rows].reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)
    return out, lse[:, :, :rows].reshape(b, hkv, t, g).transpose(0, 2, 1, 3).reshape(b, t, hq)


def token_layout(out, token_rows):
    """[B, T, Hq, D] -> [token_rows, Hq * D], zero rows past B * T."""
    b, t, hq, d = out.shape
    return jnp.pad(out.reshape(b * t, hq * d), ((0, token_rows - b * t), (0, 0)))

