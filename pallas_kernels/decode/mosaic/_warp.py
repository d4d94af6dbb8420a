"""The warp-level split-K partials kernel (``Int2DecodeConfig(kernel="warp")``).

Same record layout, inputs and outputs as the wgmma kernel (``_kernel``), another division
of the work: each of the 4 warps of a CTA walks its own 16 tokens of every 64-token record
(tokens 16 w .. 16 w + 15) with warp-level ``mma.sync.m16n8k16`` (f32 accumulators), so
the online softmax needs no cross-warp reduction a block and P never goes through shared
memory (C fragment -> ``movmatrix`` transpose -> B fragment):

  S^T [16 tok, 8 heads] = K [16 tok, D] Q^T [D, 8]        (D / 16 mma a record)
  O^T [D, 8] += V^T [D, 16 tok] P^T [16 tok, 8]           (D / 16 mma a record)

K's A fragments are the wgmma kernel's (a [64, D] wgmma A fragment is four stacked
m16n8k16 A fragments, one a warp). V^T's are gathered across threads of the record: thread
(w, l) needs channel 16 mt + l // 4 (+ 8), tokens 16 w + 2 (l % 4) (+ 1, + 8), which the
record keeps in the words of thread (mt % 4, l) (``value_source``): its words of class w // 2
(INT2) or w (INT4), one a 64-channel block, sit contiguous (``record.value_code_word``), so a
warp loads d / 64 words a lane an owner warp, the lanes contiguous; at INT2 the word is
shifted by 8 (w % 2) bits; then the usual in-place unpack. The carry is
per thread (m, l of its two heads, O^T's D / 4 f32); the 4 warps' partials are merged once
at the end through shared memory. GQA g <= 8 (N = 8), INT2 and INT4 records; the query
comes as it is ([g, D] f32); each lane builds its B-fragment words (``load_q``; reference:
``query_fragments``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax.record import (
    TILE,
    code_word,
    load_words,
    offsets,
    pairs_per_word,
    record_format,
    value_code_word,
)
from pallas_kernels.decode.mosaic._config import (
    NPAD,
    Int2DecodeConfig,
    kernel_query,
    quantized_of,
    query_scale,
)
from pallas_kernels.decode.mosaic._dequant import dequant_ns, plane_plan, raw_magic
from pallas_kernels.decode.mosaic._output import store_output
from pallas_kernels.decode.mosaic._pdl import release_next_launch, wait_for_previous_launch
from pallas_kernels.decode.mosaic._ring import make_ring_query, ring_walk

NW = 8  # the mma's N: query heads a KV head (g <= 8)
NEG = -1e30


def value_source(bits: int, d: int, w: int, lane: int, mt16: int, rh: int, kh: int):
    """Where thread (w, lane)'s V^T A register (16-channel tile mt16, row half rh, token half
    kh) sits in a record: (owner thread, its code word f, plane p). The register holds the
    codes of channel 16 mt16 + lane // 4 + 8 rh, tokens 16 w + 2 (lane % 4) + 8 kh + (0, 1)
    (low, high half), i.e. register r = 2 cb + rh (cb = 2 w + kh) of the owner's 64-channel
    block mt16 // 4 (``oscar_jax.record``)."""
    mt, wo = divmod(mt16, 4)
    f, p = divmod(16 * mt + 4 * w + 2 * kh + rh, pairs_per_word(bits))
    return 32 * wo + lane, f, p


def value_param_word(d: int, w: int, lane: int, grp: int, sz: int, kh: int) -> int:
    """Word (from the V params) holding the scale (sz 0) or zero (sz 1) pair of thread (w,
    lane)'s tokens 16 w + 2 (lane % 4) + 8 kh + (0, 1) in value group grp."""
    return d // 2 * (2 * (w // 2) + sz) + 16 * grp + 4 * (lane % 4) + 2 * (w % 2) + kh


