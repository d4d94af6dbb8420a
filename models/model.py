"""The Flax NNX causal LM: stacked-layer params in ``nnx.Param``s, pure-function forward.

The module only owns state; the math lives in ``models.layers`` as pure
functions over a plain params dict so that the layers run under
``jax.lax.scan`` and generation is one ``jax.jit`` over (params, cache).
Decoding runs on ``decode_params``: the same weights with the layers unstacked
(a tuple of per-layer dicts, one copy, cached), which the decode step reads in
place instead of slicing (copying) each layer out of the stacked arrays per step.

Value-rotation folding: for a KV config with ``rotate_values`` the cache would
rotate each value ``v -> R v`` and un-rotate the attention output. Instead the
model folds R into W_V (and b_V) and R^T into each query head's slice of W_O
once (``folded_params``, cached per rotation), and hands the cache
``cfg.replace(rotate_values=False)``: the values arrive already rotated, the
attention output comes out rotated, and the folded W_O undoes it, so the
model's function is unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import oscar_jax as oj
from models import layers
from models import sharding as msh
from models.config import ModelConfig


class _Layers(nnx.Module):
    """Stacked per-layer parameters, one ``nnx.Param`` [L, ...] per kind."""

    def __init__(self, shapes: dict, dtype, rngs: nnx.Rngs, norm_one: float = 1.0):
        for name, shape in shapes.items():
            if "norm" in name:  # weights that act as 1 (Gemma's 1 + w: zeros)
                val = jnp.full(shape, norm_one, dtype)
            elif name.startswith("b"):
                val = jnp.zeros(shape, dtype)
            else:
                val = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
            setattr(self, name, nnx.Param(val))


class CausalLM(nnx.Module):
    """Llama / Qwen2 / Qwen3 / Gemma 3 / Qwen3-MoE decoder-only LM (one decoder, per-family
    switches in ``config``).

    Attributes: ``config`` (ModelConfig), ``dtype``, ``tokenizer`` (a
    ``tokenizers.Tokenizer`` when loaded from a directory with tokenizer.json, else None).
    """

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.tokenizer = None
        shapes = layers.param_shapes(config)
        init = lambda s: (0.02 * jax.random.normal(rngs.params(), s, jnp.float32)).astype(dtype)
        self.embed = nnx.Param(init(shapes["embed"]))
        self.norm = nnx.Param(jnp.full(shapes["norm"], 1.0 - config.norm_offset, dtype))
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(init(shapes["lm_head"]))
        self.layers = _Layers(shapes["layers"], dtype, rngs, 1.0 - config.norm_offset)
        self._folded: dict = {}

    # -- params as a plain pytree ----------------------------------------------------
    def params(self) -> dict:
        """The parameters as a plain nested dict of arrays (layers stacked on axis 0)."""
        shapes = layers.param_shapes(self.config)
        out = {k: getattr(self, k)[...] for k in shapes if k != "layers"}
        out["layers"] = {k: getattr(self.layers, k)[...] for k in shapes["layers"]}
        return out

    def set_params(self, params: dict) -> None:
        """Replace the parameters (same tree as ``params()``); drops cached folded copies."""
        for k, v in params.items():
            if k == "layers":
                for n, a in v.items():
                    getattr(self.layers, n)[...] = a
            else:
                getattr(self, k)[...] = v
        self._folded.clear()

    def folded_params(self, kv: oj.KVQuantConfig | None) -> dict:
        """Params with the value rotation of ``kv`` folded in (plain params when none)."""
        if kv is None or not kv.rotate_values:
            return self.params()
        key = (kv.rotation, kv.rotation_seed)
        if key not in self._folded:
            r = oj.rotation_matrix(kv, self.config.head_dim)
            self._folded[key] = fold_value_rotation(self.config, self.params(), r)
        return self._folded[key]

    def sharded_params(self, kv: oj.KVQuantConfig | None, mesh, ax=None) -> dict:
        """``folded_params(kv)`` placed on ``mesh`` in ``models.sharding``'s layout (cached)."""
        ax = ax or msh.AXES
        rot = (kv.rotation, kv.rotation_seed) if kv is not None and kv.rotate_values else None
        key = ("mesh", rot, mesh, ax)
        if key not in self._folded:
            self._folded[key] = msh.shard_params(self.config, self.folded_params(kv), mesh, ax)
        return self._folded[key]

    def decode_params(self, kv: oj.KVQuantConfig | None, mesh=None, ax=None) -> dict:
        """What decoding runs on: ``folded_params(kv)`` (on ``mesh`` in ``models.sharding``'s
        layout when given) with the layers unstacked (``layers.unstack_layers``' form: each
        layer's weights their own buffers, which the decode step reads where they lie).

        Cached per (rotation, mesh). Built a layer at a time (each sliced, then placed); a
        stacked folded copy is made on the way only if none is cached, and dropped: the
        steady state is the model's own stacked params plus this one copy.
        """
        rot = (kv.rotation, kv.rotation_seed) if kv is not None and kv.rotate_values else None
        ax = (ax or msh.AXES) if mesh is not None else None
        key = ("layers", rot, mesh, ax)
        if key not in self._folded:
            src = self._folded.get(rot) if rot else self.params()
            if src is None:  # folded here, not kept
                r = oj.rotation_matrix(kv, self.config.head_dim)
                src = fold_value_rotation(self.config, self.params(), r)
            sh = None if mesh is None else msh.param_shardings(self.config, mesh, ax, True)
            place = lambda t, s: t if s is None else jax.device_put(t, s)  # noqa: E731
            out = {k: place(v, sh and sh[k]) for k, v in src.items() if k != "layers"}
            out["layers"] = tuple(
                place(layers.take_layer(src["layers"], i), sh and sh["layers"][i])
                for i in range(self.config.num_layers)
            )
            self._folded[key] = out
        return self._folded[key]

    # -- inference -------------------------------------------------------------------
    def check_ids(self, input_ids) -> np.ndarray:
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"input_ids.shape={ids.shape} dtype={ids.dtype} must be [B, T] ints")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, vocab_size={self.config.vocab_size}); "
                f"got min={ids.min()}, max={ids.max()}"
            )
        return ids.astype(np.int32)

    def logits(self, input_ids, *, kv: oj.KVQuantConfig | None = None) -> jax.Array:
        """[B, T] int32 -> [B, T, vocab] float32 logits (full-precision causal attention).

        With ``kv`` the value rotation of that config is folded into the params first
        (the function is unchanged; used to test the folding).
        """
        ids = self.check_ids(input_ids)
        return _logits_jit(self.config, self.folded_params(kv), jnp.asarray(ids))


