"""Proposal E plus KVQuant's dense-and-sparse outliers (``oscarbo``), fake-quant.

E (``bias_offset``) fixes OScaR on models with a k bias; KVQuant-style (``kvquant``) was
the best method on Qwen2.5 mainly through its ~1% fp16 outliers. This method is E with
those outliers in OScaR's own quantization space:

- **Keys**: ``k_t - RoPE_t(b_k)`` rotated (Hadamard) and divided by its stored l2 norm
  (``base.oscar_keys_scaled``), then per channel over G tokens, with the ``k_outliers``
  entries of each G x D group furthest from their channel's group mean (in group
  standard deviations) kept in fp16 and left out of the group's min / max
  (``kvquant.keys_dense_and_sparse``); back through the norm, the inverse rotation and
  ``+ RoPE_t(b_k)``.
- **Values**: rotated as OScaR's, per token over Gv = min(G, D) channels, with
  ``v_outliers`` fp16 outliers per token (``kvquant.values_dense_and_sparse``).
- **Levels**: uniform over each group's [min, max] (INT-b), or, with ``fitted_levels``
  (name suffix ``_nuq1``), a per-layer 2^b-level k-means codebook for keys and one for
  values on the normalised entries of calibration windows (``kvquant.fit_codebooks``).

Without a k bias (SmolLM2, and Gemma 3 where a k-norm follows the bias slot) it is OScaR
plus outliers. Bytes per token and KV head at D = 64, G = 32, INT2: OScaR's 50 plus
KVQuant's outliers, 20 x (2 + 2) / 32 = 2.5 for keys and 1 x (2 + 1) = 3 for values:
55.5. The k bias and the codebooks are model constants, not cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from oscar_jax import hadamard
from oscar_jax.methods import base, kvquant
from oscar_jax.methods.bias_offset import OscarBias


@dataclasses.dataclass(frozen=True)
class OscarBiasOutliers(OscarBias):
    """``oscarb`` with ``k_outliers`` / ``v_outliers`` fp16 outliers per key group / value
    token in the rotated space; ``fitted_levels``: per-layer k-means codebooks."""

    k_outliers: int = 20
    v_outliers: int = 1
    outlier_dtype: str = "float16"
    fitted_levels: bool = False

    def __post_init__(self):
        super().__post_init__()
        base._int("k_outliers", self.k_outliers, 0)
        base._int("v_outliers", self.v_outliers, 0)
        if self.outlier_dtype not in base.DTYPE_BYTES:
            raise ValueError(f"outlier_dtype={self.outlier_dtype!r} must be in {base.DTYPE_BYTES}")

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.fitted_levels

    def _offset(self, k, key_offset):
        if key_offset is None:
            return None
        t, h, d = k.shape[2], k.shape[1], k.shape[3]
        if key_offset.shape != (t, h, d):
            raise ValueError(f"key_offset.shape={key_offset.shape} must be {(t, h, d)}")
        return jnp.swapaxes(key_offset.astype(jnp.float32), 0, 1)[None]  # [1, H, T, D]

    def _keys(self, u, levels=None):
        """(u01, out, u_hat) of the normed rotated keys [B, H, T, D]."""
        return kvquant.keys_dense_and_sparse(u, self.k_outliers, self.group_size, levels,
                                             self.param_dtype, self.outlier_dtype)  # fmt: skip

    def _values(self, vr, levels=None):
        """(u01, out, v_hat) of the rotated values [B, H, T, D]."""
        gv = min(self.group_size, vr.shape[-1])
        return kvquant.values_dense_and_sparse(vr, self.v_outliers, gv, levels,
                                               self.param_dtype, self.outlier_dtype)  # fmt: skip

    def _levels(self, state):
        if not self.fitted_levels:
            lv = jnp.linspace(0.0, 1.0, 1 << self.bits)
            return lv, lv
        st = self.calibrated_state() if state is None else state
        return (jnp.asarray(st["k_levels"], jnp.float32),
                jnp.asarray(st["v_levels"], jnp.float32))  # fmt: skip

    def fake_quant_kv(
        self,
        k: Float[Array, "B H T D"],
        v: Float[Array, "B H T D"],
        key_offset: Float[Array, "T H D"] | None = None,
        *,
        state: dict | None = None,
    ):
        base.check_kv(k, v, 8, self.group_size)
        cfg = self.base("oscar")
        kl, vl = self._levels(state)
        kh = base.oscar_keys_fake_quant(
            k, cfg, self._offset(k, key_offset), quantize=lambda u: self._keys(u, kl)[2]
        )
        vr = hadamard.rotate(v.astype(jnp.float32), cfg)
        vh = hadamard.unrotate(self._values(vr, vl)[2], cfg)
        return kh, vh

    def fit(self, k, v, rope, key_offset=None) -> OscarBiasOutliers:
        """Per-layer codebooks (``k_levels``, ``v_levels`` [L, 2^b]) by k-means on the
        normalised non-outlier entries of the calibration keys (minus the k bias's RoPE'd
        part [L, T, H, D] when given, rotated, normed) and rotated values."""
        if not self.fitted_levels:
            raise NotImplementedError(f"{self.method} without fitted_levels needs no fit")
        cfg = self.base("oscar")
        keys = jax.jit(lambda x, o: self._keys(base.oscar_keys_scaled(x, cfg, o)[0])[:2])
        values = jax.jit(lambda x: self._values(hadamard.rotate(x, cfg))[:2])

        def layers():
            for li, (kk, vv) in enumerate(zip(np.asarray(k), np.asarray(v), strict=True)):
                t = kk.shape[2] - kk.shape[2] % self.group_size
                off = None if key_offset is None else self._offset(kk[:, :, :t],
                                                                   key_offset[li][:t])  # fmt: skip
                yield keys(kk[:, :, :t], off), values(vv[:, :, :t])

        return self.replace(calibration=kvquant.fit_codebooks(layers(), self.bits))

    def bytes_per_token(self, head_dim: int, context: int = 2048) -> dict[str, float]:
        parts = super().bytes_per_token(head_dim, context)
        parts.pop("total")
        ob = kvquant.outlier_bytes(self.k_outliers, self.v_outliers, self.outlier_dtype,
                                   self.group_size, head_dim)  # fmt: skip
        parts.update(ob)
        return base.total(parts)
