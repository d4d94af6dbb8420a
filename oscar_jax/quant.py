"""Asymmetric min/max group quantization and dense bit packing into uint8.

Quantization (round to nearest, per group of G elements along ``axis``)::

    scale = (max - min) / (2^b - 1),   zero = min          (stored in param dtype)
    q     = clamp(round((x - zero) / scale), 0, 2^b - 1)   (uses the *stored* scale/zero)
    x_hat = q * scale + zero

A constant group has scale 0: its codes are 0 and ``x_hat == zero == x``; no
NaN or Inf. The error of every element is at most scale/2 plus the rounding of
scale and zero to their dtype.

Packing layout ("planar"): a run of n codes along ``axis`` becomes n * b / 8
bytes. For b in {1, 2, 4, 8}, with c = 8 / b codes per byte and P = n / c,
byte j holds code[j + i * P] in bits [i*b, (i+1)*b) for i = 0..c-1. So
unpacking plane i of a byte vector yields the contiguous slice
``code[i*P:(i+1)*P]``: a decode kernel never has to interleave. For b = 3 the
low two bits are packed as a 2-bit planar array and the high bit as a 1-bit
planar array, concatenated: n/4 + n/8 = 3n/8 bytes (dense).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, UInt8

from oscar_jax.eager import compiled


def packed_size(n: int, bits: int) -> int:
    """Bytes that n codes of ``bits`` bits take along the packed axis."""
    if n % pack_divisor(bits):
        raise ValueError(f"{n=} must be a multiple of {pack_divisor(bits)} to pack {bits=}")
    return n * bits // 8


def pack_divisor(bits: int) -> int:
    """n must be a multiple of this to pack n codes of ``bits`` bits."""
    if bits not in (1, 2, 3, 4, 8):
        raise ValueError(f"{bits=} must be one of (1, 2, 3, 4, 8)")
    return 8 if bits in (1, 3) else 8 // bits


def _pack_pow2(codes: Array, bits: int) -> Array:
    c = 8 // bits
    n = codes.shape[-1]
    planes = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], c, n // c)
    out = jnp.zeros(planes.shape[:-2] + (n // c,), jnp.uint8)
    for i in range(c):
        out = out | (planes[..., i, :] << jnp.uint8(i * bits))
    return out


def _unpack_pow2(packed: Array, bits: int) -> Array:
    c = 8 // bits
    mask = jnp.uint8((1 << bits) - 1)
    planes = [(packed >> jnp.uint8(i * bits)) & mask for i in range(c)]
    return jnp.concatenate(planes, axis=-1)


@compiled(arrays=("codes",))
def pack(codes: UInt8[Array, "... n"], bits: int, axis: int = -1) -> UInt8[Array, "... m"]:
    """Pack integer codes in [0, 2^bits) along ``axis`` into uint8 (planar layout)."""
    codes = jnp.moveaxis(codes, axis, -1)
    packed_size(codes.shape[-1], bits)
    if bits == 8:
        out = codes.astype(jnp.uint8)
    elif bits == 3:
        c = codes.astype(jnp.uint8)
        out = jnp.concatenate([_pack_pow2(c & 3, 2), _pack_pow2(c >> 2, 1)], axis=-1)
    else:
        out = _pack_pow2(codes, bits)
    return jnp.moveaxis(out, -1, axis)


@compiled(arrays=("packed",))
def unpack(packed: UInt8[Array, "... m"], bits: int, axis: int = -1) -> UInt8[Array, "... n"]:
    """Exact inverse of ``pack``."""
    packed = jnp.moveaxis(packed, axis, -1)
    if bits == 8:
        out = packed
    elif bits == 3:
        m = packed.shape[-1]
        if m % 3:
            raise ValueError(f"packed length {m} must be a multiple of 3 for bits=3")
        lo, hi = packed[..., : 2 * m // 3], packed[..., 2 * m // 3 :]
        out = _unpack_pow2(lo, 2) | (_unpack_pow2(hi, 1) << jnp.uint8(2))
    elif bits in (1, 2, 4):
        out = _unpack_pow2(packed, bits)
    else:
        raise ValueError(f"{bits=} must be one of (1, 2, 3, 4, 8)")
    return jnp.moveaxis(out, -1, axis)


def round_to_dtype(x: Array, dtype) -> Array:
    """x rounded to ``dtype``'s precision, kept in float32.

    ``astype(bf16).astype(f32)`` is not enough: XLA's default excess-precision
    rule may drop the round trip inside a fused jit program, so codes computed
    from "stored" scales would differ between programs. ``reduce_precision`` is
    kept, so every compilation computes codes from the values actually stored.
    float16 subnormals are rounded as the cast rounds them (reduce_precision flushes
    them); bfloat16's lie in float32's subnormal range, which XLA on CPU flushes anyway.
    """
    dtype = jnp.dtype(dtype)
    x = x.astype(jnp.float32)
    if dtype == jnp.float32:
        return x
    if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        fi = jnp.finfo(dtype)
        out = jax.lax.reduce_precision(x, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
        if dtype == jnp.dtype(jnp.float16):
            # reduce_precision flushes float16's subnormals (|x| < 2^-14) to zero, while the
            # cast that stores the value keeps them: a scale of 1e-5 became 0 and collapsed
            # its group. Round to the subnormal grid (multiples of 2^-24) instead, exactly
            # as the cast does (the scaling by 2^24 is exact, round is half to even).
            step = float(fi.smallest_subnormal)
            sub = jnp.round(x * (1.0 / step)) * step
            out = jnp.where(jnp.abs(x) < float(fi.smallest_normal), sub, out)
        return out
    return x.astype(dtype).astype(jnp.float32)  # fp8 formats: saturating rules of their own


def scaled_reciprocal(d: Array, s: Array, div=jnp.divide) -> Array:
    """r = 1 / (d s) (float32; 0 where d s is 0, inf or NaN), so that x / d ~= (x s) * r.

    ``d`` is a stored token norm and ``s`` the power of two of ``pow2_prescale`` of the
    max |x| it was computed from (``codec.token_norm_and_prescale``). Then d s lies in
    [2**-23, 129 sqrt(n)] for a norm over n elements (m s is in [1, 4) for a normal m
    below 2**122, [2, 128) above, >= 2**-23 for a subnormal one), so r is a normal
    float32 for every finite non-zero d, with no range cases: both scalings by s are
    exact, and (x s) r rounds as x * (1 / d) where 1 / d is normal. The encoders (XLA
    and the Pallas kernel) divide key tiles this way, one division per token instead of
    one per element; the kernel's x s is the one its norm's sum of squares already
    takes. ``div`` is the division to use (the kernel passes its IEEE ``div.rn`` or, for
    16-bit norms, a Newton reciprocal).
    """
    ds = d.astype(jnp.float32) * s
    ok = (ds > 0) & (ds < jnp.inf)
    return jnp.where(ok, div(jnp.ones_like(ds), jnp.where(ok, ds, 1.0)), 0.0)


# Token norms' prescale s >= 2**-121 (their bits depend on it only for max |x| >= 2**122).
NORM_MAX_EXPONENT = 121


def pow2_prescale(m: Array, max_exponent: int = 126) -> tuple[Array, Array]:
    """(s, 1 / s) for m > 0 (float32): s = 2**-e with e = floor(log2 m) clamped to
    [-126, max_exponent], so x * s (|x| <= m) lies in (-4, 4) for max_exponent = 126 (in
    (-2**(128 - max_exponent), ..) in general) and both scalings are exact. Read from
    m's exponent bits: no division, the same bits on every backend (the Pallas encoder
    calls this too); a subnormal m takes e = -126. Token norms take ``NORM_MAX_EXPONENT``
    (set when the Pallas encoder multiplied a key by s and a Hadamard's 1 / sqrt(b) at
    once, which needed s / sqrt(b) normal)."""
    if not -126 <= max_exponent <= 126:
        raise ValueError(f"{max_exponent=} must be in [-126, 126]")
    bits = jax.lax.bitcast_convert_type(m.astype(jnp.float32), jnp.int32)
    e = jnp.clip((bits >> 23) & 0xFF, 1, 127 + max_exponent)  # biased exponent
    s = jax.lax.bitcast_convert_type((254 - e) << 23, jnp.float32)  # 2^(127 - e)
    return s, jax.lax.bitcast_convert_type(e << 23, jnp.float32)  # 2^(e - 127)


@compiled(arrays=("x",))
def quantize_groups(
    x: Float[Array, "..."],
    bits: int,
    group_size: int,
    axis: int,
    param_dtype,
) -> tuple[UInt8[Array, "..."], Array, Array]:
    """Min/max quantize x in groups of ``group_size`` consecutive elements along ``axis``.

    Returns (codes, scale, zero): codes uint8 with x's shape (unpacked); scale and
    zero with ``axis`` shrunk to n / group_size, in ``param_dtype``.
    """
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % group_size:
        raise ValueError(f"axis length {n} must be a multiple of {group_size=}")
    xf = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    xg = xf.reshape(*xf.shape[:-1], n // group_size, group_size)
    levels = (1 << bits) - 1
    mn = jnp.min(xg, axis=-1)
    mx = jnp.max(xg, axis=-1)
    s32 = round_to_dtype((mx - mn) / levels, param_dtype)
    z32 = round_to_dtype(mn, param_dtype)
    scale, zero = s32.astype(param_dtype), z32.astype(param_dtype)
    s32, z32 = s32[..., None], z32[..., None]
    inv = jnp.where(s32 > 0, 1.0 / jnp.where(s32 > 0, s32, 1.0), 0.0)
    q = jnp.clip(jnp.round((xg - z32) * inv), 0, levels)
    q = jnp.where(jnp.isfinite(q), q, 0).astype(jnp.uint8).reshape(xf.shape)
    return (
        jnp.moveaxis(q, -1, axis),
        jnp.moveaxis(scale, -1, axis),
        jnp.moveaxis(zero, -1, axis),
    )


@compiled(arrays=("codes", "scale", "zero"))
def dequantize_groups(
    codes: UInt8[Array, "..."], scale: Array, zero: Array, group_size: int, axis: int
) -> Float[Array, "..."]:
    """x_hat = codes * scale + zero, broadcasting each group's scale over its elements (f32)."""
    axis = axis % codes.ndim
    s = jnp.repeat(scale.astype(jnp.float32), group_size, axis=axis)
    z = jnp.repeat(zero.astype(jnp.float32), group_size, axis=axis)
    return codes.astype(jnp.float32) * s + z