@functools.partial(jax.jit, static_argnums=0)
def _logits_jit(cfg, params, ids):
    return layers.logits_fn(cfg, params, ids)


def fold_value_rotation(cfg: ModelConfig, params: dict, r: np.ndarray) -> dict:
    """W_V <- W_V R^T per KV head (v' = R v), b_V likewise, W_O <- blockdiag(R) W_O per query head.

    ``r`` is the [D, D] orthogonal matrix with ``rotate(x) = R @ x``.
    """
    d = cfg.head_dim
    rj = jnp.asarray(r, jnp.float32)
    lay = dict(params["layers"])
    L, hd_in = lay["wv"].shape[:2]
    wv = lay["wv"].astype(jnp.float32).reshape(L, hd_in, cfg.num_kv_heads, d)
    wv = jnp.einsum("lhkd,ed->lhke", wv, rj, precision=layers.HIGHEST)
    lay["wv"] = wv.reshape(L, hd_in, cfg.kv_size).astype(params["layers"]["wv"].dtype)
    if "bv" in lay:
        bv = lay["bv"].astype(jnp.float32).reshape(L, cfg.num_kv_heads, d)
        bv = jnp.einsum("lkd,ed->lke", bv, rj, precision=layers.HIGHEST)
        lay["bv"] = bv.reshape(L, cfg.kv_size).astype(params["layers"]["bv"].dtype)
    wo = lay["wo"].astype(jnp.float32).reshape(L, cfg.num_heads, d, -1)
    wo = jnp.einsum("ed,lqdh->lqeh", rj, wo, precision=layers.HIGHEST)
    lay["wo"] = wo.reshape(L, cfg.q_size, -1).astype(params["layers"]["wo"].dtype)
    return {**params, "layers": lay}


def abstract_model(cfg: ModelConfig, dtype=jnp.bfloat16) -> CausalLM:
    """The model with ShapeDtypeStruct params (``nnx.eval_shape``: nothing is allocated)."""
    return nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
