"""The shared decoder as pure functions over a plain params dict (layers stacked on axis 0).

Params (``[in, out]`` weight layout, ``L`` layers, ``Dq = heads * head_dim``)::

    embed [V, Hd]   norm [Hd]   lm_head [Hd, V] (absent when tied)
    layers: attn_norm, mlp_norm [L, Hd]; wq [L, Hd, Dq]; wk, wv [L, Hd, Dkv];
            wo [L, Dq, Hd]; w_gate, w_up [L, Hd, I]; w_down [L, I, Hd];
            optional bq [L, Dq], bk, bv [L, Dkv], bo [L, Hd] (qkv_bias / o_bias),
            optional q_norm, k_norm [L, head_dim] (qk_norm)

Layers run under ``jax.lax.scan`` over the stacked leading axis. Norms, RoPE,
softmax and logits are computed in float32; matmuls in the params' dtype with
float32 accumulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, rope_inv_freq

HIGHEST = jax.lax.Precision.HIGHEST


def dense(x, w, b=None):
    y = jnp.einsum("...i,io->...o", x, w, precision=HIGHEST, preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def rms_norm(x, w, eps: float):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * y.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


def rope_cos_sin(cfg: ModelConfig, positions):
    """cos, sin [..., head_dim] (float32) for integer positions [...]."""
    inv = jnp.asarray(rope_inv_freq(cfg))
    f = positions.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([f, f], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """x [B, T, H, D]; cos/sin [B, T, D]: the rotate-half convention of Llama/Qwen."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, :, None] + rot * sin[:, :, None]).astype(x.dtype)


def qkv(cfg: ModelConfig, lp, x, positions):
    """Projections of x [B, T, Hd] -> q [B,T,Hq,D], k, v [B,T,Hkv,D] (k, q after norm + RoPE)."""
    b, t, _ = x.shape
    d = cfg.head_dim
    q = dense(x, lp["wq"], lp.get("bq")).reshape(b, t, cfg.num_heads, d)
    k = dense(x, lp["wk"], lp.get("bk")).reshape(b, t, cfg.num_kv_heads, d)
    v = dense(x, lp["wv"], lp.get("bv")).reshape(b, t, cfg.num_kv_heads, d)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(cfg, positions)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def mlp(lp, x):
    g = dense(x, lp["w_gate"]).astype(jnp.float32)
    u = dense(x, lp["w_up"]).astype(jnp.float32)
    return dense((jax.nn.silu(g) * u).astype(x.dtype), lp["w_down"])


QUERY_CHUNK = 256  # long prompts attend in blocks of queries: scores are [.., chunk, T]


def _attend(qg, k, v, q_pos, valid):
    """qg [B,C,Hkv,g,D] f32 at positions q_pos [C] over all keys k/v [B,T,Hkv,D]."""
    d = qg.shape[-1]
    t = k.shape[1]
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32), precision=HIGHEST)
    s = s * (1.0 / np.sqrt(d))
    mask = (jnp.arange(t)[None, :] <= q_pos[:, None])[None]  # [1, C, T]
    if valid is not None:
        mask = mask & valid[:, None, :]
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask[:, None, None], p, 0.0)
    return jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32), precision=HIGHEST)


def causal_attention(q, k, v, valid=None, chunk: int = QUERY_CHUNK):
    """Full-precision causal attention: q [B,T,Hq,D], k/v [B,T,Hkv,D] -> [B,T,Hq,D].

    ``valid`` [B, T] masks keys (right padding); a query only sees keys at or before it.
    Prompts longer than ``chunk`` (and divisible by it) run ``lax.map`` over query blocks.
    """
    b, t, hq, d = q.shape
    h = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, t, h, hq // h, d)
    if t <= chunk or t % chunk:
        o = _attend(qg, k, v, jnp.arange(t), valid)
    else:
        n = t // chunk
        qc = jnp.moveaxis(qg.reshape(b, n, chunk, h, hq // h, d), 1, 0)
        pos = jnp.arange(t).reshape(n, chunk)
        o = jax.lax.map(lambda a: _attend(a[0], k, v, a[1], valid), (qc, pos))
        o = jnp.moveaxis(o, 0, 1)
    return o.reshape(b, t, hq, d).astype(q.dtype)


def block(cfg: ModelConfig, lp, x, positions, valid=None):
    """One decoder layer over a whole sequence; returns (x, (k, v)) with k/v as cached."""
    hn = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q, k, v = qkv(cfg, lp, hn, positions)
    o = causal_attention(q, k, v, valid)
    b, t = x.shape[:2]
    x = x + dense(o.reshape(b, t, cfg.q_size), lp["wo"], lp.get("bo"))
    x = x + mlp(lp, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps))
    return x, (k, v)


def embed(params, ids):
    return jnp.take(params["embed"], ids, axis=0)


def forward(cfg: ModelConfig, params, ids, positions=None, valid=None, keep_kv=False):
    """Run all layers with lax.scan: hidden states [B,T,Hd] (pre final norm) and K/V per layer.

    K/V are ``[L, B, T, Hkv, D]`` when ``keep_kv`` (else None).
    """
    b, t = ids.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = embed(params, ids)

    def step(x, lp):
        x, kv = block(cfg, lp, x, positions, valid)
        return x, (kv if keep_kv else None)

    x, kv = jax.lax.scan(step, x, params["layers"])
    return x, kv


def lm_head(cfg: ModelConfig, params, x):
    """Final norm + output projection -> float32 logits."""
    x = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    if cfg.tie_word_embeddings:
        w = params["embed"]
        return jnp.einsum("...i,vi->...v", x, w, precision=HIGHEST,
                          preferred_element_type=jnp.float32)  # fmt: skip
    return jnp.einsum("...i,iv->...v", x, params["lm_head"], precision=HIGHEST,
                      preferred_element_type=jnp.float32)  # fmt: skip


def logits_fn(cfg: ModelConfig, params, ids):
    x, _ = forward(cfg, params, ids)
    return lm_head(cfg, params, x)


def param_shapes(cfg: ModelConfig) -> dict:
    """Shapes of every parameter (stacked layers), as a nested dict of tuples."""
    L, h, i, d = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    lay = dict(
        attn_norm=(L, h), mlp_norm=(L, h),
        wq=(L, h, cfg.q_size), wk=(L, h, cfg.kv_size), wv=(L, h, cfg.kv_size),
        wo=(L, cfg.q_size, h), w_gate=(L, h, i), w_up=(L, h, i), w_down=(L, i, h),
    )  # fmt: skip
    if cfg.qkv_bias:
        lay.update(bq=(L, cfg.q_size), bk=(L, cfg.kv_size), bv=(L, cfg.kv_size))
    if cfg.o_bias:
        lay.update(bo=(L, h))
    if cfg.qk_norm:
        lay.update(q_norm=(L, d), k_norm=(L, d))
    out = dict(embed=(cfg.vocab_size, h), norm=(h,), layers=lay)
    if not cfg.tie_word_embeddings:
        out["lm_head"] = (h, cfg.vocab_size)
    return out
