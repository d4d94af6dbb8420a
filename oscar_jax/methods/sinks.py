"""KIVI with the first S tokens of every row kept in full precision ("sink tokens").

The simplest answer to Token Norm Imbalance: the attention sinks (position 0 and a few
after it) are the tokens whose small keys KIVI's per-channel groups crush, so keep their
keys and values unquantized and leave them out of their group's min/max. The rest is
KIVI: keys per channel over G tokens, values per token over G channels, INT-b.

Bytes: KIVI's per token, plus S tokens x (K + V) x D x ``fp_dtype`` per row and KV head,
amortised over the context (their code slots are counted as if still stored, as a
dense layout would keep them).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float

from oscar_jax.methods import base


@dataclasses.dataclass(frozen=True)
class KiviSinks(base.MethodConfig):
    """KIVI + the first ``sinks`` tokens of each row in full precision."""

    sinks: int = 4

    def __post_init__(self):
        super().__post_init__()
        base._int("sinks", self.sinks, 0)

    def keep_mask(self, b: int, h: int, t: int):
        """[B, H, T] bool: the tokens kept in full precision."""
        return jnp.broadcast_to(jnp.arange(t) < self.sinks, (b, h, t))

    def fake_quant_kv(
        self,
        k: Float[Array, "B H T D"],
        v: Float[Array, "B H T D"],
        key_offset: Float[Array, "T H D"] | None = None,
    ):
        base.check_kv(k, v, 8, self.group_size)
        b, h, t, _ = k.shape
        keep = self.keep_mask(b, h, t)
        kh = base.masked_group_fake_quant(k, keep, self.bits, self.group_size, self.param_dtype)
        kh = jnp.where(keep[..., None], base.round_fp(k, self.fp_dtype), kh)
        vh = base.values_fake_quant(v, self.base("kivi"))
        vh = jnp.where(keep[..., None], base.round_fp(v, self.fp_dtype), vh)
        return kh, vh

    def bytes_per_token(self, head_dim: int, context: int = 2048) -> dict[str, float]:
        if context < 1:
            raise ValueError(f"{context=} must be >= 1")
        parts = base.kivi_bytes(self.bits, head_dim, self.group_size,
                                base.DTYPE_BYTES[self.param_dtype])  # fmt: skip
        parts["sink_kv"] = self.sinks * 2 * head_dim * base.DTYPE_BYTES[self.fp_dtype] / context
        return base.total(parts)
