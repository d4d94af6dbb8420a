"""Kernel bodies of the INT decode kernel (see ``pallas_kernels.decode.triton`` for the algebra).

``int_kernel`` is the Pallas kernel: grid (B, H, splits [+1]); the quantized splits run
``_int_quant_part`` and, when the ring is fused, the last split runs ``_ring_part`` on
the full-precision residual ring. The body dequantizes one key group and one value
chunk at a time, straight into the MMA operand layout; a register double buffer of the
next block's tiles and one [T, D] tile per operand unpacked by a broadcast shift were
both slower.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from oscar_jax.cache import quantized_count
from pallas_kernels.decode.tiles import (
    dequant,
    hi_lo,
    kron_rotate,
    pow2_scale,
    split_dot,
    word_half,
)

GP = 16  # MMA rows: the GQA query group is padded to this
NEG = -1e30  # finite 'minus infinity' of the online softmax


def _store_rows(ref, cols, val, rows):
    """ref[:, cols] = val [GP, W] for its first ``rows`` rows only (the real query heads of
    the padded GQA group): the partials' padded rows are never written nor read."""
    if rows >= GP:
        ref[:, cols] = val
    else:
        from jax.experimental.pallas import triton as plgpu

        mask = jax.lax.broadcasted_iota(jnp.int32, val.shape, 0) < rows
        plgpu.store(ref.at[:, cols], val, mask=mask)


