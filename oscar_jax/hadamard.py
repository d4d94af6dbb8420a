"""Channel rotations over the last axis: fast Walsh-Hadamard and ablations.

``fwht`` is the orthonormal Walsh-Hadamard transform in O(d log d) (log2(d)
butterfly stages, no d x d matmul). For a head size that is not a power of two
(80, 96, 192, ...) the rotation is block-diagonal: ``d`` is cut into equal
blocks of the largest power of two that divides it (96 -> 3 blocks of 32,
192 -> 3 blocks of 64), each transformed on its own. The normalised
Walsh-Hadamard matrix is symmetric and its own inverse, so the same call
rotates and un-rotates.

Ablations: ``randomized_hadamard`` (H diag(s), random signs s) and
``random_orthogonal`` (Q of a seeded Gaussian's QR). Their matrices are built
with numpy at trace time, so they are static constants of the config.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from oscar_jax.config import KVQuantConfig
from oscar_jax.eager import compiled


def hadamard_block_size(d: int) -> int:
    """Largest power of two dividing ``d``: the block of the block-diagonal Hadamard."""
    if d < 1:
        raise ValueError(f"{d=} must be positive")
    return d & -d


@compiled(arrays=("x",))
def fwht(x: Float[Array, "... d"]) -> Float[Array, "... d"]:
    """Orthonormal (block-diagonal) fast Walsh-Hadamard transform of the last axis.

    Computed in float32 at least; returns x's dtype.
    """
    d = x.shape[-1]
    b = hadamard_block_size(d)
    dtype = x.dtype
    y = x.astype(jnp.promote_types(dtype, jnp.float32))
    lead = y.shape[:-1]
    y = y.reshape(*lead, d // b, b)
    h = 1
    while h < b:
        y = y.reshape(*lead, d // b, b // (2 * h), 2, h)
        a, c = y[..., 0, :], y[..., 1, :]
        y = jnp.stack([a + c, a - c], axis=-2)
        h *= 2
    y = y.reshape(*lead, d) * (1.0 / np.sqrt(b))
    return y.astype(dtype)


def hadamard_matrix(d: int) -> np.ndarray:
    """The dense (block-diagonal) orthonormal Hadamard matrix, float64, for tests and kernels."""
    b = hadamard_block_size(d)
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    h = h / np.sqrt(b)
    return np.kron(np.eye(d // b), h)


@functools.lru_cache(maxsize=64)
def _random_signs(d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).choice([-1.0, 1.0], size=d)


@functools.lru_cache(maxsize=64)
def _random_orthogonal(d: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed).standard_normal((d, d))
    q, r = np.linalg.qr(g)
    return q * np.sign(np.diag(r))[None, :]  # Haar-distributed, deterministic


def rotation_matrix(cfg: KVQuantConfig, d: int) -> np.ndarray:
    """The d x d orthogonal matrix R of the config: ``rotate(x) = x @ R.T`` (float64)."""
    if cfg.rotation == "hadamard":
        return hadamard_matrix(d)
    if cfg.rotation == "randomized_hadamard":
        return hadamard_matrix(d) * _random_signs(d, cfg.rotation_seed)[None, :]
    if cfg.rotation == "random_orthogonal":
        return _random_orthogonal(d, cfg.rotation_seed)
    return np.eye(d)


def sylvester(n: int) -> np.ndarray:
    """The unnormalised n x n Sylvester Hadamard matrix (n a power of two)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def kronecker_factor(cfg: KVQuantConfig, d: int, w: int) -> np.ndarray | None:
    """The +-1 factors of R = H_(d/w) (x) [w, w] blocks, for kernels that rotate chunks.

    Returns F [d, w]: rows a*w..(a+1)*w are chunk a's factor F_a (its random signs folded
    in), so that for x split in d/w chunks x_a, ``rotate(x)`` chunk b is
    ``sum_a H[a, b] (x_a @ F_a) / sqrt(d)`` (butterflies over the chunks of x_a @ F_a) and
    ``unrotate(y)`` chunk a is ``butterflies(y)_a @ F_a.T / sqrt(d)``. None where R has no
    such form (``random_orthogonal``, ``none``, a block-diagonal Hadamard).
    """
    if cfg.rotation not in ("hadamard", "randomized_hadamard") or hadamard_block_size(d) != d:
        return None
    if w & (w - 1) or not 1 <= w <= d:
        raise ValueError(f"{w=} must be a power of two <= {d=}")
    pm = np.round(rotation_matrix(cfg, d).T * np.sqrt(d))  # rotate(x) = x @ pm / sqrt(d)
    block = pm[:, :w]
    n = d // w
    if not np.array_equal(pm, np.kron(sylvester(n), np.ones((w, w))) * np.tile(block, (1, n))):
        raise AssertionError("internal: a Hadamard rotation without Kronecker form")
    return block


