"""Kernel bodies of the INT decode kernel (see ``pallas_kernels.decode`` for the algebra).

``int_kernel`` is the Pallas kernel: grid (B, H, splits [+1]); the quantized splits run
``_int_quant_part`` and, when the ring is fused, the last split runs ``_ring_part`` on
the full-precision residual ring.

Bodies measured and dropped (H200, 1 x 128K, benchmarks/results/decode_notes.md): a
register double buffer of the next block's tiles (255 registers, 0.356 ms against
0.309 ms for this body at equal launch settings) and one [T, D] tile per operand
unpacked by a broadcast shift (one key and one value dot per block, 0.302 ms against
0.236 ms).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

GP = 16  # MMA rows: the GQA query group is padded to this
NEG = -1e30  # finite 'minus infinity' of the online softmax


def _split_dot(x, y, dims, half):
    """f32-accurate x . y for 16-bit y: x = hi + lo in y's dtype, two tensor-core dots.

    hi and lo each carry 8 (bf16) or 11 (f16) bits; products with y are exact in the f32
    accumulator, so the result differs from an IEEE f32 dot by ~2^-16 relative. A float32
    ``y`` (an f32 cache) takes the IEEE f32 dot instead.
    """
    f32 = jnp.float32
    if half is None:
        return jax.lax.dot_general(
            x, y.astype(f32), dims, precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32
        )
    x_hi = x.astype(half)
    x_lo = (x - x_hi.astype(f32)).astype(half)
    out = jax.lax.dot_general(x_hi, y, dims, preferred_element_type=f32)
    return out + jax.lax.dot_general(x_lo, y, dims, preferred_element_type=f32)


def _ring_part(n_ref, nq_ref, qp_ref, kr_ref, vr_ref, acc_ref, m_ref, l_ref, *, bs):
    """The full-precision residual ring, in the original basis (see ``_split_dot``)."""
    slots, d = kr_ref.shape
    n, nq = n_ref[0], nq_ref[0]
    q = qp_ref[...]  # [GP, D] f32
    half = kr_ref.dtype if kr_ref.dtype in (jnp.bfloat16, jnp.float16) else None
    base = nq % slots

    def body(it, carry):
        m_prev, l_prev, acc = carry
        r0 = pl.multiple_of(it * bs, bs)
        k = kr_ref[pl.ds(r0, bs), :]  # [bs, D]
        s = _split_dot(q, k, (((1,), (1,)), ((), ())), half).T  # [bs, GP]
        rel = r0 + jax.lax.broadcasted_iota(jnp.int32, (bs, GP), 0) - base
        valid = jnp.where(rel < 0, rel + slots, rel) < n - nq
        s = jnp.where(valid, s, NEG)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=0))
        corr = jnp.exp(m_prev - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[None, :]), 0.0)
        pv = _split_dot(p.T, vr_ref[pl.ds(r0, bs), :], (((1,), (0,)), ((), ())), half)
        return m_new, l_prev * corr + jnp.sum(p, axis=0), acc * corr[:, None] + pv

    init = (
        jnp.full((GP,), NEG, jnp.float32),
        jnp.zeros((GP,), jnp.float32),
        jnp.zeros((GP, d), jnp.float32),
    )
    m, lsum, acc = jax.lax.fori_loop(0, slots // bs, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = lsum


def int_kernel(*refs, ring, **kw):
    """Grid (B, H, splits [+1 for the ring]): the last split handles the ring when fused."""
    if not ring:
        return _int_quant_part(*refs, s_id=pl.program_id(2), **kw)
    quant_refs, ring_refs, out_refs = refs[:9], refs[9:13], refs[-3:]
    n_ref, qp_ref, kr_ref, vr_ref = ring_refs
    last = pl.num_programs(2) - 1
    s_id = pl.program_id(2)

    @pl.when(s_id < last)
    def _():
        _int_quant_part(*quant_refs, *out_refs, s_id=s_id, **kw)

    @pl.when(s_id == last)
    def _():
        _ring_part(n_ref, quant_refs[0], qp_ref, kr_ref, vr_ref, *out_refs, bs=ring)


def _int_quant_part(
    nq_ref,
    q_ref,
    kc_ref,
    ks_ref,
    kz_ref,
    kn_ref,
    vc_ref,
    vs_ref,
    vz_ref,
    acc_ref,
    m_ref,
    l_ref,
    *,
    s_id,
    bits,
    t,
    g,
    gv,
    bps,
    d,
    ablate="",
):
    """Scores as [GP, T] (query rows = MMA rows), so p feeds the value dot from registers.

    With the query heads as the M side of both dots (as in flash attention), p never
    goes through shared memory, and the per-token value scale is a [1, T] row. The
    value dot takes bfloat16 operands (p * vs and the exact codes): float16 overflowed
    for value scales above 65504 and lost precision below its normal range (6e-5).
    Measured offline (ptxas -v of the lowered IR, 4 warps, T = 64): 80 registers with
    the value path removed, 176 for the [T, GP] formulation with it.
    """
    f32, f16, bf16 = jnp.float32, jnp.float16, jnp.bfloat16
    c = 8 // bits
    p_w = d // c  # channels per plane = bytes per token
    w = min(p_w, gv)  # channels per value chunk (one value group)
    nchunk = p_w // w
    ngt = t // g
    mask = (1 << bits) - 1
    nq = nq_ref[0]
    start = s_id * bps * t
    nblk = jnp.clip((nq - start + t - 1) // t, 0, bps)
    nt = (((1,), (1,)), ((), ()))  # x @ y.T
    nn = (((1,), (0,)), ((), ()))  # x @ y

    def body(it, carry):
        m_prev, l_prev, accs, zs = carry
        t0 = pl.multiple_of(start + it * t, t)
        g0 = pl.multiple_of(t0 // g, ngt)
        kb = kc_ref[pl.ds(g0, ngt), :, :]  # [NGt, G, P] uint8
        s = jnp.zeros((GP, t), f32)
        for i in range(c):
            ks = ks_ref[pl.ds(g0, ngt), pl.ds(i * p_w, p_w)].astype(f32)
            kz = kz_ref[pl.ds(g0, ngt), pl.ds(i * p_w, p_w)].astype(f32)
            code = ((kb >> (bits * i)) & mask).astype(f32)
            if ablate == "no_kdeq":
                kh = code.reshape(t, p_w)
            else:
                kh = (code * ks[:, None, :] + kz[:, None, :]).reshape(t, p_w)  # [T, P]
            if ablate == "no_dot":
                s = s + jnp.sum(kh, axis=1)[None, :]
                continue
            qi = q_ref[:, pl.ds(i * p_w, p_w)]  # [GP, P] f16
            s = s + jax.lax.dot_general(qi, kh.astype(f16), nt, preferred_element_type=f32)
        s = s * kn_ref[pl.ds(t0, t)].astype(f32)[None, :]
        valid = t0 + jax.lax.broadcasted_iota(jnp.int32, (GP, t), 1) < nq
        s = jnp.where(valid, s, NEG)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        corr = jnp.exp(m_prev - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)  # [GP, T]
        l_new = l_prev * corr + jnp.sum(p, axis=1)
        if ablate == "no_v":
            return m_new, l_new, accs, zs
        new_accs = [None] * (c * nchunk)
        for j in range(nchunk):
            vb = vc_ref[pl.ds(t0, t), pl.ds(j * w, w)]  # [T, W] uint8
            for i in range(c):
                k = i * nchunk + j
                vs = vs_ref[pl.ds(t0, t), (i * p_w + j * w) // gv].astype(f32)  # [T]
                wt = (p * vs[None, :]).astype(bf16)  # [GP, T]
                code = ((vb >> (bits * i)) & mask).astype(bf16)
                pv = jax.lax.dot_general(wt, code, nn, preferred_element_type=f32)  # [GP, W]
                new_accs[k] = accs[k] * corr[:, None] + pv
        new_zs = []
        for grp in range(d // gv):
            vz = vz_ref[pl.ds(t0, t), grp].astype(f32)  # [T]
            new_zs.append(zs[grp] * corr + jnp.sum(p * vz[None, :], axis=1))
        return m_new, l_new, tuple(new_accs), tuple(new_zs)

    init = (
        jnp.full((GP,), NEG, f32),
        jnp.zeros((GP,), f32),
        tuple(jnp.zeros((GP, w), f32) for _ in range(c * nchunk)),
        tuple(jnp.zeros((GP,), f32) for _ in range(d // gv)),
    )
    m, lsum, accs, zs = jax.lax.fori_loop(0, nblk, body, init)
    for i in range(c):
        for j in range(nchunk):
            ch0 = i * p_w + j * w
            acc_ref[:, pl.ds(ch0, w)] = accs[i * nchunk + j] + zs[ch0 // gv][:, None]
    m_ref[...] = m
    l_ref[...] = lsum
