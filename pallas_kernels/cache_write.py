"""One layer's decode-step cache update in one Pallas launch (lowered through Triton).

With early flushes (``oscar_jax.flush``) a layer's step writes its cache by ~11 XLA
scatters: the ring clear of the flushed group (2), the ring append (2) and the store
of the encoded group (7). On the GPU each is its own small kernel, so an INT2 step of 32
layers launches ~400 copies (a BF16 cache: 77).
``fused_update`` does the same writes in one launch per layer, bit-identical to::

    c = clear_groups(c, ...)               # prepare_flushes(..., clear=True)
    c = append_to_ring(c, k_t, v_t)[0]
    c = write_flush(c, todo)

Grid (row b, KV head h): each program writes only its own [b, h] slices, in place
(every cache array is aliased input -> output), at dynamic offsets under ``pl.when``:
zeros over the flushed group's G ring slots, the new token's ring slot when the row
is not full, and the encoded group at token nq when the row flushes. Per-token norms
([B, 1, Lq], shared by the heads) are written by the h = 0 program only. Lengths and
flags stay XLA elementwise ops (they fuse). Runs are dropped as ``ring._set_rows``
drops them (not ok, or not wholly inside the array). The caller's cache comes from
``prepare_flushes(..., clear=False)``: its flags already hold the encoding overflows,
its ring still holds the group (read by the encoder, whose output this kernel takes,
so XLA orders that read before the in-place write).

A layout='record' cache (the Mosaic kernel's) has four cache arrays (ring K and V, the
records, the float32 norms): a flushed group's half-record words (``record.group_update``,
built in XLA) are merged into record nq // 64 by the half's word mask, as
``oscar_jax.ring``'s XLA write does.

It takes 0.7 ms off a Llama-3.1-8B INT2 step (planar cache) at batch 1, 32K and 128K, on
the H200 (BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import oscar_jax
from oscar_jax import record
from oscar_jax import sharding as osh
from oscar_jax.cache import KVCache, _rem
from oscar_jax.flush import Flush, can_flush_early
from oscar_jax.ring import ring_append_plan
from pallas_kernels.decode.config import _pow2

CACHE_FIELDS = ("k_res", "v_res", "k_codes", "k_scale", "k_zero", "k_norm",
                "v_codes", "v_scale", "v_zero")  # fmt: skip


def unsupported_reason(cache) -> str | None:
    """Why ``fused_update`` cannot take this cache (None: it can)."""
    if not isinstance(cache, KVCache):
        return f"cache={type(cache).__name__} must be a KVCache"
    cfg = cache.cfg
    if not can_flush_early(cache):
        return (
            f"cache must be quantized with residual_length >= 1 and a quantized part "
            f"(method={cfg.method!r}, residual_length={cfg.residual_length}, "
            f"quant_capacity={cache.quant_capacity})"
        )
    if cache.slots != cache.slots_total:
        return f"cache.slots={cache.slots} must be {cache.slots_total} (an unsharded ring)"
    if cfg.layout == "record":  # INT2 or INT4, G 32, D 128 (KVQuantConfig validates): pow2 tiles
        return None
    d, db = cache.head_dim, cache.k_codes.shape[3]
    nv = cache.v_scale.shape[3]
    if not (_pow2(d) and _pow2(db) and _pow2(nv)):
        return (
            f"head_dim={d}, packed bytes {db} (bits={cfg.bits}) and value groups {nv} "
            "must be powers of two (Triton tiles)"
        )
    return None


def _ring_writes(slot_ref, clr_ref, at_ref, kt_ref, vt_ref, kr, vr, g: int):
    """Zero the flushed group's G ring slots and write the token's slot (-1: no write);
    returns the group's quantized position (-1: no flush)."""
    slot, clr, at = slot_ref[0], clr_ref[0], at_ref[0]

    @pl.when(clr >= 0)
    def _():
        c0 = pl.multiple_of(clr, g)
        kr[pl.ds(c0, g), :] = jnp.zeros((g, kr.shape[1]), kr.dtype)
        vr[pl.ds(c0, g), :] = jnp.zeros((g, vr.shape[1]), vr.dtype)

    @pl.when(slot >= 0)
    def _():
        kr[pl.ds(slot, 1), :] = kt_ref[...]
        vr[pl.ds(slot, 1), :] = vt_ref[...]

    return at


