"""The ring and the LSE merge of the split partials: in XLA, or as a second Mosaic launch."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax.cache import _residual_tokens
from oscar_jax.record import TILE
from pallas_kernels.decode.mosaic._config import (
    KERNEL_QUERY_DTYPES,
    LOG2E,
    NPAD,
    Int2DecodeConfig,
    kernel_query,
    quantized_of,
    query_scale,
)
from pallas_kernels.decode.mosaic._kernel import _partials_raw, int2_decode_partials
from pallas_kernels.decode.mosaic._output import store_output
from pallas_kernels.decode.mosaic._pdl import wait_for_previous_launch
from pallas_kernels.decode.mosaic._ring import make_ring_query, ring_inputs, ring_walk
from pallas_kernels.decode.mosaic._warp import warp_decode_partials

# the split merge's pipeline slots at most (of the 227 KB a CTA may have on sm_90, the rest
# left to the ring's scratch and the output's)
MERGE_SMEM_BYTES = 180 * 1024
# merge_stages=None: as many steps in flight as fit this much shared memory, at most
# MERGE_AUTO_STAGES (16 CTAs stream the splits at 1 x 128K; on an H100 as fast as 2 steps)
MERGE_AUTO_BYTES = 150 * 1024
MERGE_AUTO_STAGES = 5


def weigh_splits(acc, m2, l, m_ref):
    """The splits' partials rescaled to a common max and summed over the split axis:
    acc [B, H, S, g, D], m2 / l [B, H, S, g] (log2 units), m_ref [B, H, g] -> (sum_s acc_s
    2^(m2_s - m_ref) [B, H, g, D], sum_s l_s 2^(m2_s - m_ref) [B, H, g])."""
    w = jnp.exp2(m2 - m_ref[:, :, None])
    return jnp.sum(acc * w[..., None], axis=2), jnp.sum(l * w, axis=2)


def normalized(num, lsum, dtype):
    """num [B, H, g, D] / lsum [B, H, g], 0 for a row with no token (lsum 0)."""
    out = num / jnp.where(lsum > 0, lsum, 1.0)[..., None]
    return jnp.where(lsum[..., None] > 0, out, 0.0).astype(dtype)


def merge_partials_with_ring(acc, m2, l, q, k_res, v_res, ring_valid, *, g, softmax_scale=None,
                             unrotate=None, out_dtype=None):  # fmt: skip
    """Kernel partials (log2 units) + the full-precision ring -> output [B, H, g, D].

    acc [B, H, S, D, NPAD] (O^T), m2 / l [B, H, S, NPAD] as ``int2_decode_partials``;
    q [B, H, g, D] (original basis, for the ring); k_res / v_res [B, H, R, D];
    ring_valid [B, R] bool; ``unrotate``: maps the quantized part's acc [B, H, g, D]
    from the rotated value basis (None: identity).
    """
    f32 = jnp.float32
    d = q.shape[-1]
    scale = float(1.0 / np.sqrt(d)) if softmax_scale is None else float(softmax_scale)
    acc = jnp.swapaxes(acc, -1, -2)[..., :g, :]  # [B, H, S, g, D]
    m2, l = m2[..., :g], l[..., :g]
    # ring scores in log2 units
    s = jnp.einsum("bhgd,bhtd->bhgt", q.astype(f32), k_res.astype(f32)) * (scale * LOG2E)
    valid = ring_valid[:, None, None, :]
    s = jnp.where(valid, s, -1e30)
    mr = jnp.max(s, -1)  # [B, H, g]
    m_all = jnp.maximum(mr, jnp.max(m2, axis=2))
    pr = jnp.where(valid, jnp.exp2(s - m_all[..., None]), 0.0)
    ring_acc = jnp.einsum("bhgt,bhtd->bhgd", pr, v_res.astype(f32))
    qacc, lq = weigh_splits(acc, m2, l, m_all)
    if unrotate is not None:
        qacc = unrotate(qacc)
    return normalized(qacc + ring_acc, jnp.sum(pr, -1) + lq, out_dtype or q.dtype)


def int2_decode_attention(q, q_rot, rec, kn, nq, k_res, v_res, lengths, *,
                          cfg: Int2DecodeConfig = Int2DecodeConfig(), softmax_scale=None,
                          param_dtype=jnp.float16, unrotate=None):  # fmt: skip
    """Decode attention over an INT2 cache in the fragment layout: one Mosaic GPU launch
    for the quantized tokens, then XLA for the ring and the merge.

    q [B, H, g, D] original basis, q_rot the rotated query (same shape); rec, kn, nq as
    ``int2_decode_partials``; k_res, v_res [B, H, R, D]; lengths [B] int32 tokens a row
    (the ring holds tokens nq .. length - 1, token t in slot t mod R, as
    ``oscar_jax.cache``'s). Returns [B, H, g, D] in q's dtype.
    """
    acc, m2, l = int2_decode_partials(q_rot, rec, kn, nq, cfg=cfg, softmax_scale=softmax_scale,
                                      param_dtype=param_dtype)  # fmt: skip
    _, ring_valid = _residual_tokens(nq, lengths, k_res.shape[2])
    return merge_partials_with_ring(acc, m2, l, q, k_res, v_res, ring_valid, g=q.shape[2],
                                    softmax_scale=softmax_scale, unrotate=unrotate)  # fmt: skip


def merge_splits_with_ring_split(acc, ml, *, g, unrotate=None, out_dtype):
    """The LSE merge of ``merge="fused"``'s partials, whose last split is the ring's:
    acc [B, H, S + 1, D / 64, 64, NPAD], ml [B, H, S + 1, 2, NPAD] -> [B, H, g, D].
    ``unrotate`` maps the quantized splits' sum from the rotated value basis (the ring's
    values are in the original basis)."""
    b, h, sr = acc.shape[:3]
    d = acc.shape[3] * TILE
    acc = jnp.swapaxes(acc.reshape(b, h, sr, d, NPAD), -1, -2)[..., :g, :]  # [B, H, S+1, g, D]
    m2, l = ml[..., 0, :g], ml[..., 1, :g]
    m_all = jnp.max(m2, axis=2)
    qacc, lq = weigh_splits(acc[:, :, :-1], m2[:, :, :-1], l[:, :, :-1], m_all)
    if unrotate is not None:
        qacc = unrotate(qacc)
    racc, lr = weigh_splits(acc[:, :, -1:], m2[:, :, -1:], l[:, :, -1:], m_all)
    return normalized(qacc + racc, lq + lr, out_dtype)


def int2_decode_attention_fused(q, q_rot, rec, kn, nq, k_res, v_res, lengths, *,
                                cfg: Int2DecodeConfig = Int2DecodeConfig(), softmax_scale=None,
                                param_dtype=jnp.float16, unrotate=None):  # fmt: skip
    """As ``int2_decode_attention``, with the ring walked inside the partials kernel as one
    more split (its K / V tiles wgmma operands from shared memory), so that what is left to
    XLA is the query prep and one LSE merge of the splits: fewer launches at small batch."""
    ring = ring_inputs(q, k_res, v_res, lengths, softmax_scale, cfg.ring_query)
    acc, ml = _partials_raw(q_rot, rec, kn, nq, cfg=cfg, softmax_scale=softmax_scale,
                            param_dtype=param_dtype, ring=ring)  # fmt: skip
    return merge_splits_with_ring_split(acc, ml, g=q.shape[2], unrotate=unrotate,
                                        out_dtype=q.dtype)  # fmt: skip


def merge_step_for(merge_step: int, splits: int) -> int:
    """Splits the merge launch combines a pipeline step: ``merge_step`` balanced over the
    steps (ceil(splits / merge_step) of them). The last step may reach past the split
    count (33 splits at 8: 5 steps of 7): its TMA reads those slots as zeros and the
    kernel sets their max to -1e30, so they weigh nothing."""
    steps = -(-splits // min(merge_step, splits))
    return -(-splits // steps)


def int2_merge_ring(acc, ml, q_ring_t, k_res, v_res, nq, lengths, *, auto_barriers=True,
                    step=1, final=None, stages=None, nq_of=None, make_query=None,
                    pdl=False, columns=NPAD):  # fmt: skip
    """Second launch: the full-precision ring and the LSE merge of the split partials.

    acc [B, H, S, D / 64, 64, NPAD] f32 and ml [B, H, S, 2, NPAD] f32 (raw outputs of the
    partials kernel: O^T channel blocks; running max in log2 units and row sums);
    q_ring_t [B, H, D, NPAD] or, as a hi + lo pair, [B, H, 2, D, NPAD] in the ring's dtype
    (query^T, original basis, scaled by softmax_scale * log2(e), heads past g zero:
    ``_ring.ring_inputs``); with ``make_query=(form, rscale)`` the query itself instead,
    [B, H, g, D] in the original basis (float32, bfloat16 or float16), from which each CTA
    makes the ring's query (form "pair" or "bf16", ``Int2DecodeConfig.ring_query``; rscale
    ``_config.query_scale``) with ``_ring.make_ring_query``, so no XLA launch builds it;
    k_res, v_res [B, H, R, D] bfloat16 or float16; nq, lengths [B] int32: the quantized
    tokens and tokens of each row (the ring holds tokens nq .. length - 1, token t in slot t
    mod R; ``_ring.ring_walk``). All five None: no ring (the partials kernel walked it as
    its last split): the splits' merge only.
    ``nq_of`` (the cache's ``KVQuantConfig``): nq holds the lengths, and the kernel computes nq
    (``_config.quantized_of``).
    ``stages``: the splits' pipeline depth, steps in flight (None: as many as fit
    ``MERGE_AUTO_BYTES``, at most ``MERGE_AUTO_STAGES``; ``Int2DecodeConfig.merge_stages``).
    ``pdl``: wait for the partials launch in the kernel (``_pdl``; ``Int2DecodeConfig.pdl``).
    ``columns``: query heads of the partials read (``Int2DecodeConfig.merge_columns``): NPAD,
    or 8 for g <= 8 (half the bytes: the padded heads 8-15 are not read), only without the
    ring (its wgmma has 16 columns) and with ``final``; ``step`` then even, so that each
    pipeline slot of (m, l) rows (64 step bytes) stays 128-byte aligned for TMA.
    Returns out^T [B, H, D / 64, 64, NPAD] f32, normalised (0 for a row with no token);
    with ``final=(g, dtype, flags, poison)`` the output in the library's layout instead, [B, H, g,
    D] in ``dtype`` (the first g heads), NaN for a row whose int32 ``flags`` [B] have
    ``poison`` bits set (``flags`` None: none): the transpose, slice, cast and
    ``poison_flagged_rows`` in the kernel's store, no XLA fusion after the launch.
    One CTA (one warpgroup) per (b, h, channel block c): ring tiles of 64 slots through
    wgmma (A = K tile / V^T tile of block c from shared memory; each block's CTA computes
    the ring's scores itself), then block c of the splits' partials rescaled to the common
    max. D / 64 CTAs a (b, h) shorten the serial walk over the splits and multiply the
    programs of a small batch.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, h, s, nmt, _, _ = acc.shape
    d = nmt * TILE
    has_ring = q_ring_t is not None
    cols = columns
    if cols != NPAD and (cols != 8 or has_ring or final is None or final[0] > cols
                         or step % 2):  # fmt: skip
        raise ValueError(f"merge_columns={cols} must be {NPAD}, or 8 for a merge without the "
                         f"ring, with final= of g <= 8 heads and an even step: {has_ring=}, "
                         f"g={final and final[0]}, {step=}")  # fmt: skip
    nsteps = -(-s // step)
    slot = step * (TILE + 2) * cols * 4  # a step's acc block and its (m, l) rows, f32
    auto = max(1, min(MERGE_AUTO_STAGES, MERGE_AUTO_BYTES // slot))
    depth = min(stages or auto, nsteps)
    if depth * slot > MERGE_SMEM_BYTES:
        raise ValueError(f"merge_stages={stages} puts {depth} steps of {slot} bytes of partials "
                         f"in shared memory: at most {MERGE_SMEM_BYTES} bytes ({step=} splits "
                         f"a step, {s} splits)")  # fmt: skip
    f32 = jnp.float32
    WG = plgpu.Layout.WGMMA
    b_tr = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))

    if final is not None:
        g, out_dtype, flags, poison = final
    has_flags = final is not None and flags is not None

    def kernel(acc_ref, ml_ref, *refs):
        wait_for_previous_launch(pdl)
        flags_ref = refs[0] if has_flags else None
        refs = refs[1:] if has_flags else refs
        if has_ring and make_query is not None:
            *refs, qin_smem, qf_smem = refs
        if final is not None:
            *refs, t_smem = refs
        if has_ring:
            q_ref, k_ref, v_ref, nq_ref, len_ref, out_ref, o_smem, q_smem, p_smem, q_bar = refs
        else:
            out_ref, o_smem = refs
        bi = jax.lax.axis_index("b")
        hi = jax.lax.axis_index("h")
        ci = jax.lax.axis_index("c")
        if has_ring:
            if make_query is None:
                plgpu.copy_gmem_to_smem(q_ref.at[bi, hi], q_smem, q_bar)
                plgpu.barrier_wait(q_bar)
            else:
                plgpu.copy_gmem_to_smem(q_ref.at[bi, hi], qin_smem, q_bar)
                plgpu.barrier_wait(q_bar)
                make_ring_query(qin_smem, qf_smem, q_smem, g=q_ring_t.shape[2],
                                rscale=make_query[1])  # fmt: skip
            m, l_acc, o = ring_walk(q_smem, p_smem, k_ref.at[bi, hi], v_ref.at[bi, hi],
                                    (quantized_of(nq_ref[bi], nq_of), len_ref[bi]), (ci,),
                                    slots=k_res.shape[2])  # fmt: skip
            lsum = jnp.sum(l_acc, axis=0)  # [NPAD] COL layout
            # The splits' pipeline's first TMA copies (async proxy) land in scoped shared
            # memory that the ring's pipeline and this cross-warp sum's scratch just used
            # through plain stores and loads (generic proxy). Without a proxy fence
            # (commit_smem: fence.proxy.async + barrier) those copies and the earlier stores
            # are unordered: on the H200 some rows came out wrong at 16-48 rows x 8 heads
            # (several CTAs an SM), right with it.
            plgpu.commit_smem()
        else:
            m = plgpu.layout_cast(jnp.full((cols,), -1e30, f32), WG.reduce(0))
            lsum = plgpu.layout_cast(jnp.zeros((cols,), f32), WG.reduce(0))
            o = plgpu.layout_cast(jnp.zeros((TILE, cols), f32), WG)

        def part_body(idxs, a_smem, ml_smem, carry):
            (it,) = idxs
            m_prev, l_prev, o = carry
            # slots past the split count (the last step's) came in as zeros: max -1e30
            past = [jnp.where(it * step + u < s, 0.0, -1e30) for u in range(step)]
            ms = [plgpu.load(ml_smem.at[2 * u], layout=WG.reduce(0)) + past[u]
                  for u in range(step)]  # fmt: skip
            ls = [plgpu.load(ml_smem.at[2 * u + 1], layout=WG.reduce(0)) for u in range(step)]
            m_new = m_prev
            for mu in ms:
                m_new = jnp.maximum(m_new, mu)
            ca = jnp.exp2(m_prev - m_new)
            ca_b = jax.lax.broadcast_in_dim(ca, (TILE, cols), [1])
            l_new, o = l_prev * ca, o * ca_b
            for u in range(step):
                cs = jnp.exp2(ms[u] - m_new)
                cs_b = jax.lax.broadcast_in_dim(cs, (TILE, cols), [1])
                l_new = l_new + ls[u] * cs
                o = o + plgpu.load(a_smem.at[u], layout=WG) * cs_b
            # every warp's plain loads of the slot done, and fenced against the async proxy,
            # before one thread's TMA refills it (no automatic barriers in this kernel)
            plgpu.commit_smem()
            return m_new, l_new, o

        part_pipe = plgpu.emit_pipeline(
            part_body,
            grid=(nsteps,),
            in_specs=[  # acc [S, D, 16]: block c's 64 channels of ``step`` splits
                plgpu.BlockSpec((step, TILE, cols), lambda i: (i, ci, 0)),
                plgpu.BlockSpec((2 * step, cols), lambda i: (i, 0)),
            ],
            max_concurrent_steps=depth,
            init_carry=(m, lsum, o),
        )
        # acc [S, D, cols] (8 columns: the first of two 8-column groups), ml [S * 2, 16]
        acc_row = acc_ref.at[bi, hi] if cols == NPAD else acc_ref.at[bi * h + hi, :, :, 0]
        m, lsum, o = part_pipe(acc_row, ml_ref.at[bi, hi])
        if final is None:
            store_output(o, lsum, o_smem, out_ref.at[bi, hi, ci])
        else:
            bad = (flags_ref[bi] & poison) != 0 if has_flags else None
            store_output(o, lsum, o_smem, out_ref.at[bi, hi, :, pl.ds(ci * TILE, TILE)],
                         t_smem=t_smem, bad=bad)  # fmt: skip
        plgpu.wait_smem_to_gmem(0)

    if make_query is None:
        q_shape, make_scratch = (q_ring_t.shape[2:] if has_ring else None), []
    else:
        if make_query[0] not in ("pair", "bf16") or q_ring_t.dtype not in KERNEL_QUERY_DTYPES:
            raise ValueError(f"make_query={make_query!r} must name 'pair' or 'bf16', and the "
                             f"query be a float: {q_ring_t.dtype=}")  # fmt: skip
        q_shape = (2, d, NPAD) if make_query[0] == "pair" else (d, NPAD)
        # the query as read ([g, D]), then ``ring_query``'s f32 before its rounding
        make_scratch = [plgpu.SMEM(q_ring_t.shape[2:], q_ring_t.dtype),
                        plgpu.SMEM((d, NPAD), f32)]  # fmt: skip
    ring_scratch = [
        plgpu.SMEM(q_shape, k_res.dtype, transforms=b_tr),
        plgpu.SMEM((TILE, NPAD), k_res.dtype, transforms=b_tr),
        plgpu.Barrier(num_arrivals=1),
    ] if has_ring else []  # fmt: skip
    if final is None:
        out_type, final_scratch = jax.ShapeDtypeStruct((b, h, nmt, TILE, NPAD), f32), []
    else:
        out_type = jax.ShapeDtypeStruct((b, h, g, d), out_dtype)
        final_scratch = [plgpu.SMEM((cols, TILE), out_dtype)]
    fn = plgpu.kernel(
        kernel,
        # its name in profiles and ncu -k
        kernel_name="oscar_decode_int2_ring_merge" if has_ring else "oscar_decode_split_merge",
        out_type=out_type,
        scratch_types=[
            plgpu.SMEM((TILE, cols), f32),
            *ring_scratch,
            *final_scratch,
            *(make_scratch if has_ring else []),
        ],
        grid=(b, h, nmt),
        grid_names=("b", "h", "c"),
        compiler_params=plgpu.CompilerParams(
            approx_math=True, unsafe_no_auto_barriers=not auto_barriers
        ),
    )
    ring = ((q_ring_t, k_res, v_res, nq.astype(jnp.int32), lengths.astype(jnp.int32))
            if has_ring else ())  # fmt: skip
    fl = (flags.astype(jnp.int32),) if has_flags else ()
    # 8 columns: (b, h) flattened and the 16 split in two groups, because TMA strides at most
    # 5 dimensions and Mosaic tiles a box of 8 f32 columns (8, 8), so 8 of 16 columns of the
    # same array would take a sixth
    acc = acc.reshape(b, h, s, d, NPAD) if cols == NPAD else \
        acc.reshape(b * h, s, d, NPAD // cols, cols)  # fmt: skip
    return fn(acc, ml.reshape(b, h, s * 2, NPAD), *fl, *ring)


def int2_decode_attention_2launch(q, q_rot, rec, kn, nq, k_res, v_res, lengths, *,
                                  cfg: Int2DecodeConfig = Int2DecodeConfig(), softmax_scale=None,
                                  param_dtype=jnp.float16, ring_in_kernel=False,
                                  out_dtype=None, flags=None, poison=0, signs=None,
                                  nq_of=None):  # fmt: skip
    """As ``int2_decode_attention`` (no value un-rotation: the cache's values must be stored
    in the original basis or the rotation folded into W_V / W_O), with the merge in a second
    Mosaic GPU launch: q prep (XLA or, ``cfg.prep``, the kernels) + partials kernel + merge
    kernel. The ring: walked by
    the merge launch (before the splits), or with ``ring_in_kernel`` by one more split of
    the partials kernel (its bytes stream in the big launch; the merge launch then only
    merges the splits). The merge launch writes the
    output [B, H, g, D] in ``out_dtype`` (None: q's) itself, NaN for the rows whose
    ``flags`` [B] have ``poison`` bits set (``oscar_jax.attention.poison_flagged_rows``).
    ``signs`` (warp kernel): the partials kernel rotates the query itself, R q =
    fwht(signs q) (``oscar_jax.hadamard.fwht_signs``), and q_rot is not read (None).
    ``nq_of`` (the cache's ``KVQuantConfig``): nq is the lengths, and the kernels compute
    the rows' nq themselves (``_config.quantized_of``; ``Int2DecodeConfig.prep``)."""
    b, h, g, d = q.shape
    # prep="kernel": the kernel that walks the ring makes its query from the query in the
    # original basis: the warp kernel's ring split where it reads that query (it rotates
    # it itself), the merge launch always
    if ring_in_kernel:
        in_kernel = (cfg.prep == "kernel" and cfg.kernel == "warp"
                     and signs is not None)  # fmt: skip
    else:
        in_kernel = cfg.prep == "kernel"
    ring = ring_inputs(q, k_res, v_res, lengths, softmax_scale, cfg.ring_query,
                       query=not in_kernel)  # fmt: skip
    acc, ml = _partials_raw(q if signs is not None else q_rot, rec, kn, nq, cfg=cfg,
                            softmax_scale=softmax_scale, param_dtype=param_dtype,
                            ring=ring if ring_in_kernel else None, signs=signs,
                            nq_of=nq_of)  # fmt: skip
    make_query = None
    if in_kernel and not ring_in_kernel:
        ring = (kernel_query(q), *ring[1:])
        make_query = (cfg.ring_query, query_scale(softmax_scale, d))
    merge_ring = (None,) * 5 if ring_in_kernel else (*ring[:3], nq, ring[3])
    step = merge_step_for(cfg.merge_step, acc.shape[2])
    cols = cfg.merge_columns if ring_in_kernel else NPAD  # the ring's wgmma has 16 columns
    if cols != NPAD:
        step += step % 2  # (m, l) slots of 64 step bytes: 128-byte aligned for TMA
    final = (g, jnp.dtype(out_dtype or q.dtype), flags, poison)
    return int2_merge_ring(acc, ml, *merge_ring, auto_barriers=cfg.auto_barriers, step=step,
                           final=final, stages=cfg.merge_stages, nq_of=nq_of,
                           make_query=make_query, pdl=cfg.pdl, columns=cols)  # fmt: skip


def int2_decode_attention_1launch(q, q_rot, rec, kn, nq, k_res, v_res, lengths, *,
                                  cfg: Int2DecodeConfig, softmax_scale=None,
                                  param_dtype=jnp.float16, out_dtype=None, flags=None,
                                  poison=0, signs=None, nq_of=None):  # fmt: skip
    """As ``int2_decode_attention_2launch`` in one Mosaic launch: the warp kernel
    (``cfg.kernel == "warp"``) with one split a (b, h), each CTA walking its records, then
    the ring, and storing the merged output ([B, H, g, D] in ``out_dtype``, None: q's; NaN
    for the rows whose ``flags`` have ``poison`` bits). For batches whose B x H CTAs fill
    the GPU by themselves: no partials round trip, no merge launch. ``signs``: as
    ``int2_decode_attention_2launch``'s (the kernel rotates the query; q_rot not read),
    ``nq_of`` too (nq is the lengths)."""
    if cfg.kernel != "warp":
        raise ValueError(f"the one-launch call runs the warp kernel: {cfg.kernel=}")
    g = q.shape[2]
    in_kernel = cfg.prep == "kernel" and signs is not None
    ring = ring_inputs(q, k_res, v_res, lengths, softmax_scale, cfg.ring_query,
                       query=not in_kernel)  # fmt: skip
    final = (g, jnp.dtype(out_dtype or q.dtype), flags, poison)
    return warp_decode_partials(q if signs is not None else q_rot, rec, kn, nq,
                                cfg=dataclasses.replace(cfg, splits=1),
                                softmax_scale=softmax_scale, param_dtype=param_dtype, ring=ring,
                                final=final, signs=signs, nq_of=nq_of)  # fmt: skip
