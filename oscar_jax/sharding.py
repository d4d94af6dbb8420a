"""Sharded caches and decode attention on a (data, model, sequence) device mesh.

Default layout (``MeshAxes``; every axis must exist in the mesh, size 1 is fine):

* **data**: batch rows (all per-row arrays, ``lengths`` and ``flags``).
* **model**: KV heads (and the query heads that read them; ``per_token`` norms,
  shared by all heads, are replicated over this axis).
* **sequence**: the quantized part along tokens (codes, scales, zeros, norms).
  The full-precision ring (R + G tokens) stays replicated over this axis: it is
  small and every shard needs the newest tokens. For a ``bf16`` cache the ring
  *is* the sequence, so it is split along slots instead.

Decode attention runs under ``shard_map``: each device attends over its own
shard and returns (acc, max, sum); the partials are merged exactly with a
``pmax`` and two ``psum`` over the sequence axis, then the replicated ring is
folded in. The quantized shard's partial is the XLA reference math
(``implementation="xla"``) or the Pallas INT2/INT4 split-K kernel ("pallas",
registered by ``pallas_kernels``, told the shard's own token count); the ring
(and the whole ``bf16`` cache, split along slots) always uses the XLA math.
Appends write only on the shard that owns the position, so nothing is gathered
(``tests/test_sharding.py`` checks the compiled HLO).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from oscar_jax import attention as att
from oscar_jax import backends, record, ring
from oscar_jax import cache as kvc
from oscar_jax import flush as fl
from oscar_jax.cache import KVCache
from oscar_jax.codec import EncodedKeys, EncodedValues


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """Names of the mesh axes that shard rows, heads and tokens."""

    data: str = "data"
    model: str = "model"
    sequence: str = "sequence"


AXES = MeshAxes()


def mesh_sizes(mesh: Mesh, ax: MeshAxes = AXES) -> tuple[int, int, int]:
    """(data, model, sequence) sizes of the mesh; ValueError if an axis is missing."""
    missing = [a for a in (ax.data, ax.model, ax.sequence) if a not in mesh.shape]
    if missing:
        raise ValueError(f"mesh axes {tuple(mesh.shape)} must include {missing}")
    return mesh.shape[ax.data], mesh.shape[ax.model], mesh.shape[ax.sequence]


def _per_layer(cache: KVCache, leading_axes: int) -> KVCache:
    """The cache with ``leading_axes`` leading (stacking) axes dropped, as shapes only."""
    if leading_axes == 0:
        return cache
    if isinstance(leading_axes, bool) or not isinstance(leading_axes, int) or leading_axes < 0:
        raise ValueError(f"leading_axes={leading_axes!r} must be an int >= 0")
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape[leading_axes:], x.dtype), cache
    )


def cache_specs(cache: KVCache, ax: MeshAxes = AXES, leading_axes: int = 0) -> KVCache:
    """A KVCache-shaped pytree of PartitionSpecs: the default layout above.

    ``leading_axes``: unsharded axes in front of every field, e.g. 1 for the caches of all
    layers stacked on a leading layer axis (``jax.vmap`` of ``init_cache``).
    """
    if leading_axes:
        specs = cache_specs(_per_layer(cache, leading_axes), ax)
        pad = (None,) * leading_axes
        return jax.tree_util.tree_map(
            lambda s: P(*pad, *s), specs, is_leaf=lambda x: isinstance(x, P)
        )
    d, m, s = ax.data, ax.model, ax.sequence
    q4 = P(d, m, s, None)
    norm_heads = m if cache.k_norm.shape[1] == cache.num_kv_heads else None
    ring = P(d, m, s, None) if not cache.cfg.quantized else P(d, m, None, None)
    return dataclasses.replace(
        cache,
        k_codes=q4, k_scale=q4, k_zero=q4, k_norm=P(d, norm_heads, s),
        v_codes=q4, v_scale=q4, v_zero=q4,
        k_res=ring, v_res=ring, lengths=P(d), flags=P(d),
    )  # fmt: skip


def check_mesh(cache: KVCache, mesh: Mesh, ax: MeshAxes = AXES, leading_axes: int = 0) -> None:
    """ValueError unless the cache's shapes divide evenly over the mesh."""
    cache = _per_layer(cache, leading_axes)
    nd, nm, ns = mesh_sizes(mesh, ax)
    if cache.batch % nd:
        raise ValueError(f"batch={cache.batch} must be divisible by the {ax.data} axis ({nd})")
    if cache.num_kv_heads % nm:
        raise ValueError(
            f"num_kv_heads={cache.num_kv_heads} must be divisible by the {ax.model} axis ({nm})"
        )
    if cache.cfg.quantized:  # whole groups (records of 64 tokens for layout='record') a shard
        need = ns * (record.TILE if cache.cfg.layout == "record" else cache.cfg.group_size)
        if cache.quant_capacity % need:
            raise ValueError(
                f"quantized capacity {cache.quant_capacity} must be divisible by "
                f"{ax.sequence} axis x group_size = {need} (raise max_len)"
            )
    elif cache.slots % ns:
        raise ValueError(
            f"max_len={cache.max_len} must be divisible by the {ax.sequence} axis ({ns}) "
            "for a bf16 cache"
        )