def _kernel(slot_ref, clr_ref, at_ref, kt_ref, vt_ref, ekc, eks, ekz, ekn, evc, evs, evz,
            *refs, g: int, norm_shared: bool):  # fmt: skip
    """One (b, h): clear the flushed ring group, append the token, store the encoded group."""
    kr, vr, kc, ks, kz, kn, vc, vs, vz = refs[len(CACHE_FIELDS) :]  # the aliased outputs
    at = _ring_writes(slot_ref, clr_ref, at_ref, kt_ref, vt_ref, kr, vr, g)

    @pl.when(at >= 0)
    def _():
        t0 = pl.multiple_of(at, g)
        grp = jax.lax.div(at, jnp.int32(g))
        kc[pl.ds(t0, g), :] = ekc[...]
        ks[pl.ds(grp, 1), :] = eks[...]
        kz[pl.ds(grp, 1), :] = ekz[...]
        vc[pl.ds(t0, g), :] = evc[...]
        vs[pl.ds(t0, g), :] = evs[...]
        vz[pl.ds(t0, g), :] = evz[...]

    norm_ok = at >= 0
    if norm_shared:  # one norm row for all heads: written by head 0 only
        norm_ok = norm_ok & (pl.program_id(1) == 0)

    @pl.when(norm_ok)
    def _():
        kn[pl.ds(pl.multiple_of(at, g), g)] = ekn[...]


def _record_kernel(slot_ref, clr_ref, at_ref, kt_ref, vt_ref, words_ref, mask_ref, ekn, *refs,
                   g: int, rows: int):  # fmt: skip
    """One (b, h) of a layout='record' cache: clear the flushed ring group, append the
    token, merge the group's half-record into record at // 64 (``rows`` rows of 64 words: 25
    at INT2, 40 at INT4; Triton tiles are powers of 2) and
    store its float32 norms at kn[at : at + G]."""
    kr, vr, rec, kn = refs[4:]  # the aliased outputs
    at = _ring_writes(slot_ref, clr_ref, at_ref, kt_ref, vt_ref, kr, vr, g)

    @pl.when(at >= 0)
    def _():
        base = jax.lax.div(at, jnp.int32(record.TILE)) * rows
        for r in range(rows):
            old = rec[pl.ds(base + r, 1), :]
            new = jnp.where(mask_ref[pl.ds(r, 1), :] != 0, words_ref[pl.ds(r, 1), :], old)
            rec[pl.ds(base + r, 1), :] = new
        kn[pl.ds(pl.multiple_of(at, g), g)] = ekn[...]


