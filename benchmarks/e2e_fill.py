"""Random weights and caches of the real shapes for the end-to-end benchmarks (no download,
no long forward pass).

* Pseudo-random bf16 weights of the real shapes (std 0.02, from an integer hash of each
  element's index), made on the device in one jit, optionally straight into a mesh
  layout: nothing float32 is materialised, on the host or the device. The layers are
  in the per-layer form (``models.layers.unstack_layers``: a tuple of L dicts, each
  layer its own buffers), which the decode step reads in place. The value
  rotation is not folded: folding an orthogonal matrix into random weights gives another
  random draw, so the weights are taken as already folded (the cache config has
  ``rotate_values=False``, as ``models.prepare`` hands it).
* Caches of any context without a long forward pass: allocated and filled on the device
  (``fill="random"``: random codes / scales / norms / ring, lengths set; ``"encode"``: the
  real ``oscar_jax.prefill`` of random K/V, layer by layer and in row chunks; ``"zeros"``:
  lengths only). The decode kernels do the same work for any content.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

import oscar_jax as oj
from benchmarks.e2e_common import abstract
from models import layers, memory
from models.config import ModelConfig
from oscar_jax import sharding as osh


def _mix32(x):
    """The lowbias32 integer hash (uint32 -> uint32)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def hash_uniform(shape, salt: int, offset: int = 0):
    """Pseudo-random float32 in [0, 1) from a hash of each element's index (plus ``offset``:
    a part of a bigger array, e.g. one layer's, gets that array's values).

    Elementwise integer ops only: it compiles in a blink and fuses into its consumer
    (``jax.random``'s threefry takes seconds to compile per shape on CPU). Indices wrap
    at 2^32 elements (a repeated pattern past that is harmless for timing).
    """
    idx = jnp.full(shape, offset % 2**32, jnp.uint32)
    stride = 1
    for ax in range(len(shape) - 1, -1, -1):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, ax) * jnp.uint32(stride % 2**32)
        stride *= shape[ax]
    salt = jnp.uint32(salt & 0xFFFFFFFF) if isinstance(salt, int) else salt.astype(jnp.uint32)
    x = _mix32(idx ^ _mix32(salt))
    return (x >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def random_params(cfg: ModelConfig, shardings, seed: int = 0, dtype=jnp.bfloat16) -> dict:
    """Weights ~ U with std 0.02 (ones for norms, zeros for biases) in ``dtype``, on the device.

    The per-layer form (``layers.unstack_layers``: what the decode step reads in place);
    layer l's tensor holds the values of slice l of the stacked one (salted by its index in
    the stacked tree, hashed by its stacked element index). One jit, fused per tensor:
    nothing float32 is materialised, on the host or the device.
    """
    shapes = layers.param_shapes(cfg)
    flat, _ = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=layers.is_shape)
    salt = {tuple(str(getattr(k, "key", k)) for k in p): 1000 * seed + i
            for i, (p, _) in enumerate(flat)}  # fmt: skip
    half = 0.02 * np.sqrt(3.0)  # U(-a, a) has std a / sqrt(3)

    def tensor(name, shape, key, offset=0):
        if "norm" in name:
            return jnp.ones(shape, dtype)
        if name.startswith("b"):
            return jnp.zeros(shape, dtype)
        return (half * (2.0 * hash_uniform(shape, salt[key], offset) - 1.0)).astype(dtype)

    def build():
        out = {k: tensor(k, s, (k,)) for k, s in shapes.items() if k != "layers"}

        def one(k, s, i):
            t = tensor(k, s[1:], ("layers", k), i * int(np.prod(s[1:])))
            return layers.Transposed(t.T) if k in layers.PROJECTIONS else t

        lay = shapes["layers"]
        out["layers"] = tuple(
            {k: one(k, s, i) for k, s in lay.items()} for i in range(cfg.num_layers)
        )
        return out

    return jax.jit(build, out_shardings=shardings)()


def tree_nbytes(tree) -> int:
    return memory.abstract_nbytes(tree)


def abstract_caches(cfg, kv, batch, max_len, mesh=None, ax=osh.AXES, device=None,
                    dtype=jnp.bfloat16):  # fmt: skip
    """The per-layer caches (tuple of L [B, ...]) as ShapeDtypeStructs carrying shardings."""
    if cfg.local_layers:  # make_caches fills KVCaches only
        raise ValueError(
            f"local_layers={cfg.local_layers}: the end-to-end benchmarks model every layer's "
            "cache as a KVCache; Gemma 3's rings: models.abstract_decode_caches"
        )
    shapes = memory.abstract_cache(cfg, kv, batch=batch, max_len=max_len, dtype=dtype)
    if mesh is None:
        sh = SingleDeviceSharding(device or jax.devices()[0])
        one = jax.tree_util.tree_map(lambda s: abstract(s.shape, s.dtype, sh), shapes)
    else:
        shards = osh.cache_shardings(shapes, mesh, ax)
        one = jax.tree_util.tree_map(lambda s, h: abstract(s.shape, s.dtype, h), shapes, shards)
    return (one,) * cfg.num_layers


