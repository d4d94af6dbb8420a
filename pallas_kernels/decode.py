"""Split-K flash-decoding over the packed OScaR cache (Pallas, lowered through Triton).

One program handles one (row b, KV head h, split s): all ``g`` query heads of the
KV head (padded to ``gp = 16`` MMA rows) against the split's blocks of ``T``
quantized tokens, so one read of the packed K/V serves every query head.

With ``q' = R q`` (rotated once per step in XLA, softmax scale folded in), key group
``j`` of token ``t`` and value group ``grp``::

    score_t = norm_t * dot(q', code_t * ks_j + kz_j)
    out[:, grp] = dot(p, code[:, grp] * vs[:, grp] + vz[:, grp])

Each packed code tile is dequantized in the tensor-core operand registers it is read
into (``decode_int._dequant``: bit-pattern int->float and packed 16-bit fmas, inline
PTX), so nothing but the packed bytes and their parameters crosses memory and no
tile takes a shared-memory layout change. The key MMA is float16 (the dequantized
keys and the scaled query must stay below 65504, as for any float16 kernel), the
value MMA float16 with float16 parameters (the default), bfloat16 with bfloat16 ones
(values of any float32 magnitude) and, with float32 parameters, values dequantized in
float32 and split into bfloat16 hi + lo halves for two value dots (one bfloat16
rounding of the parameters cost up to 2e-2 relative output error against the float32
XLA path: benchmarks/results/decode_notes.md); accumulation, softmax and the
partials are float32. Each split writes (acc, m, l), acc for the real query rows only
(GQA 4: 4 of the 16; the merge reads those). With two token sub-blocks
(``DecodeConfig.token_split``) the padded rows carry the odd tokens: rows (j, h) hold
head h over tokens j, j + 2, .. (see ``decode_int._int_quant_part``). By default the
residual ring is the launch's last split (the plain f32 query split into two 16-bit
halves, so two tensor-core dots give ~f32 accuracy; its acc stays in the original
basis). By default (``DecodeConfig.rotate_in_kernel``) the kernel itself scales and
rotates the query and un-rotates each split's acc with the Hadamard rotation's Kronecker
factors (a few [16, W] x [W, W] dots per program), and derives each row's quantized
count from its length, so every partial is in the original basis and a second Pallas
launch merges the splits into the output (``decode_merge``): a call is two launches.
Otherwise (``rotate_in_kernel=False``, a rotation without Kronecker form, or
``merge="xla"``) XLA rotates the query and merges the splits, un-rotating the quantized
splits' weighted sum once (seven launches around the kernel at 1 x 4K).
(An in-kernel [D, D] rotation and f32 FMA dots in the ring cost 2.2 KB of register
spills per thread in the whole kernel: ``ptxas -v`` of the lowered IR.) With
``fuse_ring=False`` the ring goes
through ``oscar_jax.attention.residual_partial`` instead. ``decode_attention_pallas``
assumes an unsharded cache (ring slots ``cache.slots``, quantized positions from 0);
``quantized_partial_pallas`` serves one sequence shard of ``oscar_jax.sharding`` (its own
token count as ``nq``, no ring).

Launch parameters and their heuristic: ``pallas_kernels.decode_config``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

import oscar_jax
from oscar_jax import hadamard
from oscar_jax.attention import (
    check_query,
    merge_partials,
    poison_flagged_rows,
    register_quantized_partial,
    residual_partial,
)
from pallas_kernels import decode_merge
from pallas_kernels.decode_config import (
    DecodeConfig,
    _triton_params,
    choose_config,
)
from pallas_kernels.decode_int import GP, int_kernel
from pallas_kernels.decode_merge import merge_splits


# -- the INT kernel ------------------------------------------------------------------
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
    cost more in the merge than the kernel saves on short splits (H200, session 12:
    1 x 4K at 1 block per split 0.0180 ms with 2, 0.0171 with 1; 32 blocks per split
    gain 2-3% at 1 x 128K and 8 x 32K; the threshold between is not measured)."""
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
    ``split_slots(ns, sub)``: the split axis of the outputs (default ns; ``decode_merge``
    wants it padded). ``qscale`` (with ``in_kernel_rotation``, a power-of-two GQA ratio):
    qs is the plain query as given, [B, H, rows, D] in its own dtype, and the kernel
    scales it and fills its MMA rows itself (``decode_int._query_rows``), sparing the
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
    ring = (cfg.ring_rows or ring_block(cache.slots)) if fused else 0
    if ring and cache.slots % ring:
        raise ValueError(f"ring_rows={ring} must divide the ring's {cache.slots} slots")
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
        ablate=cfg.ablate,
        asm=not cfg.interpret and cfg.unpack == "asm",
        ring=ring,
        vpair=vpair,
        vtile=cfg.vparams == "tile",
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
    XLA fusion (a pad per query and a multiply were three launches, ~1 us each)."""
    return pad_query(jnp.stack(qgs, axis=2).astype(jnp.float32) * scale, jnp.float32)


def decode_attention_pallas(q, cache, *, softmax_scale=None, **options):
    """``decode_attention(..., implementation="pallas")``; options: DecodeConfig fields.
    Rows with ``FLAG_NONFINITE`` come back NaN (in the merge kernel where it runs)."""
    g = check_query(q, cache)
    kcfg = cache.cfg
    b, hq, d = q.shape
    h = cache.num_kv_heads
    if d not in (64, 128, 256):
        raise ValueError(f"head_dim={d} must be 64, 128 or 256 for the pallas decode kernel")
    if g > GP:
        raise ValueError(f"GQA ratio num_q_heads/num_kv_heads={g} must be <= {GP}")
    scale = float(1.0 / np.sqrt(d)) if softmax_scale is None else float(softmax_scale)
    f32 = jnp.float32
    qg = q.astype(f32).reshape(b, h, g, d)
    if not kcfg.quantized:
        from pallas_kernels import decode_bf16

        cfg = choose_config(b, h, cache.slots, block=128, **options)
        out = decode_bf16.decode_bf16(qg * scale, cache, cfg)
        return poison_flagged_rows(out.reshape(b, hq, d).astype(q.dtype), cache)
    if kcfg.bits not in (2, 4):
        raise ValueError(f"bits={kcfg.bits} must be 2 or 4 for the pallas decode kernel")
    cfg = choose_config(b, h, cache.quant_capacity, kcfg.group_size, **options)
    fused = cache.quant_capacity and cfg.fuse_ring and ring_block(cache.slots) >= 16
    in_rot = fused and cfg.rotate_in_kernel and in_kernel_rotation_applies(kcfg, d)
    # the Pallas merge needs every partial in the original basis
    pallas_merge = fused and (in_rot or not kcfg.rotate_values) and cfg.merge != "xla"
    if cfg.merge == "pallas" and not pallas_merge:
        raise ValueError(
            "merge='pallas' needs the fused ring and every partial in the original basis "
            f"(rotate_in_kernel=True with a Hadamard rotation, or no value rotation); got "
            f"fuse_ring={cfg.fuse_ring}, rotate_in_kernel={cfg.rotate_in_kernel}, "
            f"rotation={kcfg.rotation!r}, rotate_values={kcfg.rotate_values}"
        )
    if fused:
        qscale = None
        if in_rot and g & (g - 1) == 0:  # the kernel scales and pads the query itself
            qs, qscale, unrot = q.reshape(b, h, g, d), scale, None
        elif in_rot:
            qs, unrot = stack_queries(scale, qg), None  # every partial in the original basis
        else:
            q_rot = hadamard.rotate(qg, kcfg, dense=True) if kcfg.rotate_keys else qg
            qs = stack_queries(scale, q_rot, qg)
            unrot = (
                (lambda x: hadamard.unrotate(x, kcfg, dense=True)) if kcfg.rotate_values else None
            )
        if pallas_merge:
            cols = min(cfg.merge_cols, d) or decode_merge.auto_cols(b, h, d)

            def slots(ns, sub):
                step = decode_merge.step_splits(ns, g, sub, cols, cfg.merge_chunk)
                return decode_merge.padded_splits(ns, step)

            raw = int_partials(
                qs, cache, cfg, rows=g, in_kernel_rotation=in_rot, split_slots=slots,
                qscale=qscale,
            )  # fmt: skip
            out = decode_merge.merge(
                raw.acc, raw.m, raw.lsum, ns=raw.ns, rows=g, sub=raw.sub, ring=raw.ring,
                out_dtype=q.dtype, flags=cache.flags, cols=cols, chunk=cfg.merge_chunk,
                num_warps=cfg.merge_warps, interpret=cfg.interpret,
            )  # fmt: skip
            return out.reshape(b, hq, d)
        parts = quantized_partials(qs, cache, cfg, rows=g, in_kernel_rotation=in_rot, qscale=qscale)
        acc, m, lsum = merge_splits(*parts, last_basis=unrot)
        out = jnp.where(lsum[..., None] > 0, acc / jnp.where(lsum > 0, lsum, 1.0)[..., None], 0.0)
        return poison_flagged_rows(out.reshape(b, hq, d).astype(q.dtype), cache)
    parts = [residual_partial(qg, cache, scale)]
    if cache.quant_capacity:
        q_rot = hadamard.rotate(qg, kcfg, dense=True) if kcfg.rotate_keys else qg
        acc, m, lsum = merge_splits(
            *quantized_partials(stack_queries(scale, q_rot), cache, cfg, rows=g)
        )
        if kcfg.rotate_values:
            acc = hadamard.unrotate(acc, kcfg, dense=True)
        parts.append((acc, m, lsum))
    return poison_flagged_rows(merge_partials(parts).reshape(b, hq, d).astype(q.dtype), cache)


def quantized_partial_pallas(q_rot, cache, scale, *, offset=0, **options):
    """``oscar_jax.attention.quantized_partial`` by the INT kernel, for a sequence shard.

    q_rot [b, h, g, d] f32 (unscaled) -> (acc [b, h, g, d] rotated basis, m, l [b, h, g]).
    The shard holds global quantized positions offset.. (``cache.lengths`` are global): it
    reads clip(nq - offset, 0, capacity) tokens. No fused ring (the caller adds the ring).
    A ``bf16`` cache (all tokens in the ring, no rotation) runs the BF16 kernel over its
    ring slots offset.. instead: clip(length - offset, 0, slots) of them.
    """
    kcfg = cache.cfg
    b, h, g, d = q_rot.shape
    if d not in (64, 128, 256):
        raise ValueError(f"head_dim={d} must be 64, 128 or 256 for the pallas decode kernel")
    if not kcfg.quantized:
        from pallas_kernels import decode_bf16

        cfg = choose_config(b, h, cache.slots, block=128, **options)
        n = jnp.clip(cache.lengths.astype(jnp.int32) - offset, 0, cache.slots)
        acc, m, lsum = decode_bf16.bf16_partials(q_rot * scale, cache, cfg, lengths=n)
        return acc[:, :, :g], m[:, :, :g], lsum[:, :, :g]
    if kcfg.bits not in (2, 4):  # (a GQA ratio g > GP: pad_query raises)
        raise ValueError(f"bits={kcfg.bits} must be 2 or 4 for the pallas decode kernel")
    lq = cache.quant_capacity
    cfg = choose_config(b, h, lq, kcfg.group_size, **options)
    if lq == 0:
        z = jnp.zeros((b, h, g), jnp.float32)
        return jnp.zeros_like(q_rot), z - jnp.inf, z
    nq = jnp.clip(cache.num_quantized().astype(jnp.int32) - offset, 0, lq)
    parts = quantized_partials(stack_queries(scale, q_rot), cache, cfg, nq=nq, rows=g)
    return merge_splits(*parts)


oscar_jax.register_decode_attention("pallas", decode_attention_pallas, poisons=True)
register_quantized_partial("pallas", quantized_partial_pallas)
