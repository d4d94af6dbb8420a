"""The split-K partials kernel: one CTA per (row, KV head, split) over the records."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from oscar_jax.record import TILE, record_format
from pallas_kernels.decode.mosaic._config import (
    NPAD,
    WARP_PROBES,
    Int2DecodeConfig,
    quantized_of,
)
from pallas_kernels.decode.mosaic._dequant import _dequant_fns
from pallas_kernels.decode.mosaic._pdl import release_next_launch, wait_for_previous_launch
from pallas_kernels.decode.mosaic._ring import ring_query, ring_walk
from pallas_kernels.decode.mosaic._warp import warp_decode_partials


def int2_decode_partials(q_rot, rec, kn, nq, *, cfg: Int2DecodeConfig = Int2DecodeConfig(),
                         softmax_scale=None, param_dtype=jnp.float16):  # fmt: skip
    """See ``_partials_raw``; returns acc [B, H, S, D, 16], m [B, H, S, 16], l [B, H, S, 16]."""
    acc, ml = _partials_raw(q_rot, rec, kn, nq, cfg=cfg, softmax_scale=softmax_scale,
                            param_dtype=param_dtype)  # fmt: skip
    b, h, s = acc.shape[:3]
    return acc.reshape(b, h, s, q_rot.shape[-1], NPAD), ml[..., 0, :], ml[..., 1, :]


def _partials_raw(q_rot, rec, kn, nq, *, cfg: Int2DecodeConfig = Int2DecodeConfig(),
                  softmax_scale=None, param_dtype=jnp.float16, ring=None, signs=None,
                  nq_of=None):  # fmt: skip
    """Split-K partials of the quantized part (and, with ``ring``, of the ring as one more
    split).

    q_rot [B, H, g, D] (rotated query, g <= 16 query heads per KV head, any float dtype;
    D = 64, 128 or 256); rec [B, H, Lp/64, W] uint32 (``record_words(bits, D)``: 1600 / 2560
    at D = 128), kn [B, H, Lp] f32 (``fragment_layout``); nq [B] int32 quantized tokens per
    row (0 <= nq <= Lp).
    ring: None, or (qr [B, H, (2,) D, 16] the query for the ring as ``_ring.ring_inputs`` makes
    it (None: the warp kernel makes it, ``Int2DecodeConfig.prep``), k_res, v_res [B, H,
    R, D] in qr's 16-bit dtype, lengths [B] int32 tokens a row, the ring holding tokens nq
    .. length - 1): split S (the last) walks the ring instead of records. signs: the warp
    kernel's in-kernel rotation (``_warp.warp_decode_partials``; q_rot then in the original
    basis). nq_of (the cache's ``KVQuantConfig``): nq holds the rows' lengths and the warp
    kernel computes nq itself (``_config.quantized_of``; for the wgmma kernel XLA does).
    Returns acc [B, H, S (+ 1), D / 64, 64, 16] f32 (unnormalised O^T by channel blocks), ml
    [B, H, S (+ 1), 2, 16] f32 (running max of the scores in log2 units, -inf-like -1e30 for
    an empty split; the row sums).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if cfg.kernel == "warp":
        if cfg.stage not in ("full", *WARP_PROBES):
            raise ValueError(f"the warp kernel has no stage {cfg.stage!r}")
        return warp_decode_partials(q_rot, rec, kn, nq, cfg=cfg, softmax_scale=softmax_scale,
                                    param_dtype=param_dtype, ring=ring, signs=signs,
                                    nq_of=nq_of)  # fmt: skip
    nq = quantized_of(nq, nq_of)  # [B]: the wgmma kernel reads nq as given
    if signs is not None:
        raise ValueError(f"the in-kernel query rotation is the warp kernel's: {cfg.kernel=}")
    b, h, g, d = q_rot.shape
    _, _, nrec, words = rec.shape
    bits, d_rec = record_format(words)
    assert d == d_rec and g <= NPAD, (q_rot.shape, rec.shape)
    nmt = d // 64  # channel blocks of the values (wgmma M = 64 each)
    assert rec.shape[:2] == (b, h), (rec.shape, q_rot.shape)
    lp = nrec * TILE
    bt = cfg.block_tokens
    assert lp % bt == 0, (lp, bt)
    nsub = bt // TILE
    bps, s = cfg.split_plan(b, h, lp)
    pdt = jnp.dtype(param_dtype)
    qt = ring_query(q_rot, softmax_scale, pdt)  # [B, H, D, 16], as the ring's wgmma B operand
    key_frag, value_frags, stream_touch, dequant_touch = _dequant_fns(
        pdt, no_fma=cfg.stage == "nofma", unpack=cfg.unpack, bits=bits, d=d
    )
    f32 = jnp.float32
    NEG = -1e30
    b_tr = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
    WG = plgpu.Layout.WGMMA
    stage = "full" if cfg.stage == "nofma" else cfg.stage

    def kernel(q_ref, rec_ref, kn_ref, nq_ref, *refs):
        wait_for_previous_launch(cfg.pdl)
        release_next_launch(cfg.pdl)
        if ring is None:
            acc_out, ml_out, q_smem, p_smem, o_smem, ml_smem, q_bar = refs
        else:
            qr_ref, kr_ref, vr_ref, len_ref, acc_out, ml_out, q_smem, p_smem, o_smem, ml_smem, \
                q_bar, qr_smem, pr_smem, qr_bar = refs  # fmt: skip
        bi = jax.lax.axis_index("b")
        hi = jax.lax.axis_index("h")
        si = jax.lax.axis_index("s")

        def write(m, l_acc, outs):  # this split's partials -> acc_out / ml_out
            lsum = jnp.sum(l_acc, axis=0)
            for mt, o in enumerate(outs):
                o_smem[mt] = o
            ml_smem[0] = m
            ml_smem[1] = lsum
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, acc_out.at[bi, hi, si])
            plgpu.copy_smem_to_gmem(ml_smem, ml_out.at[bi, hi, si])
            plgpu.wait_smem_to_gmem(0)

        def records():
            """Split si of the quantized part (its blocks of records) -> ``write``."""
            nqv = nq_ref[bi]
            start_blk = si * bps
            nblk = jnp.clip((nqv - start_blk * bt + bt - 1) // bt, 0, bps)
            plgpu.copy_gmem_to_smem(q_ref.at[bi, hi], q_smem, q_bar)
            plgpu.barrier_wait(q_bar)

            def body(idxs, r_smem, n_smem, carry):
                (it,) = idxs
                m_prev, l_acc, *outs = carry
                t_base = (start_blk + it) * bt
                if stage in ("stream", "dequant"):
                    touch = stream_touch if stage == "stream" else dequant_touch
                    x = None
                    for jt in range(nsub):
                        strided = plgpu.Layout.WG_STRIDED((128,), 1)
                        y = plgpu.inline_mgpu(
                            arg_types=(plgpu.RefType(),),
                            return_type=plgpu.ShapeDtypeStruct((128,), jnp.uint32, layout=strided),
                        )(functools.partial(touch, row=jt))(r_smem)  # fmt: skip
                        x = y if x is None else x ^ y
                    # one cross-warp reduction per block (as the softmax max of 'full')
                    return (m_prev, l_acc + jnp.sum((x & 1).astype(jnp.int32)).astype(f32), *outs)

                def issue_qk(acc_ref, jt):
                    """Dequantize key subtile jt into the fragment layout and issue its wgmma."""
                    if cfg.split_operands:  # K = 64 channel blocks: fewer live registers
                        for hf in range(nmt):
                            kf = plgpu.inline_mgpu(
                                arg_types=(plgpu.RefType(),),
                                return_type=plgpu.ShapeDtypeStruct((TILE, 64), pdt, layout=WG),
                            )(functools.partial(key_frag, row=jt, half=hf))(r_smem)  # fmt: skip
                            plgpu.wgmma(acc_ref, kf, q_smem.at[pl.ds(hf * 64, 64)])
                    else:
                        kf = plgpu.inline_mgpu(
                            arg_types=(plgpu.RefType(),),
                            return_type=plgpu.ShapeDtypeStruct((TILE, d), pdt, layout=WG),
                        )(functools.partial(key_frag, row=jt))(r_smem)  # fmt: skip
                        plgpu.wgmma(acc_ref, kf, q_smem)

                def scores(sc, jt):
                    """Raw S^T of subtile jt -> times the token norms, invalid tokens at NEG."""
                    nrm = plgpu.load(n_smem.at[jt], layout=WG.reduce(1))  # [64] f32
                    sc = sc * jax.lax.broadcast_in_dim(nrm, (TILE, NPAD), [0])
                    tok = (
                        t_base
                        + jt * TILE
                        + plgpu.broadcasted_iota(jnp.int32, (TILE, NPAD), 0, layout=WG)
                    )
                    return jnp.where(tok < nqv, sc, NEG)

                if cfg.overlap_keys:  # all key wgmma of the block in flight before one wait

                    def qk_all(*acc_refs):
                        for jt, acc_ref in enumerate(acc_refs):
                            issue_qk(acc_ref, jt)
                        plgpu.wgmma_wait(0)
                        return tuple(a[...] for a in acc_refs)

                    raw = pl.run_scoped(
                        qk_all, *[plgpu.ACC((TILE, NPAD), f32) for _ in range(nsub)]
                    )
                    ss = [scores(sc, jt) for jt, sc in enumerate(raw)]
                else:  # one subtile at a time (the measured configuration)
                    ss = []
                    for jt in range(nsub):

                        def qk(acc_ref, jt=jt):
                            issue_qk(acc_ref, jt)
                            return acc_ref[...]

                        ss.append(scores(pl.run_scoped(qk, plgpu.ACC((TILE, NPAD), f32)), jt))
                mx = ss[0]
                for sc in ss[1:]:
                    mx = jnp.maximum(mx, sc)
                m_new = jnp.maximum(m_prev, jnp.max(mx, axis=0))
                corr = jnp.exp2(m_prev - m_new)
                corr_b = jax.lax.broadcast_in_dim(corr, (TILE, NPAD), [1])
                m_b = jax.lax.broadcast_in_dim(m_new, (TILE, NPAD), [1])
                l_acc = l_acc * corr_b
                ps = []
                for sc in ss:
                    p = jnp.exp2(sc - m_b)
                    l_acc = l_acc + p
                    ps.append(p)
                if stage == "keys":
                    return (m_new, l_acc, *(o * corr_b for o in outs))
                for jt, p in enumerate(ps):
                    p_smem[jt] = p.astype(pdt)
                plgpu.commit_smem()
                outs = [o * corr_b for o in outs]
                vt = plgpu.ShapeDtypeStruct((TILE, TILE), pdt, layout=WG)

                def pv(accs):
                    for jt in range(nsub):
                        if cfg.split_operands:  # one channel block at a time
                            for mt, a in enumerate(accs):
                                (v,) = plgpu.inline_mgpu(
                                    arg_types=(plgpu.RefType(),),
                                    return_type=(vt,),
                                )(functools.partial(value_frags, row=jt, mts=(mt,)))(r_smem)
                                plgpu.wgmma(a, v, p_smem.at[jt])
                            continue
                        vs = plgpu.inline_mgpu(
                            arg_types=(plgpu.RefType(),), return_type=(vt,) * nmt,
                        )(functools.partial(value_frags, row=jt))(r_smem)  # fmt: skip
                        for a, v in zip(accs, vs, strict=True):
                            plgpu.wgmma(a, v, p_smem.at[jt])

                outs = pl.run_state(pv)(tuple(plgpu.ACC.init(o) for o in outs))
                return (m_new, l_acc, *outs)

            zeros = lambda: plgpu.layout_cast(jnp.zeros((TILE, NPAD), f32), WG)  # noqa: E731
            init = (
                plgpu.layout_cast(jnp.full((NPAD,), NEG, f32), WG.reduce(0)),
                zeros(),
                *(zeros() for _ in range(nmt)),
            )
            pipe_specs = [
                plgpu.BlockSpec((nsub, words // 64, 64), lambda i: (start_blk + i, 0, 0)),
                plgpu.BlockSpec((nsub, TILE), lambda i: (start_blk + i, 0)),
            ]
            pipe = plgpu.emit_pipeline(
                body,
                grid=(nblk,),
                in_specs=pipe_specs,
                max_concurrent_steps=cfg.max_concurrent_steps,
                init_carry=init,
            )
            m, l_acc, *outs = pipe(rec_ref.at[bi, hi], kn_ref.at[bi, hi])  # rec [n, W / 64, 64]
            write(m, l_acc, outs)

        if ring is None:
            records()
            return

        @pl.when(si < s)
        def _():
            records()

        @pl.when(si == s)
        def _():
            plgpu.copy_gmem_to_smem(qr_ref.at[bi, hi], qr_smem, qr_bar)
            plgpu.barrier_wait(qr_bar)
            m, l_acc, *outs = ring_walk(
                qr_smem,
                pr_smem,
                kr_ref.at[bi, hi],
                vr_ref.at[bi, hi],
                (nq_ref[bi], len_ref[bi]),
                range(nmt),
                slots=ring[1].shape[2],
            )
            write(m, l_acc, outs)

    sr = s + (ring is not None)  # splits written
    out_type = (
        jax.ShapeDtypeStruct((b, h, sr, nmt, TILE, NPAD), f32),
        jax.ShapeDtypeStruct((b, h, sr, 2, NPAD), f32),
    )
    ring_scratch = [] if ring is None else [
        plgpu.SMEM(ring[0].shape[2:], ring[0].dtype, transforms=b_tr),
        plgpu.SMEM((TILE, NPAD), ring[0].dtype, transforms=b_tr),
        plgpu.Barrier(num_arrivals=1),
    ]  # fmt: skip
    fn = plgpu.kernel(
        kernel,
        kernel_name=f"oscar_decode_int{bits}_partials",  # its name in profiles and ncu -k
        out_type=out_type,
        scratch_types=[
            plgpu.SMEM((d, NPAD), pdt, transforms=b_tr),
            plgpu.SMEM((nsub, TILE, NPAD), pdt, transforms=b_tr),
            plgpu.SMEM((nmt, TILE, NPAD), f32),
            plgpu.SMEM((2, NPAD), f32),
            plgpu.Barrier(num_arrivals=1),
            *ring_scratch,
        ],
        grid=(b, h, sr),
        grid_names=("b", "h", "s"),
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            unsafe_no_auto_barriers=not cfg.auto_barriers,
            reduction_scratch_bytes=cfg.reduction_scratch,
        ),
    )
    rec3 = rec.reshape(b, h, nrec, words // 64, 64)  # TMA boxes are <= 256 per dimension
    return fn(qt, rec3, kn.reshape(b, h, nrec, TILE), nq.astype(jnp.int32), *(ring or ()))
