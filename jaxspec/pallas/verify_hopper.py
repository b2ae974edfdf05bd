"""Tree verify on Hopper: paged attention for 16-64 draft tokens through Mosaic GPU (wgmma, TMA).

A verify of T tokens at GQA g holds T * g query rows per KV head (256 for a 64-token tree at 8B
heads), where paged_attention.py's Triton kernel tops out near 260 TFLOP/s. This kernel is
FlashAttention-3's shape over pages: a CTA takes 2 * wg_rows query rows of one request and KV head
(tokens padded to a power of two from 8, rows head-major, q and o in the model's [B, T, Hq, D]);
two consumer warpgroups (64 rows each by default) run wgmma and the online softmax, taking turns
on the tensor cores (as written, one's softmax under the other's products; as compiled, looser:
see below), while a producer warpgroup fills a
ring of K/V tiles by TMA, one copy per page (`block_kv // page_size` pages a tile, all counted on
the tile's barrier). The CTAs of one head launch side by side and share its pages through L2.
persistent=N (the engine's choice, N = the GPU's SMs) launches N CTAs that take the (request,
head, query block) items in turn, the ring and the page-table loads running on from one item to
the next: 0.5-17% less time than a CTA an item in each of 15 comparisons in kernels-focus-v37..v39.
Each consumer sends its output out through its half of the last tile's K slot, holding the slot
until then, so one query buffer serves and the next item's queries load during the last tile;
that leaves room for a ring of three tiles (verify_timeline-0515872, 64 tokens: 249.1 us against
259.5 with two tiles and the output through two query buffers, as before). A last tile of at most
64 keys (a 64-token verify on 2048 cached keys: 16.5 tiles) is fetched and computed at half width.

Options that did not beat the default at 64 tokens (v30..v39, verify_timeline-*): overlap
(FlashAttention-3's intra-warpgroup overlap: tile i's scores and tile i - 1's values issued
together; also with both awaited before the softmax, kernels-focus-v40 at 70acc13: 359 us against
324), multicast (a head's two CTAs as a cluster, each page copy multicast to
both), wg_rows=128 (463c3e4: 353 us against 249), 64- and 192-key tiles (463c3e4: 315 us); since
removed, a tile's values and the next tile's scores issued together after the tile's softmax
(dbf860e, f3efd70: 4% slower), the row max and sum by column halves combined first (dbf860e:
0.4-1% slower),
the consumers' turns running on across items (5d597e1: level), a share of the exponentials
by polynomial on the FMA pipe (verify_probe-b19c869: 9% slower) and the queries in registers for
the scores product (kernels-focus-v41: level).

Where a 64-token verify's time goes (verify_probe-*, ncu_source-pers): copies of this kernel with
one part cut out (the exponentials, the row max, the rescale, DRAM reads, half the pages, either
product) are 0-11% faster, and by Nsight Compute's per-instruction samples a consumer warp spends
about as long in its softmax as in waiting for its own two products. The two consumers' turns are
balanced, so shortening one phase leaves the period to the other. Mosaic GPU's in-kernel profiler
(profile_dir; verify_timeline-*) puts a consumer's 128-key tile at about 3.3k cycles: 0.7-0.9k
issuing and awaiting its scores, 1.3k in the softmax, 0.75-0.95k in the values product; without
the softmax the tile still takes 3.05k. Its waits are short (verify_timeline-f55db9e, per tile:
0.10-0.14k a turn, twice; 0.08-0.22k for the keys, 0.07-0.08k for the values, 0.27-0.29k for the
scores product after issuing it): each consumer's own chain of product, softmax and product is
what sets the pace.

Where a head's rows take two CTAs or more (64 tokens at 8B heads; stale_max), the default loop's
softmax takes P against a stale reference max a row (softmax_stale): no row max, no rescale of the
output, in most tiles. A row's reference moves only where a tile's P would pass 2^STALE_SLACK (or
overflow); a warp votes on that after the exponentials and, rarely, redoes the tile with its row
max from the scores it kept (an item's first tile always: m = NEG_INF). The
row max is 64 FMNMX a thread and a tile on the ALU pipe, in the chain from a tile's scores to its
values; instructions there set the pace (verify_timeline-4a76ae1: 64 integer adds a tile there,
4% slower). verify_timeline-28b1d97: 244.3 us against 251.0 for b4aa46a's row max each tile, 250.7
for this loop with it. The redo packs its P by integer rounding, so that ptxas packs the kept P
(F2FP) before the vote, among the exponentials, rather than sinking both packings past the join
to after the values' turn wait (3466605, where it did: 246.1 in the same run; the SASS of these
loops: bench/results/mosaic_sass-28b1d97.txt). Tried and left:
the output's rescale skipped by a warp's vote where no row's max moved past a slack (6315e1a:
level), the redo decided by the whole warpgroup and computed from the scores' product again
(e1aab6e: 7% slower, spilling). At 16 tokens, one CTA a head and memory-bound, it was 8% slower
(verify_timeline-5b9a1bd-t16), level at 32.

The turns are looser than the code reads: in the SASS (bench/results/mosaic_sass-f8f4d9e.txt; the
PTX from mosaic_dump.py, ptxas and nvdisasm from NVIDIA's pip wheels) ptxas has moved each
consumer's softmax-done arrival, written after the softmax with the row max each tile, up to just
after its row max, above the exponentials (the optimisation barrier fences LLVM, not ptxas), and
the bf16 packing and output rescale down below the wait for the next turn. So the other consumer
starts its softmax while this one is still in its own, and the two softmaxes overlap instead of
alternating. Forcing the written order (a store of the row sums to shared memory, which the
arrival's release must follow) gives the strict ping-pong, and it is slower: verify_timeline-bf75a55,
262.9 us against 249.5 without the store; its profile shows why: a softmax alone still takes 1.35k
cycles, more than the other consumer's two products, so strict turns leave the period at two
softmaxes plus the turn waits. Turns at the scores issue alone (no softmax-done arrival, no
store): 269.6 us. With the stale max the arrival is written before the softmax; ptxas places it
among the exponentials (after them: 246.7 us in verify_timeline-28b1d97).

Masking as in paged_attention.py: tiles wholly inside the cached prefix need none; the last one
or two tiles hold the new tokens, whose visibility comes as two 32-bit words per query row (bit j:
may read new token j; a chain's words are its causal triangle).

Scores are in base 2: the softmax scale times log2 e multiplies the raw scores inside exp2's
argument (one FFMA a score). The reference is `paged_attention_ref` (attention_ref.py). Under
interpret=True (CPU tests) the two products are jnp dots: jax 0.10's GPU interpreter cannot read
a transposed wgmma operand nor run run_state, and has no clusters; the copies, barriers, masks and
softmax run as on the GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxspec.pallas.attention_ref import NEG_INF
from jaxspec.pallas.paged_attention import LOG2E, pack_tree_mask

PT_LANES = 32  # page-table row staged as [width / 32, 32]: 128-byte TMA rows
SMEM_BYTES = 227 * 1024  # an H100 CTA's most shared memory
SMEM_SLACK = 1024  # barriers and alignment


def supports(q, k_pages, tree_mask, softcap=None, block_kv=None, pages_per_seq=0) -> bool:
    """Shapes this kernel takes: trees (or chains) of at most 64 tokens, bf16/f16, head_dim 64 or
    128, pages that tile a K/V block (8 rows and up: TMA's tile; by default blocks of 64 and 128),
    and page-table rows of pages_per_seq that fit in shared memory beside a ring of two tiles."""
    b, t, hq, d = q.shape
    ps = k_pages.shape[2]
    kv = 128 if block_kv is None else block_kv
    return (softcap is None and t <= 64 and d in (64, 128)
            and q.dtype in (jnp.bfloat16, jnp.float16) and k_pages.dtype == q.dtype
            and ps >= 8 and all(kv % ps == 0 for kv in ((64, 128) if block_kv is None else (block_kv,)))
            and _smem_bytes(kv, d, q.dtype.itemsize, 64, _table_width(pages_per_seq, kv // ps), 2, 1) <= SMEM_BYTES)


def _table_width(pages_per_seq, pages_per_tile):  # a page-table row, padded to whole 128-byte rows
    lanes = max(PT_LANES, pages_per_tile)
    return -(-pages_per_seq // lanes) * lanes


def _smem_bytes(block_kv, d, itemsize, wg_rows, width, stages, q_bufs, profile_space=0):
    """Shared memory: the K/V ring, the query buffers, two page-table rows, the profiler's trace."""
    return (2 * stages * block_kv * d * itemsize + q_bufs * 2 * wg_rows * d * itemsize + 2 * width * 4
            + 3 * 16 * profile_space + SMEM_SLACK)


STALE_SLACK = 64  # log2 units: how far a tile's P may exceed its row's reference (P <= 2^64) unchecked


def _to_half_by_integer(p, dtype):
    """P (a Mosaic GPU FragmentedArray, f32) in 16 bits: bf16 by an integer add and shift (rounding
    to nearest), not the F2FP the kept P takes in settle_softmax, so that ptxas packs the kept P
    before the branch rather than sinking both packings past the join (and the turn's wait) with the
    f32 P live through it."""
    from jaxlib.mlir import ir

    if dtype != ir.BF16Type.get():
        return p.astype(dtype)
    bits = (p.bitcast(ir.IntegerType.get_signless(32), output_is_signed=False) + 0x8000) >> 16
    return bits.astype(ir.IntegerType.get_signless(16), is_signed=False).bitcast(dtype)


def settle_softmax(s, m, l, acc, p16, l_next, scale):
    """A tile's softmax from P taken against the rows' reference maxes m (no row max, no rescale),
    redone with the row max in the warps where some row's tile sum of P passes 2^STALE_SLACK (or is
    not finite): the first tile of an item (m = NEG_INF), and a tile whose scores rise by more than
    STALE_SLACK above the reference. -> (p16, m, l, acc). The row max is 64 FMNMX a thread and a tile
    on the ALU pipe, in the chain from a tile's scores to its values; a warp's vote on a warp-uniform
    branch decides (the redo uses shuffles within the warp, no product)."""
    import jax.experimental.mosaic.gpu as mgpu
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm, scf, vector

    tile, rows = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)
    sds = lambda x, layout: plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=layout)

    @plgpu.inline_mgpu(arg_types=(tile, rows, rows, tile, tile, rows),
                       return_type=(sds(p16, tile), sds(m, rows), sds(l, rows), sds(acc, tile)))
    def _settle(ctx, s, m, l, acc, p16, l_next):
        del ctx
        i1, i32, f32 = ir.IntegerType.get_signless(1), ir.IntegerType.get_signless(32), ir.F32Type.get()
        bound = arith.constant(f32, 2.0 ** STALE_SLACK)
        over = arith.constant(i1, 0)
        for prev, nxt in zip(l.registers.flat, l_next.registers.flat):  # this thread's rows
            is_vec = isinstance(prev.type, ir.VectorType)
            for k in range(ir.VectorType(prev.type).shape[0] if is_vec else 1):
                a, b = (vector.extract(r, [], [k]) if is_vec else r for r in (prev, nxt))
                # the tile's sum, l_next - l, unordered-or-greater: NaN and infinity count as over
                over = arith.ori(over, arith.cmpf(arith.CmpFPredicate.UGT, arith.subf(b, a), bound))
        ballot = llvm.inline_asm(i32, [arith.extui(i32, over)],
                                 "{ .reg .pred p; setp.ne.b32 p, $1, 0; vote.sync.ballot.b32 $0, p, -1; }",
                                 "=r,r", has_side_effects=False)
        redo = arith.cmpi(arith.CmpIPredicate.ne, ballot, arith.constant(i32, 0))
        kept = (p16, m, l_next, acc)
        regs = [r for x in kept for r in x.registers.flat]
        branch = scf.IfOp(redo, [r.type for r in regs], has_else=True)
        with ir.InsertionPoint(branch.then_block):
            m_new = m.max(s.reduce("max", 1) * scale)
            p = (s * scale - m_new.broadcast_in_dim(s.shape, (0,), s.layout)).exp2(approx=True)
            alpha = (m - m_new).exp2(approx=True)
            redone = (_to_half_by_integer(p, p16.mlir_dtype), m_new, l * alpha + p.reduce("add", 1),
                      acc * alpha.broadcast_in_dim(acc.shape, (0,), acc.layout))
            scf.yield_([r for x in redone for r in x.registers.flat])
        with ir.InsertionPoint(branch.else_block):
            scf.yield_(regs)
        out, results = [], list(branch.results)
        for x in kept:
            n = x.registers.size
            regs_x = np.asarray(results[:n], dtype=object).reshape(x.registers.shape)
            out.append(mgpu.FragmentedArray(_registers=regs_x, _layout=x.layout, _is_signed=x.is_signed))
            results = results[n:]
        return tuple(out)

    return _settle(s, m, l, acc, p16, l_next)


