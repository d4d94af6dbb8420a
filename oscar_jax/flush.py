"""Early flushes: encode the ring groups that the next appends of many caches are due.

A decode step appends one token to every layer's cache; about one step in G each
append flushes its oldest ring group (encodes G tokens). The group due never holds
the token being appended when R >= 1 (R is a multiple of G, so the ring keeps at
least G newer tokens), so the flushes of all layers can be encoded first, in one
batch (one encoder and one ``lax.cond`` in the compiled program, not one per layer)::

    caches, todo = prepare_flushes(caches)          # encode all; clear the groups' slots
    c = append_to_ring(caches[i], k_t, v_t)[0]      # per layer, then
    c = write_flush(c, todo[i])                     # store its encoded groups

gives the cache of ``append(caches[i], k_t, v_t)``, bit-identical: the encoders'
rotation is elementwise butterflies (``hadamard.rotate`` without ``dense``), so a row
rounds the same whatever the batch (the ``random_orthogonal`` rotation is a matmul,
whose rounding may depend on the row count). ``flush_early`` does both steps at once.
Every write is an in-place update of the slots and groups that change.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from oscar_jax.cache import FLAG_NONFINITE, KVCache
from oscar_jax.codec import EncodedKeys, EncodedValues
from oscar_jax.ring import (
    append_to_ring,
    clear_groups,
    encode_groups,
    flush_due,
    ring_groups,
    write_groups,
)


def can_flush_early(cache: KVCache) -> bool:
    """Whether ``flush_early`` applies: a quantized part, and R >= 1."""
    return cache.cfg.quantized and cache.quant_capacity > 0 and cache.cfg.residual_length > 0


def split_rows(x: Array, n: int, j: int) -> Array:
    """Rows of cache j from a batch [B * n, ...] (rows b-major, caches minor)."""
    return x.reshape(x.shape[0] // n, n, *x.shape[1:])[:, j]


class Flush(NamedTuple):
    """One cache's pending flush: encoded groups [B, H, G, ...], nq [B], rows flushing [B];
    for a layout='record' cache the groups' half-record words [B, H, W] (W =
    ``record.record_words(bits)``; or None: computed at the write)."""

    ek: EncodedKeys
    ev: EncodedValues
    nq: Array
    flush: Array
    words: Array | None = None


def encode_due(caches, implementation: str = "xla", **options):
    """Encode the groups due in all caches at once.

    -> (due [(nq, flush)] and groups [(kg, vg)] per cache, (EncodedKeys, EncodedValues,
    record words or None), overflow [B * n]) with rows b-major and caches minor (a sharded
    batch stays contiguous).
    """
    due = [flush_due(c) for c in caches]
    groups = [ring_groups(c, nq) for c, (nq, _) in zip(caches, due, strict=True)]
    kg, vg = (jnp.stack([g[i] for g in groups], axis=1) for i in (0, 1))  # [B, n, H, G, D]
    kg, vg = (x.reshape(-1, *x.shape[2:]) for x in (kg, vg))  # [B * n, H, G, D]
    flush, nq = (jnp.stack([d[i] for d in due], axis=1).reshape(-1) for i in (1, 0))
    ek, ev, bad, words = encode_groups(kg, vg, flush, nq, caches[0].cfg, implementation,
                                       options)  # fmt: skip
    return due, groups, (ek, ev, words), bad


def prepare_flushes(caches, implementation: str = "xla", *, clear: bool = True, **options):
    """Encode the groups due in all caches (one batch) and clear their ring slots.

    -> (caches, one ``Flush`` per cache for ``write_flush`` after its ``append_to_ring``).
    The lengths stay until that ring append. ValueError unless all ``can_flush_early``.
    ``clear=False`` leaves the groups in their ring slots (the encoding overflows are
    still flagged) for a caller that clears them itself, per layer
    (``pallas_kernels.cache_write.fused_update``).
    """
    caches = tuple(caches)
    if not caches or not all(can_flush_early(c) for c in caches):
        raise ValueError("flush_early needs quantized caches with residual_length >= 1")
    due, groups, enc, bad = encode_due(caches, implementation, **options)
    n, out, todo = len(caches), [], []
    for j, (c, (nq, fl), g) in enumerate(zip(caches, due, groups, strict=True)):
        ekj, evj, wj = jax.tree_util.tree_map(lambda x, j=j: split_rows(x, n, j), enc)
        bad_j = split_rows(bad, n, j)
        if clear:
            out.append(clear_groups(c, nq, fl, bad_j, *g))
        else:  # the flags of clear_groups, without its ring writes
            nonfinite = jnp.where(bad_j, FLAG_NONFINITE, 0).astype(jnp.int32)
            out.append(dataclasses.replace(c, flags=c.flags | nonfinite))
        todo.append(Flush(ekj, evj, nq, fl, wj))
    return tuple(out), tuple(todo)


def write_flush(cache: KVCache, f: Flush, q_offset=0) -> KVCache:
    """Store a pending flush's groups (``write_groups``; shard-aware with ``q_offset``)."""
    return write_groups(cache, f.ek, f.ev, f.nq, f.flush, q_offset, words=f.words)


def _ring_only(cache: KVCache, k_t: Array, v_t: Array) -> KVCache:
    return append_to_ring(cache, k_t, v_t)[0]


def write_step(
    cache: KVCache, k_t: Array, v_t: Array, f: Flush, *, append=_ring_only, write=write_flush
) -> KVCache:
    """One decode step's writes when its flush was encoded early (``prepare_flushes``): the
    token k_t / v_t [B, H, D] into the ring, then the flushed groups (``write_flush``). The
    "xla" cache write of ``oscar_jax.backends`` (``pallas_kernels.cache_write.fused_update``
    writes the same bits in one launch). The flush mask is ANDed with this cache's
    ``flags >= 0`` (always true) so that XLA cannot hoist the group writes, nor later reads
    of the cache, of every layer to the start of a step and hold them all at once.
    ``append(cache, k_t, v_t)`` / ``write(cache, f)``: the ring write and the group store
    (their per-shard forms under a mesh)."""
    c = append(cache, k_t, v_t)
    return write(c, f._replace(flush=f.flush & (c.flags >= 0)))


def flush_early(caches, implementation: str = "xla", **options) -> tuple[KVCache, ...]:
    """Quantize now the ring group that the next append of each cache would flush.

    ``caches``: caches of one config and shape (e.g. one per layer). The lengths stay
    until ``append_to_ring``. ValueError unless every cache ``can_flush_early``.
    """
    caches, todo = prepare_flushes(caches, implementation, **options)
    return tuple(write_flush(c, f) for c, f in zip(caches, todo, strict=True))
