"""Decode attention over the cache: the pure-JAX reference and the implementation switch.

Einsum legend: b batch, h KV heads, g query heads per KV head (GQA ratio),
t cache positions, d head_dim. Query heads are grouped as ``Hq = h * g`` with
query head ``i`` reading KV head ``i // g`` (the Llama / Qwen convention).

The reference dequantizes the quantized part in the rotated basis, scores it
against the rotated query (``(Rq).(Rk) = q.k``), scores the full-precision
residual against the plain query, and takes one softmax over both, so the
result is exact for the stored values. A row with no tokens returns zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from oscar_jax import backends, codec, hadamard
from oscar_jax.cache import FLAG_NONFINITE, KVCache, _residual_tokens, quantized_parts
from oscar_jax.eager import compiled

HIGHEST = jax.lax.Precision.HIGHEST


def check_query(q, cache: KVCache) -> int:
    """Validate q [B, Hq, D] against the cache; return the GQA ratio g."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache={type(cache).__name__} must be a KVCache")
    shape = getattr(q, "shape", None)
    if shape is None or len(shape) != 3:
        raise ValueError(f"q.shape={shape} must be [batch, num_q_heads, head_dim]")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q.dtype={q.dtype} must be floating")
    b, hq, d = shape
    if b != cache.batch or d != cache.head_dim:
        raise ValueError(
            f"q.shape={shape} must match the cache's batch={cache.batch} and "
            f"head_dim={cache.head_dim}"
        )
    if hq % cache.num_kv_heads:
        raise ValueError(
            f"num_q_heads={hq} must be a multiple of num_kv_heads={cache.num_kv_heads}"
        )
    return hq // cache.num_kv_heads


def merge_partials(parts):
    """Combine [(acc [b,h,g,d], m [b,h,g], l [b,h,g]), ...] into normalised outputs [b,h,g,d].

    m is a running max (-inf for an empty part), l the sum of exp(s - m).
    """
    m = parts[0][1]
    for _, mi, _ in parts[1:]:
        m = jnp.maximum(m, mi)
    acc, lse = rescale_partials(parts, m)
    return jnp.where(lse[..., None] > 0, acc / jnp.where(lse > 0, lse, 1.0)[..., None], 0.0)


def rescale_partials(parts, m):
    """Sum of the parts' (acc, l) rescaled to the common max m (used across shards too)."""
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    acc, lse = 0.0, 0.0
    for a, mi, li in parts:
        w = jnp.where(jnp.isfinite(mi), jnp.exp(mi - m_safe), 0.0)
        acc = acc + a * w[..., None]
        lse = lse + li * w
    return acc, lse