def _row_words(tree_mask, b, t, t_pad, rows_padded):
    """[B, 2, R] int32: bit j of row r's words says r's token (r % t_pad) may read new token j."""
    if tree_mask is None:
        tree_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    bits = pack_tree_mask(tree_mask)  # [B, T, 2]
    token = jnp.minimum(jnp.arange(rows_padded) % t_pad, t - 1)
    return bits[:, token].transpose(0, 2, 1)


def _kernel(layer_ref, pt_ref, kv_lens_ref, q_lens_ref, words_ref, q_ref, k_ref, v_ref, o_ref, scratch, *,
            page_size, block_kv, half_kv, stages, wg_rows, group, scale, overlap, pingpong, cluster, persistent,
            stage_in_ring, stale_max, interpret):
    import jax.experimental.pallas.mosaic_gpu as plgpu
    (q_smem_bufs, k_smem, v_smem, pt_smem), (k_ready, v_ready, q_ready, pt_ready), (k_free, v_free), (turn, issue) = scratch
    n_heads, n_qb = k_ref.shape[2], words_ref.shape[2] // (2 * wg_rows)  # KV heads; CTAs (query blocks) a head
    n_work = kv_lens_ref.shape[0] * n_heads * n_qb  # work items (request, head, query block), query block fastest
    wg = lax.axis_index("wg")
    if persistent:  # the CTA takes items sid, sid + n, ...: the ring, page loads and the next
        # item's queries run on across items, where separate CTAs each start cold (a launch wave)
        sid = lax.axis_index("s")
        first, stride, n_items = sid, persistent, lax.div(n_work - sid + persistent - 1, persistent)
    else:  # one item: this CTA's place in the grid (and its cluster)
        qb = lax.axis_index("q") * cluster + (lax.axis_index("c") if cluster > 1 else 0)
        first, stride, n_items = (lax.axis_index("b") * n_heads + lax.axis_index("h")) * n_qb + qb, 1, 1

    def item(n):  # -> request, KV head, query block, its lengths and tiles
        w = first + n * stride
        b, h, qb = lax.div(w, n_heads * n_qb), lax.rem(lax.div(w, n_qb), n_heads), lax.rem(w, n_qb)
        kv_len, q_len = kv_lens_ref[b], q_lens_ref[b]
        # at least one tile, also for an empty row (its output is not read): the overlapped loop
        # computes tile 0's scores before it
        n_tiles = jnp.maximum(lax.div(kv_len + q_len + (block_kv - 1), block_kv), 1)
        # a last tile of at most half_kv keys is computed (and fetched) at half width: a 64-token
        # verify on 2048 cached keys has 16.5 tiles of work, not 17
        half = ((kv_len + q_len - (n_tiles - 1) * block_kv <= half_kv) & (n_tiles - 1 >= lax.div(kv_len, block_kv))
                if half_kv else jnp.bool_(False))
        return b, h, qb, kv_len, q_len, n_tiles, half

    pages_per_tile = block_kv // page_size
    t_pad = q_ref.shape[1]

    def laid_out(x, layout):  # registers in wgmma's layout (the interpreter has no layouts)
        return x if interpret else plgpu.layout_cast(x, layout)

    def take_turn():  # the two consumers alternate on the tensor cores
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    # the overlapped loop's ping-pong: a consumer issues its products once the other has issued
    # its own (a barrier each, passed back and forth), so one's softmax runs under the other's
    def await_issue():
        if pingpong:
            plgpu.barrier_wait(issue.at[wg])

    def pass_issue():
        if pingpong:
            plgpu.barrier_arrive(issue.at[1 - wg])

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        # stage_in_ring: the output goes out through the last tile's K slot (this consumer's half of
        # it), which the consumer releases only then, so that its one query buffer is free as soon as
        # the last scores product is done: the next item's queries load during the last tile.
        # Otherwise the output goes out through the query buffer, and the next item's queries load
        # during this item into a second buffer where shared memory allows, else after the output
        n_bufs = q_smem_bufs.shape[0]

        def heads_of(qb):  # the query heads (within the KV head's group) of this consumer's rows
            row0 = qb * (2 * wg_rows) + wg * wg_rows
            return row0, [row0 // t_pad + i for i in range(wg_rows // t_pad)]

        def load_q(n, buf):
            # rows are head-major (r = j * t_pad + token, query head h * group + j): each head's
            # t_pad rows come straight from q [B, T, Hq, D] in one strided copy, and go back to o
            # the same way; padding rows past the last head copy that head again
            b, h, qb = item(n)[:3]
            for i, j in enumerate(heads_of(qb)[1]):
                plgpu.copy_gmem_to_smem(q_ref.at[b, :, h * group + jnp.minimum(j, group - 1)],
                                        q_smem_bufs.at[buf, wg, pl.ds(i * t_pad, t_pad)], q_ready.at[buf * 2 + wg])

        load_q(0, 0)
        wgmma_rows = plgpu.Layout.WGMMA.reduce(1)

        def consume(n, base):  # item n; base: tiles the ring has carried before it
            b, h, qb, kv_len, q_len, n_tiles, half = item(n)
            n_plain = lax.div(kv_len, block_kv)  # tiles wholly inside the cached prefix: no mask
            buf = lax.rem(n, n_bufs)
            last_slot = lax.rem(base + n_tiles - 1, stages)
            # (with the output through the ring, the next queries load once the last scores are in)
            if not stage_in_ring and n_bufs > 1:  # the other buffer's output went out at the end of item n - 1
                pl.when(n + 1 < n_items)(lambda: load_q(n + 1, 1 - buf))
            elif not stage_in_ring:
                pl.when(n > 0)(lambda: load_q(n, 0))
            q_smem = q_smem_bufs.at[buf, wg]
            row0, heads = heads_of(qb)
            # each row's words straight from device memory into registers (no shared memory to spare)
            words = [words_ref.at[b, i, pl.ds(row0, wg_rows)] for i in range(2)]
            if interpret:  # the interpreter has no layouts (nor plgpu.load)
                w0, w1 = words[0][...], words[1][...]
            else:
                w0, w1 = (plgpu.load(w, (), layout=wgmma_rows, optimized=False) for w in words)
            plgpu.barrier_wait(q_ready.at[buf * 2 + wg])
            m = laid_out(jnp.full((wg_rows,), NEG_INF, jnp.float32), wgmma_rows)
            l = laid_out(jnp.full((wg_rows,), 0, jnp.float32), wgmma_rows)
            acc = laid_out(jnp.full((wg_rows, q_smem.shape[-1]), 0, jnp.float32), plgpu.Layout.WGMMA)

            def mask(s, i):  # s: [wg_rows, keys of the tile]; the hidden new tokens' scores NEG_INF
                col = (lax.broadcasted_iota(jnp.int32, s.shape, 1) if interpret else
                       plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA))
                rel = col + (i * block_kv - kv_len)
                word = jnp.where(rel < 32, lax.broadcast_in_dim(w0, s.shape, [0]),
                                 lax.broadcast_in_dim(w1, s.shape, [0]))
                bit = lax.shift_right_logical(word, rel & 31) & 1
                return jnp.where((rel < 0) | ((rel < q_len) & (bit == 1)), s, NEG_INF)

            def softmax(s, i, m, l, masked):
                """Scores in raw units; m in scaled ones (softmax scale and log2 e): the row max is
                scaled once, and each score's exponent is one FFMA (kernels-focus-v34, ncu_probe-mosaic:
                8.6M fewer FMA-pipe instructions at 64 tokens, 2% less time)."""
                s = mask(s, i) if masked else s
                m_new = jnp.maximum(m, s.max(axis=1) * scale)
                p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
                alpha = jnp.exp2(m - m_new)
                return p.astype(k_smem.dtype), m_new, l * alpha + p.sum(axis=1), alpha

            def softmax_stale(s, i, m, l, acc, masked):
                """The softmax against the rows' reference maxes, which move only where a tile's P
                would pass 2^STALE_SLACK (settle_softmax) -> (p16, m, l, acc), acc rescaled."""
                s = mask(s, i) if masked else s
                p = jnp.exp2(s * scale - lax.broadcast_in_dim(m, s.shape, [0]))
                l_next = l + p.sum(axis=1)
                if not interpret:
                    return settle_softmax(s, m, l, acc, p.astype(k_smem.dtype), l_next, scale)
                redo = ~(l_next - l <= 2.0 ** STALE_SLACK)  # (by row: the interpreter has no warps)
                m_new = jnp.where(redo, jnp.maximum(m, s.max(axis=1) * scale), m)
                p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
                alpha = jnp.exp2(m - m_new)
                return p.astype(k_smem.dtype), m_new, l * alpha + p.sum(axis=1), rescale(acc, alpha)

            def qk_dot(slot, width=block_kv):  # the interpreter's products
                return lax.dot_general(q_smem[...], k_smem[slot, :width], (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)

            def pv_dot(acc, p16, slot):
                return acc + lax.dot_general(p16, v_smem[slot, :p16.shape[1]], (((1,), (0,)), ((), ())),
                                             preferred_element_type=jnp.float32)

            def rescale(acc, alpha):
                return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            def step(i, carry, masked, width=block_kv):  # the consumers' turns (module docstring: looser in SASS)
                acc, m, l = carry
                slot = lax.rem(base + i, stages)
                with jax.named_scope("scores"):  # (the inner regions: where a consumer waits)
                    with jax.named_scope("keys wait"):
                        plgpu.barrier_wait(k_ready.at[slot])
                    if interpret:
                        s = qk_dot(slot, width)
                        take_turn()
                    else:
                        def scores(acc_ref):
                            keys = k_smem.at[slot] if width == block_kv else k_smem.at[slot, pl.ds(0, width)]
                            plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(keys, (1, 0)))
                            with jax.named_scope("turn wait"):
                                take_turn()
                            with jax.named_scope("scores wait"):
                                return acc_ref[...]
                        s = pl.run_scoped(scores, plgpu.ACC((wg_rows, width), jnp.float32))
                    if stage_in_ring:
                        last = i == n_tiles - 1
                        pl.when(~last)(lambda: plgpu.barrier_arrive(k_free.at[slot]))
                        pl.when(last & (n + 1 < n_items))(lambda: load_q(n + 1, 0))
                    else:
                        plgpu.barrier_arrive(k_free.at[slot])
                if stale_max:
                    # the turn passes as the softmax begins (where ptxas had put the arrival written
                    # after the row max's softmax, above the exponentials: module docstring)
                    plgpu.barrier_arrive(turn)
                    with jax.named_scope("softmax"):
                        p16, m_new, l, acc = softmax_stale(s, i, m, l, acc, masked)
                else:
                    with jax.named_scope("softmax"):
                        p16, m_new, l, alpha = softmax(s, i, m, l, masked)
                        acc = rescale(acc, alpha)
                        acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                        plgpu.barrier_arrive(turn)  # softmax done, as written (in SASS: after the row max)
                with jax.named_scope("values"):
                    with jax.named_scope("values wait"):
                        plgpu.barrier_wait(v_ready.at[slot])
                    with jax.named_scope("turn wait"):
                        plgpu.barrier_wait(turn)
                    if interpret:
                        acc = pv_dot(acc, p16, slot)
                    else:
                        def values(acc_ref):
                            plgpu.wgmma(acc_ref, p16, v_smem.at[slot] if width == block_kv
                                        else v_smem.at[slot, pl.ds(0, width)])
                        acc = pl.run_state(values)(plgpu.ACC.init(acc))
                    plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            def step_overlapped(i, carry, masked):
                """Tile i's scores and tile i - 1's values go to the tensor cores together; tile i's
                softmax runs while the values product is in flight (FlashAttention-3's intra-warpgroup
                overlap)."""
                acc, m, l, p_prev = carry
                slot, prev = lax.rem(base + i, stages), lax.rem(base + i - 1, stages)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[prev])
                if interpret:
                    await_issue()
                    s = qk_dot(slot)
                    acc = pv_dot(acc, p_prev, prev)
                    pass_issue()
                    plgpu.barrier_arrive(k_free.at[slot])
                    p16, m, l, alpha = softmax(s, i, m, l, masked)
                else:
                    def body(refs):
                        acc_ref, p_ref, m_ref, l_ref, alpha_ref = refs

                        def scores(s_ref):
                            with jax.named_scope("issue"):
                                await_issue()
                                plgpu.wgmma(s_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                                plgpu.wgmma(acc_ref, p_ref[...], v_smem.at[prev])
                                pass_issue()
                            with jax.named_scope("scores"):
                                return plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # the scores, not the values
                        s = pl.run_scoped(scores, plgpu.ACC((wg_rows, block_kv), jnp.float32))
                        plgpu.barrier_arrive(k_free.at[slot])
                        with jax.named_scope("softmax"):
                            p_ref[...], m_ref[...], l_ref[...], alpha_ref[...] = softmax(s, i, m_ref[...], l_ref[...],
                                                                                         masked)
                    acc, p16, m, l, alpha = pl.run_state(body)((plgpu.ACC.init(acc), p_prev, m, l, m))
                    # p_prev's registers feed the in-flight product: keep them until run_state's wait
                    acc, p_prev = lax.optimization_barrier((acc, p_prev))
                plgpu.barrier_arrive(v_free.at[prev])
                with jax.named_scope("rescale"):
                    return rescale(acc, alpha), m, l, p16

            if overlap:
                if pingpong:
                    pl.when(wg == 1)(lambda: plgpu.barrier_arrive(issue.at[0]))  # consumer 0 issues first
                slot = lax.rem(base, stages)
                plgpu.barrier_wait(k_ready.at[slot])
                if interpret:
                    await_issue()
                    s = qk_dot(slot)
                    pass_issue()
                else:
                    def first_scores(acc_ref):
                        await_issue()
                        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                        pass_issue()
                        return acc_ref[...]
                    s = pl.run_scoped(first_scores, plgpu.ACC((wg_rows, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                p16, m, l, _ = softmax(s, 0, m, l, masked=True)  # tile 0 may hold new tokens
                first_masked = jnp.maximum(n_plain, 1)
                plain, masked = (functools.partial(step_overlapped, masked=f) for f in (False, True))
                carry = lax.fori_loop(1, first_masked, plain, (acc, m, l, p16))
                acc, m, l, p16 = lax.fori_loop(first_masked, n_tiles, masked, carry)
                last = lax.rem(base + n_tiles - 1, stages)
                plgpu.barrier_wait(v_ready.at[last])
                if interpret:
                    await_issue()
                    acc = pv_dot(acc, p16, last)
                    pass_issue()
                else:
                    def last_values(acc_ref):
                        await_issue()
                        plgpu.wgmma(acc_ref, p16, v_smem.at[last])
                        pass_issue()
                    acc = pl.run_state(last_values)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[last])
                if pingpong:  # consumer 1's last pass, so that every phase has its waiter
                    pl.when(wg == 0)(lambda: plgpu.barrier_wait(issue.at[0]))
            else:
                pl.when(wg == 1)(take_turn)
                n_full = n_tiles - half.astype(jnp.int32)  # the half tile, if any, is the last
                carry = lax.fori_loop(0, n_plain, functools.partial(step, masked=False), (acc, m, l))
                carry = lax.fori_loop(n_plain, n_full, functools.partial(step, masked=True), carry)
                if half_kv:
                    carry = lax.fori_loop(n_full, n_tiles, functools.partial(step, masked=True, width=half_kv), carry)
                acc, m, l = carry
                pl.when(wg == 0)(take_turn)
            with jax.named_scope("epilogue"):
                acc = acc / lax.broadcast_in_dim(jnp.maximum(l, 1e-30), acc.shape, [0])
                # (the other consumer's last scores product, the slot's other reader, finished before
                # this consumer's last turn: its softmax-done arrival completed that turn's phase)
                out_smem = (k_smem.at[last_slot, pl.ds(pl.multiple_of(wg * wg_rows, wg_rows), wg_rows)]
                            if stage_in_ring else q_smem)
                out_smem[...] = acc.astype(out_smem.dtype)
                plgpu.commit_smem()
                for i, j in enumerate(heads):
                    @pl.when(j < group)
                    def _():
                        plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(i * t_pad, t_pad)], o_ref.at[b, :, h * group + j])
                # only the buffer's reads before it is reused; the writes to device memory are
                # awaited once, at the end
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                if stage_in_ring:
                    plgpu.barrier_arrive(k_free.at[last_slot])
            return base + n_tiles

        lax.fori_loop(0, n_items, consume, 0)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        layer = layer_ref[0]

        # a half tile's second half is not read: its pages are counted on the barrier, not copied
        half_pages = pages_per_tile // 2 if half_kv and pages_per_tile > 1 else pages_per_tile

        def fetch(cache_ref, smem, ready, h, pt, tile, slot, half_tile):
            # in a cluster both CTAs issue the same copies: each fetches its share of the page and
            # the TMA unit writes it into both CTAs' rings (one L2 read for the head's two CTAs)
            for j in range(pages_per_tile):
                p = tile * pages_per_tile + j
                page = pt[lax.div(p, PT_LANES), lax.rem(p, PT_LANES)]
                copy = functools.partial(plgpu.copy_gmem_to_smem,
                                         cache_ref.at[layer, pl.ds(page * page_size, page_size), h],
                                         smem.at[slot, pl.ds(j * page_size, page_size)], ready.at[slot],
                                         collective_axes="c" if cluster > 1 else None)
                if j < half_pages:
                    copy()
                else:
                    pl.when(~half_tile)(copy)
                    pl.when(half_tile)(lambda: plgpu.barrier_arrive(ready.at[slot]))

        # each request's page-table row goes into shared memory (a page number read from device
        # memory per copy would put a global load's latency in front of every page's TMA), the
        # next item's while this item's tiles go out
        def load_page_table(n):
            plgpu.copy_gmem_to_smem(pt_ref.at[item(n)[0]], pt_smem.at[lax.rem(n, 2)], pt_ready.at[lax.rem(n, 2)])

        load_page_table(0)

        def produce(n, base):  # item n's tiles into ring slots base, base + 1, ... (mod stages)
            b, h, _, _, _, n_tiles, half = item(n)
            pl.when(n + 1 < n_items)(lambda: load_page_table(n + 1))
            with jax.named_scope("page table"):
                plgpu.barrier_wait(pt_ready.at[lax.rem(n, 2)])
            pt = pt_smem.at[lax.rem(n, 2)]

            @pl.loop(0, n_tiles)
            def _(tile):
                slot, reused = lax.rem(base + tile, stages), base + tile >= stages
                half_tile = half & (tile == n_tiles - 1)
                with jax.named_scope("slot wait"):
                    pl.when(reused)(lambda: plgpu.barrier_wait(k_free.at[slot]))
                fetch(k_ref, k_smem, k_ready, h, pt, tile, slot, half_tile)
                pl.when(reused)(lambda: plgpu.barrier_wait(v_free.at[slot]))
                fetch(v_ref, v_smem, v_ready, h, pt, tile, slot, half_tile)
            return base + n_tiles

        total = lax.fori_loop(0, n_items, produce, 0)

        # observe the last tiles' releases too: every waiter of a barrier sees each of its phases
        # (the interpreter checks this; on the GPU these waits end as the consumers finish)
        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _(tile):
            plgpu.barrier_wait(k_free.at[lax.rem(tile, stages)])
            plgpu.barrier_wait(v_free.at[lax.rem(tile, stages)])


@functools.partial(jax.jit, static_argnames=("block_kv", "stages", "wg_rows", "grid_order", "overlap", "pingpong",
                                             "multicast", "persistent", "stale_max", "interpret", "profile_dir",
                                             "profile_space"))
def verify_tree_hopper(q, k_pages, v_pages, layer, page_table, kv_lens, q_lens, tree_mask=None, *,
                       block_kv=None, stages=None, wg_rows=None, grid_order="bhq", overlap=False,
                       pingpong=True, multicast=False, persistent=0, stale_max=None, interpret=False,
                       profile_dir=None, profile_space=0):
    """q [B, T, Hq, D]; k_pages/v_pages [L, N, ps, Hkv, D]; layer: scalar -> [B, T, Hq, D].

    The new tokens' K/V are already in the pages (slots kv_len .. kv_len + q_len - 1); tree_mask
    [B, T, T] bool, or None for a chain (causal). By default two consumers of 64 query rows take
    128-key tiles in a ring of `stages` (None: three where they fit in shared memory, else two);
    wg_rows=128 (64-key tiles: registers) reads a 64-token tree's K/V once a head instead of twice,
    but the CTAs of one head run side by side and share its pages in L2 (kernels-focus-v30: 393-401
    us against 441-445 at 64 tokens; verify_timeline-463c3e4: 353 us against 249). overlap: the
    intra-warpgroup overlapped loop, its issues passed between the consumers unless pingpong=False
    (v36: level with the default at 16 and 32 tokens, 11% slower at 64). multicast: a head's CTAs
    paired in clusters, each page fetched once for both (v35: 4% slower at 64 tokens; GPU only).
    persistent: that many CTAs (0: one an item; at most one an SM fits, by shared memory). Where the
    output cannot go through the ring (overlap, wg_rows=128), it goes through the query buffer, two
    of them where they fit beside the ring (v37-v39: 315-335 us against 326-343 at 64 tokens).
    stale_max: the default loop's softmax against a stale reference max (module docstring); None:
    where a head's rows take two CTAs or more, the compute-bound shapes (verify_timeline-28b1d97, 64
    tokens: 244.3 us against 250.7 with the row max each tile; -5b9a1bd, one CTA a head: 214.2
    against 198.4 at 16 tokens, 207.5 against 207.0 at 32).
    profile_dir, profile_space: Mosaic GPU's in-kernel profiler (GPU only), a trace of the named
    regions (scores, softmax, values, epilogue; the producer's waits), up to profile_space regions a
    warpgroup, written as a Perfetto JSON file into profile_dir each call (bench/probes/verify_timeline.py)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    b, t, hq, d = q.shape
    n_layers, _, ps, hkv, _ = k_pages.shape
    g = hq // hkv
    t_pad = max(8, 1 << (t - 1).bit_length())
    rows = t_pad * g
    wg_rows = wg_rows or 64
    block_kv = block_kv or (64 if wg_rows == 128 else 128)
    padded = -(-rows // (2 * wg_rows)) * 2 * wg_rows
    assert supports(q, k_pages, tree_mask, block_kv=block_kv), (q.shape, k_pages.shape, q.dtype)
    n_qb = padded // (2 * wg_rows)  # CTAs a request and KV head
    stale_max = n_qb >= 2 if stale_max is None else stale_max
    if multicast and (n_qb % 2 or interpret):  # (the interpreter has no clusters)
        raise ValueError(f"multicast pairs a head's CTAs: needs an even count (got {n_qb}) and a GPU")
    cluster = 2 if multicast else 1
    if persistent and cluster > 1:
        raise ValueError("persistent CTAs take items one at a time: no multicast clusters")
    persistent = min(persistent, b * hkv * n_qb)  # no CTA without an item
    pages_per_tile = block_kv // ps
    width = _table_width(page_table.shape[1], pages_per_tile)
    smem = functools.partial(_smem_bytes, block_kv, d, q.dtype.itemsize, wg_rows, width, profile_space=profile_space)
    stage_in_ring = not overlap and 2 * wg_rows <= block_kv
    if stages is None:  # three tiles in flight where they fit beside one query buffer
        stages = 3 if smem(3, 1) <= SMEM_BYTES else 2
    q_bufs = 2 if persistent and not stage_in_ring and smem(stages, 2) <= SMEM_BYTES else 1
    if smem(stages, q_bufs) > SMEM_BYTES:
        raise ValueError(f"verify_tree_hopper: {smem(stages, q_bufs)} bytes of shared memory needed (a ring of {stages} "
                         f"{block_kv}-key tiles, page-table rows of {page_table.shape[1]} pages), over {SMEM_BYTES}")
    # the last tile at half width where it holds at most 64 keys (the default loop, 128-key tiles:
    # 64 is wgmma's least key count for P from registers with 128-byte swizzled V)
    half_kv = 64 if block_kv == 128 and not overlap and cluster == 1 else 0
    page_table = jnp.pad(page_table, ((0, 0), (0, width - page_table.shape[1])))
    page_table = page_table.reshape(b, width // PT_LANES, PT_LANES)  # 2-D: TMA boxes hold <= 256 a side
    qp = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0))) if t_pad > t else q
    words = _row_words(tree_mask, b, t, t_pad, padded)
    k_rows = k_pages.reshape(n_layers, -1, hkv, d)  # [L, N * ps, Hkv, D]: one page = ps rows
    v_rows = v_pages.reshape(n_layers, -1, hkv, d)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)

    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def verify_tree_hopper_kernel(*refs):  # the name profilers show
        pl.run_scoped(
            lambda *scratch: _kernel(*refs, scratch, page_size=ps, block_kv=block_kv, half_kv=half_kv, stages=stages,
                                     wg_rows=wg_rows, group=g, scale=d ** -0.5 * LOG2E, overlap=overlap, pingpong=pingpong,
                                     cluster=cluster,
                                     persistent=persistent, stage_in_ring=stage_in_ring, stale_max=stale_max,
                                     interpret=interpret),
            (plgpu.SMEM((q_bufs, 2, wg_rows, d), q.dtype, transforms=tiled),
             plgpu.SMEM((stages, block_kv, d), q.dtype, transforms=tiled),
             plgpu.SMEM((stages, block_kv, d), q.dtype, transforms=tiled),
             plgpu.SMEM((2, width // PT_LANES, PT_LANES), jnp.int32)),
            (plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=stages),
             plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=stages),
             plgpu.Barrier(num_arrivals=wg_rows // t_pad, num_barriers=2 * q_bufs),
             plgpu.Barrier(num_arrivals=1, num_barriers=2)),
            # a ring slot is free once the consumers of every CTA it was written into are done with it
            (plgpu.ClusterBarrier(collective_axes=("c",), num_arrivals=2, num_barriers=stages) if cluster > 1
             else plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
            (plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=1, num_barriers=2)),
            collective_axes="wg",
        )

    interpret_params = None
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interpret_params = InterpretGPUParams()
    out = plgpu.kernel(
        verify_tree_hopper_kernel,
        out_type=jax.ShapeDtypeStruct((b, t_pad, hq, d), q.dtype),
        # the last axis varies fastest (Mosaic GPU reverses the grid into CUDA's x, y, z): with q
        # last, a request and head's query blocks run side by side and share its pages through L2
        grid=(persistent,) if persistent else tuple(dict(b=b, h=hkv, q=n_qb // cluster)[a] for a in grid_order),
        grid_names=("s",) if persistent else tuple(grid_order),
        cluster=(cluster,) if cluster > 1 else (),
        cluster_names=("c",) if cluster > 1 else (),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0,
                                             **(dict(profile_space=profile_space, profile_dir=profile_dir)
                                                if profile_dir else {})),
        interpret=interpret_params,
    )(layer, page_table, kv_lens, q_lens, words, qp, k_rows, v_rows)
    return out[:, :t] if t_pad > t else out