def cache_shardings(
    cache: KVCache, mesh: Mesh, ax: MeshAxes = AXES, leading_axes: int = 0
) -> KVCache:
    """A KVCache-shaped pytree of NamedShardings (for jit's in/out_shardings)."""
    check_mesh(cache, mesh, ax, leading_axes)
    specs = cache_specs(cache, ax, leading_axes)
    return jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
    )


def shard_cache(cache: KVCache, mesh: Mesh, ax: MeshAxes = AXES, leading_axes: int = 0) -> KVCache:
    """Place a cache (``leading_axes`` stacking axes in front) on the mesh in the default layout."""
    return jax.device_put(cache, cache_shardings(cache, mesh, ax, leading_axes))


def query_spec(ax: MeshAxes = AXES) -> P:
    """q and the attention output [B, Hq, D]: rows on data, heads on model."""
    return P(ax.data, ax.model, None)


def _merge_over(part, axis: str):
    """Exact softmax merge of (acc, m, l) partials across a mesh axis (inside shard_map)."""
    acc, m, denom = part
    m_all = jax.lax.pmax(m, axis)
    acc, denom = att.rescale_partials([(acc, m, denom)], m_all)
    return jax.lax.psum(acc, axis), m_all, jax.lax.psum(denom, axis)


def sharded_decode_attention(
    q: Float[Array, "B Hq D"],
    cache: KVCache,
    mesh: Mesh,
    *,
    softmax_scale: float | None = None,
    ax: MeshAxes = AXES,
    implementation: str = "auto",
    **options,
) -> Float[Array, "B Hq D"]:
    """``decode_attention`` over a cache sharded in the default layout.

    ``implementation``: the shards' partial (``backends.TABLES["quantized_partial"]``),
    "xla" (reference math), "triton" (the INT kernel over the quantized part, the BF16
    kernel over a ``bf16`` cache's ring slice; ``options``: their ``DecodeConfig`` fields)
    or "auto" (``backends.choose``: Triton on a GPU where it covers the cache, else XLA).
    """
    g = att.check_query(q, cache)
    check_mesh(cache, mesh, ax)
    implementation = backends.pick("quantized_partial", implementation, cache, g, options)
    partial = backends.resolve("quantized_partial", implementation)
    if options and implementation == "xla":
        raise ValueError(f"options {sorted(options)} need implementation='triton', not 'xla'")
    cfg = cache.cfg

    def local(q, c):
        qg, q_rot, scale = att.grouped_query(q, c, softmax_scale)
        idx = jax.lax.axis_index(ax.sequence)
        if cfg.quantized:
            part = partial(q_rot, c, scale, offset=idx * c.quant_capacity, **options)
            acc, m, denom = _merge_over(part, ax.sequence)
            parts = [(att.unrotate_values(acc, cfg), m, denom), att.residual_partial(qg, c, scale)]
        else:  # the whole bf16 cache is ring: each shard holds slots idx * slots..
            part_fn = att.residual_partial if implementation == "xla" else partial
            part = part_fn(qg, c, scale, offset=idx * c.slots, **options)
            parts = [_merge_over(part, ax.sequence)]
        return att.merge_partials(parts).reshape(q.shape).astype(q.dtype)

    fn = shard_map_on(mesh, local, (query_spec(ax), cache_specs(cache, ax)), query_spec(ax))
    return att.poison_flagged_rows(fn(q, cache), cache)  # as decode_attention does


def sharded_append(
    cache: KVCache,
    k_t: Float[Array, "B H D"],
    v_t: Float[Array, "B H D"],
    mesh: Mesh,
    *,
    implementation: str = "xla",
    ax: MeshAxes = AXES,
    flush: bool = True,
    **options,
) -> KVCache:
    """``append`` for a cache in the default layout: each shard writes only what it owns.

    ``flush=False``: the ring write alone (the flush encoded early by
    ``oscar_jax.flush.prepare_flushes``, stored by ``sharded_write_flush``).
    """
    kvc._check_kv(cache, k_t, v_t, 3, "[batch, num_kv_heads, head_dim]")
    check_mesh(cache, mesh, ax)
    specs = cache_specs(cache, ax)
    kv_spec = P(ax.data, ax.model, None)
    if not cache.cfg.quantized:
        flags = cache.flags | kvc._nonfinite_rows(k_t, v_t)  # over all heads, before splitting

        def local_ring(c, k, v, fl):
            out, _, _ = ring.append_to_ring(c, k, v, ring_offset=jax.lax.axis_index(ax.sequence)
                                           * c.slots)  # fmt: skip
            return dataclasses.replace(out, flags=out.flags | fl)

        return shard_map_on(mesh, local_ring, (specs, kv_spec, kv_spec, P(ax.data)), specs)(
            cache, k_t, v_t, flags
        )
    out, nq_old, due = ring.append_to_ring(cache, k_t, v_t)  # ring: not sequence-sharded
    if cache.quant_capacity == 0 or not flush:
        return out
    c, ek, ev, words = ring.encode_flush(out, nq_old, due, implementation, options)
    return sharded_write_flush(c, fl.Flush(ek, ev, nq_old, due, words), mesh, ax)


