"""Encoding of key and value blocks into the cache's packed layout, and back.

All arrays here are head-major, the cache's layout. Legend of shape letters:
B batch, H KV heads, Hn norm heads (H for ``per_head``, 1 for ``per_token``),
T tokens (a multiple of G), D head_dim, Db = D * bits / 8 packed bytes,
G key group (tokens), Gv value group (channels).

Keys (``encode_keys``): rotate (``rotate_keys``), divide by the stored l2 norm
(``token_scaling``; a zero-norm key stays zero and stores norm 0, so no NaN; the
division is (x s) * ``quant.scaled_reciprocal`` of the norm, as in the kernel),
quantize per channel over G consecutive tokens, pack along channels.
Values (``encode_values``): rotate (``rotate_values``), quantize per token over
Gv consecutive channels, pack along channels.

``encode`` picks the implementation from ``oscar_jax.backends`` ("xla" here, the fused
Pallas kernel as "triton"); this module stays pure JAX.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float, UInt8

from oscar_jax import backends, hadamard, quant
from oscar_jax.config import KVQuantConfig
from oscar_jax.eager import compiled


class EncodedKeys(NamedTuple):
    codes: UInt8[Array, "B H T Db"]
    scale: Array  # [B, H, T/G, D] param dtype
    zero: Array  # [B, H, T/G, D] param dtype
    norm: Array  # [B, Hn, T] norm dtype (ones when token_scaling is off)


class EncodedValues(NamedTuple):
    codes: UInt8[Array, "B H T Db"]
    scale: Array  # [B, H, T, D/Gv] param dtype
    zero: Array  # [B, H, T, D/Gv] param dtype


def token_norm_and_prescale(
    x: Float[Array, "B H T D"], granularity: str
) -> tuple[Float[Array, "B Hn T"], Float[Array, "B Hn T"]]:
    """Overflow-safe l2 norm per (token, head) or per token over all heads (float32),
    sqrt(sum((x s)^2)) / s, and s: the power of two of ``quant.pow2_prescale`` of max |x|
    (exact scalings; the Pallas encoder computes the same, summing in another order)."""
    axes = (-1,) if granularity == "per_head" else (1, 3)
    xf = x.astype(jnp.float32)
    if granularity == "per_token":
        xf = jnp.swapaxes(xf, 1, 2)[:, None]  # [B, 1, T, H, D]
        axes = (-2, -1)
    m = jnp.max(jnp.abs(xf), axis=axes, keepdims=True)
    s, inv = quant.pow2_prescale(jnp.where(m > 0, m, 1.0), quant.NORM_MAX_EXPONENT)
    n = jnp.sqrt(jnp.sum(jnp.square(xf * s), axis=axes, keepdims=True)) * inv
    n = jnp.where(m > 0, n, 0.0)
    return n.reshape(n.shape[:3]), s.reshape(n.shape[:3])


def token_l2_norm(x: Float[Array, "B H T D"], granularity: str) -> Float[Array, "B Hn T"]:
    """The norm of ``token_norm_and_prescale``."""
    return token_norm_and_prescale(x, granularity)[0]


@compiled(arrays=("k",))
def encode_keys_xla(k: Float[Array, "B H T D"], cfg: KVQuantConfig) -> EncodedKeys:
    """Pure-JAX reference: rotate -> token-scale -> per-channel group quantize -> pack."""
    x = k.astype(jnp.float32)
    if cfg.rotate_keys:
        x = hadamard.rotate(x, cfg)
    b, h, t, _ = x.shape
    hn = h if cfg.norm_granularity == "per_head" else 1
    if cfg.token_scaling:
        n, s = token_norm_and_prescale(x, cfg.norm_granularity)  # [B, Hn, T]
        n32 = quant.round_to_dtype(n, cfg.norm_jnp_dtype)  # the stored norm
        norm = n32.astype(cfg.norm_jnp_dtype)
        r = quant.scaled_reciprocal(n32, s)
        x = (x * s[..., None]) * r[..., None]
    else:
        norm = jnp.ones((b, hn, t), cfg.norm_jnp_dtype)
    codes, scale, zero = quant.quantize_groups(x, cfg.bits, cfg.group_size, 2, cfg.scale_dtype)
    return EncodedKeys(quant.pack(codes, cfg.bits, axis=-1), scale, zero, norm)


@compiled(arrays=("v",))
def encode_values_xla(v: Float[Array, "B H T D"], cfg: KVQuantConfig) -> EncodedValues:
    """Pure-JAX reference: rotate -> per-token channel-group quantize -> pack."""
    x = v.astype(jnp.float32)
    if cfg.rotate_values:
        x = hadamard.rotate(x, cfg)
    gv = cfg.value_group(x.shape[-1])
    codes, scale, zero = quant.quantize_groups(x, cfg.bits, gv, 3, cfg.scale_dtype)
    return EncodedValues(quant.pack(codes, cfg.bits, axis=-1), scale, zero)


@compiled(arrays=("enc",))
def decode_keys(
    enc: EncodedKeys, cfg: KVQuantConfig, *, rotated: bool = True
) -> Float[Array, "B H T D"]:
    """Dequantized keys times their norms (float32); in the rotated basis unless rotated=False."""
    codes = quant.unpack(enc.codes, cfg.bits, axis=-1)
    x = quant.dequantize_groups(codes, enc.scale, enc.zero, cfg.group_size, axis=2)
    x = x * enc.norm.astype(jnp.float32)[..., None]
    if not rotated and cfg.rotate_keys:
        x = hadamard.unrotate(x, cfg)
    return x


@compiled(arrays=("enc",))
def decode_values(
    enc: EncodedValues, cfg: KVQuantConfig, *, rotated: bool = True
) -> Float[Array, "B H T D"]:
    """Dequantized values (float32); in the rotated basis unless rotated=False."""
    codes = quant.unpack(enc.codes, cfg.bits, axis=-1)
    x = quant.dequantize_groups(codes, enc.scale, enc.zero, cfg.value_group(codes.shape[-1]), 3)
    if not rotated and cfg.rotate_values:
        x = hadamard.unrotate(x, cfg)
    return x


def encode_xla(k, v, cfg: KVQuantConfig, **unused) -> tuple[EncodedKeys, EncodedValues]:
    """The "xla" encoder: ``encode_keys_xla`` and ``encode_values_xla``."""
    if unused:
        raise ValueError(f"implementation='xla' takes no tuning options, got {sorted(unused)}")
    return encode_keys_xla(k, cfg), encode_values_xla(v, cfg)


@compiled(arrays=("k", "v"))
def encode(
    k: Float[Array, "B H T D"],
    v: Float[Array, "B H T D"],
    cfg: KVQuantConfig,
    *,
    implementation: str = "xla",
    **options,
) -> tuple[EncodedKeys, EncodedValues]:
    """Encode a block of keys and values (T a multiple of G) with the chosen implementation
    (``oscar_jax.backends.TABLES["encode"]``: "xla" or "triton", or a callable)."""
    return backends.resolve("encode", implementation)(k, v, cfg, **options)
