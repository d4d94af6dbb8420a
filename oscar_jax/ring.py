"""The decode-time residual ring of ``oscar_jax.cache``: append one token per row, and
flush the oldest whole group of G tokens to the quantized part when it is due.

Every write is an in-place ``scatter`` of whole runs (``_set_rows``), so a step touches
one ring slot and, on a flush, one group per row. The pieces (``append_to_ring``,
``encode_flush``, ``write_groups``) are public to the sharded step
(``oscar_jax.sharding``), the fused Pallas write (``pallas_kernels.cache_write``) and
``oscar_jax.flush``, which recombine them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from oscar_jax import codec, record
from oscar_jax.cache import (
    FLAG_NONFINITE,
    FLAG_OVERFLOW,
    KVCache,
    _check_kv,
    _div,
    _nonfinite_encoding,
    _nonfinite_rows,
    _rem,
    quantized_count,
)
from oscar_jax.config import KVQuantConfig
from oscar_jax.eager import compiled


@compiled(arrays=("cache", "k_t", "v_t"))
def append(
    cache: KVCache,
    k_t: Float[Array, "B H D"],
    v_t: Float[Array, "B H D"],
    *,
    implementation: str = "xla",
    **options,
) -> KVCache:
    """Add one token per row; flush a whole group of G to the quantized part when due.

    A full row (length == max_len) is left unchanged and gets FLAG_OVERFLOW.
    ``implementation`` picks the encoder used by flushes ("xla" or "pallas").
    Only the ring slot and (on a flush) one group per row are written, in place: the
    encoding runs under a ``lax.cond`` that returns the small encoded groups, never
    the cache (a cond returning the cache makes XLA copy it).
    """
    _check_kv(cache, k_t, v_t, 3, "[batch, num_kv_heads, head_dim]")
    out, nq_old, flush = append_to_ring(cache, k_t, v_t)
    if not cache.cfg.quantized or cache.quant_capacity == 0:
        return out  # nothing can ever flush
    c, ek, ev, words = encode_flush(out, nq_old, flush, implementation, options)
    return write_groups(c, ek, ev, nq_old, flush, words=words)


def _set_rows(dst: Array, src: Array, pos: Array, ok: Array, offset=0) -> Array:
    """dst[b, :, pos[b] - offset : + len] = src[b] where ok[b] and the run lies in dst.

    ``offset`` is the global position of dst's first element along axis 2: a shard
    of a sequence-sharded array writes only the runs that it owns. One ``scatter`` of
    whole runs (an in-place update); a run out of bounds, or not ok, is dropped whole.
    """
    local = jnp.where(ok, pos - offset, dst.shape[2]).astype(jnp.int32)  # dst.shape[2]: dropped
    dn = jax.lax.ScatterDimensionNumbers(  # rows are a batch dimension (sharded rows stay local)
        update_window_dims=tuple(range(1, dst.ndim)),
        inserted_window_dims=(),
        scatter_dims_to_operand_dims=(2,),
        operand_batching_dims=(0,),
        scatter_indices_batching_dims=(0,),
    )
    drop = jax.lax.GatherScatterMode.FILL_OR_DROP
    return jax.lax.scatter(dst, local[:, None], src.astype(dst.dtype), dn,
                           indices_are_sorted=True, unique_indices=True, mode=drop)  # fmt: skip


def flush_due(cache: KVCache) -> tuple[Array, Array]:
    """(nq [B], flush [B]): quantized count now, and rows whose next append will flush."""
    n = cache.lengths
    nq = quantized_count(n, cache.cfg)
    n_new = n + (n < cache.max_len).astype(n.dtype)
    return nq, quantized_count(n_new, cache.cfg) > nq


def ring_append_plan(cache: KVCache, k_t, v_t):
    """One token's ring append, without the write: (ok [B]: the row has room, its ring
    slot [B], the new lengths [B] and flags [B])."""
    n = cache.lengths
    ok = n < cache.max_len
    flags = cache.flags | jnp.where(ok, 0, FLAG_OVERFLOW) | _nonfinite_rows(k_t, v_t)
    return ok, _rem(n, cache.slots_total), n + ok.astype(jnp.int32), flags


def append_to_ring(cache: KVCache, k_t, v_t, ring_offset=0):
    """Write one token per row into the ring; return (cache, nq before, rows due to flush)."""
    ok, slot, lengths, flags = ring_append_plan(cache, k_t, v_t)
    nq_old, flush = flush_due(cache)
    out = dataclasses.replace(
        cache,
        k_res=_set_rows(cache.k_res, k_t[:, :, None], slot, ok, ring_offset),
        v_res=_set_rows(cache.v_res, v_t[:, :, None], slot, ok, ring_offset),
        lengths=lengths,
        flags=flags,
    )
    return out, nq_old, flush


def ring_groups(cache: KVCache, nq: Array) -> tuple[Array, Array]:
    """The ring group of tokens nq..nq+G-1 of each row: keys, values [B, H, G, D]."""
    start = _rem(nq, cache.slots_total)  # multiple of G since S is
    g = cache.cfg.group_size
    take = jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, g, axis=1))
    return take(cache.k_res, start), take(cache.v_res, start)


def encode_groups(kg, vg, flush: Array, nq: Array, cfg: KVQuantConfig, implementation: str,
                  options):  # fmt: skip
    """Encode groups [B, H, G, D] when a row flushes (a ``lax.cond`` of small outputs).

    -> (EncodedKeys, EncodedValues, overflow [B]: a flushing row whose encoding is not
    finite, words: for a layout='record' config the half-record words [B, H, W] of the
    groups stored at quantized position nq [B] (``record.flush_words``), else None).
    Without a flushing row the encoder is skipped (zeros returned).
    """

    def enc(kg, vg):
        ek, ev = codec.encode(kg, vg, cfg, implementation=implementation, **options)
        words = None
        if cfg.layout == "record":
            words = record.flush_words(ek, ev, nq, param_dtype=cfg.scale_dtype)
        return ek, ev, flush & _nonfinite_encoding(ek, ev, cfg.levels), words

    shapes = jax.eval_shape(enc, kg, vg)
    skip = lambda kg, vg: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731
    return jax.lax.cond(jnp.any(flush), enc, skip, kg, vg)


def clear_groups(cache: KVCache, nq: Array, flush: Array, overflow: Array, kg, vg) -> KVCache:
    """Zero the ring slots of each flushing row's group and flag encoding overflows.

    ``kg``, ``vg``: the groups as read (``ring_groups``), written back to the rows that do
    not flush: the write then depends on that read, so XLA orders the read first and
    updates the ring in place (an unordered read would make it copy the ring).
    """
    start = _rem(nq, cache.slots_total)
    keep = lambda g: jnp.where(flush[:, None, None, None], jnp.zeros((), g.dtype), g)  # noqa: E731
    every = jnp.ones_like(flush)
    return dataclasses.replace(
        cache,
        k_res=_set_rows(cache.k_res, keep(kg), start, every),
        v_res=_set_rows(cache.v_res, keep(vg), start, every),
        flags=cache.flags | jnp.where(overflow, FLAG_NONFINITE, 0).astype(jnp.int32),
    )


def encode_flush(cache: KVCache, nq: Array, flush: Array, implementation: str, options):
    """Encode each flushing row's oldest ring group (tokens nq..nq+G-1) and zero its slots.

    -> (cache with the slots cleared, EncodedKeys, EncodedValues, record words or None) for
    ``write_groups``.
    """
    kg, vg = ring_groups(cache, nq)
    ek, ev, overflow, words = encode_groups(kg, vg, flush, nq, cache.cfg, implementation,
                                            options)  # fmt: skip
    return clear_groups(cache, nq, flush, overflow, kg, vg), ek, ev, words


def write_groups(cache: KVCache, ek, ev, nq: Array, flush: Array, q_offset=0,
                 words: Array | None = None) -> KVCache:  # fmt: skip
    """Store encoded groups at token position nq of each flushing row (shard-aware);
    ``words``: a record cache's half-record words from ``encode_groups`` (else computed)."""
    if cache.cfg.layout == "record":
        return _write_records(cache, ek, ev, nq, flush, q_offset, words)
    g = cache.cfg.group_size
    gofs = q_offset // g
    return dataclasses.replace(
        cache,
        k_codes=_set_rows(cache.k_codes, ek.codes, nq, flush, q_offset),
        k_scale=_set_rows(cache.k_scale, ek.scale, _div(nq, g), flush, gofs),
        k_zero=_set_rows(cache.k_zero, ek.zero, _div(nq, g), flush, gofs),
        k_norm=_set_rows(cache.k_norm, ek.norm, nq, flush, q_offset),
        v_codes=_set_rows(cache.v_codes, ev.codes, nq, flush, q_offset),
        v_scale=_set_rows(cache.v_scale, ev.scale, nq, flush, q_offset),
        v_zero=_set_rows(cache.v_zero, ev.zero, nq, flush, q_offset),
    )


def _write_records(cache: KVCache, ek, ev, nq: Array, flush: Array, q_offset=0,
                   words: Array | None = None) -> KVCache:  # fmt: skip
    """``write_groups`` of a layout='record' cache: each flushing row's group becomes one half
    of record nq // 64 (read, merged by the half's word mask, written back: one
    record per (row, head)), its norms go to kn[nq : nq + G] as float32."""
    rec, tile = cache.k_codes, record.TILE
    words, mask, norm = record.group_update(ek, ev, nq, cache.num_kv_heads, words=words,
                                            param_dtype=cache.cfg.scale_dtype)  # fmt: skip
    r, r_offset = _div(nq, tile), q_offset // tile
    local = jnp.clip(r - r_offset, 0, rec.shape[2] - 1)  # out of this shard: dropped below
    old = jax.vmap(lambda x, i: jax.lax.dynamic_index_in_dim(x, i, 1, keepdims=False))(rec, local)
    new = jnp.where(mask[:, None, :], words, old)
    return dataclasses.replace(
        cache,
        k_codes=_set_rows(rec, new[:, :, None], r, flush, r_offset),
        k_norm=_set_rows(cache.k_norm, norm, nq, flush, q_offset),
    )