def shard_map_on(mesh: Mesh, f, ins, outs):
    """``jax.shard_map(f, ...)`` whose arguments are first placed by their ``ins`` specs
    where the mesh has Explicit axes (``jax.make_mesh``'s default from jax 0.11): there
    shard_map refuses an argument whose sharding differs from its spec, e.g. one not yet
    on the mesh. Over Auto axes the arguments pass as they are (placed by the compiler)."""
    fn = jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=outs, check_vma=False)
    explicit = jax.sharding.AxisType.Explicit
    if not any(t == explicit for t in getattr(mesh, "axis_types", ())):
        return fn

    def placed(*args):
        args = jax.tree.map(
            lambda spec, x: jax.sharding.reshard(x, NamedSharding(mesh, spec)), tuple(ins),
            args, is_leaf=lambda v: isinstance(v, P),
        )  # fmt: skip
        return fn(*args)

    return placed


def flush_specs(c: KVCache, ax: MeshAxes = AXES, f: fl.Flush | None = None) -> fl.Flush:
    """PartitionSpecs of a cache's encoded ``Flush`` (rows on data, KV heads on model; a
    record cache's words too, unless the given flush ``f`` carries none)."""
    kv4 = P(ax.data, ax.model, None, None)
    norm = P(ax.data, cache_specs(c, ax).k_norm[1], None)
    has_words = c.cfg.layout == "record" and (f is None or f.words is not None)
    words = P(ax.data, ax.model, None) if has_words else None
    return fl.Flush(EncodedKeys(kv4, kv4, kv4, norm), EncodedValues(kv4, kv4, kv4), P(ax.data),
                    P(ax.data), words)  # fmt: skip


def _or_over(flags, axis: str):
    """Bitwise OR of int32 flags [B] over a mesh axis (one all-reduce)."""
    bits = jax.numpy.arange(31, dtype=flags.dtype)
    on = jax.lax.psum((flags[:, None] >> bits) & 1, axis) > 0
    return jax.numpy.sum(on.astype(flags.dtype) << bits, axis=1).astype(flags.dtype)


def local_flush_reason(cache: KVCache, mesh: Mesh, ax: MeshAxes = AXES) -> str | None:
    """Why ``sharded_prepare_flushes`` cannot encode on each device (None: it can)."""
    _, model, seq = mesh_sizes(mesh, ax)
    if seq != 1:
        return f"mesh axis {ax.sequence!r} has size {seq}; it must be 1"
    if model > 1 and cache.k_norm.shape[1] == 1:
        return "per-token key norms span every KV head: the model axis must have size 1"
    return None


def sharded_prepare_flushes(caches, mesh: Mesh, ax: MeshAxes = AXES, **kwargs):
    """``oscar_jax.flush.prepare_flushes`` on each device's rows and KV heads (``shard_map``).

    For encoders XLA cannot partition (a Pallas kernel would otherwise run on gathered,
    replicated groups). Row flags are OR-ed over the model axis. Needs
    ``local_flush_reason(...) is None`` (ValueError naming the reason otherwise).
    """
    caches = tuple(caches)
    reason = local_flush_reason(caches[0], mesh, ax)
    if reason is not None:
        raise ValueError(reason)

    def local(cs):
        out, todo = fl.prepare_flushes(cs, **kwargs)
        out = tuple(dataclasses.replace(c, flags=_or_over(c.flags, ax.model)) for c in out)
        return out, todo

    specs = tuple(cache_specs(c, ax) for c in caches)
    fspecs = tuple(flush_specs(c, ax) for c in caches)
    return shard_map_on(mesh, local, (specs,), (specs, fspecs))(caches)


def sharded_write_flush(c: KVCache, f: fl.Flush, mesh: Mesh, ax: MeshAxes = AXES) -> KVCache:
    """``oscar_jax.flush.write_flush`` on the sequence shards: each writes the groups it owns."""
    specs, fspec = cache_specs(c, ax), flush_specs(c, ax, f)

    def local_write(c, f):
        return fl.write_flush(c, f, q_offset=jax.lax.axis_index(ax.sequence) * c.quant_capacity)

    return shard_map_on(mesh, local_write, (specs, fspec), specs)(c, f)
