"""The tail of a fused-ring INT decode call in one Pallas launch.

``finish`` merges the INT kernel's split partials (two per split with token sub-blocks),
un-rotates their sum (values are stored rotated), adds the fused residual ring's split
and normalises: one program per (row, KV head). It replaces the XLA tail of
``decode.decode_attention_pallas`` (``merge_splits`` and the final division: two
reduce fusions, a reduce-select, the un-rotation GEMM and a select, five launches).
Selected by ``DecodeConfig.merge = "pallas"``.

Inputs are the INT kernel's raw outputs: acc [B, H, NS, GP, D] (only the rows it wrote
are read: sub * g of the quantized splits, g of the ring, the last split), m, l
[B, H, NS, GP]. Unwritten rows are masked before any arithmetic (they are uninitialised).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.decode_config import DecodeConfig, _triton_params
from pallas_kernels.decode_int import GP, NEG

CHUNK = 4  # quantized splits merged per loop step ([CHUNK, GP, D] f32 in registers)
HIGHEST = jax.lax.Precision.HIGHEST


def _iota(shape, axis):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def _dot3(x, y_hi, y_lo):
    """x [M, K] f32 @ (y_hi + y_lo) [K, N] bfloat16 halves, ~2^-16 relative: three bfloat16
    tensor-core dots (x_lo @ y_lo left out) instead of an f32 FMA dot, whose [D, D] operand
    spilled 1.2 KB per thread."""
    f32, bf16, nn = jnp.float32, jnp.bfloat16, (((1,), (0,)), ((), ()))
    x_hi = x.astype(bf16)
    x_lo = (x - x_hi.astype(f32)).astype(bf16)
    out = jax.lax.dot_general(x_hi, y_hi, nn, preferred_element_type=f32)
    out = out + jax.lax.dot_general(x_hi, y_lo, nn, preferred_element_type=f32)
    return out + jax.lax.dot_general(x_lo, y_hi, nn, preferred_element_type=f32)


def _finish_kernel(acc_ref, m_ref, l_ref, *rest, ns, rows, sub, rotate):
    """acc_ref [NS, GP, D], m_ref / l_ref [NS, GP] -> o_ref [GP, D] (rows < ``rows`` real)."""
    rh_ref, rl_ref, o_ref = rest if rotate else (None, None, rest[0])
    f32 = jnp.float32
    d = acc_ref.shape[-1]
    nq, live = ns - 1, sub * rows  # quantized splits; rows they wrote

    def body(ci, carry):  # online merge of CHUNK quantized splits, row by row
        mx, lx, ax = carry  # [GP], [GP], [GP, D]
        s0 = ci * CHUNK
        ok2 = (s0 + _iota((CHUNK, GP), 0) < nq) & (_iota((CHUNK, GP), 1) < live)
        m = jnp.where(ok2, m_ref[pl.ds(s0, CHUNK), :], NEG)  # in bounds: NSp % CHUNK == 0
        lc = jnp.where(ok2, l_ref[pl.ds(s0, CHUNK), :], 0.0)
        ok3 = (s0 + _iota((CHUNK, GP, d), 0) < nq) & (_iota((CHUNK, GP, d), 1) < live)
        a = jnp.where(ok3, acc_ref[pl.ds(s0, CHUNK), :, :], 0.0)  # [CHUNK, GP, D]
        m_new = jnp.maximum(mx, jnp.max(m, axis=0))
        w = jnp.where(lc > 0, jnp.exp(m - m_new[None, :]), 0.0)  # [CHUNK, GP]
        corr = jnp.exp(mx - m_new)
        ax = ax * corr[:, None] + jnp.sum(a * w[:, :, None], axis=0)
        return m_new, lx * corr + jnp.sum(lc * w, axis=0), ax

    init = (jnp.full((GP,), NEG, f32), jnp.zeros((GP,), f32), jnp.zeros((GP, d), f32))
    mx, lx, ax = jax.lax.fori_loop(0, -(-nq // CHUNK), body, init)
    if sub > 1:  # rows (j, h) -> head h: a 0/1-weighted row combination (exact weights)
        same = (_iota((GP, GP), 0) % rows == _iota((GP, GP), 1) % rows) & (
            _iota((GP, GP), 1) < live
        )
        mh = jnp.max(jnp.where(same, mx[None, :], NEG), axis=1)  # [GP]
        wm = jnp.where(same & (lx[None, :] > 0), jnp.exp(mx[None, :] - mh[:, None]), 0.0)
        ax = jax.lax.dot_general(wm, ax, (((1,), (0,)), ((), ())), precision=HIGHEST,
                                 preferred_element_type=f32)  # fmt: skip
        lx, mx = jnp.sum(wm * lx[None, :], axis=1), mh
    if rotate:  # quantized values are stored rotated: acc @ R, the original basis
        ax = _dot3(ax, rh_ref[...], rl_ref[...])
    real = _iota((GP,), 0) < rows
    mr = jnp.where(real, m_ref[nq, :], NEG)  # the ring split, original basis
    lr = jnp.where(real, l_ref[nq, :], 0.0)
    ar = jnp.where(_iota((GP, d), 0) < rows, acc_ref[nq, :, :], 0.0)
    mt = jnp.maximum(mx, mr)
    w1 = jnp.where(lx > 0, jnp.exp(mx - mt), 0.0)
    w2 = jnp.where(lr > 0, jnp.exp(mr - mt), 0.0)
    acc = ax * w1[:, None] + ar * w2[:, None]
    lt = lx * w1 + lr * w2
    o_ref[...] = jnp.where(lt[:, None] > 0, acc / jnp.where(lt > 0, lt, 1.0)[:, None], 0.0)


def finish(acc, m, lsum, rot, cfg: DecodeConfig, *, ns: int, rows: int, sub: int):
    """Raw INT-kernel partials -> normalised outputs [B, H, rows, D] f32.

    acc [B, H, NSp, GP, D], m / lsum [B, H, NSp, GP]: ``ns`` splits written, the fused
    ring's the last of them; NSp >= ns rounded up to a multiple of ``CHUNK`` (the loads
    of the last chunk stay in bounds). ``rot`` [D, D] f32: the values' rotation R (the
    quantized splits' sum is multiplied by it, as ``hadamard.unrotate``), or None.
    """
    b, h, nsp, gp, d = acc.shape
    if nsp % CHUNK or nsp < ns:
        raise ValueError(f"acc.shape={acc.shape}: splits must be >= {ns}, a multiple of {CHUNK}")
    kern = functools.partial(_finish_kernel, ns=ns, rows=rows, sub=sub, rotate=rot is not None)

    def blk(*shape):
        return pl.BlockSpec((None, None, *shape), lambda i, j: (i, j) + (0,) * len(shape))

    in_specs = [blk(nsp, gp, d), blk(nsp, gp), blk(nsp, gp)]
    args = [acc, m, lsum]
    if rot is not None:
        hi = rot.astype(jnp.bfloat16)
        lo = (rot - hi.astype(jnp.float32)).astype(jnp.bfloat16)
        in_specs += [pl.BlockSpec((d, d), lambda i, j: (0, 0))] * 2
        args += [hi, lo]
    kwargs = {} if cfg.interpret else dict(compiler_params=_triton_params(4, 1))
    out = pl.pallas_call(
        kern,
        grid=(b, h),
        in_specs=in_specs,
        out_specs=blk(gp, d),
        out_shape=jax.ShapeDtypeStruct((b, h, gp, d), jnp.float32),
        interpret=cfg.interpret,
        name="oscar_decode_finish",
        **kwargs,
    )(*args)
    return out[:, :, :rows]
