"""In-register dequantization of a record into wgmma fragments (``inline_mgpu`` bodies)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from oscar_jax.record import (
    TILE,
    code_word,
    key_param_word,
    load_words,
    offsets,
    pairs_per_word,
    thread_words,
    value_code_word,
)

MAGIC = {"float16": (0x6400, 1024.0, 10), "bfloat16": (0x4300, 128.0, 7)}  # bits, value, mantissa


def plane_plan(p: int, *, bits: int, param_dtype, unpack: str = "lop3"):
    """How plane ``p`` of a code word becomes a pair of codes (the kernel's unpack, in one
    place): (shift, mask, q). The word is shifted right by ``shift`` bits, AND ``mask``
    keeps the two ``bits``-wide codes (one a 16-bit half) at plane q, OR the magic makes
    each half the 16-bit float ``value + code f^q`` (f = 2^bits, exact while the codes sit
    in the mantissa: q < span), and ``x f^-q - value f^-q`` is the code again, exactly.
    "shift" unpack: every plane shifted to q = 0; "lop"/"lop3": a shift only every
    ``span`` planes (the mantissa's bits // bits)."""
    _, _, mant = MAGIC[jnp.dtype(param_dtype).name]
    span = mant // bits
    cmask = (1 << bits) - 1
    if unpack == "shift":
        shift, q = bits * p, 0
    else:
        k, q = divmod(p, span)
        shift = bits * span * k
    return shift, (cmask | (cmask << 16)) << (bits * q), q


def emulate_fragment(words, p: int, scale, zero, *, bits: int, param_dtype, unpack="lop3"):
    """numpy of what the kernel computes for plane ``p`` of code words ``words`` (uint32)
    with the 16-bit scale / zero pairs: [..., 2] values in param_dtype (lo, hi half),
    following ``plane_plan`` step by step with each FMA rounded once (as HFMA2)."""
    pdt = jnp.dtype(param_dtype)
    magic, value, _ = MAGIC[pdt.name]
    shift, mask, q = plane_plan(p, bits=bits, param_dtype=pdt, unpack=unpack)
    x = ((np.asarray(words, np.uint32) >> np.uint32(shift)) & np.uint32(mask)) | np.uint32(
        magic | (magic << 16)
    )
    halves = np.stack([x & 0xFFFF, x >> 16], -1).astype(np.uint16).view(pdt)
    xf = halves.astype(np.float64)
    f = float(1 << bits) ** -q
    code = (xf * f - value * f).astype(pdt).astype(np.float64)  # exact: an integer
    return (code * np.asarray(scale, np.float64) + np.asarray(zero, np.float64)).astype(pdt)


def raw_magic(q: int, *, bits: int, param_dtype) -> tuple[int, float]:
    """The "raw" unpack of a code at plane q (``plane_plan``): OR-ing the returned 16-bit
    pattern onto the masked bits gives the float ``offset + code`` exactly, offset =
    2^(mantissa - bits q) (the exponent is picked per plane, so every plane reads the code
    with weight 1: one LOP3 a pair, no FMA). (pattern, offset)."""
    pdt = jnp.dtype(param_dtype)
    _, _, mant = MAGIC[pdt.name]
    bias = 15 if pdt == jnp.float16 else 127
    e = mant - bits * q
    return (bias + e) << mant, float(2.0**e)


def emulate_raw(words, p: int, *, bits: int, param_dtype):
    """numpy of the "raw" unpack of plane ``p`` (``raw_magic``): [..., 2] float64 values
    ``offset + code`` (lo, hi half) and the offset."""
    pdt = jnp.dtype(param_dtype)
    shift, mask, q = plane_plan(p, bits=bits, param_dtype=pdt, unpack="lop3")
    pat, off = raw_magic(q, bits=bits, param_dtype=pdt)
    x = ((np.asarray(words, np.uint32) >> np.uint32(shift)) & np.uint32(mask)) | np.uint32(
        pat | (pat << 16)
    )
    halves = np.stack([x & 0xFFFF, x >> 16], -1).astype(np.uint16).view(pdt)
    return halves.astype(np.float64), off


def _dequant_fns(pdt, no_fma=False, unpack="shift", bits=2, d=128):
    """inline_mgpu bodies: record smem ref -> K [64, d] / V^T channel blocks [64, 64]
    fragments of an INT2 or INT4 record of head_dim ``d`` (``oscar_jax.record``'s layout):
    (key_frag, value_frags, stream_touch, dequant_touch)."""
    ns = dequant_ns(pdt, no_fma=no_fma, unpack=unpack, bits=bits, d=d)
    return ns.key_frag, ns.value_frags, ns.stream_touch, ns.dequant_touch


def dequant_ns(pdt, no_fma=False, unpack="shift", bits=2, d=128):
    """The unpack's MLIR helpers (loads, thread indices, ``unpack_pair``, ``key_frag``, ...)
    as one namespace, shared by the wgmma kernel and the warp-level one (``_warp``)."""
    import types

    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector
    from jax.experimental import pallas as pl  # noqa: F401
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mu

    is_f16 = pdt == jnp.float16
    magic, mvalue, _ = MAGIC[jnp.dtype(pdt).name]
    _kc, _vc, _kp, _vp = offsets(bits, d)
    ppw = pairs_per_word(bits)  # f16x2 registers a code word fills
    nwords = thread_words(bits, d)  # code words a thread a tensor (its d / 4 registers)
    per = load_words(bits, d)  # code words a load (16 bytes, 8 for INT2 at d = 64)

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

    def load4(ref, row, word, n=4):  # vector<n x i32> at word ``word`` of record ``row``
        i32 = ir.IntegerType.get_signless(32)
        if isinstance(word, int):
            hi, lo = idx(word >> 6), idx(word & 63)
        else:
            hi, lo = idx(arith.shrui(word, c32(6))), idx(arith.andi(word, c32(63)))
        return vector.load(ir.VectorType.get((n,), i32), ref, [idx(row), hi, lo])

    def words(vec):
        return [vector.extract(vec, [], [k]) for k in range(ir.VectorType(vec.type).shape[0])]

    def code_words(rec_ref, row, first, tid, n):
        """This thread's first ``n`` code words of the tensor at word ``first`` (f = 0..n-1 at
        ``code_word(f, tid, per)``), loaded ``per`` words at a time."""
        out = []
        for k in range(-(-n // per)):
            at = arith.addi(c32(first + code_word(per * k, 0, per)), arith.muli(tid, c32(per)))
            out += words(load4(rec_ref, row, at, per))
        return out[:n]

    def value_code_words(rec_ref, row, tid):
        """This thread's V code words (f = 0..T-1 at ``value_code_word(f, tid)``): one load
        of the M = d / 64 contiguous words of each class f % C."""
        c_, m_ = 16 // ppw, d // 64
        out = [None] * nwords
        for c in range(c_):
            at = arith.addi(c32(_vc + value_code_word(c, 0, bits, d)), arith.muli(tid, c32(m_)))
            for m, x in enumerate(words(load4(rec_ref, row, at, m_))):
                out[m * c_ + c] = x
        return out

    def tids():
        tid = arith.remui(mu.thread_idx(), c32(128))
        w = arith.divui(tid, c32(32))
        lane = arith.remui(tid, c32(32))
        j = arith.remui(lane, c32(4))
        return tid, w, j

    shifted = {}  # (id of the word, shift) -> the word shifted right, one SHF per word

    def plane_src(word, p):
        """(word to mask, its mask, plane q): ``plane_plan``; one SHF per word and shift."""
        shift, mask, q = plane_plan(p, bits=bits, param_dtype=pdt, unpack=unpack)
        if shift == 0:
            return word, mask, q
        key = (id(word), shift)
        if key not in shifted:
            shifted[key] = (word, arith.shrui(word, c32(shift)))  # keep word alive
        return shifted[key][1], mask, q

    def unpack_pair(word, p, scale, zero):
        """(code at bits b p, code at bits 16 + b p) of ``word`` -> x2 = code * scale + zero
        (b = ``bits``, f = 2^b).

        "shift": shift the plane down, OR the magic on (1024 + code or 128 + code, exact),
        subtract the magic, FMA. "lop": mask the plane in place (1024 + code f^q, exact for
        q < span), one FMA with exact constants back to the code (code = x f^-q - 1024 f^-q,
        an integer), FMA: no shift for most planes."""
        i32, ft, v2, _ = ctypes()
        src, mask, q = plane_src(word, p)
        if unpack == "lop3":  # one LOP3: ptxas splits LLVM's and + or of two constants
            x = llvm.inline_asm(
                i32, [src], f"lop3.b32 $0, $1, {mask}, {magic | (magic << 16)}, 0xea;", "=r,r"
            )
        else:
            x = arith.ori(arith.andi(src, c32(mask)), c32(magic | (magic << 16)))
        xv = vector.bitcast(v2, vector.broadcast(ir.VectorType.get((1,), i32), x))

        def splat(v):
            return arith.constant(v2, ir.DenseElementsAttr.get_splat(v2, ir.FloatAttr.get(ft, v)))

        if no_fma:  # ablation (timing only): magic-biased codes, no scale / zero
            return xv
        if q == 0:
            xv = arith.subf(xv, splat(mvalue))
        else:
            f = float(1 << bits) ** -q
            xv = _fma(xv, splat(f), splat(-mvalue * f))
        sv = vector.bitcast(v2, vector.broadcast(ir.VectorType.get((1,), i32), scale))
        zv = vector.bitcast(v2, vector.broadcast(ir.VectorType.get((1,), i32), zero))
        return _fma(xv, sv, zv)

    def raw_pair(word, p):
        """(code at bits b p, code at bits 16 + b p) of ``word`` -> i32 holding the pair
        ``offset + code`` exactly (``raw_magic``; one LOP3), and the offset."""
        i32 = ir.IntegerType.get_signless(32)
        src, mask, q = plane_src(word, p)
        pat, off = raw_magic(q, bits=bits, param_dtype=pdt)
        x = llvm.inline_asm(
            i32, [src], f"lop3.b32 $0, $1, {mask}, {pat | (pat << 16)}, 0xea;", "=r,r"
        )
        return x, off

    def _fma(a, b, c):
        return llvm.intr_fma(a, b, c) if hasattr(llvm, "intr_fma") else arith.addf(
            arith.mulf(a, b), c)  # fmt: skip

    def key_frag(ctx, rec_ref, row, half=None):
        """K tile (tokens x channels) of record ``row`` of ``rec_ref`` [n, W/64, 64] uint32:
        [64, d], or with ``half`` its channels 64 half.. 64 half + 63 (fewer live registers)."""
        return key_unpack(key_loads(rec_ref, row, half), half)

    def key_loads(rec_ref, row, half=None, probe_v1=False):
        """The shared-memory loads of ``key_frag`` alone: (code words, {cb: scale pair word},
        {cb: zero pair word}), which the folded kernel uses without the unpack. ``probe_v1``
        (timing only, wrong values): the same loads at record layout 1's addresses (word d/8
        j + cb: the 4 distinct 16-byte chunks of a warp's load two to a bank group)."""
        tid, w, j = tids()
        cw = code_words(rec_ref, row, _kc, tid, nwords)
        g = arith.divui(w, c32(2))
        base = arith.addi(c32(_kp), arith.muli(g, c32(d)))
        jstride = d // 8 if probe_v1 else key_param_word(1, 0)
        sbase = arith.addi(base, arith.muli(j, c32(jstride)))
        zbase = arith.addi(sbase, c32(d // 2))
        cbs = range(d // 8) if half is None else range(8 * half, 8 * half + 8)
        ks_ = sorted({cb // 4 for cb in cbs})
        sw, zw = {}, {}
        for k in ks_:  # words key_param_word(j, 4 k + n), n = 0..3: one 16-byte load
            at = 4 * k if probe_v1 else key_param_word(0, 4 * k)
            for n, x in enumerate(words(load4(rec_ref, row, arith.addi(sbase, c32(at))))):
                sw[4 * k + n] = x
            for n, x in enumerate(words(load4(rec_ref, row, arith.addi(zbase, c32(at))))):
                zw[4 * k + n] = x
        return cw, sw, zw

    def key_unpack(loads, half=None):
        """``key_loads``' words -> the K fragment (``key_frag``)."""
        shifted.clear()
        cw, sw, zw = loads
        cbs = range(d // 8) if half is None else range(8 * half, 8 * half + 8)
        layout = fa.WGMMA_LAYOUT
        width = d if half is None else 64
        regs = np.empty(layout.registers_shape((TILE, width)), dtype=object)
        for cb in cbs:
            for rh in range(2):
                r = 2 * cb + rh
                regs[0, cb - cbs[0], 0, 0, rh, 0, 0, 0, 0] = unpack_pair(
                    cw[r // ppw], r % ppw, sw[cb], zw[cb]
                )
        return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

    def key_raw(loads):
        """``key_loads``' code words -> {(cb, rh): (i32 pair offset + code, offset)} of this
        thread's K A registers (``raw_pair``; the scales and zeros are applied elsewhere)."""
        shifted.clear()
        cw = loads[0]
        return {(cb, rh): raw_pair(cw[(2 * cb + rh) // ppw], (2 * cb + rh) % ppw)
                for cb in range(d // 8) for rh in range(2)}  # fmt: skip

    def value_frags(ctx, rec_ref, row, mts=None):
        """V^T tiles (channels x tokens) [64, 64] for the channel blocks ``mts`` (None: all
        d / 64)."""
        mts = range(d // 64) if mts is None else mts
        shifted.clear()
        tid, w, j = tids()
        cw = value_code_words(rec_ref, row, tid)
        layout = fa.WGMMA_LAYOUT
        outs = []
        for mt in mts:
            g = arith.addi(c32(2 * mt), arith.divui(w, c32(2)))
            pw = {}
            for c in range(2):
                for sz in range(2):
                    off = arith.addi(c32(_vp + (c * 2 + sz) * (d // 2)), arith.addi(
                        arith.muli(g, c32(16)), arith.muli(j, c32(4))))  # fmt: skip
                    pw[c, sz] = words(load4(rec_ref, row, off))
            regs = np.empty(layout.registers_shape((TILE, TILE)), dtype=object)
            for cb in range(8):
                c = cb // 4
                for rh in range(2):
                    r = 16 * mt + 2 * cb + rh
                    regs[0, cb, 0, 0, rh, 0, 0, 0, 0] = unpack_pair(
                        cw[r // ppw], r % ppw, pw[c, 0][cb % 4], pw[c, 1][cb % 4])  # fmt: skip
            outs.append(mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None))
        return tuple(outs)

    def stream_touch(ctx, rec_ref, row):
        """Stage 'stream': XOR of this thread's K and V code words (keeps the loads live)."""
        tid, w, j = tids()
        a = code_words(rec_ref, row, _kc, tid, nwords)
        bw = value_code_words(rec_ref, row, tid)
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

    return types.SimpleNamespace(**{k: v for k, v in locals().items() if callable(v)})