# The default of ``dense`` for callers that do not choose (the encoders): False keeps
# the butterflies, elementwise and so bit-identical whatever the batch. Benchmarks
# set it to time the XLA encoder with a matmul rotation.
DENSE_DEFAULT = False


def fwht_signs(cfg: KVQuantConfig, d: int) -> np.ndarray | None:
    """The signs s [d] (+-1.0) with R x = fwht(s * x) over a whole head of ``d`` channels
    (all ones for ``hadamard``), or None where the config's R is not one Walsh-Hadamard
    transform of the head (no rotation, random orthogonal, or a block-diagonal Hadamard
    of a ``d`` that is not a power of two): kernels that rotate the query themselves."""
    if hadamard_block_size(d) != d:
        return None
    if cfg.rotation == "hadamard":
        return np.ones(d)
    if cfg.rotation == "randomized_hadamard":
        return _random_signs(d, cfg.rotation_seed).copy()
    return None


def _apply(x: Array, cfg: KVQuantConfig, inverse: bool, dense: bool | None) -> Array:
    """R x (or R^T x when inverse) over the last axis, in f32, returned in x's dtype."""
    d = x.shape[-1]
    if cfg.rotation == "none":
        return x
    dense = DENSE_DEFAULT if dense is None else dense
    if cfg.rotation == "hadamard" and not dense:  # symmetric and its own inverse
        return fwht(x)
    xf = x.astype(jnp.float32)
    if cfg.rotation == "randomized_hadamard" and not dense:  # R = H diag(s), R^T = diag(s) H
        signs = jnp.asarray(_random_signs(d, cfg.rotation_seed), jnp.float32)
        y = fwht(xf) * signs if inverse else fwht(xf * signs)
        return y.astype(x.dtype)
    r = jnp.asarray(rotation_matrix(cfg, d), jnp.float32)
    spec = "...e,ed->...d" if inverse else "...d,ed->...e"
    return jnp.einsum(spec, xf, r, precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


@compiled(arrays=("x",))
def rotate(
    x: Float[Array, "... d"], cfg: KVQuantConfig, *, dense: bool | None = None
) -> Float[Array, "... d"]:
    """Apply the config's rotation R to the last axis (returns x's dtype, computed in f32).

    ``dense=True`` takes one [d, d] matmul instead of the butterflies: for a few rows
    (a decode query) XLA fuses the butterfly stages into one loop that re-reads every
    input per output (on the H200 ~30 us for one query of 8 KV heads x 16 rows, where
    the GEMM takes ~2 us).
    """
    return _apply(x, cfg, inverse=False, dense=dense)


@compiled(arrays=("y",))
def unrotate(
    y: Float[Array, "... d"], cfg: KVQuantConfig, *, dense: bool | None = None
) -> Float[Array, "... d"]:
    """Apply R^T (the inverse rotation) to the last axis (``dense`` as in ``rotate``)."""
    return _apply(y, cfg, inverse=True, dense=dense)
