"""Sharded long-context decoding: params and caches on a (data, model, sequence) mesh.

Default layout (``oscar_jax.sharding.MeshAxes`` names; every axis must exist, size 1 is fine):

* **data**: batch rows (prompt ids, lengths, tokens, logits, every cache row).
* **model**: attention heads, Megatron style. ``wq``/``wk``/``wv`` (and their biases)
  are column-split by heads, so device i of the axis holds KV heads
  ``[i * Hkv/n, (i+1) * Hkv/n)`` and exactly the query heads that read them (GQA
  groups are contiguous); ``wo`` is row-split (one all-reduce of the layer's
  output). The MLP likewise: ``w_gate``/``w_up`` column-split, ``w_down`` row-split
  (one all-reduce). Embeddings, ``lm_head``, norms, ``bo`` and ``q_norm``/``k_norm``
  (over head_dim, shared by all heads) are replicated. Mixture of experts (Qwen3-MoE):
  every expert's hidden dimension is split the same way (``we_gate``/``we_up`` column,
  ``we_down`` row: one all-reduce), the router replicated, so each device holds a slice
  of every expert and the routing needs no all-to-all. Gemma 3's sliding-window rings
  (``models.window``) are split by rows and KV heads like the caches.
* **sequence**: the cache's quantized part along tokens (``oscar_jax.sharding``'s
  layout, per layer); the dense layers are
  replicated over this axis and only attention is split: each device attends over
  its token shard and the partial softmaxes are merged exactly (pmax + psum).

Requirements (ValueError otherwise): ``num_kv_heads`` and ``intermediate_size``
divisible by the model axis (a head is never split: a KV head must live with its
cache), batch by the data axis, and the cache by the sequence axis
(``oscar_jax.sharding.check_mesh``: quantized capacity by ``sequence x group_size``,
or ``max_len`` by ``sequence`` for a ``bf16`` cache).
"""

from __future__ import annotations

import collections
import dataclasses
import re
import warnings

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models import layers
from models.config import ModelConfig
from models.window import WindowCache
from oscar_jax import sharding as osh
from oscar_jax.cache import KVCache
from oscar_jax.sharding import AXES, MeshAxes

_COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")  # [(L,) in, out]: out split
_EXPERT_COLUMN = ("we_gate", "we_up")  # [(L,) E, in, out]: each expert's out split
_EXPERT_ROW = ("we_down",)  # [(L,) E, in, out]: each expert's in split
_ROW = ("wo", "w_down")  # [(L,) in, out]: in split
_BIAS = ("bq", "bk", "bv")  # [(L,) out]: out split


def check_model_mesh(cfg: ModelConfig, mesh: Mesh, ax: MeshAxes = AXES, batch=None) -> None:
    """ValueError unless the model's heads / MLP (and ``batch``) divide evenly over the mesh."""
    nd, nm, _ = osh.mesh_sizes(mesh, ax)
    if cfg.num_kv_heads % nm:
        raise ValueError(
            f"num_kv_heads={cfg.num_kv_heads} must be divisible by the {ax.model} axis ({nm}): "
            "heads are split whole, each KV head with its query heads and its cache"
        )
    inter = ("moe_intermediate_size", cfg.moe_intermediate_size) if cfg.is_moe else (
        "intermediate_size", cfg.intermediate_size)  # fmt: skip
    if inter[1] % nm:
        raise ValueError(f"{inter[0]}={inter[1]} must be divisible by the {ax.model} axis ({nm})")
    if batch is not None and batch % nd:
        raise ValueError(f"batch={batch} must be divisible by the {ax.data} axis ({nd})")


def warn_known_crash(kv, mesh) -> bool:
    """Warn (and return True) before a sharded BF16-cache decode compiles on GPUs with
    XLA's Shardy partitioner: on jax 0.11.2 (H200) that compile dies with a segmentation
    fault inside Shardy, which Python cannot catch; GSPMD compiles the same program."""
    devices = list(np.asarray(mesh.devices).flat)
    if kv.quantized or len(devices) < 2 or not jax.config.jax_use_shardy_partitioner:
        return False
    if not all(d.platform == "gpu" for d in devices):
        return False
    warnings.warn(
        "sharded decoding with the BF16 cache on GPUs crashed XLA's Shardy partitioner "
        "(segfault, jax 0.11.2); set JAX_USE_SHARDY_PARTITIONER=false or "
        "jax.config.update('jax_use_shardy_partitioner', False) before compiling",
        RuntimeWarning,
        stacklevel=3,
    )
    return True