def _query_rows(ref, cols, qscale, rows):
    """[GP, W] f32 query rows, channels ``cols``. ``qscale`` None: ``ref`` is the wrapper's
    [GP, D] f32 block (scaled, rows filled). Else ``ref`` is the query as given, [g, D] in
    its dtype (g a power of two): scaled here and tiled over the MMA rows, row r = head
    r mod g for r < ``rows`` (the token sub-blocks' rows (j, h)), zero past them."""
    if qscale is None:
        return ref[:, cols]
    x = ref[:, cols].astype(jnp.float32) * np.float32(qscale)  # [g, W]
    g, w = x.shape
    if g < GP:
        x = jnp.broadcast_to(x[None], (GP // g, g, w)).reshape(GP, w)
    return jnp.where(jax.lax.broadcasted_iota(jnp.int32, (GP, w), 0) < rows, x, 0.0)


def quantized_tokens(nq_ref, nq_of):
    """The row's quantized token count: ``nq_ref[0]``, or with ``nq_of`` (the cache's
    ``KVQuantConfig``) ``cache.quantized_count`` of the row's length in ``nq_ref``, computed
    in the kernel so that XLA runs no [B] launch for it."""
    return nq_ref[0] if nq_of is None else quantized_count(nq_ref[0], nq_of)


def _ring_part(
    n_ref, nq_ref, qp_ref, kr_ref, vr_ref, acc_ref, m_ref, l_ref, *, bs, rows, qscale, nq_of
):
    """The full-precision residual ring, in the original basis (see ``split_dot``)."""
    slots, d = kr_ref.shape
    n, nq = n_ref[0], quantized_tokens(nq_ref, nq_of)
    q = _query_rows(qp_ref, slice(None), qscale, rows)  # [GP, D] f32
    half = kr_ref.dtype if kr_ref.dtype in (jnp.bfloat16, jnp.float16) else None
    base = nq % slots

    def body(it, carry):
        m_prev, l_prev, acc = carry
        r0 = pl.multiple_of(it * bs, bs)
        k = kr_ref[pl.ds(r0, bs), :]  # [bs, D]
        s = split_dot(q, k, (((1,), (1,)), ((), ())), half).T  # [bs, GP]
        rel = r0 + jax.lax.broadcasted_iota(jnp.int32, (bs, GP), 0) - base
        valid = jnp.where(rel < 0, rel + slots, rel) < n - nq
        s = jnp.where(valid, s, NEG)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=0))
        corr = jnp.exp(m_prev - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[None, :]), 0.0)
        pv = split_dot(p.T, vr_ref[pl.ds(r0, bs), :], (((1,), (0,)), ((), ())), half)
        return m_new, l_prev * corr + jnp.sum(p, axis=0), acc * corr[:, None] + pv

    init = (
        jnp.full((GP,), NEG, jnp.float32),
        jnp.zeros((GP,), jnp.float32),
        jnp.zeros((GP, d), jnp.float32),
    )
    m, lsum, acc = jax.lax.fori_loop(0, slots // bs, body, init)
    _store_rows(acc_ref, slice(None), acc, rows)
    m_ref[...] = m
    l_ref[...] = lsum


def int_kernel(*refs, ring, rot=(False, False), **kw):
    """Grid (B, H, splits [+1 for the ring]): the last split handles the ring when fused.

    refs: the 9 inputs of ``_int_quant_part``, the query's and the output's rotation
    factors where ``rot`` = (rotate the query, un-rotate the output) asks for them, the 4
    ring inputs when fused, the 3 outputs."""
    nrot = sum(rot)
    fac = refs[9 : 9 + nrot]
    kw = dict(kw, fq_ref=fac[0] if rot[0] else None, fo_ref=fac[-1] if rot[1] else None)
    quant_refs, ring_refs, out_refs = refs[:9], refs[9 + nrot : -3], refs[-3:]
    if not ring:
        return _int_quant_part(*quant_refs, *out_refs, s_id=pl.program_id(2), **kw)
    n_ref, qp_ref, kr_ref, vr_ref = ring_refs
    last = pl.num_programs(2) - 1
    s_id = pl.program_id(2)

    @pl.when(s_id < last)
    def _():
        _int_quant_part(*quant_refs, *out_refs, s_id=s_id, **kw)

    @pl.when(s_id == last)
    def _():
        _ring_part(n_ref, quant_refs[0], qp_ref, kr_ref, vr_ref, *out_refs, bs=ring,
                   rows=kw["rows"], qscale=kw.get("qscale"), nq_of=kw.get("nq_of"))  # fmt: skip


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
    asm=False,
    vpair=None,
    rows=GP,
    sub=1,
    knpair=None,
    fq_ref=None,
    fo_ref=None,
    qscale=None,
    nq_of=None,
):
    """One block of T tokens = T / G key groups, one online-softmax step per block.

    Both operands are dequantized where the MMA reads them: the packed codes come
    from shared memory straight into the tensor-core operand layout and become
    ``code * scale + zero`` by bit pattern and packed 16-bit fmas (``tiles.dequant``): no
    int->float conversion, no float32 round trip, no shared-memory layout change. Keys
    are float16 (the query, loaded once, is the invariant A operand); values are float16
    with float16 parameters, else bfloat16 (float16 overflows above 65504 where bfloat16
    or float32 parameters allow larger values); p enters the value dot once per group
    for all planes. Scores are [GP, G] with the query heads as MMA rows. Float16
    parameters also spare the per-element bfloat16 -> float16 conversions of the key
    parameters (each thread holds 8 channels' scales and zeros per group and plane).

    ``vpair`` (the 16-bit parameter dtype, or None): ``vs_ref`` / ``vz_ref`` hold the
    value scales / zeros bitcast to uint32 pairs [T, D / Gv / 2], so each per-token
    column load moves 4-byte elements (Triton's pipeliner then issues it as cp.async;
    2-byte elements stay synchronous ld.global.b16) and serves two value groups.

    ``sub`` = S = 2 (``DecodeConfig.token_split``): row r of the MMA holds query head
    r mod (rows / S) for the tokens j, j + S, j + 2S, .. of each group, j = r // (rows /
    S): the key tile is [G / S, S * P] (S tokens per row), the query plane a block-
    diagonal [GP, S * P] (built here once from the row-tiled query), the scores
    [GP, G / S], and p is spread back to [GP, G] (zero off the row's tokens) for the
    value dot, which keeps its [G, W] tile: by a dot with a 0/1 matrix, which stays in
    registers where a broadcast + reshape went through shared memory (offline: 1,563
    against 1,585 loop instructions). Each row is its own online softmax.
    S = 2 only: ``kn_ref`` is then the 16-bit norms (dtype ``knpair``) as [Lq / 2] uint32
    pairs, 4-byte elements that Triton pipelines (strided 2-byte column loads stay
    synchronous ld.global.b16, and are slower).
    """
    f32, f16, bf16 = jnp.float32, jnp.float16, jnp.bfloat16
    # value MMA dtype: float16 with float16 parameters (their range bounds the values, and
    # no conversion is needed), else bfloat16 (values of any float32 magnitude). float32
    # parameters: values dequantized in float32 and split into bfloat16 hi + lo halves
    # (two value dots, ~2^-16 relative), since one bfloat16 rounding of the parameters
    # moves outputs by 2e-2 against the float32 reference
    vpdt = jnp.dtype(vs_ref.dtype if vpair is None else vpair)
    vdt = f16 if vpdt == f16 else bf16
    vsplit = vpdt == f32
    vpt = f32 if vsplit else vdt  # dtype of the dequantizing parameters
    c = 8 // bits
    p_w = d // c  # channels per plane = bytes per token
    w = min(p_w, gv)  # channels per value chunk (one value group)
    nchunk = p_w // w
    ngt = t // g
    nq = quantized_tokens(nq_ref, nq_of)
    start = s_id * bps * t
    nblk = jnp.clip((nq - start + t - 1) // t, 0, bps)
    nt = (((1,), (1,)), ((), ()))  # x @ y.T
    nn = (((1,), (0,)), ((), ()))  # x @ y
    g2, sp = g // sub, sub * p_w  # score columns per group, key-tile width

    def iota(shape, axis):
        return jax.lax.broadcasted_iota(jnp.int32, shape, axis)

    def tile(x):  # [R, P] -> [R, S * P] = [x, .., x]
        r, n = x.shape
        return x if sub == 1 else jnp.broadcast_to(x[:, None, :], (r, sub, n)).reshape(r, sub * n)

    def row_sub(shape):  # the sub-block j of each MMA row, [shape] int32
        return jnp.minimum(iota(shape, 0) // (rows // sub), sub - 1)

    qs = [_query_rows(q_ref, pl.ds(i * p_w, p_w), qscale, rows) for i in range(c)]  # [GP, P]
    if fq_ref is not None:  # the plain query, rotated once per program
        qs = kron_rotate(qs, fq_ref, inverse=False, split=False)  # rounded to f16 anyway
    qs = [tile(x) for x in qs]  # [GP, S * P] per plane
    if sub > 1:
        diag = row_sub((GP, sp)) == iota((GP, sp), 1) // p_w
        qs = [jnp.where(diag, x, 0.0) for x in qs]  # block-diagonal
    qs = [x.astype(f16) for x in qs]

    def norms(t0):
        """[GP, G / S] f32 token norms of the score tile at t0 (see ``knpair``)."""
        if sub == 1:
            return kn_ref[pl.ds(t0, g)].astype(f32)[None, :]
        word = kn_ref[pl.ds(t0 // 2, g2)]  # [G / 2] uint32: tokens 2t' (low half), 2t' + 1
        rj, out = row_sub((GP, g2)), jnp.zeros((GP, g2), f32)
        for j in range(2):
            out = jnp.where(rj == j, word_half(word, j, knpair).astype(f32)[None, :], out)
        return out

    def scores(gi, t0):
        """[GP, G / S] scores (invalid tokens at NEG) of key group gi starting at token t0."""
        kb = kc_ref[gi, :, :]  # [G / S, S * P] uint8
        shp = (g2, sp)
        ks = [jnp.broadcast_to(tile(ks_ref[pl.ds(gi, 1), pl.ds(i * p_w, p_w)].astype(f16)), shp)
              for i in range(c)]  # [G / S, S * P] per plane  # fmt: skip
        kz = [jnp.broadcast_to(tile(kz_ref[pl.ds(gi, 1), pl.ds(i * p_w, p_w)].astype(f16)), shp)
              for i in range(c)]  # fmt: skip
        kh = dequant(kb, bits, asm, f16, ks, kz)  # f16 keys per plane, MMA layout
        s = jnp.zeros((GP, g2), f32)
        for i in range(c):
            s = s + jax.lax.dot_general(qs[i], kh[i], nt, preferred_element_type=f32)
        s = s * norms(t0)
        tok = t0 + sub * iota((GP, g2), 1) + (row_sub((GP, g2)) if sub > 1 else 0)
        valid = tok < nq
        return jnp.where(valid, s, NEG), valid

    def spread(p):
        """[GP, G / S] -> [GP, G]: each row's weights at its own tokens, zero elsewhere."""
        if sub == 1:
            return p
        e = (iota((g2, g), 1) // sub == iota((g2, g), 0)).astype(p.dtype)  # [G / S, G]
        pe = jax.lax.dot_general(p, e, nn, preferred_element_type=f32)  # exact: one term
        return jnp.where(iota((GP, g), 1) % sub == row_sub((GP, g)), pe, 0.0)

    def vparam(ref, q, tg, words):
        """[G] value scale / zero (``vpt``) of group q for tokens tg.. (see ``vpair``)."""
        if vpair is None:
            return ref[pl.ds(tg, g), q].astype(vpt)
        key = (id(ref), q // 2)
        if key not in words:
            words[key] = ref[pl.ds(tg, g), q // 2]  # [G] uint32: 4-byte elements
        return word_half(words[key], q % 2, vpair).astype(vpt)

    def body(it, carry):
        m_prev, l_prev, accs = carry
        t0 = pl.multiple_of(start + it * t, t)
        sv = [scores(t0 // g + j, t0 + j * g) for j in range(ngt)]
        m_new = m_prev
        for s, _ in sv:
            m_new = jnp.maximum(m_new, jnp.max(s, axis=1))
        corr = jnp.exp(m_prev - m_new)
        ps = [jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0) for s, valid in sv]  # [GP, G]
        l_new = l_prev * corr
        for p in ps:
            l_new = l_new + jnp.sum(p, axis=1)
        new_accs = [a * corr[:, None] for a in accs]
        for jg, p in enumerate(ps):
            tg = t0 + jg * g
            pb = spread(p.astype(vdt)).astype(vdt)  # one conversion per group, every plane
            words = {}  # vpair: one [G] uint32 load serves value groups 2k and 2k + 1
            for j in range(nchunk):
                grps = [(i * p_w + j * w) // gv for i in range(c)]
                vs = [jnp.broadcast_to(vparam(vs_ref, q, tg, words)[:, None], (g, w))
                      for q in grps]  # [G, W] per plane  # fmt: skip
                vz = [jnp.broadcast_to(vparam(vz_ref, q, tg, words)[:, None], (g, w))
                      for q in grps]  # fmt: skip
                vb = vc_ref[pl.ds(tg, g), pl.ds(j * w, w)]  # [G, W] uint8
                vh = dequant(vb, bits, asm, vpt, vs, vz)  # float32: hi + lo dots
                vh = [hi_lo(x, bf16) if vsplit else [x] for x in vh]
                for i in range(c):
                    k = i * nchunk + j
                    for part in vh[i]:
                        new_accs[k] = new_accs[k] + jax.lax.dot_general(
                            pb, part, nn, preferred_element_type=f32
                        )  # [GP, W]
        return m_new, l_new, tuple(new_accs)

    init = (
        jnp.full((GP,), NEG, f32),
        jnp.zeros((GP,), f32),
        tuple(jnp.zeros((GP, w), f32) for _ in range(c * nchunk)),
    )
    m, lsum, accs = jax.lax.fori_loop(0, nblk, body, init)
    if fo_ref is not None:  # chunk k of accs: channels k W..; the split's acc un-rotated
        if vdt == f16:  # rows scaled to [1, 2): in float16 range, 11 bits even for tiny ones
            amax = jnp.max(jnp.abs(accs[0]), axis=1)  # [GP]
            for a in accs[1:]:
                amax = jnp.maximum(amax, jnp.max(jnp.abs(a), axis=1))
            up, down = pow2_scale(amax)
            accs = kron_rotate([a * up[:, None] for a in accs], fo_ref, inverse=True, split=False)
            accs = [a * down[:, None] for a in accs]
        else:
            accs = kron_rotate(list(accs), fo_ref, inverse=True, split=True)
    for i in range(c):
        for j in range(nchunk):
            _store_rows(acc_ref, pl.ds(i * p_w + j * w, w), accs[i * nchunk + j], rows)
    m_ref[...] = m
    l_ref[...] = lsum
