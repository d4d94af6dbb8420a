"""The BF16 member of the decode-kernel family: split-K flash-decoding over a ``bf16`` cache.

For ``method == "bf16"`` the cache is a ring of S = max_len slots holding token t in
slot t, so a row of length n is slots [0, n). One program handles (row, KV head,
split) with the GQA query group padded to 16 MMA rows, exactly like the INT
kernel (same heuristic, same merge), so the benchmark compares like with like.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.decode.config import DecodeConfig, _triton_params
from pallas_kernels.decode.int_kernel import GP, NEG
from pallas_kernels.decode.merge import merge_splits
from pallas_kernels.decode.partials import pad_query


def _load(ref, t0, t, limit, interpret):
    """Rows [t0, t0+t) of a [S, D] ref; rows >= limit (past the ring) read as zero."""
    if interpret:
        s = ref.shape[0]
        rows = ref[pl.ds(jnp.minimum(t0, s - t), t), :]  # in bounds; shift and mask below
        shift = t0 - jnp.minimum(t0, s - t)
        idx = jax.lax.broadcasted_iota(jnp.int32, (t, 1), 0)
        rows = jnp.roll(rows, -shift, axis=0)
        return jnp.where(idx + t0 < limit, rows, 0)
    from jax.experimental.pallas import triton as plgpu

    idx = t0 + jax.lax.broadcasted_iota(jnp.int32, (t, 1), 0)
    return plgpu.load(ref.at[pl.ds(t0, t), :], mask=idx < limit, other=0)


def _bf16_kernel(n_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, t, bps, slots, interpret):
    n = n_ref[0]
    start = pl.program_id(2) * bps * t
    nblk = jnp.clip((n - start + t - 1) // t, 0, bps)
    q = q_ref[...]  # [GP, D] bf16

    def body(it, carry):
        m_prev, l_prev, acc = carry
        t0 = pl.multiple_of(start + it * t, t)
        k = _load(k_ref, t0, t, slots, interpret)
        s = jax.lax.dot_general(
            k, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [T, GP]
        valid = t0 + jax.lax.broadcasted_iota(jnp.int32, (t, GP), 0) < n
        s = jnp.where(valid, s, NEG)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=0))
        corr = jnp.exp(m_prev - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[None, :]), 0.0)
        v = _load(v_ref, t0, t, slots, interpret)
        pv = jax.lax.dot_general(
            p.astype(v.dtype), v, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )  # [GP, D]
        return m_new, l_prev * corr + jnp.sum(p, axis=0), acc * corr[:, None] + pv

    d = q_ref.shape[1]
    init = (
        jnp.full((GP,), NEG, jnp.float32),
        jnp.zeros((GP,), jnp.float32),
        jnp.zeros((GP, d), jnp.float32),
    )
    m, lsum, acc = jax.lax.fori_loop(0, nblk, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = lsum


def decode_bf16(qg_scaled, cache, cfg: DecodeConfig):
    """qg_scaled [B, H, g, D] (softmax scale folded in) -> normalised outputs [B, H, g, D] f32."""
    acc, m, lsum = bf16_partials(qg_scaled, cache, cfg)
    out = jnp.where(lsum[..., None] > 0, acc / jnp.where(lsum > 0, lsum, 1.0)[..., None], 0.0)
    return out[:, :, : qg_scaled.shape[2]]


def bf16_partials(qg_scaled, cache, cfg: DecodeConfig, lengths=None):
    """Merged (acc [B, H, GP, D], m, l [B, H, GP]) over ring slots [0, lengths) (default
    ``cache.lengths``; a sequence shard passes its own count), m = -inf where empty."""
    b, h, g, d = qg_scaled.shape
    slots = cache.slots
    t = cfg.block_tokens
    nblk_all = -(-slots // t)
    bps = min(cfg.blocks_per_split, nblk_all)
    ns = -(-nblk_all // bps)
    dt = cache.dtype
    if dt not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"cache dtype {dt} must be bfloat16 or float16 for the pallas bf16 kernel")
    kern = functools.partial(_bf16_kernel, t=t, bps=bps, slots=slots, interpret=cfg.interpret)

    def full(*shape):
        return pl.BlockSpec((None, None, *shape), lambda i, j, s: (i, j) + (0,) * len(shape))

    def part(*shape):
        return pl.BlockSpec(
            (None, None, None, *shape), lambda i, j, s: (i, j, s) + (0,) * len(shape)
        )

    f32 = jnp.float32
    kwargs = (
        {} if cfg.interpret else dict(compiler_params=_triton_params(cfg.num_warps, cfg.num_stages))
    )
    acc, m, lsum = pl.pallas_call(
        kern,
        grid=(b, h, ns),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j, s: (i,)),
            full(GP, d),
            full(slots, d),
            full(slots, d),
        ],
        out_specs=[part(GP, d), part(GP), part(GP)],
        out_shape=[
            jax.ShapeDtypeStruct((b, h, ns, GP, d), f32),
            jax.ShapeDtypeStruct((b, h, ns, GP), f32),
            jax.ShapeDtypeStruct((b, h, ns, GP), f32),
        ],
        interpret=cfg.interpret,
        name="oscar_decode_bf16",
        **kwargs,
    )(
        (cache.lengths if lengths is None else lengths).astype(jnp.int32),
        pad_query(qg_scaled, dt),
        cache.k_res,
        cache.v_res,
    )
    return merge_splits(acc, m, lsum)
