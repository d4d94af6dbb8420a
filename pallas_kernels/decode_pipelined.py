"""Software-pipelined body of the INT decode kernel (``DecodeConfig(pipeline=True)``).

Same algebra and outputs as ``decode._int_quant_part``; the differences target the
latency-bound behaviour measured on the H200 (the default body spends ~3 us per
block per SM, far above its bytes or ALU work):

- every load of a block (codes, scales, zeros, norms; the value scales as one
  coalesced [T, D/Gv] tile instead of per-group [T, 1] columns) is issued at the
  top of the body, before any compute, and the *next* block's tiles are loaded
  while the current one is computed (a register double buffer carried by the loop);
- the query planes are loaded once, outside the loop.

Written after the device budget was spent: checked in interpret mode only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

GP = 16  # MMA rows: the GQA query group is padded to this
NEG = -1e30  # finite 'minus infinity' of the online softmax


def int_quant_part_pipelined(
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
    w = min(p_w, gv)  # channels per value chunk (inside one value group)
    nchunk = p_w // w
    ngv = d // gv
    ngt = t // g
    mask = (1 << bits) - 1
    lq = kc_ref.shape[0] * g
    nq = nq_ref[0]
    start = s_id * bps * t
    nblk = jnp.clip((nq - start + t - 1) // t, 0, bps)
    qs = [q_ref[:, pl.ds(i * p_w, p_w)] for i in range(c)]  # loop-invariant [GP, P] f16

    def load(t0):
        t0 = pl.multiple_of(jnp.minimum(t0, lq - t), t)
        g0 = pl.multiple_of(t0 // g, ngt)
        return (
            kc_ref[pl.ds(g0, ngt), :, :],
            tuple(ks_ref[pl.ds(g0, ngt), pl.ds(i * p_w, p_w)] for i in range(c)),
            tuple(kz_ref[pl.ds(g0, ngt), pl.ds(i * p_w, p_w)] for i in range(c)),
            kn_ref[pl.ds(t0, t)],
            tuple(vc_ref[pl.ds(t0, t), pl.ds(j * w, w)] for j in range(nchunk)),
            vs_ref[pl.ds(t0, t), :],
            vz_ref[pl.ds(t0, t), :],
        )

    def column(tile, grp):  # [T, ngv] -> [T, 1] without slicing a loaded value
        col = jax.lax.broadcasted_iota(jnp.int32, tile.shape, 1)
        return jnp.sum(jnp.where(col == grp, tile, 0.0), axis=1, keepdims=True)

    def compute(tiles, t0, state):
        m_prev, l_prev, accs, zs = state
        kb, ks, kz, kn, vbs, vs_t, vz_t = tiles
        kb = kb.astype(jnp.int32)
        s = jnp.zeros((t, GP), jnp.float32)
        for i in range(c):
            code = ((kb >> (bits * i)) & mask).astype(jnp.float32)
            if ablate == "no_kdeq":
                kh = code.reshape(t, p_w)
            else:
                kh = (
                    code * ks[i].astype(jnp.float32)[:, None, :]
                    + kz[i].astype(jnp.float32)[:, None, :]
                ).reshape(t, p_w)
            s = s + jax.lax.dot_general(
                kh.astype(jnp.float16),
                qs[i],
                (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32,
            )
        s = s * kn.astype(jnp.float32)[:, None]
        valid = t0 + jax.lax.broadcasted_iota(jnp.int32, (t, GP), 0) < nq
        s = jnp.where(valid, s, NEG)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=0))
        corr = jnp.exp(m_prev - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[None, :]), 0.0)  # [T, GP]
        l_new = l_prev * corr + jnp.sum(p, axis=0)
        if ablate == "no_v":
            return m_new, l_new, accs, zs
        vs_t = vs_t.astype(jnp.float32)
        vz_t = vz_t.astype(jnp.float32)
        new_accs = [None] * (c * nchunk)
        for j in range(nchunk):
            vb = vbs[j].astype(jnp.int32)
            for i in range(c):
                k = i * nchunk + j
                wt = (p * column(vs_t, (i * p_w + j * w) // gv)).astype(jnp.float16)
                code = ((vb >> (bits * i)) & mask).astype(jnp.float16)
                pv = jax.lax.dot_general(
                    wt, code, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
                )  # [GP, W]
                new_accs[k] = accs[k] * corr[:, None] + pv
        new_zs = tuple(zs[r] * corr + jnp.sum(p * column(vz_t, r), axis=0) for r in range(ngv))
        return m_new, l_new, tuple(new_accs), new_zs

    def body(it, carry):
        state, tiles = carry
        t0 = start + it * t
        nxt = load(t0 + t)  # issued before the current block's compute
        return compute(tiles, t0, state), nxt

    state = (
        jnp.full((GP,), NEG, jnp.float32),
        jnp.zeros((GP,), jnp.float32),
        tuple(jnp.zeros((GP, w), jnp.float32) for _ in range(c * nchunk)),
        tuple(jnp.zeros((GP,), jnp.float32) for _ in range(ngv)),
    )
    (m, lsum, accs, zs), _ = jax.lax.fori_loop(0, nblk, body, (state, load(start)))
    for i in range(c):
        for j in range(nchunk):
            ch0 = i * p_w + j * w
            acc_ref[:, pl.ds(ch0, w)] = accs[i * nchunk + j] + zs[ch0 // gv][:, None]
    m_ref[...] = m
    l_ref[...] = lsum
