"""Exhaustive GPU checks of the quantize kernel's divisions without ``div.rn``.

The fused encoder (``pallas_kernels.quantize.numerics``) divides a group's range by
``levels`` (3 at 2 bits, 15 at 4 bits) with Markstein's correction step
(``markstein_div_asm``) and inverts float16 scales with one Newton step from
``rcp.approx`` (``newton_rcp_asm``), both instead of ``div.rn.f32``. This script
compares them with ``div.rn.f32`` bit for bit in Pallas kernels: the level division for
every non-negative float32 (all 2^31 bit patterns with the sign bit clear: zeros,
subnormals, normals, inf and NaNs; NaN against NaN counts as equal), the reciprocal for
every positive finite float16 (the scales it is used on) and every bfloat16 in
[2^-100, 2^124) (which holds every stored 16-bit norm times its power-of-two prescale,
the divisor of ``quant.scaled_reciprocal``: [2^-23, 2^7 sqrt(n)]), and prints the
mismatches.
Needs a GPU::

    python3 -m benchmarks.check_division [--what levels|rcp|all]
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.quantize.numerics import markstein_div_asm, newton_rcp_asm, ptx_f32

BLOCK = 1 << 16  # bit patterns per program


def _kernel(o_ref, *, levels: int, base: int):
    bits = (base + pl.program_id(0) * BLOCK) + jax.lax.broadcasted_iota(jnp.int32, (BLOCK,), 0)
    a = jax.lax.bitcast_convert_type(bits, jnp.float32)
    f32 = jax.ShapeDtypeStruct((BLOCK,), jnp.float32)
    (got,) = plgpu.elementwise_inline_asm(
        markstein_div_asm(levels), args=[a], constraints="=f,f", pack=1, result_shape_dtypes=[f32]
    )
    (want,) = plgpu.elementwise_inline_asm(
        f"div.rn.f32 $0, $1, {ptx_f32(levels)};",
        args=[a], constraints="=f,f", pack=1, result_shape_dtypes=[f32],
    )  # fmt: skip
    same = (jax.lax.bitcast_convert_type(got, jnp.int32) == jax.lax.bitcast_convert_type(
        want, jnp.int32)) | ((got != got) & (want != want))  # fmt: skip
    o_ref[0] = jnp.sum(jnp.where(same, 0, 1))


@functools.partial(jax.jit, static_argnames=("levels", "base", "programs"))
def mismatches(levels: int, base: int, programs: int):
    """Mismatch count per program over bit patterns base .. base + programs * BLOCK."""
    return pl.pallas_call(
        functools.partial(_kernel, levels=levels, base=base),
        grid=(programs,),
        out_specs=pl.BlockSpec((1,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((programs,), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="check_division",
    )()


def float16s():
    h = jnp.arange(1, 0x7C00, dtype=jnp.uint16)  # +subnormals .. 65504; not 0, inf, NaN
    return jax.lax.bitcast_convert_type(h, jnp.float16).astype(jnp.float32)


def prescaled_bfloat16s():
    lo, hi = (127 - 100) << 7, (127 + 124) << 7  # bit patterns of 2^-100 and 2^124
    h = jnp.arange(lo, hi, dtype=jnp.uint16)
    return jax.lax.bitcast_convert_type(h, jnp.bfloat16).astype(jnp.float32)


def rcp_mismatches(x) -> tuple[int, int]:
    """(mismatches, values): ``newton_rcp_asm`` against ``div.rn.f32`` of 1 by x for every
    value of x (float32)."""
    n = x.size

    def kernel(x_ref, o_ref):
        a = x_ref[...]
        f32 = jax.ShapeDtypeStruct(a.shape, jnp.float32)
        (got,) = plgpu.elementwise_inline_asm(
            newton_rcp_asm(), args=[a], constraints="=f,f", pack=1, result_shape_dtypes=[f32]
        )
        (want,) = plgpu.elementwise_inline_asm(
            "div.rn.f32 $0, 0f3F800000, $1;", args=[a], constraints="=f,f", pack=1,
            result_shape_dtypes=[f32],
        )  # fmt: skip
        same = jax.lax.bitcast_convert_type(got, jnp.int32) == jax.lax.bitcast_convert_type(
            want, jnp.int32
        )
        o_ref[...] = jnp.where(same, 0, 1)

    pad = -n % 1024
    xp = jnp.concatenate([x, jnp.ones((pad,), jnp.float32)])
    out = pl.pallas_call(
        kernel,
        grid=(xp.size // 1024,),
        in_specs=[pl.BlockSpec((1024,), lambda i: (i,))],
        out_specs=pl.BlockSpec((1024,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct(xp.shape, jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="check_reciprocal",
    )(xp)
    return int(jnp.sum(out[:n])), n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", choices=("levels", "rcp", "all"), default="all")
    what = ap.parse_args().what
    if jax.devices()[0].platform != "gpu":
        print("needs a GPU")
        return 2
    bad = 0
    if what in ("rcp", "all"):
        n, total = rcp_mismatches(float16s())
        print(f"float16 reciprocals: {n} mismatches of {total} positive finite float16")
        bad += n
        n, total = rcp_mismatches(prescaled_bfloat16s())
        print(f"bfloat16 reciprocals: {n} mismatches of {total} bfloat16 in [2^-100, 2^124)")
        bad += n
    if what == "rcp":
        return 1 if bad else 0
    chunk = 1 << 14  # programs per call: 2^30 bit patterns
    for levels in (3, 15):
        n = 0
        for base in (0, chunk * BLOCK):  # 0 .. 2^31 - 1: every pattern with sign bit 0
            n += int(jnp.sum(mismatches(levels, base, chunk)))
        print(f"levels {levels}: {n} mismatches of {2 * chunk * BLOCK} non-negative float32")
        bad += n
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
