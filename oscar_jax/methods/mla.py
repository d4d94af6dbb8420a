"""Proposal D: OScaR on a multi-head latent attention (MLA) cache, fake-quant, synthetic.

An MLA cache (DeepSeek-V2/V3) holds per token a latent ``c_t`` [Dc] (the key *and* the
value of every head, through ``W_UK`` / ``W_UV``) and a decoupled RoPE key ``kr_t`` [Dr]
shared by the heads; head h scores ``(W_UK_h^T q_h) . c_t + q_rope_h . kr_t``.
``docs/methods_design.md`` (D) has the design; this is its quantizer:

- both streams rotated by a Walsh-Hadamard matrix of their size (for ``c_t`` it folds
  into ``W_UK`` and ``W_UV`` offline, since no RoPE acts on it; for ``kr_t`` it is applied
  online after RoPE, as OScaR's key rotation);
- one l2 norm per token, over both rotated streams (``norm="joint"``, the score's
  norm: ``|[c_t, kr_t]|``) or one per stream (``"per_stream"``), or none (``None``: KIVI
  with a rotation; with ``rotate=False`` too: KIVI);
- per-channel INT-b over G tokens of the normalised streams (the latent is read as a
  key by the score: per-channel groups, as OScaR's keys).

No MLA weights exist here: ``tests/test_methods_mla.py`` checks it on random MLA-shaped
tensors with planted low-norm sink tokens.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from oscar_jax import quant
from oscar_jax.methods.rotation import hadamard_matrix

NORMS = ("joint", "per_stream", None)


def latent_fake_quant(
    c: Float[Array, "B T Dc"],
    kr: Float[Array, "B T Dr"],
    bits: int = 2,
    group_size: int = 32,
    *,
    rotate: bool = True,
    norm: str | None = "joint",
    param_dtype: str = "float16",
) -> tuple[Float[Array, "B T Dc"], Float[Array, "B T Dr"]]:
    """The latent and the RoPE key through OScaR's quantizer and back (float32)."""
    if norm not in NORMS:
        raise ValueError(f"{norm=} must be one of {NORMS}")
    if c.shape[:2] != kr.shape[:2] or c.shape[1] % group_size:
        raise ValueError(f"c {c.shape}, kr {kr.shape}: same [B, T], T a multiple of {group_size}")
    xs = [c.astype(jnp.float32), kr.astype(jnp.float32)]
    hs = [jnp.asarray(hadamard_matrix(x.shape[-1]), jnp.float32) if rotate else None for x in xs]
    xs = [x if h is None else x @ h.T for x, h in zip(xs, hs, strict=True)]
    sq = [jnp.sum(x * x, axis=-1, keepdims=True) for x in xs]
    if norm == "joint":
        ns = [jnp.sqrt(sq[0] + sq[1])] * 2
    elif norm == "per_stream":
        ns = [jnp.sqrt(s) for s in sq]
    else:
        ns = [jnp.ones_like(s) for s in sq]
    out = []
    for x, n, h in zip(xs, ns, hs, strict=True):
        n = jnp.where(n > 0, n, 1.0)
        codes, scale, zero = quant.quantize_groups(x / n, bits, group_size, 1, param_dtype)
        y = quant.dequantize_groups(codes, scale, zero, group_size, axis=1) * n
        out.append(y if h is None else y @ h)
    return out[0], out[1]
