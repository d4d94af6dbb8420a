"""The shared decoder as pure functions over a plain params dict (layers stacked on axis 0).

Params (``[in, out]`` weight layout, ``L`` layers, ``Dq = heads * head_dim``)::

    embed [V, Hd]   norm [Hd]   lm_head [Hd, V] (absent when tied)
    layers: attn_norm, mlp_norm [L, Hd]; wq [L, Hd, Dq]; wk, wv [L, Hd, Dkv];
            wo [L, Dq, Hd]; w_gate, w_up [L, Hd, I]; w_down [L, I, Hd];
            optional bq [L, Dq], bk, bv [L, Dkv], bo [L, Hd] (qkv_bias / o_bias),
            optional q_norm, k_norm [L, head_dim] (qk_norm)
            optional post_attn_norm, post_mlp_norm [L, Hd] (sandwich_norm: Gemma 3)
            MoE (num_experts E, moe_intermediate_size Ie) instead of w_gate/w_up/w_down:
            router [L, Hd, E]; we_gate, we_up [L, E, Hd, Ie]; we_down [L, E, Ie, Hd]

Gemma 3's sliding-window (local) layers differ from its global ones in two static ways
(the RoPE base and the attention window): ``block(..., local=True)``. Under the layer
``scan`` a ``lax.cond`` on the layer's kind picks the branch; the per-layer loop passes
it statically.

Layers run under ``jax.lax.scan`` over the stacked leading axis. The per-layer form
(``unstack_layers``: ``layers`` a tuple of L dicts, each layer's arrays their own
buffers, projections ``Transposed`` to ``[out, in]``: 2x faster batch-1 GEMVs) is
what decoding reads: a layer sliced out of the stacked arrays is a copy wherever it
feeds a GEMM at larger batch, every step; with the per-layer form the layers run in a
Python loop and read the weights where they lie. Norms, RoPE,
softmax and logits are computed in float32; matmuls in the params' dtype with
float32 accumulation.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

import oscar_jax as oj
from models import moe
from models.config import ModelConfig, rope_inv_freq
from models.linear import HIGHEST, Transposed, activation, dense  # noqa: F401 (re-exported)

PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "router")
EXPERTS = ("we_gate", "we_up", "we_down")  # [E, in, out] per layer (never ``Transposed``)


def rms_norm(x, w, eps: float, offset: float = 0.0):
    """RMSNorm of x [..., n] with weight w [n]. ``offset`` 0: Llama's ``w * x_hat`` with
    x_hat cast to x's dtype first; ``offset`` 1: Gemma's ``(1 + w) * x_hat`` in float32."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    if offset:
        return ((offset + w.astype(jnp.float32)) * y).astype(x.dtype)
    return (w.astype(jnp.float32) * y.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


def norm(cfg: ModelConfig, x, w):
    """The config's RMSNorm (epsilon and weight offset) of x [..., n]."""
    return rms_norm(x, w, cfg.rms_norm_eps, cfg.norm_offset)


def rope_cos_sin(cfg: ModelConfig, positions, local: bool = False):
    """cos, sin [..., head_dim] (float32) for integer positions [...] (``local``: the
    sliding-window layers' RoPE)."""
    inv = jnp.asarray(rope_inv_freq(cfg, local))
    f = positions.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([f, f], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """x [B, T, H, D]; cos/sin [B, T, D]: the rotate-half convention of Llama/Qwen."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, :, None] + rot * sin[:, :, None]).astype(x.dtype)


def qkv(cfg: ModelConfig, lp, x, positions, local: bool = False):
    """Projections of x [B, T, Hd] -> q [B,T,Hq,D], k, v [B,T,Hkv,D] (k, q after norm + RoPE).

    q comes out times ``cfg.query_scale``, so that every attention's 1/sqrt(head_dim)
    gives Gemma's 1/sqrt(query_pre_attn_scalar)."""
    b, t, _ = x.shape
    d = cfg.head_dim
    q = dense(x, lp["wq"], lp.get("bq")).reshape(b, t, cfg.num_heads, d)
    k = dense(x, lp["wk"], lp.get("bk")).reshape(b, t, cfg.num_kv_heads, d)
    v = dense(x, lp["wv"], lp.get("bv")).reshape(b, t, cfg.num_kv_heads, d)
    if cfg.qk_norm:
        q = norm(cfg, q, lp["q_norm"])
        k = norm(cfg, k, lp["k_norm"])
    cos, sin = rope_cos_sin(cfg, positions, local)
    q = apply_rope(q, cos, sin)
    if cfg.query_scale != 1.0:
        q = (q.astype(jnp.float32) * cfg.query_scale).astype(q.dtype)
    return q, apply_rope(k, cos, sin), v


def mlp(lp, x, cfg: ModelConfig | None = None):
    """The gated MLP of x [..., Hd] (SwiGLU; GeGLU with tanh gelu for Gemma), or the
    mixture of experts (``models.moe``) when the config has experts."""
    if cfg is not None and cfg.is_moe:
        return moe.moe_mlp(cfg, lp, x)
    g = dense(x, lp["w_gate"]).astype(jnp.float32)
    u = dense(x, lp["w_up"]).astype(jnp.float32)
    act = jax.nn.silu(g) if cfg is None else activation(cfg, g)
    return dense((act * u).astype(x.dtype), lp["w_down"])


QUERY_CHUNK = 256  # long prompts attend in blocks of queries: scores are [.., chunk, T]


def _attend(qg, k, v, q_pos, valid, window=None):
    """qg [B,C,Hkv,g,D] f32 at positions q_pos [C] over all keys k/v [B,T,Hkv,D]
    (``window``: a query at p sees keys at p - window < j <= p)."""
    d = qg.shape[-1]
    t = k.shape[1]
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32), precision=HIGHEST)
    s = s * (1.0 / np.sqrt(d))
    mask = jnp.arange(t)[None, :] <= q_pos[:, None]
    if window is not None:
        mask = mask & (jnp.arange(t)[None, :] > q_pos[:, None] - window)
    mask = mask[None]  # [1, C, T]
    if valid is not None:
        mask = mask & valid[:, None, :]
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask[:, None, None], p, 0.0)
    return jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32), precision=HIGHEST)


