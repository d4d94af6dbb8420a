"""The library's cache in, the library's output out: the "mosaic" decode backend's call."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from oscar_jax import attention as att
from oscar_jax import hadamard
from oscar_jax.cache import FLAG_NONFINITE
from oscar_jax.record import TILE, fragment_layout, record_words
from pallas_kernels.decode.mosaic._config import LOG2E, NPAD, Int2DecodeConfig
from pallas_kernels.decode.mosaic._kernel import int2_decode_partials
from pallas_kernels.decode.mosaic._merge import (
    int2_decode_attention,
    int2_decode_attention_1launch,
    int2_decode_attention_2launch,
    int2_decode_attention_fused,
    weigh_splits,
)

# how the ring and the splits are merged: "xla" both in XLA; "mosaic" both in a second
# Mosaic launch; "fused" the ring as one more split of the partials kernel, the splits merged
# in XLA; "fused_mosaic" the same ring split, the splits merged by the second launch;
# "single" no second launch: one split a (b, h) walks its records and the ring and stores the
# output (the warp kernel)
MERGES = ("auto", "xla", "mosaic", "fused", "fused_mosaic", "single")


def unsupported_reason(cache, g: int = 1, convert: bool = False) -> str | None:
    """Why ``decode_attention_mosaic`` cannot take this cache with ``g`` query heads per KV
    head (None: it can; ``convert``: a planar cache converted on every call counts);
    ``oscar_jax.backends.COVERAGE``'s entry."""
    why = cache.cfg.record_reason(cache.head_dim)
    if why is not None:
        return f"the Mosaic kernel needs {why}"
    if cache.quant_capacity == 0:
        return "the cache has no quantized part"
    if g > NPAD:
        return f"GQA ratio g={g} must be <= {NPAD} for the Mosaic kernel"
    if cache.cfg.layout != "record" and not convert:
        return (
            f"decode_attention_mosaic reads a cache of layout='record'; this one has "
            f"layout={cache.cfg.layout!r} (make it with KVQuantConfig(layout='record'), or "
            "pass convert=True to convert it on every call)"
        )
    return None


NUM_SMS = 132  # H100 and H200
STAGE_BYTES = 86_000  # shared memory for the TMA stages of one program (two an SM)
# the one-launch call ("single") when its B x H CTAs fill at least this share of the rounds of
# resident CTAs they take; measured (H100, CUPTI, 48 / 64 / 40 rows x 8 heads x 4K):
# fill 0.97 -> 86.0 / 105.0 us against the split call's 92.4 / 122.6, fill 0.81 -> 84.7
# against 83.3, fill 0.61-0.73 -> 11-14% slower (its tail round runs CTAs alone on an SM)
SINGLE_MIN_FILL = 0.85


