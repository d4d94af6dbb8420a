"""Proposal E, the variant that needs no weights: subtract each key group's per-channel
mean before OScaR's rotation, store it, add it back.

``mu_g = mean_{t in g} k_t`` per channel (stored in ``param_dtype``), then
``k_hat_t = OScaR(k_t - mu_g) + mu_g``. It removes the part of any key offset that is
constant over a group (a k bias in slowly-turning RoPE pairs, massive channels), not the
part RoPE turns within the group; cost: D values per group, 2 D / G bytes per token
(4 B at D = 64, G = 32, fp16).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float

from oscar_jax import quant
from oscar_jax.methods import base


@dataclasses.dataclass(frozen=True)
class OscarGroupMean(base.MethodConfig):
    """OScaR on keys minus their stored per-group, per-channel mean."""

    def fake_quant_kv(
        self,
        k: Float[Array, "B H T D"],
        v: Float[Array, "B H T D"],
        key_offset: Float[Array, "T H D"] | None = None,
    ):
        base.check_kv(k, v, 8, self.group_size)
        cfg = self.base("oscar")
        b, h, t, d = k.shape
        g = self.group_size
        kf = k.astype(jnp.float32)
        mu = jnp.mean(kf.reshape(b, h, t // g, g, d), axis=3, keepdims=True)
        mu = quant.round_to_dtype(mu, self.param_dtype)
        off = jnp.broadcast_to(mu, (b, h, t // g, g, d)).reshape(b, h, t, d)
        return base.oscar_keys_fake_quant(kf, cfg, off), base.values_fake_quant(v, cfg)

    def bytes_per_token(self, head_dim: int, context: int = 2048) -> dict[str, float]:
        pb = base.DTYPE_BYTES[self.param_dtype]
        parts = base.kivi_bytes(self.bits, head_dim, self.group_size, pb)
        parts["k_norm"] = base.DTYPE_BYTES[self.norm_dtype]
        parts["k_group_mean"] = pb * head_dim / self.group_size
        return base.total(parts)