def query_fragments(qt):
    """The reference of the query registers ``load_q`` builds in the kernel: qt [B, H, 8, D]
    16-bit (heads padded to 8) -> [B, H, 32, D / 8] uint32: lane l's B fragment words of
    k-step kk (Q^T[16 kk + 2 j + 8 half + (0, 1), l // 4], j = l % 4) at 2 kk + half."""
    b, h, n, d = qt.shape
    x = qt.reshape(b, h, n, d // 16, 2, 4, 2)  # [.., head, kk, half, j, e]
    x = jnp.transpose(x, (0, 1, 2, 5, 3, 4, 6))  # [.., head, j, kk, half, e]
    x = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    x = x[..., 0] | (x[..., 1] << 16)
    return x.reshape(b, h, 32, d // 8)


NX = 16  # extra words a lane of the query buffer: the folded kernel's offset constants


def fold_constants(bits: int, pdt) -> np.ndarray:
    """[NX] uint32: the 16-bit pairs (-offset, -offset) of the raw unpack (``raw_magic``)
    that the folded kernel's offset mma read as A registers: K's by (cb % 4, rh) at 2 (cb %
    4) + rh (plane (2 cb + rh) % P), V^T's by (kh, rh) at 8 + 2 kh + rh (plane 2 kh + rh
    after the owner's word is shifted), zero padding. They travel with the query (loaded
    once into registers): as immediates ptxas rematerializes them at every mma (one IMAD a
    register, ~60 a record)."""
    ppw = pairs_per_word(bits)

    def neg(p):
        _, _, q = plane_plan(p, bits=bits, param_dtype=pdt)
        off = raw_magic(q, bits=bits, param_dtype=pdt)[1]
        h16 = int(np.array(-off, dtype=pdt).view(np.uint16))
        return h16 | (h16 << 16)

    out = np.zeros(NX, np.uint32)
    for cb4 in range(4):
        for rh in range(2):
            out[2 * cb4 + rh] = neg((2 * cb4 + rh) % ppw)
    for kh in range(2):
        for rh in range(2):
            out[8 + 2 * kh + rh] = neg(2 * kh + rh)
    return out


def query_words(d: int, fold: str) -> int:
    """Words a lane of the query buffer: the B fragments, and with a fold the zero mma's
    pairs and the offset constants (``fold_inputs``)."""
    return d // 8 + (d // 8 + NX if fold != "none" else 0)


def fold_word_order(n: int) -> list[int]:
    """The zero mma's B pairs of the folded kernel: the query's n fragment words in the
    order of channel blocks 4i, 4i + 2, 4i + 1, 4i + 3 for each i."""
    return [4 * i + k for i in range(n // 4) for k in (0, 2, 1, 3)]


def fold_inputs(qf, bits: int, pdt):
    """What the folded kernel's ``load_q`` holds a lane (the reference of its registers):
    qf [B, H, 32, D/8] (``query_fragments``) -> [B, H, 32, D/4 + NX]: the B fragment
    words, the same words as the zero mma's B pairs (``fold_word_order``), then
    ``fold_constants``."""
    b, h, _, n = qf.shape
    kx = jnp.broadcast_to(jnp.asarray(fold_constants(bits, pdt)), (b, h, 32, NX))
    return jnp.concatenate([qf, qf[..., np.array(fold_word_order(n))], kx], axis=-1)


def sign_words(signs) -> tuple[int, ...]:
    """signs [D] (+-1) -> D / 32 words, bit i % 32 of word i // 32 set where signs[i] < 0
    (``prep_q``'s table; D a multiple of 32)."""
    neg = np.asarray(signs) < 0
    return tuple(
        int(sum(1 << k for k in range(32) if neg[32 * w + k])) for w in range(len(neg) // 32)
    )


def _warp_fns(pdt, d: int, nsub: int, bits: int = 2, fold: str = "none", probe: str = "",
              g: int = NW, qscale: float = 1.0, rotate: bool = False,
              signs: tuple[int, ...] = ()):  # fmt: skip
    """inline_mgpu bodies: ``prep_q`` (the query converted to f32 in shared memory, with
    ``rotate`` its Walsh-Hadamard rotation, ``signs`` the ``sign_words``), ``load_q`` (the
    query's B fragments into registers), ``step`` (one block of ``nsub`` records into the
    carry) and ``finish`` (the 4 warps' carries merged into the CTA's partials in shared
    memory)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, vector
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mu

    ns = dequant_ns(pdt, unpack="lop3", bits=bits, d=d)
    c32, idx, words, load4 = ns.c32, ns.idx, ns.words, ns.load4
    is_f16 = pdt == jnp.float16
    ty = "f16" if is_f16 else "bf16"
    _, vc, _, vp = offsets(bits, d)
    u = load_words(bits, d)
    nmt16 = d // 16
    fold_k, fold_v = "k" in fold, "v" in fold
    probe_v1 = probe == "v1"  # timing only (``Int2DecodeConfig.stage``)

    def i32():
        return ir.IntegerType.get_signless(32)

    def f32():
        return ir.F32Type.get()

    def c32u(x: int):  # an unsigned 32-bit pattern as the i32 constant of the same bits
        return c32(x - (1 << 32) * (x >> 31))

    def cf(v):
        return arith.constant(f32(), ir.FloatAttr.get(f32(), v))

    def as_i32(v2):  # vector<2 x f16> -> i32
        return vector.extract(vector.bitcast(ir.VectorType.get((1,), i32()), v2), [], [0])

    def mma(a, b, c):
        """c + A B by one mma.sync.m16n8k16 (A 4 regs, B 2, C 4 f32)."""
        ptx = (f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 "
               "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")  # fmt: skip
        return list(mu.inline_ptx(ptx, *a, *b, *c, result_types=[f32()] * 4))

    def mma8(a, b, c):
        """c + A B by one mma.sync.m16n8k8 (A 2 regs, B 1, C 4 f32)."""
        ptx = (f"mma.sync.aligned.m16n8k8.row.col.f32.{ty}.{ty}.f32 "
               "{$0,$1,$2,$3}, {$4,$5}, {$6}, {$7,$8,$9,$10};")  # fmt: skip
        return list(mu.inline_ptx(ptx, *a, b, *c, result_types=[f32()] * 4))

    def ex2(x):
        return mu.inline_ptx("ex2.approx.ftz.f32 $0, $1;", x, result_types=f32())

    def shfl_xor(x, m):
        return mu.inline_ptx(f"shfl.sync.bfly.b32 $0, $1, {m}, 0x1f, 0xffffffff;", x,
                             result_types=f32(), convergent=True)  # fmt: skip

    def pack(lo, hi):  # two f32 -> one 16-bit pair (lo in the low half)
        return mu.inline_ptx(f"cvt.rn.{ty}x2.f32 $0, $1, $2;", hi, lo, result_types=i32())

    def trans(x):  # 8x8 16-bit matrix across the warp, transposed
        return mu.inline_ptx("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", x,
                             result_types=i32(), convergent=True)  # fmt: skip

    def lanes():
        tid, w, j = ns.tids()
        lane = arith.remui(tid, c32(32))
        return tid, w, j, lane, arith.divui(lane, c32(4))

    def scalars(arr):
        return [vector.extract(r, [], [0]) for r in arr.registers.flat]

    def strided(vals):  # one value a register of each thread
        n = 128 * len(vals)
        regs = np.array([vector.broadcast(ir.VectorType.get((1,), v.type), v) for v in vals],
                        dtype=object)  # fmt: skip
        signed = True if isinstance(vals[0].type, ir.IntegerType) else None
        return mgpu.FragmentedArray(_registers=regs, _layout=fa.WGStridedFragLayout((n,), 1),
                                    _is_signed=signed)  # fmt: skip

    def value_loads(rec_ref, row, w, j, lane):
        """The shared-memory loads of a record's V^T registers: (parameter pair words
        {(grp, sz): [kh 0, kh 1]}, code words)."""
        pbase = arith.addi(
            arith.addi(arith.muli(arith.divui(w, c32(2)), c32(d)), arith.muli(j, c32(4))),
            arith.muli(arith.remui(w, c32(2)), c32(2)),
        )
        par = {}
        for grp in range(d // 32):
            for sz in range(2):
                at = arith.addi(pbase, c32(vp + d // 2 * sz + 16 * grp))
                par[grp, sz] = words(load4(rec_ref, row, at, 2))  # [kh 0, kh 1]
        codes = {}
        if probe_v1:  # timing only: version 1's loads (``Int2DecodeConfig.stage``)
            for mt16 in range(nmt16):
                mt, wo = divmod(mt16, 4)
                owner = arith.addi(lane, c32(32 * wo))
                if bits == 4:  # the owner's word 4 mt + w at code_word(., owner, u)
                    at = arith.addi(arith.addi(c32(vc + 128 * u * mt), arith.muli(owner, c32(u))),
                                    w)  # fmt: skip
                    (codes[mt16],) = words(load4(rec_ref, row, at, 1))
                elif (wo, 2 * mt // u) not in codes:  # 16 bytes a (owner, 4 words), then a select
                    at = arith.addi(c32(vc + code_word(u * (2 * mt // u), 0, u)),
                                    arith.muli(owner, c32(u)))  # fmt: skip
                    codes[wo, 2 * mt // u] = words(load4(rec_ref, row, at, u))
            return par, codes
        # the owner's words of class w // 2 (INT2) or w (INT4), one a 64-channel block mt
        # (``value_source``, ``record.value_code_word``): M = d / 64 contiguous words a lane
        m_ = d // 64
        cls = w if bits == 4 else arith.divui(w, c32(2))
        first = arith.addi(c32(vc), arith.muli(cls, c32(value_code_word(1, 0, bits, d))))
        for wo in range(4):
            at = arith.addi(first, arith.muli(arith.addi(lane, c32(32 * wo)), c32(m_)))
            codes[wo] = words(load4(rec_ref, row, at, m_))  # [mt]
        return par, codes

    def value_words(codes, w):
        """{mt16: the code word whose planes 2 kh + rh hold this thread's V^T registers}:
        the owner's word of block mt as loaded, at INT2 shifted right by 8 (w % 2)
        (``value_source``)."""
        sh = arith.muli(arith.remui(w, c32(2)), c32(8))
        if probe_v1:
            if bits == 4:
                return codes
            hi_word = arith.cmpi(arith.CmpIPredicate.uge, w, c32(2))
            out = {}
            for mt16 in range(nmt16):
                mt, wo = divmod(mt16, 4)
                ws = codes[wo, 2 * mt // u]
                x = arith.select(hi_word, ws[2 * mt % u + 1], ws[2 * mt % u])
                out[mt16] = arith.shrui(x, sh)
            return out
        out = {}
        for mt16 in range(nmt16):
            mt, wo = divmod(mt16, 4)
            out[mt16] = codes[wo][mt] if bits == 4 else arith.shrui(codes[wo][mt], sh)
        return out

    def value_unpack(loads, w):
        """``value_loads``' words -> {(mt16, rh, kh): i32 pair} of V^T A registers of this
        thread, dequantized (``value_source``)."""
        par, codes = loads
        xs = value_words(codes, w)
        return {(mt16, rh, kh): as_i32(ns.unpack_pair(xs[mt16], 2 * kh + rh, par[mt16 // 2, 0][kh],
                                                      par[mt16 // 2, 1][kh]))
                for mt16 in range(nmt16) for kh in range(2) for rh in range(2)}  # fmt: skip

    def value_raw(loads, w):
        """``value_loads``' code words -> {(mt16, rh, kh): (i32 pair offset + code, offset)}
        of this thread's V^T A registers (``value_unpack`` without the scale / zero)."""
        xs = value_words(loads[1], w)
        return {(mt16, rh, kh): ns.raw_pair(xs[mt16], 2 * kh + rh)
                for mt16 in range(nmt16) for kh in range(2) for rh in range(2)}  # fmt: skip

    def hmul2(a, b):  # two i32 holding 16-bit pairs -> their product pair (one HMUL2)
        v2 = ns.ctypes()[2]
        as_v2 = lambda x: vector.bitcast(v2, vector.broadcast(ir.VectorType.get((1,), i32()), x))  # noqa: E731
        return as_i32(arith.mulf(as_v2(a), as_v2(b)))

    def ld(ref, row, col):  # one element of a 2D shared-memory ref, as f32
        et = ir.MemRefType(ref.type).element_type
        v = vector.extract(vector.load(ir.VectorType.get((1,), et), ref,
                                       [idx(row), idx(col)]), [], [0])  # fmt: skip
        return v if et == f32() else arith.extf(f32(), v)

    def st(ref, v, row, col):  # one f32 element of a 2D f32 shared-memory ref
        vector.store(vector.broadcast(ir.VectorType.get((1,), f32()), v), ref,
                     [idx(row), idx(col)])  # fmt: skip

    def over(count, fn):  # fn(i) for i < count, i = tid + 128 k, then a warpgroup barrier
        tid = ns.tids()[0]
        for k in range(-(-count // 128)):
            i = arith.addi(tid, c32(128 * k))
            if 128 * (k + 1) <= count:
                fn(i)
            else:
                with mu.when(arith.cmpi(arith.CmpIPredicate.ult, i, c32(count))):
                    fn(i)
        mu.warpgroup_barrier()  # the pass's stores visible to the next

    def prep_q(ctx, src_ref, q_ref):
        """The query into q_ref [g, D] f32 from src_ref [g, D] (the kernel's input, any
        float dtype): converted, and with ``rotate`` x -> fwht(s x) without its 1 / sqrt(D)
        (which the caller folds into ``qscale``): the signs flip the float sign bits as the
        elements are copied, then log2(D) butterfly stages in place, the g D / 2 pairs of a
        stage over the 128 threads, a warpgroup barrier after each pass
        (``oscar_jax.hadamard.fwht``'s order of sums)."""
        del ctx
        half, npairs, n = d // 2, g * d // 2, g * d

        def flip(v, col):  # v times signs[col]: the sign bit xor the table's bit
            word = c32u(signs[-1])
            for wi in range(len(signs) - 2, -1, -1):
                x = c32u(signs[wi])
                word = arith.select(arith.cmpi(arith.CmpIPredicate.eq, arith.shrui(col, c32(5)),
                                               c32(wi)), x, word)  # fmt: skip
            bit = arith.shli(arith.shrui(word, arith.andi(col, c32(31))), c32(31))
            return arith.bitcast(f32(), arith.xori(arith.bitcast(i32(), v), bit))

        def copy(e):
            row, col = arith.divui(e, c32(d)), arith.remui(e, c32(d))
            v = ld(src_ref, row, col)
            st(q_ref, flip(v, col) if any(signs) else v, row, col)

        over(n, copy)
        h = 1
        while rotate and h < d:
            lg = h.bit_length() - 1

            def pair(p, h=h, lg=lg):
                row, jj = arith.divui(p, c32(half)), arith.remui(p, c32(half))
                i0 = arith.ori(arith.shli(arith.shrui(jj, c32(lg)), c32(lg + 1)),
                               arith.andi(jj, c32(h - 1)))  # fmt: skip
                i1 = arith.addi(i0, c32(h))
                a, c = ld(q_ref, row, i0), ld(q_ref, row, i1)
                st(q_ref, arith.addf(a, c), row, i0)
                st(q_ref, arith.subf(a, c), row, i1)

            over(npairs, pair)
            h *= 2
        return None

    def load_q(ctx, q_ref):
        """This lane's B fragment words of the query (loop-invariant registers), built from
        q_ref [g, D] f32 (the rotated query as it is): times ``qscale``, rounded to the
        parameter dtype, paired (``query_fragments``' words; zero for the heads past g),
        then with a fold ``fold_inputs``' permuted pairs and constants."""
        del ctx
        _, _, j, _, gid = lanes()
        live = arith.cmpi(arith.CmpIPredicate.ult, gid, c32(g))
        row = idx(arith.minui(gid, c32(g - 1)))
        zero, sc = c32(0), cf(qscale)
        qw = []
        for kk in range(d // 16):
            for half in range(2):
                col = arith.addi(arith.muli(j, c32(2)), c32(16 * kk + 8 * half))
                lo, hi = words(vector.load(ir.VectorType.get((2,), f32()), q_ref, [row, idx(col)]))
                qw.append(arith.select(live, pack(arith.mulf(lo, sc), arith.mulf(hi, sc)), zero))
        if fold != "none":
            qw += [qw[i] for i in fold_word_order(d // 8)]
            qw += [c32u(int(x)) for x in fold_constants(bits, pdt)]
        return strided(qw)

    def step(ctx, rec_ref, n_ref, q_a, lim_a, m_a, l_a, o_a):
        del ctx
        (lim,) = scalars(lim_a)
        m, lsum, o, qw = scalars(m_a), scalars(l_a), scalars(o_a), scalars(q_a)
        # B fragments, their pairs for the zero mma, offset constants (``fold_inputs``)
        qw, qz, kx = qw[: d // 8], qw[d // 8 : d // 4], qw[d // 4 :]
        o = [o[4 * k : 4 * k + 4] for k in range(nmt16)]
        tid, w, j, lane, gid = lanes()
        t0 = arith.addi(arith.muli(w, c32(16)), gid)  # this thread's first token of a record
        neg = cf(NEG)
        scores = []
        for r in range(nsub):
            kload = ns.key_loads(rec_ref, r, probe_v1=probe_v1)
            nv = [vector.extract(vector.load(ir.VectorType.get((1,), f32()), n_ref,
                                             [idx(r), idx(arith.addi(t0, c32(8 * hf)))]),
                                 [], [0]) for hf in range(2)]  # fmt: skip
            chains = [[cf(0.0)] * 4 for _ in range(2)]  # two chains: half the mma latency
            if fold_k:
                # S^T = (off + code) (s q) - off (s q) + z q: the scales fold into the
                # query's B fragment (16 HMUL2), the zeros and the plane offsets are mma of
                # the zero pairs and of constants (exact products, f32 sums), so a code pair
                # costs one LOP3
                _, sw, zw = kload
                raw = ns.key_raw(kload)
                qs = [hmul2(qw[cb], sw[cb]) for cb in range(d // 8)]
                for kk in range(d // 16):
                    cbs = (2 * kk, 2 * kk + 1)
                    bs = (qs[2 * kk], qs[2 * kk + 1])
                    a = [raw[cb, rh][0] for cb in cbs for rh in (0, 1)]
                    chains[kk % 2] = mma(a, bs, chains[kk % 2])
                    ao = [kx[2 * (cb % 4) + rh] for cb in cbs for rh in (0, 1)]
                    chains[1 - kk % 2] = mma(ao, bs, chains[1 - kk % 2])
                # z q, the same for every token of the warp: the loaded quads of zero pairs
                # as A (no register copies) against B pairs of channel blocks (4i, 4i + 2)
                # (right in row gid) and (4i + 1, 4i + 3) (right in row gid + 8)
                z1, z2 = [cf(0.0)] * 4, [cf(0.0)] * 4
                for i in range(d // 32):
                    zq = [zw[4 * i + n] for n in range(4)]
                    z1 = mma(zq, (qz[4 * i], qz[4 * i + 1]), z1)
                    z2 = mma(zq, (qz[4 * i + 2], qz[4 * i + 3]), z2)
                zt = [arith.addf(z1[0], z2[2]), arith.addf(z1[1], z2[3])]
                chains[0] = [arith.addf(x, zt[n % 2]) for n, x in enumerate(chains[0])]
            else:
                kf = ns.key_unpack(kload).registers
                for kk in range(d // 16):
                    a = [as_i32(kf[0, 2 * kk + c, 0, 0, rh, 0, 0, 0, 0]) for c in (0, 1)
                         for rh in (0, 1)]  # fmt: skip
                    chains[kk % 2] = mma(a, (qw[2 * kk], qw[2 * kk + 1]), chains[kk % 2])
            acc = [arith.addf(x, y) for x, y in zip(*chains, strict=True)]
            s = []
            for hf in range(2):
                t = arith.addi(t0, c32(8 * hf))
                ok = arith.cmpi(arith.CmpIPredicate.slt, arith.addi(t, c32(TILE * r)), lim)
                for c in range(2):
                    s.append(arith.select(ok, arith.mulf(acc[2 * hf + c], nv[hf]), neg))
            scores.append(s)  # [tok, head 2j], [tok, 2j+1], [tok+8, 2j], [tok+8, 2j+1]
        m_new, corr = [], []
        for c in range(2):
            bm = scores[0][c]
            for s in scores:
                bm = arith.maximumf(bm, arith.maximumf(s[c], s[2 + c]))
            for x in (4, 8, 16):
                bm = arith.maximumf(bm, shfl_xor(bm, x))
            mn = arith.maximumf(m[c], bm)
            m_new.append(mn)
            corr.append(ex2(arith.subf(m[c], mn)))
            lsum[c] = arith.mulf(lsum[c], corr[c])
        o = [[arith.mulf(x, corr[i % 2]) for i, x in enumerate(ot)] for ot in o]
        zv1 = [[cf(0.0)] * 4 for _ in range(d // 32)]
        zv2 = [[cf(0.0)] * 4 for _ in range(d // 32)]
        for r, s in enumerate(scores):
            vload = value_loads(rec_ref, r, w, j, lane)
            p = [ex2(arith.subf(x, m_new[i % 2])) for i, x in enumerate(s)]
            for c in range(2):
                lsum[c] = arith.addf(lsum[c], arith.addf(p[c], p[2 + c]))
            b = (trans(pack(p[0], p[1])), trans(pack(p[2], p[3])))
            if fold_v:
                # O^T += (off + code) (P s) - off (P s) + z P: the token scales fold into P's
                # B fragment per value group (2 HMUL2 a group), zeros and offsets by mma
                par = vload[0]
                raw = value_raw(vload, w)
                bs = [(hmul2(b[0], par[grp, 0][0]), hmul2(b[1], par[grp, 0][1]))
                      for grp in range(d // 32)]  # fmt: skip
                for mt16 in range(nmt16):
                    grp = mt16 // 2
                    a = [raw[mt16, rh, kh][0] for kh in (0, 1) for rh in (0, 1)]
                    o[mt16] = mma(a, bs[grp], o[mt16])
                    ao = [kx[8 + 2 * kh + rh] for kh in (0, 1) for rh in (0, 1)]
                    o[mt16] = mma(ao, bs[grp], o[mt16])
                # z P, the same for every channel of a group: the loaded zero pair [kh 0,
                # kh 1] as an m16n8k8 A (row gid right against P's tokens 0-7, row gid + 8
                # against 8-15), summed over the step and added to the group's tiles after it
                for grp in range(d // 32):
                    zv1[grp] = mma8(par[grp, 1], b[0], zv1[grp])
                    zv2[grp] = mma8(par[grp, 1], b[1], zv2[grp])
            else:
                v = value_unpack(vload, w)
                for mt16 in range(nmt16):
                    a = [v[mt16, rh, kh] for kh in (0, 1) for rh in (0, 1)]
                    o[mt16] = mma(a, b, o[mt16])
        if fold_v:
            for grp in range(d // 32):
                zt = [arith.addf(zv1[grp][0], zv2[grp][2]), arith.addf(zv1[grp][1], zv2[grp][3])]
                for mt16 in (2 * grp, 2 * grp + 1):
                    o[mt16] = [arith.addf(x, zt[n % 2]) for n, x in enumerate(o[mt16])]
        flat = [x for ot in o for x in ot]
        return strided(m_new), strided(lsum), strided(flat)

    def finish(ctx, o_ref, ml_ref, xm_ref, m_a, l_a, o_a):
        """The 4 warps' (m, l, O^T) -> the CTA's partials: o_ref [D / 64, 64, 16] f32 (O^T,
        heads >= 8 zero), ml_ref [2, 16] (max in log2 units, NEG for heads >= 8 or an
        empty split; row sums); xm_ref [2, 4, 8] f32 scratch (each warp's max and sum).

        No shared-memory atomics: f32 atomics on shared memory are compare-and-swap spin
        loops, and 4 warps on the same words made this merge ~10 us a CTA (Run AB). Each warp
        publishes its max and sum, then the warps add their rescaled O^T into o_ref in turn
        (warp 0 stores, 1-3 load, add and store; a barrier between turns): deterministic."""
        del ctx
        m, lsum, o = scalars(m_a), scalars(l_a), scalars(o_a)
        tid, w, j, lane, gid = lanes()
        vec1 = ir.VectorType.get((1,), f32())
        zero = vector.broadcast(ir.VectorType.get((4,), f32()), cf(0.0))
        per = d * NPAD // 128  # floats of o_ref a thread zeroes (heads >= 8 stay zero)
        for k in range(per // 4):
            e = arith.addi(arith.muli(tid, c32(per)), c32(4 * k))
            mt = arith.divui(e, c32(TILE * NPAD))
            row = arith.divui(arith.remui(e, c32(TILE * NPAD)), c32(NPAD))
            col = arith.remui(e, c32(NPAD))
            vector.store(zero, o_ref, [idx(mt), idx(row), idx(col)])
        for c in range(2):  # every lane of a column holds the same max; the sum over its rows
            ls = lsum[c]
            for x in (4, 8, 16):
                ls = arith.addf(ls, shfl_xor(ls, x))
            hcol = idx(arith.addi(arith.muli(j, c32(2)), c32(c)))
            vector.store(vector.broadcast(vec1, m[c]), xm_ref, [idx(c32(0)), idx(w), hcol])
            vector.store(vector.broadcast(vec1, ls), xm_ref, [idx(c32(1)), idx(w), hcol])
        mu.warpgroup_barrier()  # the zeros and every warp's (max, sum) visible

        def xm(k, wo, col):
            return vector.extract(vector.load(vec1, xm_ref, [idx(c32(k)), idx(c32(wo)), idx(col)]),
                                  [], [0])  # fmt: skip

        def col_max(col):
            mx = xm(0, 0, col)
            for wo in range(1, 4):
                mx = arith.maximumf(mx, xm(0, wo, col))
            return mx

        fac = []
        for c in range(2):
            mx = col_max(arith.addi(arith.muli(j, c32(2)), c32(c)))
            fac.append(ex2(arith.subf(m[c], mx)))
        # ml_ref: threads 0..15 write column tid (heads >= 8: NEG and 0)
        col = arith.remui(tid, c32(NW))
        mx = col_max(col)
        ltot = None
        for wo in range(4):
            x = arith.mulf(xm(1, wo, col), ex2(arith.subf(xm(0, wo, col), mx)))
            ltot = x if ltot is None else arith.addf(ltot, x)
        live = arith.cmpi(arith.CmpIPredicate.ult, tid, c32(NW))
        with mu.when(arith.cmpi(arith.CmpIPredicate.ult, tid, c32(NPAD))):
            for k, v in ((0, arith.select(live, mx, cf(NEG))),
                         (1, arith.select(live, ltot, cf(0.0)))):  # fmt: skip
                vector.store(vector.broadcast(vec1, v), ml_ref, [idx(c32(k)), idx(tid)])
        for turn in range(4):
            with mu.when(arith.cmpi(arith.CmpIPredicate.eq, w, c32(turn))):
                for mt16 in range(nmt16):
                    mt, sub = divmod(mt16, 4)
                    for i in range(4):
                        row = arith.addi(gid, c32(16 * sub + 8 * (i // 2)))
                        at = [idx(c32(mt)), idx(row),
                              idx(arith.addi(arith.muli(j, c32(2)), c32(i % 2)))]  # fmt: skip
                        v = arith.mulf(o[4 * mt16 + i], fac[i % 2])
                        if turn:
                            v = arith.addf(vector.extract(vector.load(vec1, o_ref, at), [], [0]), v)
                        vector.store(vector.broadcast(vec1, v), o_ref, at)
            if turn < 3:
                mu.warpgroup_barrier()
        return None

    return prep_q, load_q, step, finish


def warp_decode_partials(q_rot, rec, kn, nq, *, cfg: Int2DecodeConfig, softmax_scale=None,
                         param_dtype=jnp.float16, ring=None, final=None, nq_of=None,
                         signs=None):  # fmt: skip
    """The warp-level kernel's split-K partials, as ``_kernel._partials_raw`` returns them
    (acc [B, H, S (+ 1), D / 64, 64, 16] f32, ml [B, H, S (+ 1), 2, 16] f32); INT2 or INT4
    records, g <= 8. ``ring`` as ``_partials_raw``'s: one more split (the last) walks the
    full-precision ring with wgmma (``_ring.ring_walk``) while the others walk records, so
    the ring's bytes stream in the same launch as the records'. Its query None (with
    ``signs``): the CTA that walks the ring makes its query from the query it reads (the
    original basis), in ``cfg.ring_query``'s form, so no XLA launch builds it.
    ``nq_of`` (the cache's ``KVQuantConfig``): nq holds the rows' lengths and each CTA
    computes its row's nq (``_config.quantized_of``), so no XLA launch computes it.
    ``signs`` [D] (+-1; None: q_rot comes rotated): q_rot is the query in the original
    basis and each CTA rotates it itself, R q = fwht(signs q)
    (``oscar_jax.hadamard.fwht_signs``; D a power of two), so no GEMM launch precedes the
    kernel.

    ``final=(g, out_dtype, flags, poison)`` (with ``ring``, and a plan of one split a row):
    the whole call in this launch. Each CTA walks its (b, h)'s records, then the ring, merges
    the two and stores the output as ``int2_merge_ring``'s ``final`` does ([B, H, g, D] in
    out_dtype, NaN for flagged rows): no second launch, for batches whose B x H CTAs fill the
    GPU without splits."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, h, g, d = q_rot.shape
    _, _, nrec, words = rec.shape
    bits, d_rec = record_format(words)
    if d != d_rec or g > NW:
        raise ValueError(f"the warp kernel takes g <= {NW} query heads a KV head and records "
                         f"of the query's head_dim: {d=} (record {d_rec}), {g=}")  # fmt: skip
    if cfg.fold != "none" and jnp.dtype(param_dtype) != jnp.float16:
        # compiled on an H200 the folded kernel missed bfloat16's tolerance at head_dim 256
        # (s q and P s rounded to 8 mantissa bits); float16 passed everywhere
        raise ValueError(f"fold={cfg.fold!r} takes float16 parameters: {param_dtype=}")
    nmt = d // 64
    lp = nrec * TILE
    bt = cfg.block_tokens
    nsub = bt // TILE
    bps, s = cfg.split_plan(b, h, lp)
    if final is not None and (ring is None or s != 1):
        raise ValueError(f"final= takes the ring and one split a row (splits=1): {s=} "
                         f"splits planned, ring given: {ring is not None}")  # fmt: skip
    has_flags = final is not None and final[2] is not None
    pdt = jnp.dtype(param_dtype)
    # the kernel scales, rounds and pairs the query itself (``load_q``), and converts (and
    # rotates) a 16-bit one (``prep_q``): no XLA launch before it
    qin = kernel_query(q_rot)  # [B, H, g, D]
    prep = signs is not None or qin.dtype != jnp.float32
    nw = query_words(d, cfg.fold)
    probe = cfg.stage.removeprefix("probe_") if cfg.stage.startswith("probe_") else ""
    qscale = query_scale(softmax_scale, d)
    if signs is not None:
        if len(signs) != d or d & (d - 1):
            raise ValueError(f"the in-kernel rotation takes {d=} signs, d a power of two: "
                             f"{len(signs)=}")  # fmt: skip
        qscale /= float(np.sqrt(d))  # fwht's normalization
    words_s = () if signs is None else sign_words(signs)
    # ring[0] None: the ring's query made here from the query read (original basis)
    ring_qk = ring is not None and ring[0] is None
    if ring_qk and signs is None:
        raise ValueError("the ring's query is made in the kernel only where the kernel "
                         "rotates the query itself (signs given): ring[0] is None")  # fmt: skip
    prep_q, load_q, step, finish = _warp_fns(
        pdt, d, nsub, bits, cfg.fold, probe, g=g, qscale=qscale, rotate=signs is not None,
        signs=words_s)  # fmt: skip
    f32 = jnp.float32
    ST = plgpu.Layout.WG_STRIDED
    lay2, layo, layi = ST((256,), 1), ST((128 * d // 4,), 1), ST((128,), 1)
    layq = ST((128 * nw,), 1)

    def kernel(q_ref, rec_ref, kn_ref, nq_ref, *refs):
        wait_for_previous_launch(cfg.pdl)
        release_next_launch(cfg.pdl)
        qin_smem = rq_smem = None
        if ring_qk:
            *refs, rq_smem = refs
        if prep:
            *refs, qin_smem = refs
        if has_flags:
            flags_ref, *refs = refs
        if ring_qk:  # no query input for the ring
            refs = [None, *refs]
        if ring is None:
            acc_out, ml_out, q_smem, o_smem, ml_smem, xm_smem, q_bar = refs
        elif final is None:
            qr_ref, kr_ref, vr_ref, len_ref, acc_out, ml_out, q_smem, o_smem, ml_smem, \
                xm_smem, q_bar, qr_smem, pr_smem, qr_bar = refs  # fmt: skip
        else:
            qr_ref, kr_ref, vr_ref, len_ref, out_ref, q_smem, o_smem, ml_smem, xm_smem, \
                q_bar, qr_smem, pr_smem, qr_bar, t_smem = refs  # fmt: skip
        bi = jax.lax.axis_index("b")
        hi = jax.lax.axis_index("h")
        si = jax.lax.axis_index("s")

        def walk_ring(query_in_smem=False):
            """The ring's online softmax; ``query_in_smem``: qin_smem already holds this
            row's query (the one launch, after its records)."""
            if not ring_qk:
                plgpu.copy_gmem_to_smem(qr_ref.at[bi, hi], qr_smem, qr_bar)
                plgpu.barrier_wait(qr_bar)
            else:
                with jax.named_scope("ring_query"):
                    if not query_in_smem:
                        plgpu.copy_gmem_to_smem(q_ref.at[bi, hi], qin_smem, qr_bar)
                        plgpu.barrier_wait(qr_bar)
                    make_ring_query(qin_smem, rq_smem, qr_smem, g=g,
                                    rscale=query_scale(softmax_scale, d))  # fmt: skip
            return ring_walk(qr_smem, pr_smem, kr_ref.at[bi, hi], vr_ref.at[bi, hi],
                             (quantized_of(nq_ref[bi], nq_of), len_ref[bi]), range(nmt),
                             slots=ring[1].shape[2])  # fmt: skip

        if final is not None:

            def ring_and_output():
                """After ``finish``: the ring, the LSE merge with the records' partials in
                o_smem / ml_smem, the output."""
                # finish's stores visible to every warp, and the records' slots (read by
                # plain loads) fenced against the ring pipeline's TMA writes into them
                plgpu.commit_smem()
                with jax.named_scope("ring"):
                    m_r, l_r, *outs = walk_ring(query_in_smem=True)
                with jax.named_scope("store"):
                    wg = plgpu.Layout.WGMMA
                    m_q = plgpu.load(ml_smem.at[0], layout=wg.reduce(0))
                    l_q = plgpu.load(ml_smem.at[1], layout=wg.reduce(0))
                    m_all = jnp.maximum(m_q, m_r)
                    c_q, c_r = jnp.exp2(m_q - m_all), jnp.exp2(m_r - m_all)
                    lsum = l_q * c_q + jnp.sum(l_r, axis=0) * c_r
                    bc = lambda x: jax.lax.broadcast_in_dim(x, (TILE, NPAD), [1])  # noqa: E731
                    bad = (flags_ref[bi] & final[3]) != 0 if has_flags else None
                    for mt, o_r in enumerate(outs):
                        o = plgpu.load(o_smem.at[mt], layout=wg) * bc(c_q) + o_r * bc(c_r)
                        store_output(o, lsum, o_smem.at[mt],
                                     out_ref.at[bi, hi, :, pl.ds(mt * TILE, TILE)],
                                     t_smem=t_smem.at[mt], bad=bad)  # fmt: skip
                    plgpu.wait_smem_to_gmem(0)

            records(bi, hi, si, q_ref, rec_ref, kn_ref, nq_ref, q_smem, o_smem, ml_smem,
                    xm_smem, q_bar, ring_and_output, qin_smem)  # fmt: skip
            return

        def store():
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, acc_out.at[bi, hi, si])
            plgpu.copy_smem_to_gmem(ml_smem, ml_out.at[bi, hi, si])
            plgpu.wait_smem_to_gmem(0)

        if ring is None:
            records(bi, hi, si, q_ref, rec_ref, kn_ref, nq_ref, q_smem, o_smem, ml_smem,
                    xm_smem, q_bar, store, qin_smem)  # fmt: skip
            return

        @pl.when(si < s)
        def _():
            records(bi, hi, si, q_ref, rec_ref, kn_ref, nq_ref, q_smem, o_smem, ml_smem,
                    xm_smem, q_bar, store, qin_smem)  # fmt: skip

        @pl.when(si == s)
        def _():
            with jax.named_scope("ring"):
                m, l_acc, *outs = walk_ring()
                for mt, o in enumerate(outs):
                    o_smem[mt] = o
                ml_smem[0] = m
                ml_smem[1] = jnp.sum(l_acc, axis=0)
            with jax.named_scope("store"):
                store()

    def records(bi, hi, si, q_ref, rec_ref, kn_ref, nq_ref, q_smem, o_smem, ml_smem, xm_smem,
                q_bar, store, qin_smem):  # fmt: skip
        """Split si of the quantized part: its blocks of records -> the partials tile.
        qin_smem: the query as it comes, when ``prep_q`` converts (rotates) it into q_smem."""
        nqv = quantized_of(nq_ref[bi], nq_of)
        start_blk = si * bps
        nblk = jnp.clip((nqv - start_blk * bt + bt - 1) // bt, 0, bps)
        # the named scopes are the phases of Mosaic's trace when ``cfg.profile_dir`` is set
        with jax.named_scope("query"):
            plgpu.copy_gmem_to_smem(q_ref.at[bi, hi], qin_smem if prep else q_smem, q_bar)
            plgpu.barrier_wait(q_bar)
            if prep:
                plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 2)(prep_q)(qin_smem, q_smem)
            qa = plgpu.inline_mgpu(
                arg_types=(plgpu.RefType(),),
                return_type=plgpu.ShapeDtypeStruct((128 * nw,), jnp.int32, layout=layq),
            )(load_q)(q_smem)
        step_call = plgpu.inline_mgpu(
            arg_types=(plgpu.RefType(),) * 2 + (layq, layi, lay2, lay2, layo),
            return_type=(plgpu.ShapeDtypeStruct((256,), f32, layout=lay2),
                         plgpu.ShapeDtypeStruct((256,), f32, layout=lay2),
                         plgpu.ShapeDtypeStruct((128 * d // 4,), f32, layout=layo)),
        )(step)  # fmt: skip

        def body(idxs, r_smem, n_smem, carry):
            (it,) = idxs
            lim = nqv - (start_blk + it) * bt
            with jax.named_scope("step"):
                lim_a = plgpu.layout_cast(jnp.full((128,), lim, jnp.int32), layi)
                return step_call(r_smem, n_smem, qa, lim_a, *carry)

        init = (
            plgpu.layout_cast(jnp.full((256,), NEG, f32), lay2),
            plgpu.layout_cast(jnp.zeros((256,), f32), lay2),
            plgpu.layout_cast(jnp.zeros((128 * d // 4,), f32), layo),
        )
        pipe = plgpu.emit_pipeline(
            body,
            grid=(nblk,),
            in_specs=[
                plgpu.BlockSpec((nsub, words // 64, 64), lambda i: (start_blk + i, 0, 0)),
                plgpu.BlockSpec((nsub, TILE), lambda i: (start_blk + i, 0)),
            ],
            max_concurrent_steps=cfg.max_concurrent_steps,
            init_carry=init,
        )
        with jax.named_scope("pipeline"):
            carry = pipe(rec_ref.at[bi, hi], kn_ref.at[bi, hi])
        with jax.named_scope("finish"):
            plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 3 + (lay2, lay2, layo))(finish)(
                o_smem, ml_smem, xm_smem, *carry
            )
        with jax.named_scope("store"):
            store()

    sr = s + (ring is not None and final is None)  # splits written
    b_tr = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
    if ring is not None:
        rdt = ring[1].dtype  # the ring's 16-bit dtype (``_ring.ring_dtype``)
        qr_shape = ((2, d, NPAD) if cfg.ring_query == "pair" else (d, NPAD)) if ring_qk else \
            ring[0].shape[2:]  # fmt: skip
    ring_scratch = [] if ring is None else [
        plgpu.SMEM(qr_shape, rdt, transforms=b_tr),
        plgpu.SMEM((TILE, NPAD), rdt, transforms=b_tr),
        plgpu.Barrier(num_arrivals=1),
    ]  # fmt: skip
    if final is None:
        out_type = (jax.ShapeDtypeStruct((b, h, sr, nmt, TILE, NPAD), f32),
                    jax.ShapeDtypeStruct((b, h, sr, 2, NPAD), f32))  # fmt: skip
        final_scratch, fl = [], ()
    else:
        out_type = jax.ShapeDtypeStruct((b, h, final[0], d), final[1])
        final_scratch = [plgpu.SMEM((nmt, NPAD, TILE), final[1])]
        fl = (final[2].astype(jnp.int32),) if has_flags else ()
    profile = {}
    if cfg.profile_dir:  # a region a phase and a step, a warpgroup: bps steps + 4 + slack
        profile = dict(profile_space=bps + 8, profile_dir=cfg.profile_dir,
                       profile_bounds_check=True)  # fmt: skip
    fn = plgpu.kernel(
        kernel,
        # its name in profiles and ncu -k
        kernel_name=f"oscar_decode_int{bits}_warp_{'partials' if final is None else 'single'}",
        out_type=out_type,
        scratch_types=[
            plgpu.SMEM((g, d), f32),
            plgpu.SMEM((nmt, TILE, NPAD), f32),
            plgpu.SMEM((2, NPAD), f32),
            plgpu.SMEM((2, 4, NW), f32),
            plgpu.Barrier(num_arrivals=1),
            *ring_scratch,
            *final_scratch,
            *([plgpu.SMEM((g, d), qin.dtype)] if prep else []),
            *([plgpu.SMEM((d, NPAD), f32)] if ring_qk else []),
        ],
        grid=(b, h, sr),
        grid_names=("b", "h", "s"),
        compiler_params=plgpu.CompilerParams(
            approx_math=True, reduction_scratch_bytes=cfg.reduction_scratch, **profile
        ),
    )
    rec3 = rec.reshape(b, h, nrec, words // 64, 64)
    ring_in = () if ring is None else tuple(x for x in ring if x is not None)
    return fn(qin, rec3, kn.reshape(b, h, nrec, TILE), nq.astype(jnp.int32), *fl, *ring_in)


__all__ = [
    "query_fragments",
    "sign_words",
    "value_param_word",
    "value_source",
    "warp_decode_partials",
]
