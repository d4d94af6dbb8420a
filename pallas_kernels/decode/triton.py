"""Split-K flash-decoding over the packed OScaR cache (Pallas, lowered through Triton).

One program handles one (row b, KV head h, split s): all ``g`` query heads of the
KV head (padded to ``gp = 16`` MMA rows) against the split's blocks of ``T``
quantized tokens, so one read of the packed K/V serves every query head.

With ``q' = R q`` (rotated once per step in XLA, softmax scale folded in), key group
``j`` of token ``t`` and value group ``grp``::

    score_t = norm_t * dot(q', code_t * ks_j + kz_j)
    out[:, grp] = dot(p, code[:, grp] * vs[:, grp] + vz[:, grp])

Each packed code tile is dequantized in the tensor-core operand registers it is read
into (``tiles.dequant``: bit-pattern int->float and packed 16-bit fmas, inline
PTX), so nothing but the packed bytes and their parameters crosses memory and no
tile takes a shared-memory layout change. The key MMA is float16 (the dequantized
keys and the scaled query must stay below 65504, as for any float16 kernel), the
value MMA float16 with float16 parameters (the default), bfloat16 with bfloat16 ones
(values of any float32 magnitude) and, with float32 parameters, values dequantized in
float32 and split into bfloat16 hi + lo halves for two value dots (one bfloat16
rounding of the parameters costs up to 2e-2 relative output error against the float32
XLA path); accumulation, softmax and the
partials are float32. Each split writes (acc, m, l), acc for the real query rows only
(GQA 4: 4 of the 16; the merge reads those). With two token sub-blocks
(``DecodeConfig.token_split``) the padded rows carry the odd tokens: rows (j, h) hold
head h over tokens j, j + 2, .. (see ``int_kernel._int_quant_part``). By default the
residual ring is the launch's last split (the plain f32 query split into two 16-bit
halves, so two tensor-core dots give ~f32 accuracy; its acc stays in the original
basis). By default (``DecodeConfig.rotate_in_kernel``) the kernel itself scales and
rotates the query and un-rotates each split's acc with the Hadamard rotation's Kronecker
factors (a few [16, W] x [W, W] dots per program), and derives each row's quantized
count from its length, so every partial is in the original basis and a second Pallas
launch merges the splits into the output (``merge``): a call is two launches.
Otherwise (``rotate_in_kernel=False``, a rotation without Kronecker form, or
``merge="xla"``) XLA rotates the query and merges the splits, un-rotating the quantized
splits' weighted sum once (seven launches around the kernel at 1 x 4K).
(An in-kernel [D, D] rotation and f32 FMA dots in the ring cost 2.2 KB of register
spills per thread in the whole kernel: ``ptxas -v`` of the lowered IR.) With
``fuse_ring=False`` the ring goes
through ``oscar_jax.attention.residual_partial`` instead. ``decode_attention_triton``
assumes an unsharded cache (ring slots ``cache.slots``, quantized positions from 0);
``quantized_partial_triton`` serves one sequence shard of ``oscar_jax.sharding`` (its own
token count as ``nq``, no ring).

Launch parameters and their heuristic: ``pallas_kernels.decode.config``; the INT kernel's
launch: ``partials``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from oscar_jax import hadamard
from oscar_jax.attention import (
    check_query,
    merge_partials,
    poison_flagged_rows,
    residual_partial,
)
from pallas_kernels.decode import bf16 as decode_bf16
from pallas_kernels.decode import merge as decode_merge
from pallas_kernels.decode.config import choose_config
from pallas_kernels.decode.int_kernel import GP
from pallas_kernels.decode.merge import merge_splits
from pallas_kernels.decode.partials import (
    in_kernel_rotation_applies,
    int_partials,
    quantized_partials,
    ring_block,
    stack_queries,
)


def unsupported_reason(cache, g: int) -> str | None:
    """Why the Triton kernels cannot take ``cache`` with ``g`` query heads per KV head
    (None: they can); ``oscar_jax.backends.COVERAGE``'s entry and both entry points' check."""
    if cache.cfg.layout != "planar":
        return (
            f"implementation='triton' needs a cache of layout='planar'; this one has "
            f"layout={cache.cfg.layout!r} (convert_layout converts a cache exactly)"
        )
    if cache.head_dim not in (64, 128, 256):
        return f"head_dim={cache.head_dim} must be 64, 128 or 256 for the pallas decode kernel"
    if g > GP:
        return f"GQA ratio num_q_heads/num_kv_heads={g} must be <= {GP}"
    if cache.cfg.quantized and cache.cfg.bits not in (2, 4):
        return f"bits={cache.cfg.bits} must be 2 or 4 for the pallas decode kernel"
    if not cache.cfg.quantized and cache.dtype not in (jnp.bfloat16, jnp.float16):
        return (f"a bf16-method cache of dtype {jnp.dtype(cache.dtype).name} must be "
                "bfloat16 or float16 for the pallas bf16 kernel")  # fmt: skip
    return None


def _check(cache, g: int) -> None:
    why = unsupported_reason(cache, g)
    if why is not None:
        raise ValueError(why)


def decode_attention_triton(q, cache, *, softmax_scale=None, **options):
    """``decode_attention(..., implementation="triton")``; options: DecodeConfig fields.
    Rows with ``FLAG_NONFINITE`` come back NaN (in the merge kernel where it runs)."""
    g = check_query(q, cache)
    _check(cache, g)
    kcfg = cache.cfg
    b, hq, d = q.shape
    h = cache.num_kv_heads
    scale = float(1.0 / np.sqrt(d)) if softmax_scale is None else float(softmax_scale)
    f32 = jnp.float32
    qg = q.astype(f32).reshape(b, h, g, d)
    if not kcfg.quantized:
        cfg = choose_config(b, h, cache.slots, block=128, **options)
        out = decode_bf16.decode_bf16(qg * scale, cache, cfg)
        return poison_flagged_rows(out.reshape(b, hq, d).astype(q.dtype), cache)
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


def quantized_partial_triton(q_rot, cache, scale, *, offset=0, **options):
    """``oscar_jax.attention.quantized_partial`` by the INT kernel, for a sequence shard.

    q_rot [b, h, g, d] f32 (unscaled) -> (acc [b, h, g, d] rotated basis, m, l [b, h, g]).
    The shard holds global quantized positions offset.. (``cache.lengths`` are global): it
    reads clip(nq - offset, 0, capacity) tokens. No fused ring (the caller adds the ring).
    A ``bf16`` cache (all tokens in the ring, no rotation) runs the BF16 kernel over its
    ring slots offset.. instead: clip(length - offset, 0, slots) of them.
    """
    kcfg = cache.cfg
    b, h, g, d = q_rot.shape
    _check(cache, g)
    if not kcfg.quantized:
        cfg = choose_config(b, h, cache.slots, block=128, **options)
        n = jnp.clip(cache.lengths.astype(jnp.int32) - offset, 0, cache.slots)
        acc, m, lsum = decode_bf16.bf16_partials(q_rot * scale, cache, cfg, lengths=n)
        return acc[:, :, :g], m[:, :, :g], lsum[:, :, :g]
    lq = cache.quant_capacity
    cfg = choose_config(b, h, lq, kcfg.group_size, **options)
    if lq == 0:
        z = jnp.zeros((b, h, g), jnp.float32)
        return jnp.zeros_like(q_rot), z - jnp.inf, z
    nq = jnp.clip(cache.num_quantized().astype(jnp.int32) - offset, 0, lq)
    parts = quantized_partials(stack_queries(scale, q_rot), cache, cfg, nq=nq, rows=g)
    return merge_splits(*parts)
