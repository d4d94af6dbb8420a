"""Kernel bodies of the INT decode kernel (see ``pallas_kernels.decode`` for the algebra).

``int_kernel`` is the Pallas kernel: grid (B, H, splits [+1]); the quantized splits run
``_int_quant_part`` (or the software-pipelined ``decode_pipelined`` body) and, when the
ring is fused, the last split runs ``_ring_part`` on the full-precision residual ring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.decode_pipelined import GP, NEG, int_quant_part_pipelined


def _ring_part(n_ref, nq_ref, qp_ref, kr_ref, vr_ref, rt_ref, acc_ref, m_ref, l_ref, *, bs):
    """The full-precision residual ring (f32, IEEE dots), rotated into the kernel's basis."""
    slots, d = kr_ref.shape
    n, nq = n_ref[0], nq_ref[0]
    q = qp_ref[...]
    hi = jax.lax.Precision.HIGHEST
    base = nq % slots

    def body(it, carry):
        m_prev, l_prev, acc = carry
        r0 = pl.multiple_of(it * bs, bs)
        k = kr_ref[pl.ds(r0, bs), :].astype(jnp.float32)
        s = jax.lax.dot_general(
            k, q, (((1,), (1,)), ((), ())), precision=hi, preferred_element_type=jnp.float32
        )  # [bs, GP]
        rel = r0 + jax.lax.broadcasted_iota(jnp.int32, (bs, GP), 0) - base
        valid = jnp.where(rel < 0, rel + slots, rel) < n - nq
        s = jnp.where(valid, s, NEG)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=0))
        corr = jnp.exp(m_prev - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[None, :]), 0.0)
        v = vr_ref[pl.ds(r0, bs), :].astype(jnp.float32)
        pv = jax.lax.dot_general(
            p, v, (((0,), (0,)), ((), ())), precision=hi, preferred_element_type=jnp.float32
        )
        return m_new, l_prev * corr + jnp.sum(p, axis=0), acc * corr[:, None] + pv

    init = (
        jnp.full((GP,), NEG, jnp.float32),
        jnp.zeros((GP,), jnp.float32),
        jnp.zeros((GP, d), jnp.float32),
    )
    m, lsum, acc = jax.lax.fori_loop(0, slots // bs, body, init)
    if rt_ref is not None:
        acc = jax.lax.dot_general(
            acc,
            rt_ref[...],
            (((1,), (0,)), ((), ())),
            precision=hi,
            preferred_element_type=jnp.float32,
        )
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = lsum


def int_kernel(*refs, ring, rotate, pipeline, **kw):
    """Grid (B, H, splits [+1 for the ring]): the last split handles the ring when fused."""
    quant_part = int_quant_part_pipelined if pipeline else _int_quant_part
    if not ring:
        return quant_part(*refs, s_id=pl.program_id(2), **kw)
    nq_ref, q_ref, kc_ref, ks_ref, kz_ref, kn_ref, vc_ref, vs_ref, vz_ref = refs[:9]
    n_ref, qp_ref, kr_ref, vr_ref = refs[9:13]
    rt_ref = refs[13] if rotate else None
    acc_ref, m_ref, l_ref = refs[-3:]
    last = pl.num_programs(2) - 1
    s_id = pl.program_id(2)

    @pl.when(s_id < last)
    def _():
        quant_part(
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
            s_id=s_id,
            **kw,
        )

    @pl.when(s_id == last)
    def _():
        _ring_part(n_ref, nq_ref, qp_ref, kr_ref, vr_ref, rt_ref, acc_ref, m_ref, l_ref, bs=ring)


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
    c = 8 // bits
    p_w = d // c  # channels per plane = bytes per token
    w = min(p_w, gv)  # channels per value chunk (one value group)
    nchunk = p_w // w
    ngt = t // g
    mask = (1 << bits) - 1
    nq = nq_ref[0]
    start = s_id * bps * t
    nblk = jnp.clip((nq - start + t - 1) // t, 0, bps)

    def body(it, carry):
        m_prev, l_prev, accs, zs = carry
        t0 = pl.multiple_of(start + it * t, t)
        g0 = pl.multiple_of(t0 // g, ngt)
        # keys: [NGt, G, P] bytes, one byte holds c planes
        kb = kc_ref[pl.ds(g0, ngt), :, :].astype(jnp.int32)
        s = jnp.zeros((t, GP), jnp.float32)
        for i in range(c):
            ks = ks_ref[pl.ds(g0, ngt), pl.ds(i * p_w, p_w)].astype(jnp.float32)
            kz = kz_ref[pl.ds(g0, ngt), pl.ds(i * p_w, p_w)].astype(jnp.float32)
            code = ((kb >> (bits * i)) & mask).astype(jnp.float32)
            if ablate == "no_kdeq":
                kh = code.reshape(t, p_w)
            else:
                kh = (code * ks[:, None, :] + kz[:, None, :]).reshape(t, p_w)
            qi = q_ref[:, pl.ds(i * p_w, p_w)]  # [GP, P] f16
            if ablate == "no_dot":
                s = s + jnp.sum(kh, axis=1, keepdims=True)
                continue
            s = s + jax.lax.dot_general(
                kh.astype(jnp.float16),
                qi,
                (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32,
            )
        norm = kn_ref[pl.ds(t0, t)].astype(jnp.float32)
        s = s * norm[:, None]
        idx = t0 + jax.lax.broadcasted_iota(jnp.int32, (t, GP), 0)
        valid = idx < nq
        s = jnp.where(valid, s, NEG)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=0))
        corr = jnp.exp(m_prev - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[None, :]), 0.0)  # [T, GP]
        l_new = l_prev * corr + jnp.sum(p, axis=0)
        new_accs, new_zs = [None] * (c * nchunk), []
        if ablate == "no_v":
            return m_new, l_new, accs, zs
        for j in range(nchunk):
            vb = vc_ref[pl.ds(t0, t), pl.ds(j * w, w)].astype(jnp.int32)  # [T, W]
            for i in range(c):
                grp = (i * p_w + j * w) // gv
                k = i * nchunk + j
                vs = vs_ref[pl.ds(t0, t), pl.ds(grp, 1)].astype(jnp.float32)  # [T, 1]
                wt = (p * vs).astype(jnp.float16)
                code = ((vb >> (bits * i)) & mask).astype(jnp.float16)
                pv = jax.lax.dot_general(
                    wt, code, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
                )  # [GP, W]
                new_accs[k] = accs[k] * corr[:, None] + pv
        for grp in range(d // gv):
            vz = vz_ref[pl.ds(t0, t), pl.ds(grp, 1)].astype(jnp.float32)
            new_zs.append(zs[grp] * corr + jnp.sum(p * vz, axis=0))
        return m_new, l_new, tuple(new_accs), tuple(new_zs)

    init = (
        jnp.full((GP,), NEG, jnp.float32),
        jnp.zeros((GP,), jnp.float32),
        tuple(jnp.zeros((GP, w), jnp.float32) for _ in range(c * nchunk)),
        tuple(jnp.zeros((GP,), jnp.float32) for _ in range(d // gv)),
    )
    m, lsum, accs, zs = jax.lax.fori_loop(0, nblk, body, init)
    for i in range(c):
        for j in range(nchunk):
            ch0 = i * p_w + j * w
            acc_ref[:, pl.ds(ch0, w)] = accs[i * nchunk + j] + zs[ch0 // gv][:, None]
    m_ref[...] = m
    l_ref[...] = lsum
