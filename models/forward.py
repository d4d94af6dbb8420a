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

Gemma 3's sliding-window layers hold a ``models.window.WindowCache`` (a full-precision
ring of the window) instead of a ``KVCache``: the tuple of caches mixes the two, the
early flushes are prepared for the ``KVCache`` layers only.
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
from models import window as mwin
from models.config import ModelConfig
from models.placement import Local, Placement
from oscar_jax import flush as ofl
from oscar_jax import sharding as osh
from oscar_jax.backends import Backends


class Static(NamedTuple):
    """Everything that decides shapes and code paths (a jit static argument)."""

    model: ModelConfig
    kv: oj.KVQuantConfig  # the cache's config (value rotation already folded)
    max_len: int
    cache_dtype: str
    backends: Backends  # prompt_attention resolved ("auto" -> a concrete one)
    greedy: bool
    top_k: int | None
    use_top_p: bool
    stop_tokens: tuple[int, ...]
    pad_id: int
    place: Placement = Local()  # one device, or a mesh (models.placement)

    @property
    def mesh(self) -> Mesh | None:
        return self.place.mesh

    @property
    def axes(self) -> osh.MeshAxes:
        return self.place.axes


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


def prefill_forward(st: Static, params, ids, lengths):
    """Prompt [B, T] -> (logits at lengths-1 [B, V] float32, caches: tuple of L [B, ...])."""
    mc, place, ax = st.model, st.place, st.axes
    b, t = ids.shape
    valid = jnp.arange(t)[None, :] < lengths[:, None]
    x, (k, v) = layers.forward(mc, params, ids, valid=valid, keep_kv=True, stack_kv=False,
                               attention=st.backends.prompt_attention)  # fmt: skip
    if isinstance(k, tuple):  # per-layer params: L arrays [B, T, Hkv, D] each
        spec = P(ax.data, None, ax.model, None)
        k, v = (tuple(place.constrain(a, spec) for a in kv) for kv in (k, v))
    else:
        kv_spec = P(None, ax.data, None, ax.model, None)  # [L, B, T, Hkv, D]
        k, v = place.constrain(k, kv_spec), place.constrain(v, kv_spec)
    last = x[jnp.arange(b), lengths - 1]
    logits = place.constrain(layers.lm_head(mc, params, last), P(ax.data, None))
    caches = tuple(
        (_fill_window if mc.is_local(i) else _fill)(st, k[i], v[i], lengths)
        for i in range(mc.num_layers)
    )  # each its own
    return logits, place.constrain_caches(caches)


@functools.partial(jax.jit, static_argnums=0)
def _fill(st: Static, k, v, lengths):
    """One layer's cache from its prompt K/V [B, T, Hkv, D] (jitted: traced once for all L)."""
    mc = st.model
    c = oj.init_cache(
        st.kv, batch=k.shape[0], max_len=st.max_len, num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim, dtype=jnp.dtype(st.cache_dtype),
    )  # fmt: skip
    return oj.prefill(c, k, v, lengths, implementation=st.backends.encode)


@functools.partial(jax.jit, static_argnums=0)
def _fill_window(st: Static, k, v, lengths):
    """A local layer's ring from its prompt K/V [B, T, Hkv, D]."""
    mc = st.model
    size = mwin.ring_size(mc.sliding_window, st.max_len)
    c = mwin.init(k.shape[0], mc.num_kv_heads, mc.head_dim, size, jnp.dtype(st.cache_dtype))
    return mwin.prefill(c, k, v, lengths)


def fused_cache_write(st: Static, c) -> bool:
    """Whether a layer's cache update is one launch (``pallas_kernels.cache_write``): with
    ``Backends.cache_write="triton"``, early flushes and a cache (and placement) it covers;
    otherwise the step writes with separate ops (the same bits)."""
    if st.backends.cache_write != "triton" or not ofl.can_flush_early(c):
        return False
    return st.place.fused_write_ok(c)


@functools.partial(jax.jit, static_argnums=0)
def _local_layer(st: Static, x, lp, c: mwin.WindowCache, pos):
    """One sliding-window layer of a step over its ring: x [B, 1, Hd] -> (x, ring)."""
    mc, place, ax = st.model, st.place, st.axes
    x_spec = P(ax.data, None, None)
    x = place.constrain(x, x_spec)
    written = []

    def attend(q, k, v):  # [B, 1, Hq | Hkv, D]
        cw = mwin.append(c, k[:, 0], v[:, 0])
        written.append(cw)
        return mwin.attention(q[:, 0], cw)[:, None].astype(x.dtype)

    x, _ = layers.block(mc, lp, x, pos[:, None], attend,
                        between=lambda x: place.constrain(x, x_spec), local=True)  # fmt: skip
    return x, written[0]


@functools.partial(jax.jit, static_argnums=0)
def _layer(st: Static, x, lp, c, pos, todo: ofl.Flush | None):
    """One decoder layer of a step: x [B, 1, Hd], layer params, its cache -> (x, cache).

    Jitted so that the L unrolled calls trace (and lower) once; XLA inlines them.
    ``todo``: the cache's flush, encoded early (``oscar_jax.flush``), or None. With
    ``fused_cache_write`` the layer's cache writes are one Pallas launch
    (``prepare_flushes`` then leaves the flushed groups in the ring for it to clear).
    """
    mc, place, ax, be = st.model, st.place, st.axes, st.backends
    x_spec = P(ax.data, None, None)
    x = place.constrain(x, x_spec)
    written = []

    def attend(q, k, v):  # [B, 1, Hq | Hkv, D]: write the token, attend over the cache
        if todo is None:  # the append quantizes a group that ages out itself
            cw = place.append(c, k[:, 0], v[:, 0], implementation=be.encode)
        else:  # the flush was encoded early for all layers: ring slot + group store
            write = "triton" if fused_cache_write(st, c) else "xla"
            cw = place.write_step(c, k[:, 0], v[:, 0], todo, write)
        written.append(cw)
        return place.attention(q[:, 0], cw, be.attention)[:, None].astype(x.dtype)

    x, _ = layers.block(mc, lp, x, pos[:, None], attend,
                        between=lambda x: place.constrain(x, x_spec))  # fmt: skip
    return x, written[0]


def decode_forward(st: Static, params, caches, tok, pos):
    """One new token per row: tok [B] at positions pos [B] -> (logits [B, V], caches).

    ``caches``: tuple of L per-layer caches, updated in place (with donation or as a
    loop carry); the layers run in a Python loop (see the module docstring).
    """
    place, mc = st.place, st.model
    caches = list(place.constrain_caches(tuple(caches)))
    todo = [None] * len(caches)
    glob = mc.global_layers  # the KVCache layers (all, without sliding-window layers)
    if glob and ofl.can_flush_early(caches[glob[0]]):  # the step's flushes: one encode, first
        got, todo_g = place.prepare_flushes(
            tuple(caches[i] for i in glob), st.backends.encode,
            clear=not fused_cache_write(st, caches[glob[0]]),
        )  # fmt: skip
        for j, i in enumerate(glob):
            caches[i], todo[i] = got[j], todo_g[j]
    x = layers.embed(params, tok[:, None], mc)  # [B, 1, Hd]
    out = []
    for i, c in enumerate(caches):
        lp = layer_params(params, i, after=x)
        if mc.is_local(i):
            x, c = _local_layer(st, x, lp, c, pos)
        else:
            x, c = _layer(st, x, lp, c, pos, todo[i])
        out.append(c)
    logits = place.constrain(layers.lm_head(st.model, params, x[:, 0]), P(st.axes.data, None))
    return logits, place.constrain_caches(tuple(out))
