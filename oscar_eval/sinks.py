"""Attention-sink diagnostics: attention mass on position 0 and the key-norm ratio.

The OScaR effect (Token Norm Imbalance) needs sink tokens: positions that draw
most of the attention of later queries and whose keys have a much lower l2 norm
than the others. For every layer this measures, on a batch of sequences,

* ``attn_first`` [L, Hq]: the softmax weight that queries at positions
  ``>= offset`` put on position 0 (mean over those queries and the batch);
* ``key_norm_ratio`` [L, Hkv]: median_t ||k_t|| / ||k_0|| over t >= 1 (post-RoPE
  keys, as the KV cache holds them), mean over the batch: large means the first
  key has a low norm;
* ``value_norm_ratio`` [L, Hkv]: the same for values (sinks tend to carry small values).

Computed in float32 with the inference model's own functions (``models.layers``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models import layers
from models.config import ModelConfig


@functools.partial(jax.jit, static_argnums=(0, 3))
def _row_metrics(cfg: ModelConfig, params, ids, offset: int):
    """ids [1, T] -> (attn_first [L, Hq], key ratio [L, Hkv], value ratio [L, Hkv])."""
    t = ids.shape[1]
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    x = layers.embed(params, ids, cfg)
    outs = []
    for i in range(cfg.num_layers):
        lp = jax.tree.map(lambda a, i=i: a[i], params["layers"])
        window = cfg.sliding_window if cfg.is_local(i) else None  # Gemma 3's local layers

        def attend(q, k, v, window=window):  # [1, T, H, D]: sink metrics, then attention
            outs.append(_metrics(cfg, q, k, v, offset))
            return layers.causal_attention(q, k, v, window=window)

        x, _ = layers.block(cfg, lp, x, pos, attend, local=window is not None)
    return tuple(jnp.stack(o) for o in zip(*outs, strict=True))


def _metrics(cfg: ModelConfig, q, k, v, offset: int):
    """One layer's (attn_first [Hq], key ratio [Hkv], value ratio [Hkv]) of q/k/v [1, T, H, D]:
    the attention on position 0 after ``offset`` queries, median / position-0 norms."""
    t = q.shape[1]
    mask = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [Tq, Tk]
    g = cfg.num_heads // cfg.num_kv_heads
    qf = q[0].astype(jnp.float32).reshape(t, cfg.num_kv_heads, g, cfg.head_dim)
    kf = k[0].astype(jnp.float32)
    s = jnp.einsum("qhgd,khd->hgqk", qf, kf, precision=layers.HIGHEST) / np.sqrt(cfg.head_dim)
    s = jnp.where(mask, s, -jnp.inf)
    p0 = jnp.exp(s[..., 0] - jax.nn.logsumexp(s, axis=-1))  # [Hkv, g, T]
    attn_first = jnp.mean(p0[..., offset:], axis=-1).reshape(cfg.num_heads)
    kn = jnp.linalg.norm(kf, axis=-1)  # [T, Hkv]
    vn = jnp.linalg.norm(v[0].astype(jnp.float32), axis=-1)
    kr = jnp.median(kn[1:], axis=0) / kn[0]
    vr = jnp.median(vn[1:], axis=0) / vn[0]
    return attn_first, kr, vr


def sink_metrics(model_or_params, cfg: ModelConfig | None, ids, offset: int = 16) -> dict:
    """Per-layer sink metrics of a ``CausalLM`` (cfg may be None) or a params dict on ids [B, T].

    Returns numpy arrays ``attn_first`` [L, Hq], ``key_norm_ratio`` and
    ``value_norm_ratio`` [L, Hkv] (batch means), and the summary ``sink_heads``
    (query heads with attn_first >= 0.5) out of ``num_heads_total``.
    """
    if hasattr(model_or_params, "params"):
        cfg = cfg or model_or_params.config
        params = model_or_params.params()
    else:
        params = model_or_params
    if cfg is None:
        raise ValueError("cfg=None must be given with a params dict")
    ids = np.asarray(ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids.shape={ids.shape} dtype={ids.dtype} must be [B, T] ints")
    if not 0 <= offset < ids.shape[1] - 1:
        raise ValueError(f"{offset=} must lie in [0, T - 1) for T={ids.shape[1]}")
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    rows = [_row_metrics(cfg, params, jnp.asarray(r[None], jnp.int32), offset) for r in ids]
    af, kr, vr = (np.mean(np.stack([np.asarray(r[j]) for r in rows]), axis=0) for j in range(3))
    return dict(
        attn_first=af, key_norm_ratio=kr, value_norm_ratio=vr, offset=offset,
        sink_heads=int(np.sum(af >= 0.5)), num_heads_total=int(af.size),
    )  # fmt: skip


def as_json(m: dict) -> dict:
    """The metrics with arrays as nested lists rounded to 4 decimals."""
    return {k: (np.round(v.astype(np.float64), 4).tolist() if isinstance(v, np.ndarray) else v)
            for k, v in m.items()}  # fmt: skip


def format_table(m: dict) -> str:
    """One line per layer: attention on position 0 per query head, key/value norm ratios."""
    lines = [f"layer | attn on pos 0 per query head (queries >= {m['offset']}) | "
             "median||k||/||k0|| per KV head | median||v||/||v0||"]  # fmt: skip
    for i in range(m["attn_first"].shape[0]):
        a = " ".join(f"{x:.3f}" for x in m["attn_first"][i])
        k = " ".join(f"{x:.2f}" for x in m["key_norm_ratio"][i])
        v = " ".join(f"{x:.2f}" for x in m["value_norm_ratio"][i])
        lines.append(f"{i:5d} | {a} | {k} | {v}")
    lines.append(f"sink heads (attn on pos 0 >= 0.5): {m['sink_heads']}/{m['num_heads_total']}")
    return "\n".join(lines)
