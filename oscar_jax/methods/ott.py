"""OTT-style outlier tokens (Su et al., ACL 2025, arXiv 2505.10938) on top of KIVI.

In every key group of G tokens (per row and KV head) the ``pool`` tokens with the
smallest key L1 norm are outlier tokens: their keys and values go to a full-precision
pool and they are left out of the group's per-channel min/max, which the others are
quantized with (KIVI: keys per channel, values per token). The paper traces outliers
while decoding with a pool of bounded size; here the selection is per group, N per
group, which bounds the pool at N / G of the tokens.

Bytes per token and KV head: KIVI's, plus N / G x (K + V in ``fp_dtype`` + a 1-byte
index within the group). The outliers' code slots are counted as still stored.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float

from oscar_jax.methods import base


@dataclasses.dataclass(frozen=True)
class OTT(base.MethodConfig):
    """KIVI with the ``pool`` smallest-L1 keys of each group kept in full precision."""

    pool: int = 1

    def __post_init__(self):
        super().__post_init__()
        base._int("pool", self.pool, 0)
        if self.pool >= self.group_size:
            raise ValueError(f"pool={self.pool} must be < group_size={self.group_size}")

    def keep_mask(self, k: Float[Array, "B H T D"]):
        """[B, H, T] bool: the ``pool`` tokens of smallest key L1 norm in each group
        (ties: the earlier token)."""
        b, h, t, _ = k.shape
        g = self.group_size
        l1 = jnp.sum(jnp.abs(k.astype(jnp.float32)), axis=-1).reshape(b, h, t // g, g)
        rank = jnp.argsort(jnp.argsort(l1, axis=-1, stable=True), axis=-1, stable=True)
        return (rank < self.pool).reshape(b, h, t)

    def fake_quant_kv(
        self,
        k: Float[Array, "B H T D"],
        v: Float[Array, "B H T D"],
        key_offset: Float[Array, "T H D"] | None = None,
    ):
        base.check_kv(k, v, 8, self.group_size)
        keep = self.keep_mask(k)
        kh = base.masked_group_fake_quant(k, keep, self.bits, self.group_size, self.param_dtype)
        kh = jnp.where(keep[..., None], base.round_fp(k, self.fp_dtype), kh)
        vh = base.values_fake_quant(v, self.base("kivi"))
        vh = jnp.where(keep[..., None], base.round_fp(v, self.fp_dtype), vh)
        return kh, vh

    def bytes_per_token(self, head_dim: int, context: int = 2048) -> dict[str, float]:
        parts = base.kivi_bytes(self.bits, head_dim, self.group_size,
                                base.DTYPE_BYTES[self.param_dtype])  # fmt: skip
        per = 2 * head_dim * base.DTYPE_BYTES[self.fp_dtype] + 1
        parts["outlier_pool"] = self.pool * per / self.group_size
        return base.total(parts)
