"""The rotation of the fused encoder: Kronecker-factored Hadamard on tensor cores.

H_D = H_(D/W) (x) H_W (Sylvester order): each [G, W] chunk of a tile is multiplied by its
[W, W] factor (the chunk's random signs folded in) on the tensor cores, then butterflies
(the fast Walsh-Hadamard transform) combine the D/W chunks. Only [W, W] factors are
live in registers, not the [D, D] matrix (dots with [D, W] column blocks of the dense
matrix keep it all live: more registers a thread, fewer programs an SM, a slower
encoder). Factors are exact +-1 entries in the input's dtype (bf16/f16 dot, f32
accumulation: products are exact), scaled by 1/sqrt(b) in f32 as ``hadamard.fwht``
does; f32 inputs are split into three bf16 parts, so the rotation keeps f32 accuracy.
``random_orthogonal`` uses a dense f32 matrix and IEEE f32 dots. ``spec`` is
``triton._Spec`` (duck-typed: cfg, d, w, in_dtype, rot_scale).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from oscar_jax import hadamard


def rotation_operand(spec) -> np.ndarray:
    """What ``rotated_chunks`` multiplies by: dense f32 M (rotate(x) = x @ M) for
    ``random_orthogonal``; else the exact +-1 first column block of the (signed)
    Hadamard matrix, [D, W] (rows a*W..(a+1)*W are chunk a's [W, W] factor F_a), then the
    transposed factors F_a^T, the A operands of the transposed (key) tiles: [2D, W]."""
    if spec.rot_scale is None:
        return hadamard.rotation_matrix(spec.cfg, spec.d).T.astype(np.float32)
    block = hadamard.kronecker_factor(spec.cfg, spec.d, spec.w)
    if block is None:
        raise NotImplementedError("rotation is not a Kronecker product H_(D/W) x [W, W]")
    dt = jnp.float16 if spec.in_dtype == "float16" else jnp.bfloat16
    d, w = spec.d, spec.w
    block_t = block.reshape(d // w, w, w).transpose(0, 2, 1).reshape(d, w)
    return np.concatenate([block, block_t]).astype(dt)


def butterflies(zs: list) -> list:
    """Unnormalised Sylvester H_n across a list of n equal-shaped chunks (fast WHT)."""
    zs, n, step = list(zs), len(zs), 1
    while step < n:
        for i in range(0, n, 2 * step):
            for j in range(i, i + step):
                zs[j], zs[j + step] = zs[j] + zs[j + step], zs[j] - zs[j + step]
        step *= 2
    return zs


def rotated_chunks(ref, mat_ref, b, h, t0, rotate: bool, spec, transpose: bool = False):
    """The G x D tile of head h, rotated, as D/W f32 chunks of W channels each: [G, W],
    or with ``transpose`` [W, G] (the dots then compute F^T X^T, F^T read from the
    operand's second half).

    Hadamard rotations use H_D = H_(D/W) (x) H_W: one [G, W] x [W, W] tensor-core dot
    per chunk (with the chunk's signs folded into its factor), then butterflies across
    the chunks. Only [W, W] factors are live, not the [D, D] matrix.
    """
    g, w, d = spec.cfg.group_size, spec.w, spec.d
    rows = pl.ds(t0, g)

    def mm(x, m, **kw):  # x @ m, or (x @ m)^T = m^T x^T with m given as m^T
        return plgpu.dot(m, x, trans_b=True, **kw) if transpose else plgpu.dot(x, m, **kw)

    if not rotate:
        xs = [ref[b, h, rows, pl.ds(k * w, w)].astype(jnp.float32) for k in range(d // w)]
        return [x.T for x in xs] if transpose else xs
    if spec.rot_scale is None:  # random_orthogonal: dense f32 matrix, IEEE f32 dots
        x = ref[b, h, rows, :].astype(jnp.float32)
        prec = jax.lax.Precision.HIGHEST
        cols = [mat_ref[:, pl.ds(k * w, w)] for k in range(d // w)]
        return [mm(x, c.T if transpose else c, precision=prec) for c in cols]
    signed = spec.cfg.rotation != "hadamard"  # plain Hadamard: every chunk's factor is H_W
    zs, m = [], None
    for k in range(d // w):
        x = ref[b, h, rows, pl.ds(k * w, w)]
        if spec.in_dtype in ("bfloat16", "float16"):
            parts = [x]
        else:  # f32 = hi + mid + lo, each bf16: exact products with the +-1 factor
            x = x.astype(jnp.float32)
            hi = x.astype(jnp.bfloat16)
            r = x - hi.astype(jnp.float32)
            mid = r.astype(jnp.bfloat16)
            lo = (r - mid.astype(jnp.float32)).astype(jnp.bfloat16)
            parts = [hi, mid, lo]
        if m is None or signed:
            m = mat_ref[pl.ds(k * w + (d if transpose else 0), w), :]
        acc = mm(parts[0], m)
        for part in parts[1:]:
            acc = acc + mm(part, m)
        zs.append(acc)
    zs = butterflies(zs)
    return [z * spec.rot_scale for z in zs]