def _check(cache, k_t, v_t, todo) -> None:
    reason = unsupported_reason(cache)
    if reason is not None:
        raise ValueError(reason)
    want = (cache.batch, cache.num_kv_heads, cache.head_dim)
    for name, x in (("k_t", k_t), ("v_t", v_t)):
        if getattr(x, "shape", None) != want or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(
                f"{name}.shape={getattr(x, 'shape', None)} must be floating {want} "
                "[batch, num_kv_heads, head_dim]"
            )
    if not isinstance(todo, Flush):
        raise ValueError(f"todo={type(todo).__name__} must be an oscar_jax.flush.Flush")
    b, h, g, d = cache.batch, cache.num_kv_heads, cache.cfg.group_size, cache.head_dim
    hn = 1 if cache.cfg.norm_granularity == "per_token" else h
    wants = dict(
        codes=(b, h, g, d * cache.cfg.bits // 8),
        k_scale=(b, h, 1, d),
        k_norm=(b, hn, g),
        v_scale=(b, h, g, d // g),
    )
    got = dict(codes=todo.ek.codes.shape, k_scale=todo.ek.scale.shape,
               k_norm=todo.ek.norm.shape, v_scale=todo.ev.scale.shape)  # fmt: skip
    for key, shape in wants.items():
        if tuple(got[key]) != shape:
            raise ValueError(f"todo's {key}.shape={got[key]} must be {shape} for this cache")
    for name in ("nq", "flush"):
        if jnp.shape(getattr(todo, name)) != (b,):
            raise ValueError(f"todo.{name}.shape={jnp.shape(getattr(todo, name))} must be ({b},)")


def fused_update(
    cache: KVCache,
    k_t,  # [B, H, D]
    v_t,  # [B, H, D]
    todo: Flush,
    *,
    interpret: bool | None = None,
    num_warps: int = 1,
) -> KVCache:
    """``write_flush(append_to_ring(clear_groups(cache, ...), k_t, v_t)[0], todo)`` in one launch.

    ``cache``: one layer's cache from ``prepare_flushes(..., clear=False)`` (the flushed
    group still in its ring slots); ``todo``: its ``Flush``. ``interpret=None``: Pallas
    interpret mode without a GPU. ValueError for caches it does not cover
    (``unsupported_reason``) and for mismatched shapes.
    """
    _check(cache, k_t, v_t, todo)
    if interpret is None:
        interpret = not oscar_jax.gpu_available()
    if cache.cfg.layout == "record":
        return _fused_update_records(cache, k_t, v_t, todo, interpret, num_warps)
    b, h, d = cache.batch, cache.num_kv_heads, cache.head_dim
    g, s, lq = cache.cfg.group_size, cache.slots, cache.quant_capacity
    db, nv, hn = cache.k_codes.shape[3], cache.v_scale.shape[3], cache.k_norm.shape[1]
    slot, clr, at, lengths, flags = _plan(cache, k_t, v_t, todo)

    def full(*shape):
        return pl.BlockSpec((None, None, *shape), lambda i, j: (i, j) + (0,) * len(shape))

    def norm(size):
        return pl.BlockSpec((None, None, size), (lambda i, j: (i, j if hn > 1 else 0, 0)))

    row = pl.BlockSpec((1,), lambda i, j: (i,))
    cache_specs = [full(s, d), full(s, d), full(lq, db), full(lq // g, d), full(lq // g, d),
                   norm(lq), full(lq, db), full(lq, nv), full(lq, nv)]  # fmt: skip
    in_specs = [row, row, row, full(1, d), full(1, d), full(g, db), full(1, d), full(1, d),
                norm(g), full(g, db), full(g, nv), full(g, nv), *cache_specs]  # fmt: skip
    arrays = [getattr(cache, f) for f in CACHE_FIELDS]
    dt = {f: a.dtype for f, a in zip(CACHE_FIELDS, arrays, strict=True)}
    ek, ev = todo.ek, todo.ev
    srcs = [
        k_t.astype(dt["k_res"])[:, :, None],
        v_t.astype(dt["v_res"])[:, :, None],
        ek.codes.astype(dt["k_codes"]), ek.scale.astype(dt["k_scale"]),
        ek.zero.astype(dt["k_zero"]), ek.norm.astype(dt["k_norm"]),
        ev.codes.astype(dt["v_codes"]), ev.scale.astype(dt["v_scale"]),
        ev.zero.astype(dt["v_zero"]),
    ]  # fmt: skip
    kernel = functools.partial(_kernel, g=g, norm_shared=hn == 1 and h > 1)
    outs = _launch(kernel, "oscar_cache_write", (b, h), in_specs, cache_specs,
                   [slot, clr, at, *srcs], arrays, interpret, num_warps)  # fmt: skip
    return dataclasses.replace(
        cache,
        **dict(zip(CACHE_FIELDS, outs, strict=True)),
        lengths=lengths,
        flags=flags,
    )


def _launch(kernel, name, grid, in_specs, cache_specs, inputs, arrays, interpret, num_warps):
    """The pallas_call of a write kernel: ``arrays`` (the cache's) aliased input -> output."""
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=cache_specs,
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays],
        input_output_aliases={len(inputs) + i: i for i in range(len(arrays))},
        interpret=interpret,
        name=name,
        **kwargs,
    )(*inputs, *arrays)


def _plan(cache, k_t, v_t, todo):
    """(slot, clr, at) [B] int32 (-1: no write) and the new lengths and flags."""
    g = cache.cfg.group_size
    ok, ring_slot, lengths, flags = ring_append_plan(cache, k_t, v_t)
    nq, fl = todo.nq.astype(jnp.int32), todo.flush
    in_range = (nq >= 0) & (nq + g <= cache.quant_capacity)  # _set_rows drops partial runs
    none = jnp.int32(-1)
    slot = jnp.where(ok, ring_slot, none)
    clr = jnp.where(fl, _rem(nq, cache.slots_total), none)  # clear_groups' zeroed slots
    return slot, clr, jnp.where(fl & in_range, nq, none), lengths, flags


def _fused_update_records(cache: KVCache, k_t, v_t, todo: Flush, interpret: bool,
                          num_warps: int) -> KVCache:  # fmt: skip
    """``fused_update`` of a layout='record' cache (``oscar_jax.ring._write_records``'s merge
    of the group's half-record, in the kernel)."""
    b, h, d = cache.batch, cache.num_kv_heads, cache.head_dim
    g, s, lq = cache.cfg.group_size, cache.slots, cache.quant_capacity
    slot, clr, at, lengths, flags = _plan(cache, k_t, v_t, todo)
    words, mask, norm = record.group_update(todo.ek, todo.ev, todo.nq, h, words=todo.words,
                                            param_dtype=cache.cfg.scale_dtype)  # fmt: skip
    nrec = lq // record.TILE
    rows = cache.k_codes.shape[-1] // 64  # a record as rows of 64 words

    def full(*shape):
        return pl.BlockSpec((None, None, *shape), lambda i, j: (i, j) + (0,) * len(shape))

    row = pl.BlockSpec((1,), lambda i, j: (i,))
    mask_spec = pl.BlockSpec((None, rows, 64), lambda i, j: (i, 0, 0))
    cache_specs = [full(s, d), full(s, d), full(nrec * rows, 64), full(lq)]
    in_specs = [row, row, row, full(1, d), full(1, d), full(rows, 64), mask_spec, full(g),
                *cache_specs]  # fmt: skip
    arrays = [cache.k_res, cache.v_res, cache.k_codes.reshape(b, h, nrec * rows, 64),
              cache.k_norm]  # fmt: skip
    srcs = [k_t.astype(cache.k_res.dtype)[:, :, None], v_t.astype(cache.v_res.dtype)[:, :, None],
            words.reshape(b, h, rows, 64), mask.astype(jnp.int32).reshape(b, rows, 64),
            norm]  # fmt: skip
    body = functools.partial(_record_kernel, g=g, rows=rows)
    kr, vr, rec, kn = _launch(body, "oscar_cache_write_records", (b, h), in_specs, cache_specs,
                              [slot, clr, at, *srcs], arrays, interpret, num_warps)  # fmt: skip
    return dataclasses.replace(cache, k_res=kr, v_res=vr, k_codes=rec.reshape(cache.k_codes.shape),
                               k_norm=kn, lengths=lengths, flags=flags)  # fmt: skip


def sharded_fused_update(
    cache: KVCache,
    k_t,  # [B, H, D]
    v_t,  # [B, H, D]
    todo: Flush,
    mesh,
    *,
    ax: osh.MeshAxes = osh.AXES,
    **options,
) -> KVCache:
    """``fused_update`` on a mesh without sequence sharding (rows on data, KV heads on
    model): each device writes its own slices in place. Lengths and flags come from all
    heads (a non-finite token on one model shard flags the row on every shard), as
    ``oscar_jax.sharding.sharded_append``'s do. ``options``: ``fused_update``'s."""
    seq = osh.mesh_sizes(mesh, ax)[2]
    if seq != 1:
        raise ValueError(
            f"mesh axis {ax.sequence!r} has size {seq}; "
            "sharded_fused_update needs it to be 1 (a sequence-sharded cache flushes by "
            "oscar_jax.sharding.sharded_write_flush)"
        )
    osh.check_mesh(cache, mesh, ax)
    specs, kv = osh.cache_specs(cache, ax), P(ax.data, ax.model, None)
    out = osh.shard_map_on(
        mesh, lambda c, k, v, f: fused_update(c, k, v, f, **options),
        (specs, kv, kv, osh.flush_specs(cache, ax, todo)), specs,
    )(cache, k_t, v_t, todo)  # fmt: skip
    _, _, lengths, flags = ring_append_plan(cache, k_t, v_t)
    return dataclasses.replace(out, lengths=lengths, flags=flags)
