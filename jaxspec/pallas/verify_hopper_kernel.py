"""The body of the Mosaic GPU tree-verify kernel (verify_hopper.py wraps it in its
pallas_call): a producer warpgroup streams K/V page tiles by TMA into a ring, two consumer
warpgroups take turns on wgmma and the online softmax; persistent CTAs take work items in turn."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxspec.pallas.attention_ref import NEG_INF

from jaxspec.pallas.verify_hopper_softmax import STALE_SLACK, settle_softmax

PT_LANES = 32  # page-table row staged as [width / 32, 32]: 128-byte TMA rows


def kernel(layer_ref, pt_ref, kv_lens_ref, q_lens_ref, words_ref, q_ref, k_ref, v_ref, o_ref, scratch, *,
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

