"""Quantize-dequantize round trips ("fake quantization") of whole key / value tensors.

Every token is quantized (no full-precision residual): this is the quantizer on
its own, for accuracy studies. A token count that is not a multiple of G is
padded by repeating the last token, which leaves the last group's min/max as
they are, and cropped after.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from oscar_jax import codec
from oscar_jax.config import KVQuantConfig
from oscar_jax.eager import compiled


def _check(x, cfg: KVQuantConfig, name: str) -> None:
    if not isinstance(cfg, KVQuantConfig):
        raise ValueError(f"cfg={cfg!r} must be a KVQuantConfig (see oscar_jax.preset)")
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 4:
        raise ValueError(f"{name}.shape={shape} must be [batch, tokens, num_kv_heads, head_dim]")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}.dtype={x.dtype} must be floating")
    cfg.validate_head_dim(shape[-1], f"{name}.shape[-1]")


def _padded_head_major(x, g: int):
    t = x.shape[1]
    pad = (-t) % g
    xh = jnp.swapaxes(x, 1, 2)  # [B, H, T, D]
    if pad:
        xh = jnp.concatenate([xh, jnp.repeat(xh[:, :, -1:], pad, axis=2)], axis=2)
    return xh, t


@compiled(arrays=("k",))
def fake_quant_keys(k: Float[Array, "B T H D"], cfg: KVQuantConfig) -> Float[Array, "B T H D"]:
    """Keys through the config's quantizer and back, same shape and dtype, original basis."""
    _check(k, cfg, "k")
    if not cfg.quantized:
        return k
    kh, t = _padded_head_major(k, cfg.group_size)
    out = codec.decode_keys(codec.encode_keys_xla(kh, cfg), cfg, rotated=False)
    return jnp.swapaxes(out[:, :, :t], 1, 2).astype(k.dtype)


@compiled(arrays=("v",))
def fake_quant_values(v: Float[Array, "B T H D"], cfg: KVQuantConfig) -> Float[Array, "B T H D"]:
    """Values through the config's quantizer and back, same shape and dtype, original basis."""
    _check(v, cfg, "v")
    if not cfg.quantized:
        return v
    vh = jnp.swapaxes(v, 1, 2)
    out = codec.decode_values(codec.encode_values_xla(vh, cfg), cfg, rotated=False)
    return jnp.swapaxes(out, 1, 2).astype(v.dtype)
