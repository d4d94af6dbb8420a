"""Diagnostics of Token Norm Imbalance (TNI) and of each method's reconstruction error.

Shapes: B batch, T tokens, H KV heads, D head_dim, G key group size.
All functions are pure and jit-compatible; results are float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from oscar_jax.config import KVQuantConfig
from oscar_jax.fake_quant import fake_quant_keys, fake_quant_values


def token_norms(k: Float[Array, "B T H D"]) -> Float[Array, "B T H"]:
    """l2 norm of every key, per token and KV head."""
    return jnp.linalg.norm(k.astype(jnp.float32), axis=-1)


def tni_ratio(k: Float[Array, "B T H D"]) -> Float[Array, "B H"]:
    """Median token norm over min token norm, per head (the paper's TNI; inf if a norm is 0)."""
    n = token_norms(k)
    return jnp.median(n, axis=1) / jnp.min(n, axis=1)


def group_norm_range(k: Float[Array, "B T H D"], group_size: int) -> Float[Array, "B T/G H"]:
    """max - min token norm inside each key group of G consecutive tokens (T cropped to G)."""
    n = token_norms(k)
    b, t, h = n.shape
    ng = t // group_size
    n = n[:, : ng * group_size].reshape(b, ng, group_size, h)
    return jnp.max(n, axis=2) - jnp.min(n, axis=2)


def group_key_mse(k: Float[Array, "B T H D"], cfg: KVQuantConfig) -> Float[Array, "B T/G H"]:
    """Mean squared key reconstruction error of each group of G tokens, per head."""
    g = cfg.group_size
    e = jnp.square(fake_quant_keys(k, cfg).astype(jnp.float32) - k.astype(jnp.float32))
    b, t, h, d = e.shape
    ng = t // g
    return e[:, : ng * g].reshape(b, ng, g, h, d).mean(axis=(2, 4))


def relative_token_error(x: Float[Array, "B T H D"], x_hat: Float[Array, "B T H D"]):
    """||x_hat - x|| / ||x|| per token and head (0 where x is 0 and x_hat is too)."""
    num = jnp.linalg.norm((x_hat - x).astype(jnp.float32), axis=-1)
    den = jnp.linalg.norm(x.astype(jnp.float32), axis=-1)
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), num)


def attention_output(q: Float[Array, "B Hq D"], k, v) -> Float[Array, "B Hq D"]:
    """Exact softmax attention of one query per row over all T tokens (GQA), float32."""
    b, hq, d = q.shape
    h = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, h, hq // h, d)
    s = jnp.einsum("bhgd,bthd->bhgt", qg, k.astype(jnp.float32)) / jnp.sqrt(d)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhgt,bthd->bhgd", p, v.astype(jnp.float32)).reshape(b, hq, d)


def reconstruction_report(
    q: Float[Array, "B Hq D"],
    k: Float[Array, "B T H D"],
    v: Float[Array, "B T H D"],
    cfg: KVQuantConfig,
    sink_mask: Float[Array, " T"] | None = None,
) -> dict[str, float]:
    """Key/value MSE, sink tokens' relative key error and attention-output error of a method.

    All tokens are quantized (no residual), so the numbers measure the quantizer.
    """
    k_hat = fake_quant_keys(k, cfg)
    v_hat = fake_quant_values(v, cfg)
    out = attention_output(q, k, v)
    out_hat = attention_output(q, k_hat, v_hat)
    rel_k = relative_token_error(k, k_hat)  # [B, T, H]
    rep = {
        "key_mse": float(jnp.mean(jnp.square(k_hat.astype(jnp.float32) - k))),
        "value_mse": float(jnp.mean(jnp.square(v_hat.astype(jnp.float32) - v))),
        "key_rel_err": float(jnp.mean(rel_k)),
        "attn_rel_err": float(jnp.linalg.norm(out_hat - out) / jnp.linalg.norm(out)),
    }
    if sink_mask is not None:
        m = jnp.asarray(sink_mask, bool)
        rep["sink_key_rel_err"] = float(jnp.mean(rel_k[:, m]))
        rep["other_key_rel_err"] = float(jnp.mean(rel_k[:, ~m]))
    return rep


def synthetic_kv(
    key: Array,
    *,
    batch: int = 1,
    tokens: int = 512,
    num_kv_heads: int = 2,
    num_q_heads: int = 8,
    head_dim: int = 128,
    sinks: tuple[int, ...] = (0, 1),
    sink_norm_ratio: float = 20.0,
    massive_channels: int = 4,
    massive_scale: float = 10.0,
):
    """Keys with the structure the paper describes, for diagnostics and demos.

    Gaussian keys plus a few fixed "massive" channels with a large positive mean;
    the sink tokens' keys are rescaled so that their norm is ``sink_norm_ratio``
    times below the median. Values and queries are plain Gaussians. Returns
    (q [B,Hq,D], k [B,T,H,D], v [B,T,H,D], sink_mask [T]).
    """
    kq, kk, kv_, kc = jax.random.split(key, 4)
    k = jax.random.normal(kk, (batch, tokens, num_kv_heads, head_dim))
    ch = jax.random.choice(kc, head_dim, (massive_channels,), replace=False)
    k = k.at[..., ch].add(massive_scale)
    n = jnp.linalg.norm(k, axis=-1, keepdims=True)
    med = jnp.median(n, axis=1, keepdims=True)
    sink = jnp.zeros((tokens,), bool).at[jnp.asarray(sinks, jnp.int32)].set(True)
    target = med / sink_norm_ratio
    k = jnp.where(sink[None, :, None, None], k / n * target, k)
    v = jax.random.normal(kv_, (batch, tokens, num_kv_heads, head_dim))
    q = jax.random.normal(kq, (batch, num_q_heads, head_dim))
    return q, k, v, sink
