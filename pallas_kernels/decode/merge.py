"""The split merge of the decode kernels: in XLA (``merge_splits``) and as one Pallas
launch (``merge``, lowered through Triton).

``merge`` takes the INT kernel's raw split partials and returns the normalised attention
output in the query's dtype: for each (row b, KV head h, query head r)::

    M = max_s m[s, r],   w_s = exp(m[s, r] - M) if l[s, r] > 0 else 0
    out[r] = sum_s w_s acc[s, r] / sum_s w_s l[s, r]      (0 where the sum is 0)

It replaces the XLA tail of ``decode.triton.decode_attention_triton`` (a max reduction, the
weighted sums, the selects and the division: four launches, most of a small call's glue)
where every partial is in the original basis (the in-kernel rotation, or no rotation of
the values); an un-rotation would need all channels in one program ([D, D] operands,
slower at batch 1). Here the programs are (b, h, channel block of ``cols``), so a batch-1
call still spreads over B x H x D / cols programs; each walks the splits in chunks with an
online rescale.

Einsum letters: B batch, H KV heads, S splits, R query rows of the MMA (GP = 16), D channels.

Inputs, as ``partials.int_partials`` returns them: acc [B, H, Sp, GP, D] f32, m / l
[B, H, Sp, GP] f32. Splits ``ns`` and beyond (up to Sp, a multiple of the chunk) and rows
past the ones a split wrote are never written by the INT kernel: they are masked before
any arithmetic. Rows: a quantized split wrote ``sub`` x ``rows`` rows (row j * rows + r:
query head r over sub-block j of its tokens), the fused ring's split (the last,
``ring=True``) ``rows`` rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from oscar_jax.cache import FLAG_NONFINITE
from pallas_kernels.decode.config import _triton_params
from pallas_kernels.decode.int_kernel import GP, NEG

CHUNK = 128  # splits per step, at most (DecodeConfig.merge_chunk)
STEP_ELEMS = 16384  # f32 tile elements per step over the sub-blocks: 128 a thread at 4 warps
# Steps up to which the walk is unrolled, all loads issued up front: in a fori_loop each
# step waits on its loads, then reduces across warps
UNROLL = 8
SMS = 132  # streaming multiprocessors of the H200


def auto_cols(b: int, h: int, d: int) -> int:
    """Channels per program: 16 where 32 would give fewer programs than SMs, else 32."""
    return min(d, 16 if b * h * (d // 32) < SMS else 32)


def step_splits(ns: int, rows: int, sub: int, cols: int, chunk: int = CHUNK) -> int:
    """Splits per step: ``chunk``, no more than the splits (rounded to a power of two),
    and no more than ``STEP_ELEMS`` tile elements (all powers of two)."""
    cap = max(1, STEP_ELEMS // (pow2_at_least(rows) * cols * sub))
    return min(chunk, pow2_at_least(ns), cap)


def pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def padded_splits(ns: int, step: int) -> int:
    """Split slots the INT kernel's outputs need for ``merge``: ``ns`` rounded up to the
    step (the last step's loads stay in bounds; the extra slots are never written)."""
    return -(-ns // step) * step


def merge_splits(acc, m, lsum, last_basis=None):
    """Merge the split axis (2) of kernel partials: -> acc [B,H,GP,D], m, l (m=-inf if empty).

    ``last_basis(x)`` maps the weighted sum of all splits but the last into the last
    split's basis (the fused ring's acc is in the original basis, the quantized
    splits' in the rotated one) before adding the last split.
    """
    mt = jnp.max(m, axis=2)
    wgt = jnp.where(lsum > 0, jnp.exp(m - mt[:, :, None]), 0.0)
    wacc = acc * wgt[..., None]
    if last_basis is None:
        acc = jnp.sum(wacc, axis=2)
    else:
        acc = last_basis(jnp.sum(wacc[:, :, :-1], axis=2)) + wacc[:, :, -1]
    lt = jnp.sum(lsum * wgt, axis=2)
    return acc, jnp.where(lt > 0, mt, -jnp.inf), lt


def _merge_kernel(*refs, ns, nqs, rows, sub, chunk, interpret):
    """m_ref / l_ref [Sp, GP], acc_ref [Sp, GP, C] -> o_ref [RR, C] (RR = rows rounded up
    to a power of two; rows past ``rows`` are 0)."""
    m_ref, l_ref, acc_ref, *flags, o_ref = refs
    flags_ref = flags[0] if flags else None
    f32 = jnp.float32
    rr, cols = o_ref.shape

    def iota(shape, axis):
        return jax.lax.broadcasted_iota(jnp.int32, shape, axis)

    def load(ref, idx, ok, other):
        if interpret:  # interpret mode reads the (allocated, unwritten) slots, then masks
            return jnp.where(ok, ref[idx], other)
        from jax.experimental.pallas import triton as plgpu

        return plgpu.load(ref.at[idx], mask=ok, other=other)

    def part(j, s0):
        """m, l [chunk, RR] and acc [chunk, RR, C] of sub-block j at splits s0.."""
        top = ns if j == 0 else nqs  # rows j > 0 exist in the quantized splits only
        ok = (s0 + iota((chunk, rr), 0) < top) & (iota((chunk, rr), 1) < rows)
        idx = (pl.ds(s0, chunk), pl.ds(j * rows, rr))
        m = load(m_ref, idx, ok, NEG)
        lsum = load(l_ref, idx, ok, 0.0)
        ok3 = jnp.broadcast_to(ok[:, :, None], (chunk, rr, cols))
        acc = load(acc_ref, (*idx, slice(None)), ok3, 0.0)
        return m, lsum, acc

    def body(ci, carry):
        mx, lx, ax = carry  # [RR], [RR], [RR, C]
        s0 = ci * chunk if isinstance(ci, int) else pl.multiple_of(ci * chunk, chunk)
        parts = [part(j, s0) for j in range(sub)]
        m_new = mx
        for m, _, _ in parts:
            m_new = jnp.maximum(m_new, jnp.max(m, axis=0))
        corr = jnp.exp(mx - m_new)
        lx, ax = lx * corr, ax * corr[:, None]
        for m, lsum, acc in parts:
            w = jnp.where(lsum > 0, jnp.exp(m - m_new[None, :]), 0.0)  # [chunk, RR]
            lx = lx + jnp.sum(lsum * w, axis=0)
            ax = ax + jnp.sum(acc * w[:, :, None], axis=0)
        return m_new, lx, ax

    carry = (jnp.full((rr,), NEG, f32), jnp.zeros((rr,), f32), jnp.zeros((rr, cols), f32))
    nchunks = -(-ns // chunk)
    if nchunks <= UNROLL:  # straight-line code: every chunk's loads issued up front
        for ci in range(nchunks):
            carry = body(ci, carry)
    else:
        carry = jax.lax.fori_loop(0, nchunks, body, carry)
    _, lx, ax = carry
    out = jnp.where(lx[:, None] > 0, ax / jnp.where(lx > 0, lx, 1.0)[:, None], 0.0)
    if flags_ref is not None:  # FLAG_NONFINITE rows: NaN (attention.poison_flagged_rows)
        out = jnp.where((flags_ref[0] & FLAG_NONFINITE) != 0, jnp.nan, out)
    o_ref[...] = out.astype(o_ref.dtype)


def merge(
    acc,  # [B, H, Sp, GP, D] f32
    m,  # [B, H, Sp, GP] f32
    lsum,  # [B, H, Sp, GP] f32
    *,
    ns: int,
    rows: int,
    sub: int,
    ring: bool,
    out_dtype,
    flags=None,  # [B] int32, optional
    cols: int = 32,
    chunk: int = CHUNK,
    num_warps: int = 1,
    num_stages: int = 2,
    interpret: bool = False,
):
    """Raw INT-kernel partials -> normalised output [B, H, rows, D] in ``out_dtype``.

    ``ns``: splits written (the fused ring's the last when ``ring``); Sp must be
    ``padded_splits(ns, step_splits(ns, rows, sub, cols, chunk))``. ``rows``: query heads
    per KV head; ``sub``: token sub-blocks of the quantized splits (rows j * rows + r).
    ``flags`` [B] (``KVCache.flags``): rows with ``FLAG_NONFINITE`` come back NaN (the
    select XLA would add is one more launch).
    ``cols``: channels per program; ``chunk``: splits per step (a power of two).
    """
    b, h, sp, gp, d = acc.shape
    if gp != GP or m.shape != (b, h, sp, gp) or lsum.shape != m.shape:
        raise ValueError(f"acc.shape={acc.shape}, m.shape={m.shape} must be [B, H, Sp, {GP}(, D)]")
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"{chunk=} must be a power of two")
    if cols < 16 or cols & (cols - 1) or d % cols:
        raise ValueError(f"{cols=} must be a power of two >= 16 dividing head_dim {d}")
    chunk = step_splits(ns, rows, sub, cols, chunk)
    if sp != padded_splits(ns, chunk):
        raise ValueError(f"acc.shape={acc.shape}: {padded_splits(ns, chunk)} split slots for {ns=}")
    rr = pow2_at_least(rows)
    if sub not in (1, 2) or sub * rows > GP or (sub - 1) * rows + rr > GP:
        raise ValueError(f"{rows=} query rows with {sub=} sub-blocks must fit {GP} MMA rows")
    kern = functools.partial(
        _merge_kernel,
        ns=ns,
        nqs=ns - 1 if ring else ns,
        rows=rows,
        sub=sub,
        chunk=chunk,
        interpret=interpret,
    )
    kwargs = {} if interpret else dict(compiler_params=_triton_params(num_warps, num_stages))
    in_specs = [
        pl.BlockSpec((None, None, sp, gp), lambda i, j, c: (i, j, 0, 0)),
        pl.BlockSpec((None, None, sp, gp), lambda i, j, c: (i, j, 0, 0)),
        pl.BlockSpec((None, None, sp, gp, cols), lambda i, j, c: (i, j, 0, 0, c)),
    ]
    args = [m, lsum, acc]
    if flags is not None:
        if jnp.shape(flags) != (b,) or jnp.dtype(flags.dtype) != jnp.int32:
            raise ValueError(f"flags {jnp.shape(flags)} {flags.dtype} must be ({b},) int32")
        in_specs.append(pl.BlockSpec((1,), lambda i, j, c: (i,)))
        args.append(flags)
    out = pl.pallas_call(
        kern,
        grid=(b, h, d // cols),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, rr, cols), lambda i, j, c: (i, j, 0, c)),
        out_shape=jax.ShapeDtypeStruct((b, h, rr, d), out_dtype),
        interpret=interpret,
        name="oscar_decode_merge",
        **kwargs,
    )(*args)
    return out if rr == rows else out[:, :, :rows]
