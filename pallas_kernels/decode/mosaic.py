"""INT2 split-K decode attention in Pallas Mosaic GPU (Hopper, sm_90): an experimental kernel.

The "mosaic" backend of ``oscar_jax.decode_attention`` (``mosaic_backend``): it reads the
"record" layout (below; ``oscar_jax.record``), which a cache of
``KVQuantConfig(layout="record")`` holds natively (prefill and the decode-time flushes write
it), so a call reads the cache as it is. A planar cache is refused, or converted on every
call with ``decode_attention_mosaic(..., convert=True)`` (exact, but it reads and writes the
whole quantized part: a check of the kernel, not for speed). The kernel's own timings and
where its time goes: BENCHMARKS.md, "Mosaic GPU decode (experimental)".
Covered: INT2, head_dim 128, G = 32, 16-bit parameters, GQA ratio <= 16, per-head or
per-token norms (``unsupported_reason``). The kernels need jax >= 0.11.2; the layout
functions run on any backend. Entry points:

  * ``fragment_layout(k_codes, k_scale, k_zero, k_norm, v_codes, v_scale, v_zero, *,
    param_dtype, block_tokens) -> (rec, kn)``: planar cache arrays -> this kernel's layout
    (exact); ``fragment_layout_inverse(rec, kn, lq, *, param_dtype)`` its inverse.
  * ``int2_decode_attention_2launch(q, q_rot, rec, kn, nq, k_res, v_res, ring_valid, *,
    cfg, softmax_scale, param_dtype) -> [B, H, g, 128]``: the decode call in two Mosaic
    GPU launches (split-K partials; ring + LSE merge) plus two small XLA fusions (query
    prep, output transpose). Values must be in the original basis (no run-time un-rotation).
  * ``int2_decode_attention(...same..., unrotate=None)``: the partials kernel + the ring
    and merge in XLA (~10 small fusions), with an optional value un-rotation.
  * ``int2_decode_partials(q_rot, rec, kn, nq, *, cfg, ...) -> (acc, m, l)``: the kernel
    alone (split partials, log2 units), e.g. for sequence-sharded callers.

Math (per batch row b, KV head h, query head i of its GQA group; rotated basis):
  key   k_t[c] = norm_t * (code_k[t, c] * ks[t // G, c] + kz[t // G, c])
  value v_t[c] = code_v[t, c] * vs[t, c // G] + vz[t, c // G]
  s_t = q_i . k_t * softmax_scale;  out = sum_t softmax(s)_t v_t   (ring merged by LSE)

Kernel design (one CTA = one warpgroup of 128 threads = one (b, h, split)):
  * Tokens are the wgmma M dimension (64 per tile), the GQA query heads the N dimension
    (padded to 16: a 16-bit B operand in shared memory needs N >= 16 in Mosaic GPU).
    Keys: S^T[64, 16] = K[64 tok, D] @ Q^T[D, 16] (m64n16k16 x 8); values:
    O^T[D, 16] += V^T[D, 64 tok] @ P^T[64 tok, 16] (two M = 64 channel halves for D = 128;
    P^T goes registers -> shared memory -> wgmma B operand).
  * The A operands (K, V^T) are dequantized in registers straight into the wgmma
    register-fragment layout: each thread reads its own 16 bytes of codes (one LDS.128)
    and turns them into f16x2 / bf16x2 pairs by shift, AND/OR onto the magic number
    (0x6400 f16 = 1024, 0x4300 bf16 = 128), subtract the magic (exact), one FMA with the
    scale/zero pair. No layout conversion, no shared-memory round trip of the operand.
  * The cache is read as one "record" per 64 tokens (codes + scales + zeros of K and V,
    1600 uint32 words, permuted at quantize time so that every thread's parameters are
    16-byte vectors) plus a f32 norm vector: two TMA copies per block, pipelined by
    ``plgpu.emit_pipeline``.
  * Online softmax (base 2, log2(e) folded into the query) per block of ``block_tokens``;
    the row sums are kept per element and reduced once at the end.

Record layout of one 64-token tile (uint32 words; "tid" is the thread of the warpgroup,
w = tid // 32 its warp, l = tid % 32 its lane, j = l % 4):
  [0, 512)      K codes: word 4 tid + i, bits 2p + 16e, p = 2 (cb % 4) + rh, i = cb // 4,
                holds code of token 16 w + l // 4 + 8 rh, channel 8 cb + 2 j + e
                (cb in 0..15, rh, e in 0..1)
  [512, 1024)   V codes: word 512 + 4 tid + 2 mt + cb // 4, bits 2p + 16e, p = 2 (cb % 4) + rh,
                holds code of channel 64 mt + 16 w + l // 4 + 8 rh, token 8 cb + 2 j + e
                (mt in 0..1, cb in 0..7)
  [1024, 1280)  K params, 16-bit values two to a word (position 2i in the low half of
                word i, 2i + 1 in the high half): [group g in 0..1][scale, zero][128
                positions], channel 8 cb + 2 j + e of token group 2 n + g at position
                32 j + 2 cb + e, i.e. word 1024 + 128 g + 64 sz + 16 j + cb, half e
  [1280, 1536)  V params, same packing: [chunk c in 0..1 (32 tokens)][scale, zero]
                [value group 0..3][32 positions], token 32 c + 16 kk + 2 j + (0, 1, 8, 9)[e']
                at position 8 j + 4 kk + e', i.e. token 8 cb + 2 j + e of group grp at word
                1280 + 64 (2 (cb // 4) + sz) + 16 grp + 4 j + cb % 4, half e
  [1536, 1600)  zero (pad: 1600 = 25 x 64 words, the TMA box is <= 256 per dimension)
Norms: kn [B, H, Lp] float32 (token norm, 0 past Lq). nq [B] int32: the quantized tokens of
each row (any 0 <= nq <= Lp; tokens >= nq are masked).
Head_dim 128, G = 32 (key token groups and value channel groups), 16-bit parameters
(float16 or bfloat16, the dequantization dtype follows them) only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import attention as att
from oscar_jax import hadamard
from oscar_jax.cache import _residual_tokens
from oscar_jax.record import (  # noqa: F401 (re-exported: the layout's public names)
    OFFSETS,
    TILE,
    WORDS,
    D,
    G,
    fragment_layout,
    fragment_layout_inverse,
    pack_planar,
    unpack_planar,
)

NPAD = 16  # GQA query heads padded to the wgmma N (16-bit B operands need N >= 16)
_KC, _VC, _KP, _VP = OFFSETS
LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class Int2DecodeConfig:
    """Tuning of the kernel (validated; frozen so it can be a static jit argument).

    The defaults are the fastest configuration measured at 1 x 128K on the H200 (in-place
    unpack by one LOP3, overlapped key wgmma, 8 splits a merge step; BENCHMARKS.md).

    block_tokens: tokens per pipeline step (a multiple of 64).
    splits: split-K programs per (b, h) row; None: chosen so that B * H * splits fills
      the GPU about ``waves`` times; ``waves=None`` balances rounds of ``ctas_per_sm``
      resident programs an SM (``num_splits``).
    max_concurrent_steps: TMA pipeline depth.
    stage: "full" (the kernel), "keys" (key path + softmax only, no value dequant/wgmma;
      for timing), "stream" (the TMA pipeline + the code words XOR-folded; for timing),
      "dequant" (K and V dequantized as in "full" but XOR-folded: no wgmma, no softmax),
      "nofma" (as "full" without the magic subtraction and the scale/zero FMA: wrong values,
      timing only).
    auto_barriers: False sets Mosaic's ``unsafe_no_auto_barriers`` (no warpgroup barrier
      around every shared-memory store / async copy; the kernel's own ordering is: P stores
      -> commit_smem (fence + barrier) -> wgmma; a pipeline slot is refilled only after the
      issuing warp waited on the block's last wgmma, which follows every read of the slot).
    split_operands: dequantize K in two K = 64 halves and V^T one channel half at a time
      (fewer live registers, more wgmma issues; measured slower, kept for experiments).
    merge_step: at most this many splits the merge launch combines a pipeline step (the
      largest divisor of the split count, ``merge_step_for``).
    reduction_scratch: shared-memory bytes Mosaic reserves for cross-warp reductions (the
      softmax max of a block).
    overlap_keys: issue the key wgmma of all subtiles of a block before waiting, so the
      dequant of subtile j+1 overlaps the wgmma of subtile j (False: wait after each).
    """

    block_tokens: int = 256
    splits: int | None = None
    waves: int | None = None
    ctas_per_sm: int = 2
    max_concurrent_steps: int = 3
    stage: str = "full"
    auto_barriers: bool = False
    split_operands: bool = False
    overlap_keys: bool = True
    unpack: str = "lop3"
    merge_step: int = 8
    reduction_scratch: int = 2048

    def __post_init__(self):
        if self.block_tokens % TILE or self.block_tokens <= 0:
            raise ValueError(
                f"block_tokens={self.block_tokens} must be a positive multiple of {TILE}"
            )
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"splits={self.splits} must be >= 1")
        if self.max_concurrent_steps < 1:
            raise ValueError("max_concurrent_steps must be >= 1")
        if self.stage not in ("full", "keys", "stream", "dequant", "nofma"):
            raise ValueError(f"stage={self.stage!r}")
        if self.merge_step < 1:
            raise ValueError(f"merge_step={self.merge_step} must be >= 1")
        if self.unpack not in ("shift", "lop", "lop3"):
            raise ValueError(f"unpack={self.unpack!r} must be 'shift', 'lop' or 'lop3'")

    def num_splits(self, b: int, h: int, capacity: int, num_sms: int = 132) -> int:
        """Split-K programs per (b, h) row.

        ``waves`` set: about ``waves`` x num_sms programs in all. ``waves=None`` (default):
        the kernel holds ``ctas_per_sm`` programs an SM at once (its ~250 registers a
        thread allow 2), so B H s programs run in ceil(B H s / (ctas_per_sm num_sms))
        rounds and a row's time goes as rounds / s: the smallest s within 5% of the best
        rounds / s over s <= min(blocks, 64) (few splits: a cheaper merge)."""
        nblk = max(1, -(-capacity // self.block_tokens))
        if self.splits is not None:
            return min(self.splits, nblk)
        if self.waves is not None:
            want = max(1, -(-(self.waves * num_sms) // (b * h)))
            return min(want, nblk)
        slots = self.ctas_per_sm * num_sms
        cost = {s: -(-(b * h * s) // slots) / s for s in range(1, min(nblk, 64) + 1)}
        best = min(cost.values())
        return min(s for s, c in cost.items() if c <= 1.05 * best)


# ----------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------
def _dequant_fns(pdt, no_fma=False, unpack="shift"):
    """inline_mgpu bodies: record smem ref -> K [64, 128] / V^T halves [64, 64] fragments."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector
    from jax.experimental import pallas as pl  # noqa: F401
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mu

    is_f16 = pdt == jnp.float16
    magic = 0x6400 if is_f16 else 0x4300

    def ctypes():
        i32 = ir.IntegerType.get_signless(32)
        ft = ir.F16Type.get() if is_f16 else ir.BF16Type.get()
        return i32, ft, ir.VectorType.get((2,), ft), ir.VectorType.get((4,), i32)

    def c32(v):
        i32 = ir.IntegerType.get_signless(32)
        return arith.constant(i32, ir.IntegerAttr.get(i32, v))

    def idx(v):
        return (
            arith.constant(ir.IndexType.get(), v)
            if isinstance(v, int)
            else arith.index_cast(ir.IndexType.get(), v)
        )

    def load4(ref, row, word):  # vector<4xi32> at word ``word`` of record ``row`` ([n, 25, 64])
        _, _, _, v4 = ctypes()
        if isinstance(word, int):
            hi, lo = idx(word >> 6), idx(word & 63)
        else:
            hi, lo = idx(arith.shrui(word, c32(6))), idx(arith.andi(word, c32(63)))
        return vector.load(v4, ref, [idx(row), hi, lo])

    def words(vec4):
        return [vector.extract(vec4, [], [k]) for k in range(4)]

    def tids():
        tid = arith.remui(mu.thread_idx(), c32(128))
        w = arith.divui(tid, c32(32))
        lane = arith.remui(tid, c32(32))
        j = arith.remui(lane, c32(4))
        return tid, w, j

    # Planes a 16-bit half holds below the magic's exponent without a shift ("lop" unpack):
    # the f16 mantissa has 10 bits (codes at bits 0..9: planes 0..4), bf16's 7 (planes 0..2).
    span = 5 if is_f16 else 3
    shifted = {}  # (id of the word, shift) -> the word shifted right, one SHF per word

    def plane_src(word, p):
        """(word to mask, plane within it): one shift per ``span`` planes."""
        if unpack == "shift":
            return (arith.shrui(word, c32(2 * p)) if p else word), 0
        k, q = divmod(p, span)
        if k == 0:
            return word, q
        key = (id(word), k)
        if key not in shifted:
            shifted[key] = (word, arith.shrui(word, c32(2 * span * k)))  # keep word alive
        return shifted[key][1], q

    def unpack_pair(word, p, scale, zero):
        """(code at bits 2p, code at bits 16 + 2p) of ``word`` -> x2 = code * scale + zero.

        "shift": shift the plane down, OR the magic on (1024 + code or 128 + code, exact),
        subtract the magic, FMA. "lop": mask the plane in place (1024 + code 4^q, exact for
        q < span), one FMA with exact constants back to the code (code = x 4^-q - 1024 4^-q,
        an integer), FMA: no shift for most planes."""
        i32, ft, v2, _ = ctypes()
        src, q = plane_src(word, p)
        mask = 0x00030003 << (2 * q)
        if unpack == "lop3":  # one LOP3: ptxas splits LLVM's and + or of two constants
            x = llvm.inline_asm(
                i32, [src], f"lop3.b32 $0, $1, {mask}, {magic | (magic << 16)}, 0xea;", "=r,r"
            )
        else:
            x = arith.ori(arith.andi(src, c32(mask)), c32(magic | (magic << 16)))
        xv = vector.bitcast(v2, vector.broadcast(ir.VectorType.get((1,), i32), x))

        def splat(v):
            return arith.constant(v2, ir.DenseElementsAttr.get_splat(v2, ir.FloatAttr.get(ft, v)))

        base = 1024.0 if is_f16 else 128.0
        if no_fma:  # ablation (timing only): magic-biased codes, no scale / zero
            return xv
        if q == 0:
            xv = arith.subf(xv, splat(base))
        else:
            xv = _fma(xv, splat(4.0**-q), splat(-base * 4.0**-q))
        sv = vector.bitcast(v2, vector.broadcast(ir.VectorType.get((1,), i32), scale))
        zv = vector.bitcast(v2, vector.broadcast(ir.VectorType.get((1,), i32), zero))
        return _fma(xv, sv, zv)

    def _fma(a, b, c):
        return llvm.intr_fma(a, b, c) if hasattr(llvm, "intr_fma") else arith.addf(
            arith.mulf(a, b), c)  # fmt: skip

    def key_frag(ctx, rec_ref, row, half=None):
        """K tile (tokens x channels) of record ``row`` of ``rec_ref`` [n, 25, 64] uint32:
        [64, 128], or with ``half`` in (0, 1) its channels 64 half.. (fewer live registers)."""
        shifted.clear()
        tid, w, j = tids()
        cw = words(load4(rec_ref, row, arith.muli(tid, c32(4))))
        g = arith.divui(w, c32(2))
        base = arith.addi(c32(_KP), arith.muli(g, c32(128)))
        sbase = arith.addi(base, arith.muli(j, c32(16)))
        zbase = arith.addi(sbase, c32(64))
        cbs = range(16) if half is None else range(8 * half, 8 * half + 8)
        ks_ = sorted({cb // 4 for cb in cbs})
        sw, zw = {}, {}
        for k in ks_:
            for n, x in enumerate(words(load4(rec_ref, row, arith.addi(sbase, c32(4 * k))))):
                sw[4 * k + n] = x
            for n, x in enumerate(words(load4(rec_ref, row, arith.addi(zbase, c32(4 * k))))):
                zw[4 * k + n] = x
        layout = fa.WGMMA_LAYOUT
        width = D if half is None else D // 2
        regs = np.empty(layout.registers_shape((TILE, width)), dtype=object)
        for cb in cbs:
            for rh in range(2):
                p = 2 * (cb % 4) + rh
                regs[0, cb - cbs[0], 0, 0, rh, 0, 0, 0, 0] = unpack_pair(
                    cw[cb // 4], p, sw[cb], zw[cb]
                )
        return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

    def value_frags(ctx, rec_ref, row, mts=(0, 1)):
        """V^T tiles (channels x tokens) [64, 64] for the channel halves ``mts``."""
        shifted.clear()
        tid, w, j = tids()
        cw = words(load4(rec_ref, row, arith.addi(c32(_VC), arith.muli(tid, c32(4)))))
        layout = fa.WGMMA_LAYOUT
        outs = []
        for mt in mts:
            g = arith.addi(c32(2 * mt), arith.divui(w, c32(2)))
            pw = {}
            for c in range(2):
                for sz in range(2):
                    off = arith.addi(c32(_VP + (c * 2 + sz) * 64 + 0), arith.addi(
                        arith.muli(g, c32(16)), arith.muli(j, c32(4))))  # fmt: skip
                    pw[c, sz] = words(load4(rec_ref, row, off))
            regs = np.empty(layout.registers_shape((TILE, TILE)), dtype=object)
            for cb in range(8):
                c = cb // 4
                for rh in range(2):
                    p = 2 * (cb % 4) + rh
                    regs[0, cb, 0, 0, rh, 0, 0, 0, 0] = unpack_pair(
                        cw[2 * mt + cb // 4], p, pw[c, 0][cb % 4], pw[c, 1][cb % 4])  # fmt: skip
            outs.append(mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None))
        return tuple(outs)

    def stream_touch(ctx, rec_ref, row):
        """Stage 'stream': XOR of this thread's K and V code words (keeps the loads live)."""
        tid, w, j = tids()
        a = words(load4(rec_ref, row, arith.muli(tid, c32(4))))
        bw = words(load4(rec_ref, row, arith.addi(c32(_VC), arith.muli(tid, c32(4)))))
        x = a[0]
        for v in a[1:] + bw:
            x = arith.xori(x, v)
        layout = fa.WGStridedFragLayout((128,), 1)
        i32 = ir.IntegerType.get_signless(32)
        regs = np.array([vector.broadcast(ir.VectorType.get((1,), i32), x)], dtype=object)
        return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=False)

    def dequant_touch(ctx, rec_ref, row):
        """Stage 'dequant' (ablation): K and V^T dequantized as in 'full', folded by XOR
        instead of fed to wgmma (no MMA, no softmax)."""
        i32 = ir.IntegerType.get_signless(32)
        regs = list(key_frag(ctx, rec_ref, row).registers.flat)
        for v in value_frags(ctx, rec_ref, row):
            regs += list(v.registers.flat)
        x = None
        for r in regs:
            r32 = vector.extract(vector.bitcast(ir.VectorType.get((1,), i32), r), [], [0])
            x = r32 if x is None else arith.xori(x, r32)
        layout = fa.WGStridedFragLayout((128,), 1)
        out = np.array([vector.broadcast(ir.VectorType.get((1,), i32), x)], dtype=object)
        return mgpu.FragmentedArray(_registers=out, _layout=layout, _is_signed=False)

    return key_frag, value_frags, stream_touch, dequant_touch


def int2_decode_partials(q_rot, rec, kn, nq, *, cfg: Int2DecodeConfig = Int2DecodeConfig(),
                         softmax_scale=None, param_dtype=jnp.float16):  # fmt: skip
    """See ``_partials_raw``; returns acc [B, H, S, 128, 16], m [B, H, S, 16], l [B, H, S, 16]."""
    acc, ml = _partials_raw(q_rot, rec, kn, nq, cfg=cfg, softmax_scale=softmax_scale,
                            param_dtype=param_dtype)  # fmt: skip
    b, h, s = acc.shape[:3]
    return acc.reshape(b, h, s, D, NPAD), ml[..., 0, :], ml[..., 1, :]


def _partials_raw(q_rot, rec, kn, nq, *, cfg: Int2DecodeConfig = Int2DecodeConfig(),
                  softmax_scale=None, param_dtype=jnp.float16):  # fmt: skip
    """Split-K partials of the quantized part.

    q_rot [B, H, g, 128] (rotated query, g <= 8 query heads per KV head, any float dtype);
    rec [B, H, Lp/64, 1600] uint32, kn [B, H, Lp] f32 (``fragment_layout``);
    nq [B] int32 quantized tokens per row (0 <= nq <= Lp).
    Returns acc [B, H, S, 128, 8] f32 (unnormalised O^T), m [B, H, S, 8] f32 (running max
    of the scores in log2 units; -inf-like -1e30 for an empty split), l [B, H, S, 8] f32.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, h, g, d = q_rot.shape
    assert d == D and g <= NPAD, q_rot.shape
    _, _, nrec, words = rec.shape
    assert words == WORDS and rec.shape[:2] == (b, h)
    lp = nrec * TILE
    bt = cfg.block_tokens
    assert lp % bt == 0, (lp, bt)
    nsub = bt // TILE
    nblk_total = lp // bt
    s = cfg.num_splits(b, h, lp)
    bps = -(-nblk_total // s)
    s = -(-nblk_total // bps)
    scale = float(1.0 / np.sqrt(d)) if softmax_scale is None else float(softmax_scale)
    pdt = jnp.dtype(param_dtype)
    qt = q_rot.astype(jnp.float32) * (scale * LOG2E)
    qt = jnp.pad(qt, ((0, 0), (0, 0), (0, NPAD - g), (0, 0)))
    qt = jnp.swapaxes(qt, -1, -2).astype(pdt)  # [B, H, 128, 8]
    key_frag, value_frags, stream_touch, dequant_touch = _dequant_fns(
        pdt, no_fma=cfg.stage == "nofma", unpack=cfg.unpack
    )
    f32 = jnp.float32
    NEG = -1e30
    b_tr = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
    WG = plgpu.Layout.WGMMA
    stage = "full" if cfg.stage == "nofma" else cfg.stage

    def kernel(q_ref, rec_ref, kn_ref, nq_ref, acc_out, ml_out, q_smem, p_smem, o_smem, ml_smem,
               q_bar):  # fmt: skip
        bi = jax.lax.axis_index("b")
        hi = jax.lax.axis_index("h")
        si = jax.lax.axis_index("s")
        nqv = nq_ref[bi]
        start_blk = si * bps
        nblk = jnp.clip((nqv - start_blk * bt + bt - 1) // bt, 0, bps)
        plgpu.copy_gmem_to_smem(q_ref.at[bi, hi], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)

        def body(idxs, r_smem, n_smem, carry):
            (it,) = idxs
            m_prev, l_acc, o0, o1 = carry
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
                return m_prev, l_acc + jnp.sum((x & 1).astype(jnp.int32)).astype(f32), o0, o1

            def issue_qk(acc_ref, jt):
                """Dequantize key subtile jt into the fragment layout and issue its wgmma."""
                if cfg.split_operands:  # two K = 64 halves: fewer live registers
                    for hf in range(2):
                        kf = plgpu.inline_mgpu(
                            arg_types=(plgpu.RefType(),),
                            return_type=plgpu.ShapeDtypeStruct((TILE, D // 2), pdt, layout=WG),
                        )(functools.partial(key_frag, row=jt, half=hf))(r_smem)  # fmt: skip
                        plgpu.wgmma(acc_ref, kf, q_smem.at[pl.ds(hf * (D // 2), D // 2)])
                else:
                    kf = plgpu.inline_mgpu(
                        arg_types=(plgpu.RefType(),),
                        return_type=plgpu.ShapeDtypeStruct((TILE, D), pdt, layout=WG),
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

                raw = pl.run_scoped(qk_all, *[plgpu.ACC((TILE, NPAD), f32) for _ in range(nsub)])
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
                o0 = o0 * corr_b
                return m_new, l_acc, o0, o1
            for jt, p in enumerate(ps):
                p_smem[jt] = p.astype(pdt)
            plgpu.commit_smem()
            o0 = o0 * corr_b
            o1 = o1 * corr_b

            def pv(refs):
                a0, a1 = refs
                for jt in range(nsub):
                    if cfg.split_operands:  # one channel half at a time
                        for mt, a in ((0, a0), (1, a1)):
                            (v,) = plgpu.inline_mgpu(
                                arg_types=(plgpu.RefType(),),
                                return_type=(plgpu.ShapeDtypeStruct((TILE, TILE), pdt, layout=WG),),
                            )(functools.partial(value_frags, row=jt, mts=(mt,)))(r_smem)
                            plgpu.wgmma(a, v, p_smem.at[jt])
                        continue
                    v0, v1 = plgpu.inline_mgpu(
                        arg_types=(plgpu.RefType(),),
                        return_type=(plgpu.ShapeDtypeStruct((TILE, TILE), pdt, layout=WG),) * 2,
                    )(functools.partial(value_frags, row=jt))(r_smem)  # fmt: skip
                    plgpu.wgmma(a0, v0, p_smem.at[jt])
                    plgpu.wgmma(a1, v1, p_smem.at[jt])

            o0, o1 = pl.run_state(pv)((plgpu.ACC.init(o0), plgpu.ACC.init(o1)))
            return m_new, l_acc, o0, o1

        init = (
            plgpu.layout_cast(jnp.full((NPAD,), NEG, f32), WG.reduce(0)),
            plgpu.layout_cast(jnp.zeros((TILE, NPAD), f32), WG),
            plgpu.layout_cast(jnp.zeros((TILE, NPAD), f32), WG),
            plgpu.layout_cast(jnp.zeros((TILE, NPAD), f32), WG),
        )
        pipe_specs = [
            plgpu.BlockSpec((nsub, WORDS // 64, 64), lambda i: (start_blk + i, 0, 0)),
            plgpu.BlockSpec((nsub, TILE), lambda i: (start_blk + i, 0)),
        ]
        pipe = plgpu.emit_pipeline(
            body,
            grid=(nblk,),
            in_specs=pipe_specs,
            max_concurrent_steps=cfg.max_concurrent_steps,
            init_carry=init,
        )
        m, l_acc, o0, o1 = pipe(rec_ref.at[bi, hi], kn_ref.at[bi, hi])  # rec [n, 25, 64]
        lsum = jnp.sum(l_acc, axis=0)
        o_smem[0] = o0
        o_smem[1] = o1
        ml_smem[0] = m
        ml_smem[1] = lsum
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, acc_out.at[bi, hi, si])
        plgpu.copy_smem_to_gmem(ml_smem, ml_out.at[bi, hi, si])
        plgpu.wait_smem_to_gmem(0)

    out_type = (
        jax.ShapeDtypeStruct((b, h, s, 2, TILE, NPAD), f32),
        jax.ShapeDtypeStruct((b, h, s, 2, NPAD), f32),
    )
    fn = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=[
            plgpu.SMEM((D, NPAD), pdt, transforms=b_tr),
            plgpu.SMEM((nsub, TILE, NPAD), pdt, transforms=b_tr),
            plgpu.SMEM((2, TILE, NPAD), f32),
            plgpu.SMEM((2, NPAD), f32),
            plgpu.Barrier(num_arrivals=1),
        ],
        grid=(b, h, s),
        grid_names=("b", "h", "s"),
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            unsafe_no_auto_barriers=not cfg.auto_barriers,
            reduction_scratch_bytes=cfg.reduction_scratch,
        ),
    )
    rec3 = rec.reshape(b, h, nrec, WORDS // 64, 64)  # TMA boxes are <= 256 per dimension
    return fn(qt, rec3, kn.reshape(b, h, nrec, TILE), nq.astype(jnp.int32))


def merge_partials_with_ring(acc, m2, l, q, k_res, v_res, ring_valid, *, g, softmax_scale=None,
                             unrotate=None, out_dtype=None):  # fmt: skip
    """Kernel partials (log2 units) + the full-precision ring -> output [B, H, g, 128].

    acc [B, H, S, 128, NPAD] (O^T), m2 / l [B, H, S, NPAD] as ``int2_decode_partials``;
    q [B, H, g, 128] (original basis, for the ring); k_res / v_res [B, H, R, 128];
    ring_valid [B, R] bool; ``unrotate``: maps the quantized part's acc [B, H, g, 128]
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
    w = jnp.exp2(m2 - m_all[:, :, None])  # [B, H, S, g]
    qacc = jnp.sum(acc * w[..., None], axis=2)
    if unrotate is not None:
        qacc = unrotate(qacc)
    lsum = jnp.sum(pr, -1) + jnp.sum(l * w, axis=2)
    out = (qacc + ring_acc) / jnp.where(lsum > 0, lsum, 1.0)[..., None]
    out = jnp.where(lsum[..., None] > 0, out, 0.0)
    return out.astype(out_dtype or q.dtype)


def int2_decode_attention(q, q_rot, rec, kn, nq, k_res, v_res, ring_valid, *,
                          cfg: Int2DecodeConfig = Int2DecodeConfig(), softmax_scale=None,
                          param_dtype=jnp.float16, unrotate=None):  # fmt: skip
    """Decode attention over an INT2 cache in the fragment layout: one Mosaic GPU launch
    for the quantized tokens, then XLA for the ring and the merge.

    q [B, H, g, 128] original basis, q_rot the rotated query (same shape); rec, kn, nq as
    ``int2_decode_partials``; k_res, v_res [B, H, R, 128]; ring_valid [B, R].
    Returns [B, H, g, 128] in q's dtype.
    """
    acc, m2, l = int2_decode_partials(q_rot, rec, kn, nq, cfg=cfg, softmax_scale=softmax_scale,
                                      param_dtype=param_dtype)  # fmt: skip
    return merge_partials_with_ring(acc, m2, l, q, k_res, v_res, ring_valid, g=q.shape[2],
                                    softmax_scale=softmax_scale, unrotate=unrotate)  # fmt: skip


def merge_step_for(merge_step: int, splits: int) -> int:
    """Splits the merge launch combines a pipeline step: the largest divisor of the split
    count that is <= ``merge_step`` (no empty splits to pad with)."""
    return max(d for d in range(1, min(merge_step, splits) + 1) if splits % d == 0)


def int2_merge_ring(acc, ml, q_ring_t, k_res, v_res, ring_mask, *, auto_barriers=True,
                    step=1):  # fmt: skip
    """Second launch: the full-precision ring and the LSE merge of the split partials.

    acc [B, H, S, 2, 64, NPAD] f32 and ml [B, H, S, 2, NPAD] f32 (raw outputs of the
    partials kernel: O^T channel halves; running max in log2 units and row sums);
    q_ring_t [B, H, 128, NPAD] in the ring's dtype (query^T, original basis, scaled by
    softmax_scale * log2(e), heads past g zero); k_res, v_res [B, H, R, 128] bfloat16 or
    float16; ring_mask [B, Rp] f32 (1 valid slot, 0 not), Rp = R rounded up to 64.
    Returns out^T [B, H, 2, 64, NPAD] f32, normalised (0 for a row with no token).
    One CTA (one warpgroup) per (b, h): ring tiles of 64 slots through wgmma (A = K tile /
    V^T tile from shared memory), then the splits' partials rescaled to the common max.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, h, s, _, _, _ = acc.shape
    r = k_res.shape[2]
    rt = -(-r // TILE)
    rdt = k_res.dtype
    f32 = jnp.float32
    NEG = -1e30
    WG = plgpu.Layout.WGMMA
    b_tr = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
    a_tr = (
        plgpu.TilingTransform((8, 16)),
        plgpu.SwizzleTransform(32),
    )  # wgmma wants A and B swizzles equal

    def kernel(
        acc_ref, ml_ref, q_ref, k_ref, v_ref, mask_ref, out_ref, q_smem, p_smem, o_smem, q_bar
    ):
        bi = jax.lax.axis_index("b")
        hi = jax.lax.axis_index("h")
        plgpu.copy_gmem_to_smem(q_ref.at[bi, hi], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)

        def ring_body(idxs, k_smem, v_smem, m_smem, carry):
            m_prev, l_acc, o0, o1 = carry

            def qk(acc_ref_):
                plgpu.wgmma(acc_ref_, k_smem, q_smem)
                return acc_ref_[...]

            sc = pl.run_scoped(qk, plgpu.ACC((TILE, NPAD), f32))
            msk = plgpu.load(m_smem, layout=WG.reduce(1))  # [64]
            ok = jax.lax.broadcast_in_dim(msk, (TILE, NPAD), [0]) > 0.5
            sc = jnp.where(ok, sc, NEG)
            m_new = jnp.maximum(m_prev, jnp.max(sc, axis=0))
            corr = jax.lax.broadcast_in_dim(jnp.exp2(m_prev - m_new), (TILE, NPAD), [1])
            p = jnp.where(
                ok, jnp.exp2(sc - jax.lax.broadcast_in_dim(m_new, (TILE, NPAD), [1])), 0.0
            )
            l_acc = l_acc * corr + p
            p_smem[...] = p.astype(rdt)
            plgpu.commit_smem()

            def pv(refs):
                a0, a1 = refs
                plgpu.wgmma(a0, v_smem.at[:, pl.ds(0, TILE)].transpose((1, 0)), p_smem)
                plgpu.wgmma(a1, v_smem.at[:, pl.ds(TILE, TILE)].transpose((1, 0)), p_smem)

            o0, o1 = pl.run_state(pv)((plgpu.ACC.init(o0 * corr), plgpu.ACC.init(o1 * corr)))
            return m_new, l_acc, o0, o1

        init = (
            plgpu.layout_cast(jnp.full((NPAD,), NEG, f32), WG.reduce(0)),
            plgpu.layout_cast(jnp.zeros((TILE, NPAD), f32), WG),
            plgpu.layout_cast(jnp.zeros((TILE, NPAD), f32), WG),
            plgpu.layout_cast(jnp.zeros((TILE, NPAD), f32), WG),
        )
        ring_pipe = plgpu.emit_pipeline(
            ring_body,
            grid=(rt,),
            in_specs=[
                plgpu.BlockSpec((TILE, D), lambda i: (i, 0), transforms=a_tr),
                plgpu.BlockSpec((TILE, D), lambda i: (i, 0), transforms=a_tr),
                plgpu.BlockSpec((TILE,), lambda i: (i,)),
            ],
            max_concurrent_steps=min(2, rt),
            init_carry=init,
        )
        m, l_acc, o0, o1 = ring_pipe(k_ref.at[bi, hi], v_ref.at[bi, hi], mask_ref.at[bi])
        lsum = jnp.sum(l_acc, axis=0)  # [NPAD] COL layout

        def part_body(idxs, a_smem, ml_smem, carry):
            m_prev, l_prev, o0, o1 = carry
            ms = [plgpu.load(ml_smem.at[2 * u], layout=WG.reduce(0)) for u in range(step)]
            ls = [plgpu.load(ml_smem.at[2 * u + 1], layout=WG.reduce(0)) for u in range(step)]
            m_new = m_prev
            for mu in ms:
                m_new = jnp.maximum(m_new, mu)
            ca = jnp.exp2(m_prev - m_new)
            ca_b = jax.lax.broadcast_in_dim(ca, (TILE, NPAD), [1])
            l_new, o0, o1 = l_prev * ca, o0 * ca_b, o1 * ca_b
            for u in range(step):
                cs = jnp.exp2(ms[u] - m_new)
                cs_b = jax.lax.broadcast_in_dim(cs, (TILE, NPAD), [1])
                l_new = l_new + ls[u] * cs
                o0 = o0 + plgpu.load(a_smem.at[2 * u], layout=WG) * cs_b
                o1 = o1 + plgpu.load(a_smem.at[2 * u + 1], layout=WG) * cs_b
            return m_new, l_new, o0, o1

        if s % step:
            raise ValueError(f"the split count {s} must be a multiple of {step=}")
        part_pipe = plgpu.emit_pipeline(
            part_body,
            grid=(s // step,),
            in_specs=[
                plgpu.BlockSpec((2 * step, TILE, NPAD), lambda i: (i, 0, 0)),
                plgpu.BlockSpec((2 * step, NPAD), lambda i: (i, 0)),
            ],
            max_concurrent_steps=min(4 if step == 1 else 2, s // step),
            init_carry=(m, lsum, o0, o1),
        )
        m, lsum, o0, o1 = part_pipe(
            acc_ref.at[bi, hi], ml_ref.at[bi, hi]
        )  # [S * 2, 64, 16], [S * 2, 16]
        inv = jnp.where(lsum > 0, 1.0 / jnp.where(lsum > 0, lsum, 1.0), 0.0)
        inv_b = jax.lax.broadcast_in_dim(inv, (TILE, NPAD), [1])
        o_smem[0] = o0 * inv_b
        o_smem[1] = o1 * inv_b
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[bi, hi])
        plgpu.wait_smem_to_gmem(0)

    fn = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((b, h, 2, TILE, NPAD), f32),
        scratch_types=[
            plgpu.SMEM((D, NPAD), rdt, transforms=b_tr),
            plgpu.SMEM((TILE, NPAD), rdt, transforms=b_tr),
            plgpu.SMEM((2, TILE, NPAD), f32),
            plgpu.Barrier(num_arrivals=1),
        ],
        grid=(b, h),
        grid_names=("b", "h"),
        compiler_params=plgpu.CompilerParams(
            approx_math=True, unsafe_no_auto_barriers=not auto_barriers
        ),
    )
    return fn(
        acc.reshape(b, h, s * 2, TILE, NPAD),
        ml.reshape(b, h, s * 2, NPAD),
        q_ring_t,
        k_res,
        v_res,
        ring_mask,
    )


def int2_decode_attention_2launch(q, q_rot, rec, kn, nq, k_res, v_res, ring_valid, *,
                                  cfg: Int2DecodeConfig = Int2DecodeConfig(), softmax_scale=None,
                                  param_dtype=jnp.float16):  # fmt: skip
    """As ``int2_decode_attention`` (no value un-rotation: the cache's values must be stored
    in the original basis or the rotation folded into W_V / W_O), with the ring and the
    merge in a second Mosaic GPU launch: q prep (XLA) + partials kernel + merge kernel + the
    output transpose (XLA)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: F401

    b, h, g, d = q.shape
    scale = float(1.0 / np.sqrt(d)) if softmax_scale is None else float(softmax_scale)
    acc, ml = _partials_raw(
        q_rot, rec, kn, nq, cfg=cfg, softmax_scale=softmax_scale, param_dtype=param_dtype
    )
    rdt = k_res.dtype if k_res.dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16
    qr = jnp.pad(q.astype(jnp.float32) * (scale * LOG2E), ((0, 0), (0, 0), (0, NPAD - g), (0, 0)))
    qr = jnp.swapaxes(qr, -1, -2).astype(rdt)
    r = k_res.shape[2]
    rp = -(-r // TILE) * TILE
    mask = jnp.pad(ring_valid.astype(jnp.float32), ((0, 0), (0, rp - r)))
    step = merge_step_for(cfg.merge_step, acc.shape[2])
    out_t = int2_merge_ring(acc, ml, qr, k_res.astype(rdt), v_res.astype(rdt), mask,
                            auto_barriers=cfg.auto_barriers, step=step)  # fmt: skip
    out = jnp.swapaxes(out_t.reshape(b, h, D, NPAD), -1, -2)[:, :, :g]
    return out.astype(q.dtype)


# ----------------------------------------------------------------------------------
# The library's cache in, the library's output out (the "mosaic" decode backend)
# ----------------------------------------------------------------------------------
def unsupported_reason(cache) -> str | None:
    """Why ``decode_attention_mosaic`` cannot take this cache (None: it can)."""
    why = cache.cfg.record_reason(cache.head_dim)
    if why is not None:
        return f"the Mosaic kernel needs {why}"
    if cache.quant_capacity == 0:
        return "the cache has no quantized part"
    return None


def kernel_inputs(cache, *, block_tokens: int = 256):
    """What the kernel reads of ``cache``: (rec, kn) in the record layout, nq [B] int32
    quantized tokens per row, ring_valid [B, S] bool (the ring slots holding tokens).

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
    _, ring_valid = _residual_tokens(nq, cache.lengths, cache.slots)
    return rec, kn, nq, ring_valid


def decode_attention_mosaic(q, cache, *, softmax_scale=None, cfg: Int2DecodeConfig = None,
                            merge: str = "auto", convert: bool = False):  # fmt: skip
    """``oscar_jax.decode_attention`` of q [B, Hq, D] over ``cache`` by the Mosaic kernel.

    The cache must have layout='record' (``KVQuantConfig.layout``): the kernel reads its
    records as they are. ``convert=True`` takes a planar cache too and converts it on every
    call (exact, but it reads and writes the whole quantized part: a check of the kernel,
    not for speed). The query is rotated in XLA; the ring and the merge: ``merge="xla"`` by
    ``merge_partials_with_ring``, ``"mosaic"`` by the second Mosaic launch
    (``int2_decode_attention_2launch``; values must not be rotated), ``"auto"`` the second
    launch where values are unrotated, else XLA. NaN for FLAG_NONFINITE rows as the
    library's attention. ValueError for a cache ``unsupported_reason`` names.
    """
    reason = unsupported_reason(cache)
    if reason is not None:
        raise ValueError(f"decode_attention_mosaic: {reason}")
    if cache.cfg.layout != "record" and not convert:
        raise ValueError(
            f"decode_attention_mosaic reads a cache of layout='record'; this one has "
            f"layout={cache.cfg.layout!r} (make it with KVQuantConfig(layout='record'), or "
            "pass convert=True to convert it on every call)"
        )
    if merge not in ("auto", "xla", "mosaic"):
        raise ValueError(f"{merge=} must be 'auto', 'xla' or 'mosaic'")
    g = att.check_query(q, cache)
    if g > NPAD:
        raise ValueError(f"GQA ratio g={g} must be <= {NPAD} for the Mosaic kernel")
    kcfg, b, h = cache.cfg, cache.batch, cache.num_kv_heads
    if merge == "mosaic" and kcfg.rotate_values:
        raise ValueError("merge='mosaic' needs values stored unrotated (rotate_values=False)")
    if merge == "auto":
        merge = "xla" if kcfg.rotate_values else "mosaic"
    pdt = jnp.dtype(kcfg.scale_dtype)
    cfg = cfg or Int2DecodeConfig()
    rec, kn, nq, ring_valid = kernel_inputs(cache, block_tokens=cfg.block_tokens)
    qg = q.astype(jnp.float32).reshape(b, h, g, D)
    q_rot = hadamard.rotate(qg, kcfg) if kcfg.rotate_keys else qg
    if merge == "mosaic":
        out = int2_decode_attention_2launch(qg, q_rot, rec, kn, nq, cache.k_res, cache.v_res,
                                            ring_valid, cfg=cfg, softmax_scale=softmax_scale,
                                            param_dtype=pdt)  # fmt: skip
    else:
        unrot = (lambda x: hadamard.unrotate(x, kcfg)) if kcfg.rotate_values else None
        out = int2_decode_attention(qg, q_rot, rec, kn, nq, cache.k_res, cache.v_res,
                                    ring_valid, cfg=cfg, softmax_scale=softmax_scale,
                                    param_dtype=pdt, unrotate=unrot)  # fmt: skip
    return att.poison_flagged_rows(out.reshape(q.shape).astype(q.dtype), cache)
