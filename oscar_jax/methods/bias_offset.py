"""Proposal E: OScaR with the k-projection bias's RoPE-rotated contribution taken out.

A model with a k bias ``b`` (Qwen2.5) has keys ``k_t = RoPE_t(W x_t) + c_t`` with
``c_t = RoPE_t(b)``: a large offset that RoPE turns from token to token inside each
group of G tokens. KIVI's per-channel zero point absorbs most of it (it sits in a few
channel pairs); OScaR's Hadamard spreads it over every channel and its per-token norm
is dominated by it, so the rotated keys' in-group ranges grow ~3x (Qwen2.5 layer 0,
ACCURACY.md) and the INT2 logit error ~8x. This method quantizes ``k_t - c_t`` with
OScaR and adds ``c_t`` back exactly: ``k_hat_t = OScaR(k_t - c_t) + c_t``.

Cost: no byte in the cache. ``c_t`` is a function of the weights and the position;
the decode kernel adds ``q . c_t`` to the score of token t (for the rotate-half RoPE
``q . RoPE_t(b) = RoPE_t^T(q) . b``, a D-length dot per key, or one extra
[G, D] tile per group computed from positions), and the encoder subtracts ``c_t``
before rotating. A model without a k bias gets ``c_t = 0``: exactly OScaR.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float

from oscar_jax.methods import base


@dataclasses.dataclass(frozen=True)
class OscarBias(base.MethodConfig):
    """OScaR on ``k - RoPE_t(b_k)``; values as OScaR's (rotated, per-token INT-b)."""

    needs_key_bias = True

    def fake_quant_kv(
        self,
        k: Float[Array, "B H T D"],
        v: Float[Array, "B H T D"],
        key_offset: Float[Array, "T H D"] | None = None,
    ):
        base.check_kv(k, v, 8, self.group_size)
        cfg = self.base("oscar")
        off = None
        if key_offset is not None:
            t, h, d = k.shape[2], k.shape[1], k.shape[3]
            if key_offset.shape != (t, h, d):
                raise ValueError(f"key_offset.shape={key_offset.shape} must be {(t, h, d)}")
            off = jnp.swapaxes(key_offset.astype(jnp.float32), 0, 1)[None]  # [1, H, T, D]
        return base.oscar_keys_fake_quant(k, cfg, off), base.values_fake_quant(v, cfg)

    def bytes_per_token(self, head_dim: int, context: int = 2048) -> dict[str, float]:
        parts = base.kivi_bytes(self.bits, head_dim, self.group_size,
                                base.DTYPE_BYTES[self.param_dtype])  # fmt: skip
        parts["k_norm"] = base.DTYPE_BYTES[self.norm_dtype]
        return base.total(parts)


def rope_key_offset(
    bias: Float[Array, " Dkv"],
    cos: Float[Array, "T D"],
    sin: Float[Array, "T D"],
    num_kv_heads: int,
) -> Float[Array, "T H D"]:
    """``c_t = RoPE_t(b)`` per KV head (float32) for the rotate-half RoPE of Llama / Qwen,
    from the k bias [H * D] and the cos / sin tables of positions 0..T-1."""
    if bias.ndim != 1 or bias.shape[0] % num_kv_heads:
        raise ValueError(f"bias.shape={bias.shape} must be [num_kv_heads * head_dim]")
    d = bias.shape[0] // num_kv_heads
    if cos.shape != sin.shape or cos.ndim != 2 or cos.shape[1] != d:
        raise ValueError(f"cos.shape={cos.shape}, sin.shape={sin.shape} must be [T, {d}]")
    b = bias.astype(jnp.float32).reshape(1, num_kv_heads, d)
    rot = jnp.concatenate([-b[..., d // 2 :], b[..., : d // 2]], axis=-1)
    return b * cos[:, None] + rot * sin[:, None]