def _softmax_part(s, valid, v):
    """Masked scores s [b,h,g,t] and values v [b,h,t,d] -> (acc, max, sum)."""
    s = jnp.where(valid, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(valid, jnp.exp(s - m_safe[..., None]), 0.0)
    acc = jnp.einsum("bhgt,bhtd->bhgd", p, v, precision=HIGHEST)
    return acc, m, jnp.sum(p, axis=-1)


def residual_partial(qg: Float[Array, "b h g d"], cache: KVCache, scale: float, offset=0):
    """(acc, max, sum) over the cache's ring slots (a shard starting at global slot offset)."""
    s = jnp.einsum("bhgd,bhtd->bhgt", qg, cache.k_res.astype(jnp.float32), precision=HIGHEST)
    _, ok = _residual_tokens(
        cache.num_quantized(), cache.lengths, cache.slots_total, offset, cache.slots
    )
    return _softmax_part(s * scale, ok[:, None, None, :], cache.v_res.astype(jnp.float32))


def quantized_partial(q_rot: Float[Array, "b h g d"], cache: KVCache, scale: float, offset=0):
    """(acc, max, sum) over the quantized part (a shard starting at token offset), rotated basis."""
    ek, ev = quantized_parts(cache)
    k_rot = codec.decode_keys(ek, cache.cfg)  # [b, h, t, d] rotated basis, norms applied
    v_rot = codec.decode_values(ev, cache.cfg)
    s = jnp.einsum("bhgd,bhtd->bhgt", q_rot, k_rot, precision=HIGHEST) * scale
    pos = offset + jnp.arange(cache.quant_capacity)[None, :]
    valid = pos < cache.num_quantized()[:, None]
    return _softmax_part(s, valid[:, None, None, :], v_rot)


def grouped_query(q, cache: KVCache, softmax_scale):
    """q [B, Hq, D] -> (q grouped [b, h, g, d] float32, rotated copy for the keys, scale)."""
    g = check_query(q, cache)
    b, _, d = q.shape
    scale = float(1.0 / np.sqrt(d)) if softmax_scale is None else float(softmax_scale)
    qg = q.astype(jnp.float32).reshape(b, cache.num_kv_heads, g, d)
    q_rot = hadamard.rotate(qg, cache.cfg, dense=True) if cache.cfg.rotate_keys else qg
    return qg, q_rot, scale


def unrotate_values(acc, cfg):
    return hadamard.unrotate(acc, cfg, dense=True) if cfg.rotate_values else acc


@compiled(arrays=("q", "cache"))
def decode_attention_xla(
    q: Float[Array, "B Hq D"], cache: KVCache, *, softmax_scale: float | None = None
) -> Float[Array, "B Hq D"]:
    """Reference decode attention (float32 inside), exact for the stored values."""
    qg, q_rot, scale = grouped_query(q, cache, softmax_scale)
    parts = [residual_partial(qg, cache, scale)]
    if cache.quant_capacity:
        acc, m, denom = quantized_partial(q_rot, cache, scale)
        parts.append((unrotate_values(acc, cache.cfg), m, denom))
    return merge_partials(parts).reshape(q.shape).astype(q.dtype)


@compiled(arrays=("q", "cache"))
def decode_attention(
    q: Float[Array, "B Hq D"],
    cache: KVCache,
    *,
    implementation: str = "auto",
    softmax_scale: float | None = None,
    **options,
) -> Float[Array, "B Hq D"]:
    """Attention of one query token per row over the cache (q after RoPE, original basis).

    ``implementation``: a backend of ``oscar_jax.backends.TABLES["decode_attention"]``:
    "xla" (the pure-JAX reference), "triton" (the fused INT2/INT4 flash-decoding kernel
    of ``pallas_kernels.decode``; interpret mode without a GPU), "mosaic" (the Mosaic GPU
    INT2 kernel over a layout='record' cache; Hopper GPU, jax >= 0.11.2), "auto" (the
    default: the first of mosaic, triton, xla that runs here and covers the cache,
    ``backends.choose``; XLA without a GPU), or a callable
    ``fn(q, cache, *, softmax_scale=None, **options)``.
    Rows whose cache has ``FLAG_NONFINITE`` return NaN (``poison_flagged_rows``).
    """
    g = check_query(q, cache)  # before "auto" reads the cache's config
    implementation = backends.pick("decode_attention", implementation, cache, g, options)
    fn = backends.resolve("decode_attention", implementation)
    out = fn(q, cache, softmax_scale=softmax_scale, **options)
    if backends.poisons("decode_attention", implementation):
        return out
    return poison_flagged_rows(out, cache)


def poison_flagged_rows(out: Array, cache: KVCache) -> Array:
    """NaN for every row whose cache has FLAG_NONFINITE (sticky), the other rows untouched.

    A NaN/Inf that entered a row's cache does not reliably show in the attention
    output: a NaN key that is flushed is stored with norm 0 (a zero key), an Inf key
    can give a -inf score and drop its token, and NaN-ignoring reductions can hide
    the rest, so the row would yield finite, plausible and wrong outputs. The flag
    is exact, so the output of a flagged row is made NaN, always.
    """
    bad = (cache.flags & FLAG_NONFINITE) != 0
    return jnp.where(bad.reshape((-1,) + (1,) * (out.ndim - 1)), jnp.nan, out).astype(out.dtype)
