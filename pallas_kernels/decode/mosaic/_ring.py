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