def _random_field(salt: int, s, name):
    """Plausible pseudo-random content of one cache field (finite, all code values used)."""
    u = hash_uniform(s.shape, salt)
    if s.dtype == jnp.uint8:
        return (u * 256.0).astype(jnp.uint8)
    if name.endswith("scale"):
        return (0.01 + 0.05 * u).astype(s.dtype)
    if name.endswith("zero"):
        return (-0.1 * u).astype(s.dtype)
    if name == "k_norm":
        return (1.0 + 10.0 * u).astype(s.dtype)
    return (3.4641 * (u - 0.5)).astype(s.dtype)  # ring K/V: mean 0, std 1


@functools.lru_cache(maxsize=64)
def _cache_builder(leaves: tuple, tree, zeros: bool, seed: int):
    """One jitted allocator per (shapes, shardings, fill) of the per-layer caches:
    ``build(n_tokens, first_layer)``, both arguments (layers first_layer...)."""
    caches = jax.tree_util.tree_unflatten(tree, leaves)
    names = [f.name for f in dataclasses.fields(oj.KVCache) if f.name not in ("cfg", "max_len")]

    def one(shapes, layer, n_tokens):
        if shapes.cfg.layout == "record":  # random planar fields, converted exactly
            planar = jax.eval_shape(functools.partial(oj.convert_layout, layout="planar"), shapes)
            return oj.convert_layout(one(planar, layer, n_tokens), "record")
        vals = {}
        for i, name in enumerate(names):
            s = getattr(shapes, name)
            if name == "lengths":
                vals[name] = jnp.full(s.shape, n_tokens, jnp.int32)
            elif name == "flags" or zeros:
                vals[name] = jnp.zeros(s.shape, s.dtype)
            else:
                vals[name] = _random_field(100 * seed + i + 10_000 * layer, s, name)
        return oj.KVCache(**vals, cfg=shapes.cfg, max_len=shapes.max_len)

    def build(n_tokens, first_layer):
        return tuple(one(c, first_layer + i, n_tokens) for i, c in enumerate(caches))

    return jax.jit(build, out_shardings=jax.tree_util.tree_map(lambda s: s.sharding, caches))


def make_caches(shapes, n_tokens: int, fill: str = "random", seed: int = 0):
    """Allocate the per-layer caches of ``shapes`` (``abstract_caches``: a tuple, with
    shardings) holding n_tokens per row.

    ``fill``: "random" (random field contents), "zeros" (lengths only) or "encode"
    (``oscar_jax.prefill`` of random N(0, 1) K/V, one layer and a few rows at a time).
    """
    if fill not in ("random", "zeros", "encode"):
        raise ValueError(f"fill={fill!r} must be random, zeros or encode")
    shard = jax.tree_util.tree_map(lambda s: s.sharding, shapes)
    if fill == "random" and shapes and shapes[0].cfg.layout == "record":
        # one program a layer: the planar fields a record cache is converted from would
        # double an all-layer program's peak (out of memory at the largest batch)
        # (one compiled program for all layers: the layer is an argument)
        leaves, tree = jax.tree_util.tree_flatten(shapes[:1])
        build = _cache_builder(tuple(leaves), tree, False, seed)
        caches = tuple(build(jnp.int32(n_tokens), jnp.int32(i))[0] for i in range(len(shapes)))
    else:
        leaves, tree = jax.tree_util.tree_flatten(shapes)
        build = _cache_builder(tuple(leaves), tree, fill != "random", seed)
        caches = build(jnp.int32(n_tokens), jnp.int32(0))
    caches = jax.device_put(caches, shard)  # empty fields (bf16: no quantized part) may differ
    if fill == "encode":
        caches = encode_fill(caches, n_tokens, seed)
    return caches


def encode_fill(caches, n_tokens: int, seed: int = 0, chunk_tokens: int = 1 << 17):
    """Real ``oscar_jax.prefill`` of random K/V into every layer's cache, rows in chunks (in
    place; one compiled program, called per layer)."""
    c0 = caches[0]
    b, h, _, d = c0.k_res.shape  # per layer [B, H, S, D]
    rb = max(1, min(b, chunk_tokens // max(n_tokens, 1)))
    while b % rb:
        rb -= 1
    shard = jax.tree_util.tree_map(lambda x: x.sharding, c0)

    def run(cache, key):
        def one(i, c):
            r0 = i * rb
            kk, kv_ = jax.random.split(jax.random.fold_in(key, i))
            k = jax.random.normal(kk, (rb, n_tokens, h, d), jnp.float32).astype(c0.dtype)
            v = jax.random.normal(kv_, (rb, n_tokens, h, d), jnp.float32).astype(c0.dtype)
            part = oj.prefill(oj.init_cache(c0.cfg, batch=rb, max_len=c0.max_len,
                                            num_kv_heads=h, head_dim=d, dtype=c0.dtype),
                              k, v)  # fmt: skip

            def put(dst, src):
                idx = (r0,) + (0,) * (dst.ndim - 1)
                return jax.lax.dynamic_update_slice(dst, src.astype(dst.dtype), idx)

            return jax.tree_util.tree_map(put, c, part)

        return jax.lax.fori_loop(0, b // rb, one, cache)

    fn = jax.jit(run, donate_argnums=0, out_shardings=shard)
    key = jax.random.key(seed + 1)
    return tuple(fn(c, jax.random.fold_in(key, layer)) for layer, c in enumerate(caches))


def delete(tree) -> None:
    """Free the device buffers of a pytree now (so the next allocation can reuse them)."""
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()
