"""Tree verify on Hopper: paged attention for 16-64 draft tokens through Mosaic GPU (wgmma, TMA).

A verify of T tokens at GQA g holds T * g query rows per KV head, where paged_attention.py's
Triton kernel tops out near 260 TFLOP/s. This kernel is FlashAttention-3's shape over pages: a
CTA takes 2 * wg_rows query rows of one request and KV head; two consumer warpgroups run wgmma
and the online softmax in turns, while a producer warpgroup fills a ring of K/V tiles by TMA, one
copy per page. persistent=N (the engine's choice: N = the GPU's SMs) launches N CTAs that take
the (request, head, query block) items in turn.

Masking as in paged_attention.py: tiles wholly inside the cached prefix need none; the last one
or two tiles hold the new tokens, whose visibility comes as two 32-bit words per query row (bit j:
may read new token j). Scores are in base 2 (the softmax scale times log2 e inside exp2). The
kernel body is verify_hopper_kernel.py, its softmax verify_hopper_softmax.py; the reference is
`paged_attention_ref` (attention_ref.py). Under interpret=True (CPU tests) the two products are
jnp dots; the copies, barriers, masks and softmax run as on the GPU. The design's measurements:
bench/probes/verify_hopper_notes.md.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxspec.pallas.attention_ref import LOG2E
from jaxspec.pallas.tree_mask import pack_tree_mask

from jaxspec.pallas.verify_hopper_kernel import PT_LANES, kernel

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



def _row_words(tree_mask, b, t, t_pad, rows_padded):
    """[B, 2, R] int32: bit j of row r's words says r's token (r % t_pad) may read new token j."""
    if tree_mask is None:
        tree_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    bits = pack_tree_mask(tree_mask)  # [B, T, 2]
    token = jnp.minimum(jnp.arange(rows_padded) % t_pad, t - 1)
    return bits[:, token].transpose(0, 2, 1)




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
            lambda *scratch: kernel(*refs, scratch, page_size=ps, block_kv=block_kv, half_kv=half_kv, stages=stages,
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
