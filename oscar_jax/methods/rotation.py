"""Proposal B: OScaR with a rotation fitted offline per layer and KV head.

``pca_hadamard`` (``oscarp``): the keys' second-moment matrix ``C = E[k k^T]`` on
calibration windows (post-RoPE, the k bias's RoPE'd part taken out as in
``bias_offset``), its eigenvectors ``V`` (PCA basis), and ``R = H V^T``: project on the
principal directions, then mix them evenly with the Walsh-Hadamard matrix, so that every
rotated channel has the same second moment ``tr(C) / D`` (exactly, for any ``C``:
``(R C R^T)_jj = sum_i H_ji^2 lambda_i``). ``random_orthogonal`` (``oscaro``): a seeded
Haar-random orthogonal matrix per layer and head, the control. Hadamard itself is
``oscarb`` (``oscar`` without a k bias).

Then OScaR as ``oscarb``: per-token norm of the rotated key, per-channel INT-b over G
tokens, values as OScaR's. Bytes per token: OScaR's (50 at D = 64); the matrices are
model constants (D^2 per KV head per layer), not cache. A decode kernel would apply a
dense D x D rotation to q and k instead of the fast transform (the same cost at D <= 128
on a tensor core).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from oscar_jax.methods import base
from oscar_jax.methods.bias_offset import OscarBias

ROTATIONS = ("pca_hadamard", "random_orthogonal")


def hadamard_matrix(d: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix of size d (a power of two), float64."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"d={d} must be a power of two")
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


def pca_hadamard(x: np.ndarray) -> np.ndarray:
    """R = H V^T for samples x [N, D]: V the eigenvectors of the second moment x^T x / N
    (descending eigenvalues). Orthogonal, float64."""
    x = np.asarray(x, np.float64)
    c = x.T @ x / len(x)
    w, vec = np.linalg.eigh(c)
    vec = vec[:, np.argsort(w)[::-1]]
    return hadamard_matrix(x.shape[1]) @ vec.T


def random_orthogonal(d: int, rng: np.random.Generator) -> np.ndarray:
    """A Haar-random orthogonal matrix (QR of a Gaussian, signs fixed), float64."""
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return q * np.sign(np.diag(r))


@dataclasses.dataclass(frozen=True)
class OscarRotation(OscarBias):
    """OScaR (with the k-bias offset) under a per-layer, per-KV-head fitted rotation."""

    rotation: str = "pca_hadamard"
    seed: int = 0

    needs_calibration = True

    def __post_init__(self):
        super().__post_init__()
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation={self.rotation!r} must be one of {ROTATIONS}")
        base._int("seed", self.seed, 0)

    def fake_quant_kv(
        self,
        k: Float[Array, "B H T D"],
        v: Float[Array, "B H T D"],
        key_offset: Float[Array, "T H D"] | None = None,
        *,
        state: dict | None = None,
    ):
        base.check_kv(k, v, 8, self.group_size)
        st = self.calibrated_state() if state is None else state
        rot = jnp.asarray(st["rotation"], jnp.float32)  # [H, D, D]
        if rot.shape != (k.shape[1], k.shape[3], k.shape[3]):
            raise ValueError(f"rotation.shape={rot.shape} must be [H, D, D] of k {k.shape}")
        cfg = self.base("oscar")
        off = None
        if key_offset is not None:
            off = jnp.swapaxes(key_offset.astype(jnp.float32), 0, 1)[None]  # [1, H, T, D]
        kh = base.oscar_keys_fake_quant(k, cfg, off, rotation=rot)
        return kh, base.values_fake_quant(v, cfg)

    def fit(self, k, v, rope, key_offset=None) -> OscarRotation:
        """``rotation`` [L, H, D, D] from the calibration keys [L, N, H, T, D] minus the
        k bias's RoPE'd part [L, T, H, D] (when given)."""
        k = np.asarray(k, np.float64)
        n_l, _, n_h, _, d = k.shape
        rng = np.random.default_rng(self.seed)
        mats = np.zeros((n_l, n_h, d, d))
        for li in range(n_l):
            x = k[li]
            if key_offset is not None:
                x = x - np.swapaxes(np.asarray(key_offset[li], np.float64), 0, 1)[None]
            for h in range(n_h):
                if self.rotation == "pca_hadamard":
                    mats[li, h] = pca_hadamard(x[:, h].reshape(-1, d))
                else:
                    mats[li, h] = random_orthogonal(d, rng)
        return self.replace(calibration=base.Calibration(rotation=mats))