def round_fill(ctas: int, slots: int) -> float:
    """The share of ``slots`` x rounds that ``ctas`` equal CTAs keep busy."""
    return ctas / (-(-ctas // slots) * slots)


def auto_merge(cfg: Int2DecodeConfig, b: int, h: int, capacity: int, rotate_values: bool,
               num_sms: int = NUM_SMS) -> str:  # fmt: skip
    """``merge="auto"``'s choice. Rotated values: "xla" (the un-rotation is an XLA GEMM).
    With the warp kernel and B x H CTAs that fill their rounds of ctas_per_sm x num_sms
    resident slots (``SINGLE_MIN_FILL``), the whole call in one launch ("single"). Else the
    ring as the kernel's last split ("fused_mosaic": one query, one ring walk in the big
    launch, a merge launch of the splits alone) unless its B x H CTAs spill a round
    of resident CTAs into a new one while there are fewer than 3 rounds: then the ring goes
    to the merge launch ("mosaic"). Measured (CUPTI, BENCHMARKS.md): the ring split is
    faster at 1 x 128K (its 8 CTAs fit the round) and 48 x 4K (3 rounds: the short ring
    CTAs fill gaps), slower at 8 x 32K (256 CTAs fill one round of 264, the ring's 64 open
    a second: +5.5 us on an H200, +12.8 on an H100)."""
    if rotate_values:
        return "xla"
    slots = cfg.ctas_per_sm * num_sms
    if cfg.kernel == "warp" and round_fill(b * h, slots) >= SINGLE_MIN_FILL:
        return "single"
    _, s = cfg.split_plan(b, h, capacity)
    rounds = -(-(b * h * s) // slots)
    spills = -(-(b * h * (s + 1)) // slots) > rounds
    return "mosaic" if spills and rounds < 3 else "fused_mosaic"


def default_config(capacity: int, bits: int = 2, head_dim: int = 128,
                   g: int | None = None, rows: int | None = None) -> Int2DecodeConfig:  # fmt: skip
    """The default tuning: the largest block of 256, 128 or 64 tokens that divides the
    quantized capacity (a record cache holds whole 64-token records) and leaves room for at
    least 2 TMA stages in ``STAGE_BYTES``, then up to 3 stages. At head_dim 128: INT2 256
    tokens x 3 stages (80 KB), INT4 (1.6x the bytes) 256 x 2, so that two programs an SM
    fit its 228 KB of shared memory; head_dim 256 takes 128-token blocks.

    The kernel: the warp-level one (``kernel="warp"``) for INT2 and INT4 at head_dim <= 128
    with g <= 8 query heads a KV head (None: not known, taken as <= 8); the wgmma kernel
    elsewhere. The warp kernel rotates a Hadamard-rotated cache's query itself, the wgmma
    kernel's call rotates it by an XLA GEMM first. Measured (CUPTI, H100;
    docs/mosaic_decode_notes.md): INT4 warp 71.5 against wgmma 75.4 us at 1 x 128K and 39.6
    against 42.0 at 1 x 64K; INT2 at 48 x 4K warp 76.3 against wgmma 92.3 us; at 1 x 4K
    the kernel 8.7 against 10.3 us and the backend's call from a bf16 query 12.8 against
    15.4 (with the GEMM rotation for both: 16.0 against 15.4). INT2 warp rows that fill
    the rounds of three CTAs an SM (``SINGLE_MIN_FILL``) better than of two take 128-token
    blocks, three an SM, for the one-launch call: at 48 x 4K 86.0 us against 96.3 at
    256-token blocks (H100).
    """
    rec = record_words(bits, head_dim) * 4 + TILE * 4  # a record and its norms, bytes
    fits = [b for b in (256, 128, 64) if capacity % b == 0]
    block = next((b for b in fits if 2 * rec * b // TILE <= STAGE_BYTES), fits[-1])
    stages = max(1, min(3, STAGE_BYTES // (rec * block // TILE)))
    warp = head_dim <= 128 and (g is None or g <= 8)
    if warp and bits == 2 and rows and capacity % 128 == 0:
        # INT2 at 128-token blocks: 134 registers and 40 KB of stages, three CTAs an SM; taken
        # when that lets the one-launch call's rows fill their rounds (48 x 8 on 3 x 132)
        f2, f3 = round_fill(rows, 2 * NUM_SMS), round_fill(rows, 3 * NUM_SMS)
        if f3 >= SINGLE_MIN_FILL and f3 > f2:
            return Int2DecodeConfig(block_tokens=128, max_concurrent_steps=3, ctas_per_sm=3,
                                    kernel="warp")  # fmt: skip
    return Int2DecodeConfig(block_tokens=block, max_concurrent_steps=stages,
                            kernel="warp" if warp else "wgmma")  # fmt: skip


def kernel_inputs(cache, *, block_tokens: int = 256):
    """What the kernel reads of ``cache``: (rec, kn) in the record layout, nq [B] int32
    quantized tokens per row, lengths [B] int32 tokens per row (the kernels find the ring's
    valid slots from nq and lengths).

    A layout='record' cache is read as it is (``cache.rec``, ``cache.kn``; block_tokens must
    divide its capacity); a planar one is converted (``fragment_layout``, exact, but it
    reads and writes the whole quantized part)."""
    if cache.cfg.layout == "record":
        if cache.quant_capacity % block_tokens:
            raise ValueError(
                f"block_tokens={block_tokens} must divide the record cache's quantized "
                f"capacity {cache.quant_capacity}"
            )
        rec, kn = cache.rec, cache.kn
    else:
        pdt = jnp.dtype(cache.cfg.scale_dtype)
        rec, kn = fragment_layout(cache.k_codes, cache.k_scale, cache.k_zero, cache.k_norm,
                                  cache.v_codes, cache.v_scale, cache.v_zero, param_dtype=pdt,
                                  block_tokens=block_tokens)  # fmt: skip
    nq = cache.num_quantized().astype(jnp.int32)
    return rec, kn, nq, cache.lengths.astype(jnp.int32)


def decode_attention_mosaic(q, cache, *, softmax_scale=None, cfg: Int2DecodeConfig = None,
                            merge: str = "auto", convert: bool = False):  # fmt: skip
    """``oscar_jax.decode_attention`` of q [B, Hq, D] over ``cache`` by the Mosaic kernel.

    The cache must have layout='record' (``KVQuantConfig.layout``): the kernel reads its
    records as they are. ``convert=True`` takes a planar cache too and converts it on every
    call (exact, but it reads and writes the whole quantized part: a check of the kernel,
    not for speed). The query is rotated in XLA; the ring and the merge: ``merge="xla"`` by
    ``merge_partials_with_ring``, ``"mosaic"`` by the second Mosaic launch
    (``int2_decode_attention_2launch``; values must not be rotated), ``"fused"`` the ring as
    one more split of the partials kernel and one XLA merge of the splits
    (``int2_decode_attention_fused``), ``"fused_mosaic"`` that ring split and the second
    launch's merge of the splits (values not rotated), ``"single"`` one launch of the warp
    kernel with one split a (b, h) that walks the ring and stores the output itself
    (``int2_decode_attention_1launch``; values not rotated; ValueError for a ``cfg`` of
    the wgmma kernel), ``"auto"`` as ``auto_merge`` picks (XLA for rotated values, else
    one of the Mosaic calls by the shape).
    INT2 or INT4 records (the cache's bits). NaN for
    FLAG_NONFINITE rows as the library's attention. ValueError for a cache
    ``unsupported_reason`` names.
    """
    g = att.check_query(q, cache)
    reason = unsupported_reason(cache, g, convert)
    if reason is not None:
        raise ValueError(f"decode_attention_mosaic: {reason}")
    if merge not in MERGES:
        raise ValueError(f"{merge=} must be one of {MERGES}")
    kcfg, b, h = cache.cfg, cache.batch, cache.num_kv_heads
    if merge in ("mosaic", "fused_mosaic", "single") and kcfg.rotate_values:
        raise ValueError(f"{merge=} needs values stored unrotated (rotate_values=False)")
    pdt = jnp.dtype(kcfg.scale_dtype)
    if cfg is None:
        cfg = default_config(cache.quant_capacity, kcfg.bits, cache.head_dim, g, rows=b * h)
        if merge == "single":  # the one-launch call is the warp kernel's
            cfg = dataclasses.replace(cfg, kernel="warp")
    if merge == "auto":
        merge = auto_merge(cfg, b, h, cache.quant_capacity, kcfg.rotate_values)
    rec, kn, nq, lengths = kernel_inputs(cache, block_tokens=cfg.block_tokens)
    nq_of = None
    if cfg.prep == "kernel" and cfg.kernel == "warp" and merge in ("mosaic", "fused_mosaic",
                                                                   "single"):  # fmt: skip
        # the Mosaic kernels compute nq from the lengths: no XLA launch for it
        nq, nq_of = lengths, kcfg
    qg = q.astype(jnp.float32).reshape(b, h, g, cache.head_dim)
    signs = hadamard.fwht_signs(kcfg, cache.head_dim) if kcfg.rotate_keys else None
    if merge in ("mosaic", "fused_mosaic", "single") and cfg.kernel == "warp" and signs is not None:
        # the warp kernel's CTAs convert and rotate the query themselves: no launch before it
        q_rot, qg = None, q.reshape(b, h, g, cache.head_dim)
    else:
        signs = None
        # dense: one [D, D] GEMM (XLA fuses the butterflies of a few rows into a slow loop)
        q_rot = hadamard.rotate(qg, kcfg, dense=True) if kcfg.rotate_keys else qg
    if merge == "single":
        if cfg.kernel != "warp":
            raise ValueError(f"{merge=} runs the warp kernel: {cfg.kernel=}")
        out = int2_decode_attention_1launch(qg, q_rot, rec, kn, nq, cache.k_res, cache.v_res,
                                            lengths, cfg=cfg, softmax_scale=softmax_scale,
                                            param_dtype=pdt, out_dtype=q.dtype,
                                            flags=cache.flags, poison=FLAG_NONFINITE,
                                            signs=signs, nq_of=nq_of)  # fmt: skip
        return out.reshape(q.shape)
    if merge in ("mosaic", "fused_mosaic"):
        # the merge launch writes the output as the library returns it (layout, dtype and
        # the poisoned rows): no XLA fusion after the kernels
        out = int2_decode_attention_2launch(qg, q_rot, rec, kn, nq, cache.k_res, cache.v_res,
                                            lengths, cfg=cfg, softmax_scale=softmax_scale,
                                            param_dtype=pdt,
                                            ring_in_kernel=merge == "fused_mosaic",
                                            out_dtype=q.dtype, flags=cache.flags,
                                            poison=FLAG_NONFINITE, signs=signs,
                                            nq_of=nq_of)  # fmt: skip
        return out.reshape(q.shape)
    unrot = (lambda x: hadamard.unrotate(x, kcfg, dense=True)) if kcfg.rotate_values else None
    call = int2_decode_attention_fused if merge == "fused" else int2_decode_attention
    out = call(qg, q_rot, rec, kn, nq, cache.k_res, cache.v_res, lengths, cfg=cfg,
               softmax_scale=softmax_scale, param_dtype=pdt, unrotate=unrot)  # fmt: skip
    return att.poison_flagged_rows(out.reshape(q.shape).astype(q.dtype), cache)


def quantized_partial_mosaic(q_rot, cache, scale, *, offset=0, cfg: Int2DecodeConfig = None):
    """``oscar_jax.attention.quantized_partial`` by the Mosaic kernel, for a sequence shard
    of a layout='record' cache (global quantized positions offset..; ``cache.lengths`` are
    global): q_rot [b, h, g, D] f32 (unscaled) -> (acc [b, h, g, D] in the stored value
    basis, m [b, h, g] natural-log units, -inf where the shard has no token, l [b, h, g]).
    The splits are merged here, in XLA."""
    b, h, g, _ = q_rot.shape
    reason = unsupported_reason(cache, g)
    if reason is not None:
        raise ValueError(f"quantized_partial_mosaic: {reason}")
    lq = cache.quant_capacity
    cfg = cfg or default_config(lq, cache.cfg.bits, cache.head_dim, g)
    rec, kn, _, _ = kernel_inputs(cache, block_tokens=cfg.block_tokens)
    nq = jnp.clip(cache.num_quantized().astype(jnp.int32) - offset, 0, lq)
    acc, m2, l = int2_decode_partials(q_rot, rec, kn, nq, cfg=cfg, softmax_scale=scale,
                                      param_dtype=jnp.dtype(cache.cfg.scale_dtype))  # fmt: skip
    acc = jnp.swapaxes(acc, -1, -2)[..., :g, :]  # [b, h, S, g, D]
    m2, l = m2[..., :g], l[..., :g]
    mt = jnp.max(m2, axis=2)
    qacc, lsum = weigh_splits(acc, m2, l, mt)
    return qacc, jnp.where(lsum > 0, mt / LOG2E, -jnp.inf), lsum
