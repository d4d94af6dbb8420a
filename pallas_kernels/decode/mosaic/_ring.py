"""The full-precision ring inside a Mosaic kernel: one online-softmax walk over its tiles.

Shared by the merge launch (``_merge.int2_merge_ring``: one channel block a CTA) and the
partials kernels' ring split (``_kernel``, ``_warp``; ``merge="fused"``: every channel block in one
CTA). Scores are in log2 units (the query carries softmax_scale * log2(e)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from oscar_jax import quant
from oscar_jax.record import TILE
from pallas_kernels.decode.mosaic._config import NPAD, scaled_query

NEG = -1e30


def ring_query(q, softmax_scale, dtype):
    """q [B, H, g, D] (original basis) -> [B, H, D, NPAD] in ``dtype``: scaled by
    softmax_scale * log2(e), heads past g zero, transposed (the wgmma B operand)."""
    return jnp.swapaxes(scaled_query(q, softmax_scale, NPAD), -1, -2).astype(dtype)


def ring_query_pair(q, softmax_scale, dtype):
    """q [B, H, g, D] -> [B, H, 2, D, NPAD] in ``dtype``: ``ring_query``'s f32 query split
    into a 16-bit pair hi + lo (hi = q rounded, lo = the rest rounded), so the ring's scores
    keep ~16 mantissa bits of the query through two wgmma instead of bfloat16's 8. With the
    query rounded once, a row whose tokens are all in the ring missed float16 parameters'
    tolerance at head_dim 64 (the ring's P rounding alone stays within it)."""
    qt = ring_query(q, softmax_scale, jnp.float32)
    # hi through reduce_precision, not astype(dtype).astype(f32): XLA's excess-precision
    # rule drops that round trip on the GPU, which made lo = 0 and the pair a plain query
    hi = quant.round_to_dtype(qt, dtype)
    return jnp.stack([hi.astype(dtype), (qt - hi).astype(dtype)], axis=2)


def ring_inputs(q, k_res, v_res, lengths, softmax_scale, query_form: str, *, query=True):
    """The ring tuple the kernels walk: (the query as ``ring_query`` [B, H, D, NPAD] or, for
    ``query_form`` "pair" (``Int2DecodeConfig.ring_query``), ``ring_query_pair`` [B, H, 2,
    D, NPAD], k_res, v_res [B, H, R, D] in the ring's 16-bit dtype, lengths [B] int32).
    ``query`` False: None for the query, which the warp kernel then makes itself
    (``Int2DecodeConfig.prep="kernel"``)."""
    rdt = ring_dtype(k_res)
    qr = None
    if query:
        qr = (ring_query_pair if query_form == "pair" else ring_query)(q, softmax_scale, rdt)
    return qr, k_res.astype(rdt), v_res.astype(rdt), lengths.astype(jnp.int32)


def ring_dtype(k_res):
    """The 16-bit dtype the kernels read the ring in (a float32 ring is cast to bfloat16)."""
    return k_res.dtype if k_res.dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16


def make_ring_query(src_smem, f32_smem, dst_smem, *, g: int, rscale: float):
    """Inside a Mosaic kernel (one warpgroup): dst_smem <- this row's ``ring_query`` (dst
    [D, NPAD]) or ``ring_query_pair`` (dst [2, D, NPAD]) in dst's 16-bit dtype, made from
    src_smem [g, D] (the row's query as the kernel reads it: original basis, any float
    dtype) through f32_smem [D, NPAD] f32 scratch, so no XLA launch builds it
    (``Int2DecodeConfig.prep="kernel"``). ``rscale``: ``_config.query_scale``. Rounds to
    nearest even as ``quant.round_to_dtype``; ends with the stores fenced for wgmma."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 2)(_scaled_transpose(g, rscale))(
        src_smem, f32_smem
    )
    x = plgpu.load(f32_smem, layout=plgpu.Layout.WGMMA)  # [D, NPAD] f32
    xh = x.astype(dst_smem.dtype)
    if len(dst_smem.shape) == 3:  # the pair: the rest rounded again
        dst_smem.at[0][...] = xh
        dst_smem.at[1][...] = (x - xh.astype(jnp.float32)).astype(dst_smem.dtype)
    else:
        dst_smem[...] = xh
    plgpu.commit_smem()  # the stores visible to the wgmma (async proxy)


def _scaled_transpose(g: int, rscale: float):
    """The inline_mgpu body of ``make_ring_query``: dst_ref [D, NPAD] f32 <- (src_ref [g, D]
    times ``rscale``)^T, the heads past g zero; one element a thread a pass, then a
    warpgroup barrier."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, vector
    from jax.experimental.mosaic.gpu import utils as mu

    def c32(v):
        i32 = ir.IntegerType.get_signless(32)
        return arith.constant(i32, ir.IntegerAttr.get(i32, v))

    def idx(v):
        return arith.index_cast(ir.IndexType.get(), v)

    def body(ctx, src_ref, dst_ref):
        del ctx
        f32 = ir.F32Type.get()  # (inside the kernel's MLIR context)
        d = ir.MemRefType(src_ref.type).shape[1]
        et = ir.MemRefType(src_ref.type).element_type
        tid = arith.remui(mu.thread_idx(), c32(128))
        scale = arith.constant(f32, ir.FloatAttr.get(f32, rscale))
        zero = arith.constant(f32, ir.FloatAttr.get(f32, 0.0))
        count = d * NPAD
        if count % 128:
            raise ValueError(f"the ring's query is made 128 elements a pass: {d=} x {NPAD}")
        for k in range(count // 128):
            e = arith.addi(tid, c32(128 * k))
            col, head = arith.divui(e, c32(NPAD)), arith.remui(e, c32(NPAD))
            row = arith.minui(head, c32(g - 1))
            v = vector.extract(vector.load(ir.VectorType.get((1,), et), src_ref,
                                           [idx(row), idx(col)]), [], [0])  # fmt: skip
            v = arith.mulf(v if et == f32 else arith.extf(f32, v), scale)
            v = arith.select(arith.cmpi(arith.CmpIPredicate.ult, head, c32(g)), v, zero)
            vector.store(vector.broadcast(ir.VectorType.get((1,), f32), v), dst_ref,
                         [idx(col), idx(head)])  # fmt: skip
        mu.warpgroup_barrier()  # the pass's stores visible to the WGMMA-layout load
        return None

    return body


def ring_walk(q_smem, p_smem, k_ref, v_ref, rows, blocks, *, slots: int):
    """Online softmax of the ring against the query in ``q_smem`` [D, NPAD] (``ring_query``)
    or [2, D, NPAD] (``ring_query_pair``: the scores K hi + K lo, two wgmma into one
    accumulator).

    k_ref, v_ref [R, D] (16-bit, gmem); rows = (nq, length), the row's quantized tokens and
    tokens (int32 scalars): slot s holds token nq + (s - nq) mod R (``oscar_jax.cache``'s
    ring), valid while that is < length; the kernel computes it, so no mask is read.
    ``blocks``: the channel blocks of 64 to accumulate (ints or a traced index). p_smem [64,
    NPAD] scratch in the ring's dtype.
    Returns (m [NPAD] running max, l [64, NPAD] per-element row sums, one O^T [64, NPAD]
    accumulator per block), f32 in the WGMMA layouts. K and V^T tiles are wgmma A operands
    from shared memory, so the ring costs no unpack."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    f32 = jnp.float32
    WG = plgpu.Layout.WGMMA
    a_tr = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))  # as the B swizzle
    d = k_ref.shape[-1]
    rt = -(-slots // TILE)
    nb = len(blocks)

    nq, length = rows
    start = jax.lax.rem(nq, jnp.int32(slots))  # the slot of token nq
    count = jnp.clip(length - nq, 0, slots)  # tokens in the ring

    def body(idxs, k_smem, *refs):
        *v_smems, carry = refs
        m_prev, l_acc, *outs = carry
        (i,) = idxs

        def qk(acc_ref):
            for qh in (q_smem.at[0], q_smem.at[1]) if len(q_smem.shape) == 3 else (q_smem,):
                plgpu.wgmma(acc_ref, k_smem, qh)
            return acc_ref[...]

        sc = pl.run_scoped(qk, plgpu.ACC((TILE, NPAD), f32))
        slot = plgpu.broadcasted_iota(jnp.int32, (TILE, NPAD), 0, layout=WG) + i * TILE
        age = slot - start  # (slot - nq) mod R, for slot < R
        age = jnp.where(age < 0, age + slots, age)
        ok = (age < count) & (slot < slots)
        sc = jnp.where(ok, sc, NEG)
        m_new = jnp.maximum(m_prev, jnp.max(sc, axis=0))
        corr = jax.lax.broadcast_in_dim(jnp.exp2(m_prev - m_new), (TILE, NPAD), [1])
        p = jnp.where(ok, jnp.exp2(sc - jax.lax.broadcast_in_dim(m_new, (TILE, NPAD), [1])), 0.0)
        l_acc = l_acc * corr + p
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()

        def pv(accs):
            for a, v_smem in zip(accs, v_smems, strict=True):
                plgpu.wgmma(a, v_smem.transpose((1, 0)), p_smem)

        outs = pl.run_state(pv)(tuple(plgpu.ACC.init(o * corr) for o in outs))
        return (m_new, l_acc, *outs)

    zeros = lambda: plgpu.layout_cast(jnp.zeros((TILE, NPAD), f32), WG)  # noqa: E731
    init = (
        plgpu.layout_cast(jnp.full((NPAD,), NEG, f32), WG.reduce(0)),
        zeros(),
        *(zeros() for _ in range(nb)),
    )
    v_specs = [plgpu.BlockSpec((TILE, TILE), lambda i, c=c: (i, c), transforms=a_tr)
               for c in blocks]  # fmt: skip
    pipe = plgpu.emit_pipeline(
        body,
        grid=(rt,),
        in_specs=[
            plgpu.BlockSpec((TILE, d), lambda i: (i, 0), transforms=a_tr),
            *v_specs,
        ],  # fmt: skip
        max_concurrent_steps=min(2, rt),
        init_carry=init,
    )
    return pipe(k_ref, *([v_ref] * nb))
