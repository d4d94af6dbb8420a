"""The INT kernel's launch: its operands, block specs and per-split partials.

``int_partials`` runs one ``pallas_call`` of ``int_kernel.int_kernel`` over the packed
cache (and the fused residual ring) and returns the raw per-split (acc, m, l) as written
(``RawPartials``); ``quantized_partials`` lays them out per split for the XLA merge
(``merge.merge_splits``), the Pallas merge reads them as written. The query
helpers build the stacked, scaled, row-padded query the kernel reads when XLA rotates it.
The attention ops that call these: ``pallas_kernels.decode.triton``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from oscar_jax import hadamard
from pallas_kernels.decode.config import DecodeConfig, _triton_params
from pallas_kernels.decode.int_kernel import GP, int_kernel


def ring_block(slots: int) -> int:
    """Ring rows per fused-ring block: the largest power of two dividing S, capped at 64."""
    return min(64, slots & -slots)


def _u32_pairs(x):
    """[..., n] 16-bit -> [..., n / 2] uint32, element 2k in the low half (a free bitcast
    on the GPU; the kernel reads 4-byte elements, which Triton pipelines as cp.async)."""
    return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), jnp.uint32)


def token_split(cfg: DecodeConfig, cache, rows: int) -> int:
    """Token sub-blocks S of the INT kernel (``DecodeConfig.token_split``). S = 2 needs
    2 x GQA ratio <= 16 MMA rows, G >= 32 and 16-bit token norms (read as uint32 pairs).
    Auto (0) takes 2 where it applies and a split walks >= 4 blocks: twice the partials
    cost more in the merge than the kernel saves on short splits (2 is slower at 1 block
    per split, faster at 32; the threshold between is a guess)."""
    g, ndt = cache.cfg.group_size, jnp.dtype(cache.k_norm.dtype)
    fits = 2 * rows <= GP and g >= 32 and ndt.itemsize == 2
    if cfg.token_split == 2 and not fits:
        raise ValueError(
            f"token_split=2 needs 2 x GQA ratio <= {GP}, group_size >= 32 and 16-bit norms; "
            f"got GQA ratio {rows}, group_size={g}, norms {ndt.name}"
        )
    long = min(cfg.blocks_per_split, cache.quant_capacity // cfg.block_tokens) >= 4
    return cfg.token_split or (2 if fits and long else 1)


def quantized_partials(
    qs,
    cache,
    cfg: DecodeConfig,
    *,
    nq=None,
    rows: int = GP,
    in_kernel_rotation: bool = False,
    qscale: float | None = None,
):
    """Per-split (acc [B,H,NS,rows,D], m, l [B,H,NS,rows]), acc in the rotated basis:
    ``int_partials`` with the padded rows sliced off and each sub-block as its own split.
    """
    raw = int_partials(
        qs, cache, cfg, nq=nq, rows=rows, in_kernel_rotation=in_kernel_rotation, qscale=qscale
    )
    acc, m, lsum = raw.acc, raw.m, raw.lsum
    b, h = acc.shape[:2]
    if raw.sub == 1:
        return tuple(x[:, :, : raw.ns, :rows] for x in (acc, m, lsum))
    nsq = raw.ns - 1 if raw.ring else raw.ns

    def splits(x):  # [B, H, NS, GP(, D)] -> [B, H, NS * S (+ 1), rows(, D)]
        q = x[:, :, :nsq, : raw.sub * rows].reshape(b, h, nsq * raw.sub, rows, *x.shape[4:])
        return jnp.concatenate([q, x[:, :, nsq : raw.ns, :rows]], axis=2) if raw.ring else q

    return splits(acc), splits(m), splits(lsum)


@dataclasses.dataclass(frozen=True)
class RawPartials:
    """The INT kernel's outputs as written: acc [B, H, Sp, GP, D], m, l [B, H, Sp, GP];
    ``ns`` splits written (the fused ring's the last when ``ring``), each quantized split's
    first ``sub`` x ``rows`` rows (row j * rows + r: query head r over sub-block j of the
    split's tokens), the ring's first ``rows``; slots Sp >= ns past them are unwritten."""

    acc: jax.Array
    m: jax.Array
    lsum: jax.Array
    ns: int
    sub: int
    ring: bool


def int_partials(
    qs,
    cache,
    cfg: DecodeConfig,
    *,
    nq=None,
    rows: int = GP,
    in_kernel_rotation: bool = False,
    split_slots=None,
    qscale: float | None = None,
) -> RawPartials:
    """One launch of the INT kernel over the quantized cache (and the fused ring).

    ``qs`` [B, H, S, GP, D] f32, scaled (``stack_queries``): S = 1, the rotated query;
    S = 2, also the plain query, and the residual ring is the extra last split. One
    array, so that XLA builds both in one fusion. ``in_kernel_rotation`` (Hadamard
    rotations only, ``in_kernel_rotation_applies``): qs is the plain query alone (S = 1),
    the kernel rotates it and un-rotates each split's acc (Kronecker factors, a few small
    dots per program), so every partial, the fused ring's too, is in the original basis
    and the ring is fused. ``nq`` [B]: quantized tokens to read
    per row (a sequence shard's own count; default ``cache.num_quantized()``). The kernel
    writes only the rows of ``acc`` that hold real query heads (``RawPartials``).
    ``split_slots(ns, sub)``: the split axis of the outputs (default ns; ``merge.merge``
    wants it padded). ``qscale`` (with ``in_kernel_rotation``, a power-of-two GQA ratio):
    qs is the plain query as given, [B, H, rows, D] in its own dtype, and the kernel
    scales it and fills its MMA rows itself (``int_kernel._query_rows``), sparing the
    XLA pad-and-scale launch.
    """
    kcfg = cache.cfg
    b, h, lq, db = cache.k_codes.shape
    d = cache.head_dim
    g, bits = kcfg.group_size, kcfg.bits
    gv = kcfg.value_group(d)
    t = cfg.block_tokens
    if t % g or lq % t:
        raise ValueError(
            f"block_tokens={t} must be a multiple of group_size={g} and divide "
            f"the quantized capacity {lq}"
        )
    p_w = d // (8 // bits)
    if min(p_w, gv) < 16 or p_w % min(p_w, gv):
        raise ValueError(
            f"head_dim={d} with bits={bits}, value group {gv} gives MMA tiles of "
            f"{min(p_w, gv)} channels; the kernel needs >= 16"
        )
    sub = token_split(cfg, cache, rows)
    bps = min(cfg.blocks_per_split, lq // t)
    ns = -(-(lq // t) // bps)
    hn = cache.k_norm.shape[1]
    raw_q = qscale is not None
    if raw_q:
        if not in_kernel_rotation or qs.shape != (b, h, rows, d) or rows & (rows - 1):
            raise ValueError(
                f"qscale needs in_kernel_rotation and the query as ({b}, {h}, rows, {d}) with "
                f"a power-of-two GQA ratio rows; got qs.shape={qs.shape}, {rows=}"
            )
    elif qs.ndim != 5 or qs.shape[:2] != (b, h) or qs.shape[2] not in (1, 2):
        raise ValueError(f"qs.shape={qs.shape} must be ({b}, {h}, 1 or 2, {GP}, {d})")
    fused = in_kernel_rotation or (not raw_q and qs.shape[2] == 2)
    nqs = 1 if raw_q else qs.shape[2]
    if in_kernel_rotation and (nqs != 1 or not in_kernel_rotation_applies(kcfg, d)):
        raise ValueError(
            f"in_kernel_rotation needs one plain query (qs.shape={qs.shape}) and a Hadamard "
            f"rotation of head_dim {d} (rotation={kcfg.rotation!r})"
        )
    nq_of = None
    if nq is None:  # the kernel derives it from the lengths
        nq, nq_of = cache.lengths.astype(jnp.int32), kcfg
    elif fused or jnp.shape(nq) != (b,):
        raise ValueError(f"nq.shape={jnp.shape(nq)} must be ({b},), without the fused ring")
    else:
        nq = jnp.asarray(nq, jnp.int32)
    kc = cache.k_codes.reshape(b, h, lq // g, g // sub, sub * db)  # free: same bytes
    if sub > 1 and not raw_q:  # rows (j, h): query head h for sub-block j
        qs = pad_query(jnp.tile(qs[:, :, :, :rows], (1, 1, 1, sub, 1)), jnp.float32)
    v_scale, v_zero, vpair, nvp = cache.v_scale, cache.v_zero, None, d // gv
    pdt = jnp.dtype(kcfg.scale_dtype)
    pair_ok = pdt.itemsize == 2 and nvp % 2 == 0
    if cfg.vparams == "pair" or (cfg.vparams == "auto" and pair_ok):
        if not pair_ok:
            raise ValueError(
                f"vparams='pair' needs 16-bit scales and an even number of value groups; "
                f"got {pdt.name} and {nvp} groups (head_dim={d}, value group {gv})"
            )
        vpair, nvp = pdt, nvp // 2
        v_scale, v_zero = _u32_pairs(v_scale), _u32_pairs(v_zero)  # [B, H, Lq, D / Gv / 2]
    ring = ring_block(cache.slots) if fused else 0
    k_norm, knpair = cache.k_norm, None
    if sub == 2:  # 16-bit norms as uint32 pairs: [B, Hn, Lq / 2], low half the even token
        k_norm, knpair = _u32_pairs(k_norm), k_norm.dtype
    kern = functools.partial(
        int_kernel,
        bits=bits,
        t=t,
        g=g,
        gv=gv,
        bps=bps,
        d=d,
        asm=not cfg.interpret and cfg.unpack == "asm",
        ring=ring,
        vpair=vpair,
        rows=sub * rows,
        sub=sub,
        knpair=knpair,
        qscale=qscale,
        nq_of=nq_of,
    )
    rot = (in_kernel_rotation and kcfg.rotate_keys, in_kernel_rotation and kcfg.rotate_values)

    def full(*shape):
        return pl.BlockSpec((None, None, *shape), lambda i, j, s: (i, j) + (0,) * len(shape))

    def query(row):  # one of the S queries of qs [B, H, S, GP, D], or the raw query
        if raw_q:
            return pl.BlockSpec((None, None, rows, d), lambda i, j, s: (i, j, 0, 0))
        return pl.BlockSpec((None, None, None, GP, d), lambda i, j, s: (i, j, row, 0, 0))

    in_specs = [
        pl.BlockSpec((1,), lambda i, j, s: (i,)),
        query(0),
        full(lq // g, g // sub, sub * db),
        full(lq // g, d),
        full(lq // g, d),
        pl.BlockSpec((None, None, k_norm.shape[-1]), lambda i, j, s: (i, j if hn > 1 else 0, 0)),
        full(lq, db),
        full(lq, nvp),
        full(lq, nvp),
    ]
    args = [
        nq,
        qs,
        kc,
        cache.k_scale,
        cache.k_zero,
        k_norm,
        cache.v_codes,
        v_scale,
        v_zero,
    ]
    for on, width in zip(rot, (p_w, min(p_w, gv)), strict=True):  # rotation factors [D, W]
        if on:
            fac = hadamard.kronecker_factor(kcfg, d, width)
            in_specs.append(pl.BlockSpec((d, width), lambda i, j, s: (0, 0)))
            args.append(jnp.asarray(fac, jnp.float16))
    if ring:
        ns += 1
        in_specs += [
            pl.BlockSpec((1,), lambda i, j, s: (i,)),
            query(nqs - 1),
            full(cache.slots, d),
            full(cache.slots, d),
        ]
        args += [cache.lengths.astype(jnp.int32), qs, cache.k_res, cache.v_res]
    out_specs = [
        pl.BlockSpec((None, None, None, GP, d), lambda i, j, s: (i, j, s, 0, 0)),
        pl.BlockSpec((None, None, None, GP), lambda i, j, s: (i, j, s, 0)),
        pl.BlockSpec((None, None, None, GP), lambda i, j, s: (i, j, s, 0)),
    ]
    f32 = jnp.float32
    sp = ns if split_slots is None else split_slots(ns, sub)
    out_shape = [
        jax.ShapeDtypeStruct((b, h, sp, GP, d), f32),
        jax.ShapeDtypeStruct((b, h, sp, GP), f32),
        jax.ShapeDtypeStruct((b, h, sp, GP), f32),
    ]
    kwargs = (
        {} if cfg.interpret else dict(compiler_params=_triton_params(cfg.num_warps, cfg.num_stages))
    )
    acc, m, lsum = pl.pallas_call(
        functools.partial(kern, rot=rot),
        grid=(b, h, ns),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=cfg.interpret,
        name=f"oscar_decode_int{bits}",
        **kwargs,
    )(*args)
    return RawPartials(acc, m, lsum, ns=ns, sub=sub, ring=bool(ring))


def in_kernel_rotation_applies(kcfg, d: int) -> bool:
    """Whether the INT kernel can rotate the query and un-rotate its partials itself:
    a rotation on keys or values with Kronecker form (``hadamard.kronecker_factor``)."""
    rotates = kcfg.rotate_keys or kcfg.rotate_values
    return rotates and hadamard.kronecker_factor(kcfg, d, d) is not None


def pad_query(qg, dtype=jnp.float16):
    """[..., g, D] -> [..., GP, D] zero-padded rows."""
    g = qg.shape[-2]
    if g > GP:
        raise ValueError(f"GQA ratio {g} must be <= {GP}")
    pad = [(0, 0)] * qg.ndim
    pad[-2] = (0, GP - g)
    return jnp.pad(qg, pad).astype(dtype)


def stack_queries(scale, *qgs):
    """[B, H, g, D] queries -> [B, H, len(qgs), GP, D] f32, scaled, zero-padded rows: one
    XLA fusion (not a pad per query and a multiply: three launches)."""
    return pad_query(jnp.stack(qgs, axis=2).astype(jnp.float32) * scale, jnp.float32)
