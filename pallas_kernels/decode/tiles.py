"""Tile helpers of the INT decode kernel (``int_kernel``): dequantization by bit pattern,
the Hadamard rotation of rows by its Kronecker factors, float32-accurate dots of 16-bit
operands, exact power-of-two row scaling, 16-bit halves of packed words.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from oscar_jax import quant
from pallas_kernels.quantize.rotation import butterflies


def split_dot(x, y, dims, half):
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
    x_hi, x_lo = hi_lo(x, half)
    out = jax.lax.dot_general(x_hi, y, dims, preferred_element_type=f32)
    return out + jax.lax.dot_general(x_lo, y, dims, preferred_element_type=f32)


def hi_lo(x, half):
    """float32 x -> (hi, lo) in the 16-bit ``half`` with hi + lo = x to ~2^-16 relative."""
    hi = x.astype(half)
    return hi, (x - hi.astype(jnp.float32)).astype(half)


def kron_rotate(xs, f_ref, inverse: bool, split: bool):
    """Rotate (``inverse``: un-rotate) rows given as their D / W chunks ``xs`` ([R, W]
    f32 each) by the Hadamard rotation's Kronecker factors ``f_ref`` [D, W] (float16
    +-1, ``hadamard.kronecker_factor``): butterflies across the chunks and one [R, W] x
    [W, W] tensor-core dot per chunk, f32 accumulation. The chunks are scaled by
    1 / sqrt(D) first, so the 16-bit operands stay in range wherever the chunks and the
    result do. ``split``: operands as bfloat16 hi + lo halves (two dots, ~2^-16
    relative, any f32 magnitude); else one float16 rounding (2^-11)."""
    w = xs[0].shape[1]
    scale = np.float32(1.0 / np.sqrt(w * len(xs)))
    xs = [x * scale for x in xs]
    dims = (((1,), (1,)), ((), ())) if inverse else (((1,), (0,)), ((), ()))  # x F^T / x F
    if inverse:
        xs = butterflies(xs)
    out = []
    for a, x in enumerate(xs):
        f = f_ref[pl.ds(a * w, w), :]
        if split:
            out.append(split_dot(x, f.astype(jnp.bfloat16), dims, jnp.bfloat16))
        else:
            out.append(jax.lax.dot_general(x.astype(f.dtype), f, dims,
                                           preferred_element_type=jnp.float32))  # fmt: skip
    return out if inverse else butterflies(out)


def pow2_scale(amax):
    """(up, down) f32 powers of two with amax * up in [1, 2) and up * down = 1 exactly (1, 1
    where amax is 0, subnormal or beyond 2^126): scaling by them is exact, so a row can be
    rounded to float16 at full precision however small its values (below float16's normal
    range, 6.1e-5, the rounding would keep fewer bits: 1e-6 values lost 3% of their size).
    ``quant.pow2_prescale`` outside its unclamped range [2^-126, 2^127) replaced by 1."""
    up, down = quant.pow2_prescale(amax)
    ok = (amax >= np.float32(2.0**-126)) & (amax < np.float32(2.0**127))
    return jnp.where(ok, up, 1.0), jnp.where(ok, down, 1.0)


def word_half(word, j, dtype):
    """16-bit half j (0: the low one) of uint32 words as ``dtype``: the pairs that
    ``partials._u32_pairs`` packs (value scales / zeros, token norms)."""
    half = ((word >> (16 * j)) & 0xFFFF).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(half, dtype)


# bit patterns per 16-bit dtype: the float ``base`` (unit spacing in [base, 2 base), so
# or-ing a small code into its mantissa gives ``base + code`` exactly), the fill byte
# (base's exponent byte, repeated), 1.0 and -base as packed pairs, the PTX type
_BITS = {
    jnp.dtype(jnp.bfloat16): (128.0, 0x4300, 0x43434343, 0x3F803F80, 0xC300C300, "bf16x2"),
    jnp.dtype(jnp.float16): (1024.0, 0x6400, 0x64646464, 0x3C003C00, 0xE400E400, "f16x2"),
}


def _dequant_asm(x, bits, dtype, scale, zero):
    """Inline PTX, 4 bytes per instance: per plane one shift, one and, two byte permutes
    that interleave the codes with the fill byte (``base + code``), one packed fma that
    subtracts ``base`` exactly and one ``code * scale + zero``. One asm op per plane:
    Pallas' lowering takes single-result inline asm only.
    """
    from jax.experimental.pallas import triton as plgpu

    _, _, fill, one, neg, ty = _BITS[jnp.dtype(dtype)]
    mask = ((1 << bits) - 1) * 0x01010101
    out = jax.ShapeDtypeStruct(x.shape, dtype)
    planes = []
    for i in range(8 // bits):
        asm = "\n".join([
            "{",
            ".reg .b32 t, one, neg;",
            f"shr.b32 t, $2, {bits * i};",
            f"and.b32 t, t, {mask:#x};",
            f"prmt.b32 $0, t, {fill:#x}, 0x4140;",
            f"prmt.b32 $1, t, {fill:#x}, 0x4342;",
            f"mov.b32 one, {one:#x};",
            f"mov.b32 neg, {neg:#x};",
            f"fma.rn.{ty} $0, $0, one, neg;",
            f"fma.rn.{ty} $1, $1, one, neg;",
            f"fma.rn.{ty} $0, $0, $3, $5;",
            f"fma.rn.{ty} $1, $1, $4, $6;",
            "}",
        ])  # fmt: skip
        (plane,) = plgpu.elementwise_inline_asm(
            asm,
            args=[x, scale[i], zero[i]],
            constraints="=r,=r,r,r,r,r,r",
            pack=4,
            result_shape_dtypes=[out],
        )
        planes.append(plane)
    return planes


def dequant(x, bits, asm, dtype, scale, zero):
    """uint8 code tile -> the 8 / bits planes of ``code * scale + zero`` in ``dtype``.

    16-bit codes become floats by bit pattern (``base + code``, then ``- base``, exact),
    not by a quarter-rate int->float conversion. ``asm``: inline PTX with a fused
    multiply-add (``_dequant_asm``); otherwise the same bit trick in Pallas ops (interpret
    mode). float32 (float32 parameters, off the default path) converts the integers.
    """
    if asm and dtype != jnp.float32:
        return _dequant_asm(x, bits, dtype, scale, zero)
    mask = (1 << bits) - 1
    planes = []
    for i in range(8 // bits):
        plane = (x >> (bits * i)) & mask
        if dtype == jnp.float32:
            code = plane.astype(jnp.int32).astype(jnp.float32)
        else:
            base, pattern = _BITS[jnp.dtype(dtype)][:2]
            b16 = plane.astype(jnp.uint16) | jnp.uint16(pattern)
            code = jax.lax.bitcast_convert_type(b16, dtype) - jnp.asarray(base, dtype)
        planes.append(code * scale[i] + zero[i])
    return planes
