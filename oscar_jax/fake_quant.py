"""Quantize-dequantize round trips ("fake quantization") of whole key / value tensors.

Every token is quantized (no full-precision residual): this is the quantizer on
its own, for accuracy studies. A token count that is not a multiple of G is
padded by repeating the last token, which leaves the last group's min/max as
they are, and cropped after.

Non-finite input, as in the cache (``oscar_jax.cache``: ``FLAG_NONFINITE`` flags the
row, and ``decode_attention`` returns NaN for it): a batch row ``b`` with a NaN or Inf
anywhere in its input, or whose encoding overflows (a scale, zero or norm that is not
finite), comes back all NaN, every token, KV head and channel of it; without this a
NaN key would come back as a zero key and silently shift the other tokens of its
group. Every other row is bit-identical to a call without the bad row (nothing mixes
rows). Finite input never yields NaN: zero-norm keys and constant groups come back
finite.
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


def _bad_rows(*xs) -> Array:
    """[B] bool: a row with a non-finite element in any of ``xs`` (each [B, ...])."""
    bad = None
    for x in xs:
        r = ~jnp.all(jnp.isfinite(x.astype(jnp.float32)), axis=tuple(range(1, x.ndim)))
        bad = r if bad is None else bad | r
    return bad


def _poison(out, bad) -> Array:
    """``out`` [B, ...] with every element of the ``bad`` rows NaN, the others untouched."""
    return jnp.where(bad.reshape((-1,) + (1,) * (out.ndim - 1)), jnp.nan, out).astype(out.dtype)


@compiled(arrays=("k",))
def fake_quant_keys(k: Float[Array, "B T H D"], cfg: KVQuantConfig) -> Float[Array, "B T H D"]:
    """Keys through the config's quantizer and back, same shape and dtype, original basis.

    A batch row with a NaN / Inf key (or an encoding that overflows) comes back all
    NaN; the other rows are bit-identical to a call without it (see the module doc).
    ``bf16`` (not quantized) returns ``k`` itself.
    """
    _check(k, cfg, "k")
    if not cfg.quantized:
        return k
    kh, t = _padded_head_major(k, cfg.group_size)
    ek = codec.encode_keys_xla(kh, cfg)
    out = codec.decode_keys(ek, cfg, rotated=False)
    out = jnp.swapaxes(out[:, :, :t], 1, 2).astype(k.dtype)
    return _poison(out, _bad_rows(k, ek.scale, ek.zero, ek.norm, out))


@compiled(arrays=("v",))
def fake_quant_values(v: Float[Array, "B T H D"], cfg: KVQuantConfig) -> Float[Array, "B T H D"]:
    """Values through the config's quantizer and back, same shape and dtype, original basis.

    A batch row with a NaN / Inf value (or an encoding that overflows) comes back all
    NaN; the other rows are bit-identical to a call without it (see the module doc).
    ``bf16`` (not quantized) returns ``v`` itself.
    """
    _check(v, cfg, "v")
    if not cfg.quantized:
        return v
    vh = jnp.swapaxes(v, 1, 2)
    ev = codec.encode_values_xla(vh, cfg)
    out = codec.decode_values(ev, cfg, rotated=False)
    out = jnp.swapaxes(out, 1, 2).astype(v.dtype)
    return _poison(out, _bad_rows(v, ev.scale, ev.zero, out))
