"""One decode step over per-layer caches, updated in place (and the prefill that makes them).

The caches are a tuple of L ``KVCache``s, each its own buffers; a step runs the layers
in a Python loop (unrolled; ``_layer`` is jitted so it traces once): ``append`` the
token's K/V, ``decode_attention`` of its query. So each step updates every cache in
place (the ring slot, a flushed group) and the attention reads it where it lies:
nothing copies a cache. (A ``lax.scan`` over caches stacked [L, ...] as scan inputs /
outputs copied every cache, several times, every step; ``benchmarks/hlo_copies.py``
finds such copies in compiled HLO.) The flushes due in a step are encoded first, for
all layers in one batch (``oscar_jax.flush``: one encoder and one ``lax.cond`` in the
program, not L), and stored by each layer. With ``Static.mesh`` the same code runs
sharded (``models.sharding``'s layout, ``oscar_jax.sharding``'s append / attention).
The weights likewise: with per-layer params (``layers.unstack_layers``, a tuple of L
dicts) each layer's GEMMs read its weights where they lie; stacked [L, ...] params
still work, but a slice of a layer feeding a GEMM is a copy at larger batch (and on
the CPU), so every step would copy every layer's weights.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import oscar_jax as oj
from models import layers
from models import sharding as msh
from models.config import ModelConfig
from oscar_jax import flush as ofl
from oscar_jax import sharding as osh
from oscar_jax.ring import append_to_ring


class Static(NamedTuple):
    """Everything that decides shapes and code paths (a jit static argument)."""

    model: ModelConfig
    kv: oj.KVQuantConfig  # the cache's config (value rotation already folded)
    max_len: int
    cache_dtype: str
    implementation: str
    encode_implementation: str
    greedy: bool
    top_k: int | None
    use_top_p: bool
    stop_tokens: tuple[int, ...]
    pad_id: int
    mesh: Mesh | None = None  # sharded run (models.sharding's layout) when set
    axes: osh.MeshAxes = osh.AXES
    prompt_attention: str = "reference"  # layers.causal_attention's implementation


# -- building blocks (pure, traced) -------------------------------------------------
def layer_params(params, i: int, after=None) -> dict:
    """Layer i's params: ``params["layers"][i]`` of the per-layer form (read where it lies),
    or slices of the stacked [L, ...] arrays.

    Slices are copies wherever they feed a GEMM at larger batch (and on the CPU): every
    step copies every layer's weights; decode from ``layers.unstack_layers``' form
    (``CausalLM.decode_params``). ``after`` (stacked form only): an array the slices
    wait for (the layer's input): the index is i plus a zero computed from it at run
    time, so XLA slices each layer when it runs. Static slices would all be hoisted to
    the start, and every layer's weights would be held at once.
    """
    if layers.is_per_layer(params):
        return params["layers"][i]
    if after is None:
        return jax.tree_util.tree_map(lambda a: a[i], params["layers"])
    j = i + (jnp.max(jnp.abs(after)) < 0).astype(jnp.int32)  # 0 (NaN < 0 is False too)
    return layers.take_layer(params["layers"], j)


def stack_caches(caches) -> oj.KVCache:
    """Per-layer caches (tuple of L) -> one KVCache stacked on a leading layer axis [L, ...]
    (a copy: for inspection, saving, ``oscar_jax.checks``)."""
    return jax.tree_util.tree_map(lambda *x: jnp.stack(x), *caches)


def unstack_caches(stacked: oj.KVCache) -> tuple[oj.KVCache, ...]:
    """A KVCache stacked on a leading layer axis [L, ...] -> the tuple of L caches (a copy)."""
    n = stacked.k_res.shape[0]
    return tuple(jax.tree_util.tree_map(lambda x, i=i: x[i], stacked) for i in range(n))


def _prefill(st: Static, params, ids, lengths):
    """Prompt [B, T] -> (logits at lengths-1 [B, V] float32, caches: tuple of L [B, ...])."""
    mc = st.model
    b, t = ids.shape
    ax = st.axes
    valid = jnp.arange(t)[None, :] < lengths[:, None]
    x, (k, v) = layers.forward(mc, params, ids, valid=valid, keep_kv=True, stack_kv=False,
                               attention=st.prompt_attention)  # fmt: skip
    if isinstance(k, tuple):  # per-layer params: L arrays [B, T, Hkv, D] each
        spec = P(ax.data, None, ax.model, None)
        k, v = (tuple(msh.constrain(a, st.mesh, spec) for a in kv) for kv in (k, v))
    else:
        kv_spec = P(None, ax.data, None, ax.model, None)  # [L, B, T, Hkv, D]
        k, v = msh.constrain(k, st.mesh, kv_spec), msh.constrain(v, st.mesh, kv_spec)
    last = x[jnp.arange(b), lengths - 1]
    logits = layers.lm_head(mc, params, last)

    logits = msh.constrain(logits, st.mesh, P(ax.data, None))
    caches = tuple(_fill(st, k[i], v[i], lengths) for i in range(mc.num_layers))  # each its own
    return logits, msh.constrain_caches(caches, st.mesh, ax)


@functools.partial(jax.jit, static_argnums=0)
def _fill(st: Static, k, v, lengths):
    """One layer's cache from its prompt K/V [B, T, Hkv, D] (jitted: traced once for all L)."""
    mc = st.model
    c = oj.init_cache(
        st.kv, batch=k.shape[0], max_len=st.max_len, num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim, dtype=jnp.dtype(st.cache_dtype),
    )  # fmt: skip
    return oj.prefill(c, k, v, lengths, implementation=st.encode_implementation)


def _fused_write(st: Static, c) -> bool:
    """Whether a layer's cache update is one launch (``pallas_kernels.cache_write``): opt-in
    with ``encode_implementation="pallas"``, no sequence sharding, early flushes, a cache
    it covers."""
    if st.encode_implementation != "pallas" or not ofl.can_flush_early(c):
        return False
    if st.mesh is not None and osh.mesh_sizes(st.mesh, st.axes)[2] != 1:
        return False
    from pallas_kernels import cache_write  # the Pallas path only (models -> pallas_kernels)

    return cache_write.unsupported_reason(c) is None


@functools.partial(jax.jit, static_argnums=0)
def _layer(st: Static, x, lp, c, pos, todo: ofl.Flush | None):
    """One decoder layer of a step: x [B, 1, Hd], layer params, its cache -> (x, cache).

    Jitted so that the L unrolled calls trace (and lower) once; XLA inlines them.
    ``todo``: the cache's flush, encoded early (``oscar_jax.flush``), or None. With
    ``_fused_write`` the layer's cache writes are one Pallas launch (``prepare_flushes``
    then leaves the flushed groups in the ring for it to clear).
    """
    mc, mesh, ax = st.model, st.mesh, st.axes
    b = x.shape[0]
    x_spec = P(ax.data, None, None)
    x = msh.constrain(x, mesh, x_spec)
    hn = layers.rms_norm(x, lp["attn_norm"], mc.rms_norm_eps)
    q, k, v = layers.qkv(mc, lp, hn, pos[:, None])
    early = todo is not None
    fused = early and _fused_write(st, c)
    if fused:  # ring clear + append + group store in one launch (bit-identical)
        from pallas_kernels import cache_write

        if mesh is None:
            c = cache_write.fused_update(c, k[:, 0], v[:, 0], todo)
        else:  # rows / KV heads split: each device its own slices
            c = cache_write.sharded_fused_update(c, k[:, 0], v[:, 0], todo, mesh, ax=ax)
    elif mesh is None and early:
        c = append_to_ring(c, k[:, 0], v[:, 0])[0]
    elif mesh is None:
        c = oj.append(c, k[:, 0], v[:, 0], implementation=st.encode_implementation)
    else:
        c = osh.sharded_append(c, k[:, 0], v[:, 0], mesh, ax=ax, flush=not early,
                               implementation=st.encode_implementation)  # fmt: skip
    if early and not fused:  # store the groups now; the mask depends on this layer's flags
        # (always >= 0): then XLA cannot hoist the writes, nor the attention's reads (e.g. the
        # XLA path's dequantized keys) of every layer to the start of the step, and hold them all
        todo = todo._replace(flush=todo.flush & (c.flags >= 0))
        c = ofl.write_flush(c, todo) if mesh is None else osh.sharded_write_flush(c, todo, mesh, ax)
    if mesh is None:
        o = oj.decode_attention(q[:, 0], c, implementation=st.implementation)
    else:
        o = osh.sharded_decode_attention(q[:, 0], c, mesh, ax=ax, implementation=st.implementation)
    x = x + layers.dense(o.reshape(b, 1, mc.q_size).astype(x.dtype), lp["wo"], lp.get("bo"))
    x = msh.constrain(x, mesh, x_spec)
    x = x + layers.mlp(lp, layers.rms_norm(x, lp["mlp_norm"], mc.rms_norm_eps))
    return x, c


def _decode(st: Static, params, caches, tok, pos):
    """One new token per row: tok [B] at positions pos [B] -> (logits [B, V], caches).

    ``caches``: tuple of L per-layer caches, updated in place (with donation or as a
    loop carry); the layers run in a Python loop (see the module docstring).
    """
    mesh, ax = st.mesh, st.axes
    caches = msh.constrain_caches(tuple(caches), mesh, ax)
    todo = (None,) * len(caches)
    if ofl.can_flush_early(caches[0]):  # the step's flushes: one batched encode, first
        kw = dict(implementation=st.encode_implementation, clear=not _fused_write(st, caches[0]))
        if (mesh is not None and st.encode_implementation != "xla"
                and osh.local_flush_reason(caches[0], mesh, ax) is None):  # fmt: skip
            # a kernel encoder, per device (else it would run on gathered groups)
            caches, todo = osh.sharded_prepare_flushes(caches, mesh, ax, **kw)
        else:
            caches, todo = ofl.prepare_flushes(caches, **kw)
    x = layers.embed(params, tok[:, None])  # [B, 1, Hd]
    out = []
    for i, c in enumerate(caches):
        x, c = _layer(st, x, layer_params(params, i, after=x), c, pos, todo[i])
        out.append(c)
    logits = msh.constrain(layers.lm_head(st.model, params, x[:, 0]), mesh, P(ax.data, None))
    return logits, msh.constrain_caches(tuple(out), mesh, ax)
