"""Per-element numerics of the fused encoder (``pallas_kernels.quantize.triton``) in Pallas ops.

The encoder must reproduce the XLA path's codes, scales, zeros and norms (``oscar_jax.
codec``), so its divisions are IEEE round-to-nearest and its rounding is half-to-even;
on the GPU both are inline PTX (Triton's ``/`` is approximate and it lowers no round),
in interpret mode plain ``jnp``. ``spec`` is the encoder's ``_Spec`` (config, tuning,
interpret flag).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as plgpu

from oscar_jax import quant


def ptx_f32(x) -> str:
    """A float32 constant as a PTX hex literal (``0f3F800000`` for 1.0)."""
    return f"0f{np.float32(x).view(np.uint32):08X}"


def _div(a, b, spec):
    """a / b in f32: IEEE-rounded (div.rn) or via a reciprocal, per the tuning."""
    if not spec.tuning.exact_division:  # one IEEE reciprocal per row/column, then multiply
        return a * _div(
            jnp.ones_like(b),
            b,
            dataclasses.replace(spec, tuning=dataclasses.replace(spec.tuning, exact_division=True)),
        )
    b = jnp.broadcast_to(b, a.shape)
    if spec.interpret:
        return a / b
    (out,) = plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )  # fmt: skip
    return out


def markstein_div_asm(levels: int) -> str:
    """Inline PTX for ``$0 = $1 / levels``, IEEE round-to-nearest, without ``div.rn``'s
    subroutine: q = a * R with R = RN(1 / levels), the exact remainder r = fma(-q, levels,
    a), then fma(r, R, q) (Markstein's correction step); non-finite a keeps q. Checked
    equal to ``div.rn.f32`` for every non-negative float32 at levels 3 and 15 on the H200
    (``benchmarks/check_division.py``); the kernel divides only ``max - min >= 0``.
    """
    rcp = np.float32(1.0) / np.float32(levels)
    return "\n".join([
        "{",
        ".reg .f32 q, r, t;",
        ".reg .pred p;",
        f"mul.rn.f32 q, $1, {ptx_f32(rcp)};",
        f"fma.rn.f32 r, q, {ptx_f32(-levels)}, $1;",
        f"fma.rn.f32 t, r, {ptx_f32(rcp)}, q;",
        "testp.finite.f32 p, $1;",
        "selp.f32 $0, t, q, p;",
        "}",
    ])  # fmt: skip


def newton_rcp_asm() -> str:
    """Inline PTX for ``$0 = 1 / $1`` of a positive finite float16 value held in float32,
    correctly rounded without ``div.rn``'s check and slow path: y = rcp.approx (within 1
    ulp), e = fma(-x, y, 1), then fma(y, e, y), whose error is below 2^-46 relative. A
    float16 x = M 2^k (integer M < 2^11) has 1 / x at least 2^-35 relative from any
    float32 rounding midpoint, so that result rounds to the IEEE quotient; x and 1 / x
    are normal float32, so ``.ftz`` changes nothing. Checked against ``div.rn.f32`` for
    every positive finite float16 on the H200 (``benchmarks/check_division.py``).
    """
    return "\n".join([
        "{",
        ".reg .f32 y, e;",
        "rcp.approx.ftz.f32 y, $1;",
        "neg.f32 e, $1;",
        "fma.rn.f32 e, e, y, 0f3F800000;",
        "fma.rn.f32 $0, y, e, y;",
        "}",
    ])  # fmt: skip


def _newton_rcp(x):
    """1 / x (f32) by ``newton_rcp_asm``: IEEE-rounded for x of at most 11 significant
    bits (float16, bfloat16) whose reciprocal is a normal float32."""
    (out,) = plgpu.elementwise_inline_asm(
        newton_rcp_asm(), args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )  # fmt: skip
    return out


def _short(dtype) -> bool:
    """Values of this dtype have at most 11 significant bits (``_newton_rcp`` applies)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def _inv_scale(s32, spec):
    """1 / s of stored scales s (f32 [..]), 0 where s <= 0 or NaN, IEEE-rounded as the
    reference's ``where(s > 0, 1 / s, 0)``. Float16 scales take ``newton_rcp_asm`` (3
    instructions where ``div.rn`` takes ~10 with a branch; 40 of them a thread a group);
    s = inf gives 0 as 1 / inf does."""
    pos = s32 > 0
    f16 = jnp.dtype(spec.cfg.scale_dtype) == jnp.float16
    if spec.interpret or not spec.tuning.exact_division or not f16:
        return jnp.where(pos, _div(jnp.ones_like(s32), jnp.where(pos, s32, 1.0), spec), 0.0)
    fin = pos & (s32 < np.float32(np.inf))
    return jnp.where(fin, _newton_rcp(jnp.where(fin, s32, 1.0)), 0.0)


def _div_levels(a, levels: int, spec):
    """a / levels as ``_div`` rounds it (a >= 0: a group's max - min)."""
    if spec.interpret or not spec.tuning.exact_division:
        return _div(a, jnp.full_like(a, levels), spec)
    (out,) = plgpu.elementwise_inline_asm(
        markstein_div_asm(levels), args=[a], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )  # fmt: skip
    return out