PROMPT_ATTENTION = oj.backends.PROMPT_ATTENTION


def resolve_prompt_attention(implementation: str, dtype, sharded: bool = False) -> str:
    """The concrete prompt attention of ``implementation``: "auto" is cuDNN's flash
    attention on a GPU for a 16-bit, unsharded model (the float32 reference is slow on
    long prompts), else "reference"."""
    if implementation not in PROMPT_ATTENTION:
        raise ValueError(f"{implementation=} must be one of {PROMPT_ATTENTION}")
    if implementation != "auto":
        return implementation
    half = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
    return "cudnn" if half and not sharded and oj.gpu_available() else "reference"


def causal_attention(
    q, k, v, valid=None, chunk: int = QUERY_CHUNK, implementation: str = "reference",
    window: int | None = None,
):  # fmt: skip
    """Causal attention over a prompt: q [B,T,Hq,D], k/v [B,T,Hkv,D] -> [B,T,Hq,D].

    ``valid`` [B, T] masks keys (right padding); a query only sees keys at or before it.
    ``implementation``: "reference" (default) computes in float32 with
    ``Precision.HIGHEST``, over blocks of ``chunk`` queries (``lax.map``) for long
    prompts: the exactness baseline, but slow (27.9 s for a 32K-token Llama-3.1-8B
    prefill on an H200). "cudnn" (GPU, bf16/f16) and "xla" call
    ``jax.nn.dot_product_attention`` in the inputs' dtype (the valid prefix as
    key_value_seq_lengths; "xla" materialises [B, Hq, T, T] scores: short prompts only).
    Rows agree with "reference" at the positions before each row's length. "auto": see
    ``resolve_prompt_attention``. ``window`` (a static int): sliding-window attention, a
    query at position p sees the keys at p - window < j <= p (Gemma 3's local layers).
    """
    implementation = resolve_prompt_attention(implementation, q.dtype)
    if implementation != "reference":
        kv_len = None if valid is None else jnp.sum(valid, axis=1, dtype=jnp.int32)
        # float32 inputs keep float32 dots (GPUs default to TF32 for them)
        f32 = jnp.dtype(q.dtype) == jnp.float32
        with jax.default_matmul_precision("highest") if f32 else contextlib.nullcontext():
            return jax.nn.dot_product_attention(
                q, k.astype(q.dtype), v.astype(q.dtype), is_causal=True,
                key_value_seq_lengths=kv_len, implementation=implementation,
                local_window_size=None if window is None else (window - 1, 0),
            )  # fmt: skip
    b, t, hq, d = q.shape
    h = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, t, h, hq // h, d)
    if t <= chunk or t % chunk:
        o = _attend(qg, k, v, jnp.arange(t), valid, window)
    else:
        n = t // chunk
        qc = jnp.moveaxis(qg.reshape(b, n, chunk, h, hq // h, d), 1, 0)
        pos = jnp.arange(t).reshape(n, chunk)
        o = jax.lax.map(lambda a: _attend(a[0], k, v, a[1], valid, window), (qc, pos))
        o = jnp.moveaxis(o, 0, 1)
    return o.reshape(b, t, hq, d).astype(q.dtype)


def block(cfg: ModelConfig, lp, x, positions, attend, between=None, local: bool = False):
    """One pre-norm decoder layer, the one every path runs: x [B, T, Hd] ->
    (x + mlp(norm(x')), (k, v)) with x' = x + wo(attend(q, k, v)).

    ``attend(q [B, T, Hq, D], k, v [B, T, Hkv, D]) -> [B, T, Hq, D]``: the attention of
    the caller (causal over the prompt, over a cache while decoding, ...); k / v are
    returned as the caller caches them (post-RoPE). ``between(x')``: applied before the
    MLP (e.g. a sharding constraint). ``local`` (static): a sliding-window layer (its
    RoPE base; the caller's ``attend`` applies the window). With ``sandwich_norm``
    (Gemma 3) the attention and MLP outputs are normed too before their residual adds.
    """
    h = norm(cfg, x, lp["attn_norm"])
    q, k, v = qkv(cfg, lp, h, positions, local)
    o = attend(q, k, v)
    b, t = x.shape[:2]
    o = dense(o.reshape(b, t, cfg.q_size), lp["wo"], lp.get("bo"))
    if cfg.sandwich_norm:
        o = norm(cfg, o, lp["post_attn_norm"])
    x = x + o
    if between is not None:
        x = between(x)
    y = mlp(lp, norm(cfg, x, lp["mlp_norm"]), cfg)
    if cfg.sandwich_norm:
        y = norm(cfg, y, lp["post_mlp_norm"])
    x = x + y
    return x, (k, v)


def prompt_block(cfg: ModelConfig, lp, x, positions, valid=None, attention: str = "reference",
                 local: bool = False):  # fmt: skip
    """``block`` with causal attention over the sequence (``causal_attention``'s
    ``implementation``; ``valid`` [B, T] masks padded keys; ``local``: the layer's
    sliding window)."""
    window = cfg.sliding_window if local else None
    attend = lambda q, k, v: causal_attention(  # noqa: E731
        q, k, v, valid, implementation=attention, window=window
    )
    return block(cfg, lp, x, positions, attend, local=local)


def embed(params, ids, cfg: ModelConfig | None = None):
    """Token embeddings [..., Hd] of ids [...] (times sqrt(hidden) in the params' dtype
    when ``cfg.embed_scale``: Gemma)."""
    x = jnp.take(params["embed"], ids, axis=0)
    if cfg is not None and cfg.embed_scale:
        x = x * jnp.asarray(np.sqrt(cfg.hidden_size), x.dtype)
    return x


def is_per_layer(params) -> bool:
    """Whether ``params["layers"]`` is the per-layer form (a tuple of L dicts)."""
    return isinstance(params["layers"], tuple | list)


def num_layers(params) -> int:
    lay = params["layers"]
    return len(lay) if is_per_layer(params) else jax.tree_util.tree_leaves(lay)[0].shape[0]


def unstack_layers(params: dict) -> dict:
    """Params with ``layers`` as a tuple of L per-layer dicts (each layer its own buffers).

    A copy of the layer weights, made eagerly (call it once, outside ``jit``); per-layer
    params come back as they are. ``CausalLM.decode_params`` builds (and caches) the
    decoding form of a model layer by layer (folded, placed on a mesh).
    """
    if is_per_layer(params):
        return params
    lay = tuple(take_layer(params["layers"], i) for i in range(num_layers(params)))
    return {**params, "layers": lay}


@jax.jit
def take_layer(lay: dict, i):
    """Layer i of stacked layer params [L, ...] in the per-layer form: projections
    ``Transposed`` (a copy; ``i`` traced: one compile for all L)."""
    one = {k: jax.lax.dynamic_index_in_dim(a, i, keepdims=False) for k, a in lay.items()}
    return {k: Transposed(a.T) if k in PROJECTIONS else a for k, a in one.items()}


def plain(w):
    """A weight as ``[in, out]`` (undoes ``Transposed``)."""
    return w.w.T if isinstance(w, Transposed) else w


def stack_layers(params: dict) -> dict:
    """The inverse of ``unstack_layers``: layers stacked on a leading axis (a copy)."""
    if not is_per_layer(params):
        return params
    lay = params["layers"]
    return {**params, "layers": {k: jnp.stack([plain(lp[k]) for lp in lay]) for k in lay[0]}}


_block_jit = jax.jit(prompt_block, static_argnums=0, static_argnames=("attention", "local"))


def forward(cfg: ModelConfig, params, ids, positions=None, valid=None, keep_kv=False,
            stack_kv=True, attention: str = "reference"):  # fmt: skip
    """Run all layers: hidden states [B,T,Hd] (pre final norm) and K/V per layer.

    Stacked params: ``lax.scan`` over the layer axis. Per-layer params: a Python loop
    over the layers (one jitted ``block``, traced once), no stacking of the weights.
    K/V are ``[L, B, T, Hkv, D]`` when ``keep_kv`` (else None); with per-layer params
    and ``stack_kv=False``, tuples of L ``[B, T, Hkv, D]`` (no stacking copy).
    ``attention``: the prompt attention (``causal_attention``'s implementation).
    """
    b, t = ids.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = embed(params, ids, cfg)
    if is_per_layer(params):
        kvs = []
        for i, lp in enumerate(params["layers"]):
            x, kv = _block_jit(cfg, lp, x, positions, valid, attention=attention,
                               local=cfg.is_local(i))  # fmt: skip
            if keep_kv:
                kvs.append(kv)
        if not keep_kv:
            return x, None
        k, v = zip(*kvs, strict=True)
        return x, ((jnp.stack(k), jnp.stack(v)) if stack_kv else (k, v))

    def step(x, lp, local=False):
        x, kv = prompt_block(cfg, lp, x, positions, valid, attention, local)
        return x, (kv if keep_kv else None)

    if not cfg.local_layers:
        return jax.lax.scan(step, x, params["layers"])
    kinds = jnp.asarray([cfg.is_local(i) for i in range(cfg.num_layers)])

    def either(x, a):  # the layer's kind picks the branch
        lp, is_local = a
        return jax.lax.cond(is_local, lambda: step(x, lp, True), lambda: step(x, lp, False))

    return jax.lax.scan(either, x, (params["layers"], kinds))


def lm_head(cfg: ModelConfig, params, x):
    """Final norm + output projection -> float32 logits (soft-capped with
    ``final_logit_softcapping``)."""
    x = norm(cfg, x, params["norm"])
    if cfg.tie_word_embeddings:
        w = params["embed"]
        out = jnp.einsum("...i,vi->...v", x, w, precision=HIGHEST,
                         preferred_element_type=jnp.float32)  # fmt: skip
    else:
        out = jnp.einsum("...i,iv->...v", x, params["lm_head"], precision=HIGHEST,
                         preferred_element_type=jnp.float32)  # fmt: skip
    if cfg.final_logit_softcapping:
        cap = float(cfg.final_logit_softcapping)
        out = jnp.tanh(out / cap) * cap
    return out


def logits_fn(cfg: ModelConfig, params, ids):
    x, _ = forward(cfg, params, ids)
    return lm_head(cfg, params, x)


def param_shapes(cfg: ModelConfig, per_layer: bool = False) -> dict:
    """Shapes of every parameter (stacked layers), as a nested dict of tuples.

    ``per_layer``: ``layers`` is a tuple of L dicts of the per-layer shapes (walk it
    with ``is_leaf=is_shape``: the tuple of layers is a tuple too).
    """
    L, h, i, d = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    lay = dict(
        attn_norm=(L, h), mlp_norm=(L, h),
        wq=(L, h, cfg.q_size), wk=(L, h, cfg.kv_size), wv=(L, h, cfg.kv_size),
        wo=(L, cfg.q_size, h), w_gate=(L, h, i), w_up=(L, h, i), w_down=(L, i, h),
    )  # fmt: skip
    if cfg.is_moe:
        e, ie = cfg.num_experts, cfg.moe_intermediate_size
        for k in ("w_gate", "w_up", "w_down"):
            del lay[k]
        lay.update(router=(L, h, e), we_gate=(L, e, h, ie), we_up=(L, e, h, ie),
                   we_down=(L, e, ie, h))  # fmt: skip
    if cfg.sandwich_norm:
        lay.update(post_attn_norm=(L, h), post_mlp_norm=(L, h))
    if cfg.qkv_bias:
        lay.update(bq=(L, cfg.q_size), bk=(L, cfg.kv_size), bv=(L, cfg.kv_size))
    if cfg.o_bias:
        lay.update(bo=(L, h))
    if cfg.qk_norm:
        lay.update(q_norm=(L, d), k_norm=(L, d))
    if per_layer:
        one = {k: Transposed(s[:0:-1]) if k in PROJECTIONS else s[1:] for k, s in lay.items()}
        lay = tuple(dict(one) for _ in range(L))
    out = dict(embed=(cfg.vocab_size, h), norm=(h,), layers=lay)
    if not cfg.tie_word_embeddings:
        out["lm_head"] = (h, cfg.vocab_size)
    return out


def is_shape(x) -> bool:
    """A leaf of ``param_shapes``: a tuple of ints (for ``tree_map``'s ``is_leaf``)."""
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)
