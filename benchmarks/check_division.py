"""Exhaustive GPU check of the quantize kernel's division by the level count.

The fused encoder (``pallas_kernels.quantize_numerics``) divides a group's range by
``levels`` (3 at 2 bits, 15 at 4 bits) with Markstein's correction step
(``markstein_div_asm``) instead of ``div.rn.f32``.
This script compares the two bit for bit for every non-negative float32 (all 2^31 bit
patterns with the sign bit clear: zeros, subnormals, normals, inf and NaNs) in a Pallas
kernel and prints the number of mismatches per level count (NaN against NaN counts as
equal). Needs a GPU::

    PYTHONPATH=. python3 benchmarks/check_division.py
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.quantize_numerics import markstein_div_asm, ptx_f32

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


def main() -> int:
    if jax.devices()[0].platform != "gpu":
        print("needs a GPU")
        return 2
    chunk = 1 << 14  # programs per call: 2^30 bit patterns
    bad = 0
    for levels in (3, 15):
        n = 0
        for base in (0, chunk * BLOCK):  # 0 .. 2^31 - 1: every pattern with sign bit 0
            n += int(jnp.sum(mismatches(levels, base, chunk)))
        print(f"levels {levels}: {n} mismatches of {2 * chunk * BLOCK} non-negative float32")
        bad += n
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