def _codes(a, inv, levels: int, spec, below=None):
    """``below << nbits | code`` in the low bits (int32; higher bits are garbage on the GPU,
    cut off by the uint8 store), code = round_half_even(clip(a inv, 0, levels)), NaN -> 0:
    the reference's ``clip(round(where(isnan(v), 0, clip(v, -1, levels + 1))), 0,
    levels)`` of v = a inv (equal for every v: the clip bounds are integers, rounding is
    monotonic). A byte's planes are packed from the highest down: ``below`` is the higher
    planes; ``inv`` [.., 1] or a's shape.

    On the GPU one inline-PTX instance per element, with f = inv 2^-nbits (exact: a power
    of two): ``mul.rn.sat.f32`` t = a f, which is RN(v) 2^-nbits clamped to [0, 1] (NaN
    -> 0) by the multiply's own saturation, ``min.f32`` with levels 2^-nbits, the magic-
    number add 1.5 * 2^(23 - nbits) (its round-to-nearest-even rounds t to a multiple of
    2^-nbits and leaves RN(v) in the low mantissa bits) and one shift-add of the higher
    planes onto those bits (the magic number's bits only carry upwards): no quarter-rate
    ``cvt`` conversions, no masking, no separate clip at 0 (one instruction an element
    fewer than max, min, add). f is exact while inv >= 2^(nbits - 126), i.e. for scales
    up to 2^(126 - nbits) (groups spanning less than ~6e37 at 2 bits); beyond, f is
    subnormal and a code within an ulp of a rounding tie may round the other way.
    """
    nbits = levels.bit_length()
    if spec.interpret:
        v = a * inv
        v = jnp.clip(jnp.where(v != v, 0.0, v), 0.0, float(levels))
        code = jnp.round(v).astype(jnp.int32)
        return code if below is None else (below << nbits) | code
    f = jnp.broadcast_to(inv * np.float32(2.0**-nbits), a.shape)
    lines = [
        "{",
        ".reg .f32 t;",
        "mul.rn.sat.f32 t, $1, $2;",
        f"min.f32 t, t, {ptx_f32(levels * 2.0**-nbits)};",
        f"add.rn.f32 t, t, {ptx_f32(1.5 * 2.0 ** (23 - nbits))};",
    ]
    if below is None:
        lines.append("mov.b32 $0, t;")
        args, cons = [a, f], "=r,f,f"
    else:
        lines += [".reg .b32 u;", "mov.b32 u, t;", f"mad.lo.u32 $0, $3, {1 << nbits}, u;"]
        args, cons = [a, f, below], "=r,f,f,r"
    (out,) = plgpu.elementwise_inline_asm(
        "\n".join([*lines, "}"]), args=args, constraints=cons, pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)],
    )  # fmt: skip
    return out


def _quantize(y, mn, mx, spec, below=None):
    """Stored scale/zero of a group and the codes of y packed onto ``below`` (the higher
    planes; see ``_codes``), as quant.quantize_groups."""
    levels = spec.cfg.levels
    scale = _div_levels(mx - mn, levels, spec).astype(spec.cfg.scale_dtype)
    zero = mn.astype(spec.cfg.scale_dtype)
    s32, z32 = scale.astype(jnp.float32), zero.astype(jnp.float32)
    inv = _inv_scale(s32, spec)
    return scale, zero, _codes(y - z32, inv, levels, spec, below)


def _row_max_abs(ys):
    """max |y| per token over the [W, G] key chunks ys (a column's maximum): the chunks
    combined element-wise first, so that one cross-thread reduction remains."""
    m = jnp.abs(ys[0])
    for y in ys[1:]:
        m = jnp.maximum(m, jnp.abs(y))
    return jnp.max(m, axis=0)


def _recip(d, sc, spec):
    """quant.scaled_reciprocal of stored norms d (f32 [G]) and their prescales sc with the
    kernel's division: r, x / d ~= (x sc) * r. 16-bit norms take ``_newton_rcp`` (d sc is
    a normal float of at most 11 significant bits with a normal reciprocal): no ``div.rn``
    with its slow path and call, which pinned registers."""
    gpu_exact = not spec.interpret and spec.tuning.exact_division
    if gpu_exact and _short(spec.cfg.norm_jnp_dtype):
        return quant.scaled_reciprocal(d, sc, div=lambda a, b: _newton_rcp(b))
    return quant.scaled_reciprocal(d, sc, div=lambda a, b: _div(a, b, spec))


def _row_sumsq(ys, sc, spec):
    """(sum((y s)^2) per token over the [W, G] key chunks ys, the chunks y s), s = ``sc``
    [G] (the power of two of ``quant.pow2_prescale``) or None (s = 1: the kernel's direct
    path); the chunks' squares summed element-wise first, in chunk order. The reference's
    norm is sqrt(sum) / s, and its keys over the norm (y s) * ``_recip``, so the scaled
    chunks serve both. On the GPU each square is added by one ``fma.rn`` (JAX's Triton
    does not contract a multiply and an add by itself): the sum may differ from the
    reference's in its last bit, as the reduction order already lets it."""
    acc, zs = None, []
    for y in ys:
        z = y if sc is None else y * sc[None, :]
        zs.append(z)
        if acc is None:
            acc = z * z
        elif spec.interpret:
            acc = acc + z * z
        else:
            (acc,) = plgpu.elementwise_inline_asm(
                "fma.rn.f32 $0, $1, $1, $2;", args=[z, acc], constraints="=f,f,f", pack=1,
                result_shape_dtypes=[jax.ShapeDtypeStruct(z.shape, jnp.float32)],
            )  # fmt: skip
    return jnp.sum(acc, axis=0), zs
