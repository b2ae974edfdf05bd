"""The verify kernel's softmax against a stale reference max (verify_hopper.py): a tile's P
taken against each row's reference, redone with the row max only where it would overflow."""
from __future__ import annotations

import numpy as np


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

