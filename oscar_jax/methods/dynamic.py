"""Proposal C: a full-precision window that grows with the TNI of the tokens it flushes.

The cache keeps the newest ``residual_length`` = R' tokens in full precision, as
OScaR's. When a group of G tokens is about to be quantized, its TNI is measured: the
ratio of its median key norm to its smallest (the norms OScaR computes anyway, of the
key minus the k bias's RoPE'd part, per KV head). A group whose ratio exceeds ``tni``
stays in the full-precision window (the window grows by G) instead of being quantized,
for the first ``pins`` such groups of each row and head (causal: the decision sees only
the group and the earlier decisions). The budget: R' + pins x G full-precision tokens at
most, fixed at OScaR's R = 128 by the name (``oscard2``: pins 2, R' = 64): the window
shrinks to R' when no group needs it and grows back to R when groups with a sink do.

Everything else is ``oscarb`` (OScaR with the k-bias offset). Bytes per token of the
quantized part: OScaR's (a pinned group's code slots are counted as still stored); the
full-precision budget is OScaR's R at most, so at the average this spends no more.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from oscar_jax.methods import base
from oscar_jax.methods.bias_offset import OscarBias


def pinned_groups(
    norms: Float[Array, "B H T"], group_size: int, tni: float, pins: int
) -> Bool[Array, "B H T"]:
    """Tokens of the first ``pins`` groups (per row and head) whose median norm over
    smallest norm exceeds ``tni`` (a group with a zero norm counts as exceeding)."""
    b, h, t = norms.shape
    ng = norms.reshape(b, h, t // group_size, group_size)
    med = jnp.median(ng, axis=-1)
    mn = jnp.min(ng, axis=-1)
    hot = med > tni * mn
    pin = hot & (jnp.cumsum(hot, axis=-1) <= pins)
    return jnp.repeat(pin, group_size, axis=-1)


@dataclasses.dataclass(frozen=True)
class OscarDynamic(OscarBias):
    """``oscarb`` with up to ``pins`` high-TNI groups per row kept in the window."""

    pins: int = 2
    tni: float = 4.0

    def __post_init__(self):
        super().__post_init__()
        base._int("pins", self.pins, 0)
        if not self.tni > 1.0:
            raise ValueError(f"tni={self.tni!r} must be > 1 (median over smallest norm)")

    @property
    def budget(self) -> int:
        """Full-precision tokens at most: R' + pins x G."""
        return self.residual_length + self.pins * self.group_size

    def keep_mask(self, k: Float[Array, "B H T D"], key_offset=None) -> Bool[Array, "B H T"]:
        x = k.astype(jnp.float32)
        if key_offset is not None:
            x = x - jnp.swapaxes(key_offset.astype(jnp.float32), 0, 1)[None]
        norms = jnp.linalg.norm(x, axis=-1)
        return pinned_groups(norms, self.group_size, self.tni, self.pins)

    def fake_quant_kv(
        self,
        k: Float[Array, "B H T D"],
        v: Float[Array, "B H T D"],
        key_offset: Float[Array, "T H D"] | None = None,
    ):
        kh, vh = super().fake_quant_kv(k, v, key_offset)
        keep = self.keep_mask(k, key_offset)[..., None]
        kh = jnp.where(keep, base.round_fp(k, self.fp_dtype), kh)
        return kh, jnp.where(keep, base.round_fp(v, self.fp_dtype), vh)
