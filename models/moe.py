"""Qwen3-MoE's sparse MLP: a softmax top-k router and E SwiGLU experts.

Per layer: ``router`` [Hd, E] (or ``layers.Transposed`` [E, Hd]), ``we_gate`` /
``we_up`` [E, Hd, Ie], ``we_down`` [E, Ie, Hd]. The router's softmax is taken in
float32 over all E experts, the top k kept and, with ``norm_topk_prob``, renormalised
to sum to one (transformers' ``Qwen3MoeTopKRouter``); the token's output is the
weighted sum of its k experts' SwiGLU outputs. Qwen3-MoE has no shared experts.

Two ways to run the experts, the same function:

* ``"ragged"``: the N*k (token, expert) pairs sorted by expert, each expert's rows one
  group of ``jax.lax.ragged_dot`` (reads every expert's weights once): prefill and
  large batches.
* ``"gather"``: each pair's expert weights gathered ([N*k, Hd, Ie]) and contracted with
  its token (reads only the chosen experts' weights, once per pair): decoding at small
  batch, where a step routes N*k << E pairs and the weights are the step's bytes.

``"auto"`` takes ``"gather"`` when N*k <= E / 2, else ``"ragged"`` (static: the shapes
decide).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.linear import activation, dense

HIGHEST = jax.lax.Precision.HIGHEST
IMPLEMENTATIONS = ("auto", "ragged", "gather")


def route(cfg: ModelConfig, lp, x):
    """Router of x [N, Hd] -> (weights [N, k] in x's dtype, expert ids [N, k] int32)."""
    logits = dense(x, lp["router"]).astype(jnp.float32)  # [N, E]
    probs = jax.nn.softmax(logits, axis=-1)
    w, idx = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w.astype(x.dtype), idx.astype(jnp.int32)


def _ragged(cfg: ModelConfig, lp, x, w, idx):
    """Experts by ``ragged_dot`` over the pairs sorted by expert: x [N, Hd] -> [N, Hd] f32."""
    n, k = idx.shape
    flat = idx.reshape(-1)  # [N*k]
    order = jnp.argsort(flat, stable=True)
    tok = order // k
    xs = jnp.take(x, tok, axis=0)  # [N*k, Hd], grouped by expert
    sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)  # [E]
    dot = lambda a, b: jax.lax.ragged_dot(  # noqa: E731
        a, b, sizes, precision=HIGHEST, preferred_element_type=jnp.float32
    )
    g, u = dot(xs, lp["we_gate"]), dot(xs, lp["we_up"])  # [N*k, Ie]
    y = dot((activation(cfg, g) * u).astype(x.dtype), lp["we_down"]).astype(x.dtype)
    y = y.astype(jnp.float32) * w.reshape(-1)[order][:, None].astype(jnp.float32)
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[tok].add(y)


def _gather(cfg: ModelConfig, lp, x, w, idx):
    """Experts by gathering each pair's weights: x [N, Hd] -> [N, Hd] f32."""
    f32 = jnp.float32
    wg = jnp.take(lp["we_gate"], idx, axis=0)  # [N, k, Hd, Ie]
    wu = jnp.take(lp["we_up"], idx, axis=0)
    wd = jnp.take(lp["we_down"], idx, axis=0)  # [N, k, Ie, Hd]
    ein = lambda s, a, b: jnp.einsum(s, a, b, precision=HIGHEST, preferred_element_type=f32)  # noqa: E731
    g, u = ein("nh,nkhi->nki", x, wg), ein("nh,nkhi->nki", x, wu)
    y = ein("nki,nkih->nkh", (activation(cfg, g) * u).astype(x.dtype), wd).astype(x.dtype)
    return jnp.sum(y.astype(f32) * w[..., None].astype(f32), axis=1)


def moe_mlp(cfg: ModelConfig, lp, x, implementation: str = "auto"):
    """The sparse MLP of x [..., Hd] -> [..., Hd] (x's dtype)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    w, idx = route(cfg, lp, x2)
    if implementation == "auto":
        pairs = x2.shape[0] * cfg.num_experts_per_tok
        implementation = "gather" if 2 * pairs <= cfg.num_experts else "ragged"
    run = _gather if implementation == "gather" else _ragged
    return run(cfg, lp, x2, w, idx).astype(x.dtype).reshape(shape)