def param_specs(cfg: ModelConfig, ax: MeshAxes = AXES, per_layer: bool = False) -> dict:
    """PartitionSpecs with the tree of ``CausalLM.params()`` (the default layout above).

    ``per_layer``: the tree of ``layers.unstack_layers`` (a tuple of L per-layer dicts),
    each layer split the same way, without the leading layer axis, projections
    ``layers.Transposed`` with their specs reversed.
    """
    shapes = layers.param_shapes(cfg)
    m = ax.model

    def lay(name):
        if name in _COLUMN:
            return P(None, m)
        if name in _ROW:
            return P(m, None)
        if name in _BIAS:
            return P(m)
        if name in _EXPERT_COLUMN:
            return P(None, None, m)
        if name in _EXPERT_ROW:
            return P(None, m, None)
        return P()

    one = {k: lay(k) for k in shapes["layers"]}  # one layer's [in, out] / [out]
    out = {k: P() for k in shapes if k != "layers"}
    if per_layer:  # projections layers.Transposed: [out, in]
        one = {k: layers.Transposed(P(*s[::-1])) if k in layers.PROJECTIONS else s
               for k, s in one.items()}  # fmt: skip
        out["layers"] = tuple(dict(one) for _ in range(cfg.num_layers))
    else:
        out["layers"] = {k: P(None, *s) if s else P() for k, s in one.items()}  # [L, ...]
    return out


def param_shardings(cfg: ModelConfig, mesh: Mesh, ax: MeshAxes = AXES,
                    per_layer: bool = False) -> dict:  # fmt: skip
    """NamedShardings of ``param_specs`` on ``mesh`` (ValueError unless the model divides)."""
    check_model_mesh(cfg, mesh, ax)
    return jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), param_specs(cfg, ax, per_layer),
        is_leaf=lambda x: isinstance(x, P),
    )  # fmt: skip


def shard_params(cfg: ModelConfig, params: dict, mesh: Mesh, ax: MeshAxes = AXES) -> dict:
    """Place a params tree (stacked or per-layer) on the mesh in the default layout."""
    return jax.device_put(params, param_shardings(cfg, mesh, ax, layers.is_per_layer(params)))


def rows(mesh: Mesh, ax: MeshAxes = AXES, ndim: int = 1) -> NamedSharding:
    """Sharding of a per-row array of rank ``ndim``: rows on data, the rest replicated."""
    return NamedSharding(mesh, P(ax.data, *([None] * (ndim - 1))))


def constrain(x, mesh: Mesh | None, spec: P):
    """``with_sharding_constraint`` to ``spec`` on ``mesh`` (identity without a mesh)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def window_shardings(ring: WindowCache, mesh: Mesh, ax: MeshAxes = AXES) -> WindowCache:
    """Shardings of a local layer's ring (the layout ``constrain_caches`` pins): K/V
    [B, Hkv, S, D] split by rows and KV heads, lengths / flags by rows."""
    kv, row = NamedSharding(mesh, P(ax.data, ax.model, None, None)), NamedSharding(mesh, P(ax.data))
    return WindowCache(kv, kv, row, row)


def constrain_caches(caches, mesh: Mesh | None, ax: MeshAxes = AXES):
    """Pin caches to the default cache layout (identity without mesh): a tuple of per-layer
    caches [B, ...], or one KVCache stacked on leading layer axes [L, B, ...]."""
    if mesh is None:
        return caches
    if isinstance(caches, WindowCache):  # a local layer's ring [B, Hkv, S, D]
        spec = P(ax.data, ax.model, None, None)
        return dataclasses.replace(
            caches, k=constrain(caches.k, mesh, spec), v=constrain(caches.v, mesh, spec),
            lengths=constrain(caches.lengths, mesh, P(ax.data)),
            flags=constrain(caches.flags, mesh, P(ax.data)),
        )  # fmt: skip
    if isinstance(caches, KVCache):
        lead = caches.k_res.ndim - 4
        return jax.lax.with_sharding_constraint(
            caches, osh.cache_shardings(caches, mesh, ax, leading_axes=lead)
        )
    return tuple(constrain_caches(c, mesh, ax) for c in caches)


_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(rf"\s({'|'.join(_KINDS)})(?:-start)?\(")


def collectives(hlo_text: str) -> collections.Counter:
    """Count the collective ops in a compiled HLO text (``.lower(..).compile().as_text()``)."""
    found = (_COLLECTIVE.search(ln) for ln in hlo_text.splitlines())
    return collections.Counter(m.group(1) for m in found if m)


def collective_lines(hlo_text: str, kind: str) -> list[str]:
    """The HLO instructions of one collective kind (e.g. ``"all-gather"``), for inspection."""
    return [ln.strip() for ln in hlo_text.splitlines()
            if (m := _COLLECTIVE.search(ln)) and m.group(1) == kind]  # fmt: skip
