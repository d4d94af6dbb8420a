"""The experimental Mosaic GPU INT2 decode kernel (``pallas_kernels.decode.mosaic``).

On the CPU: its record layout is an exact permutation of the cache's planar arrays
(``fragment_layout`` and its inverse, bit for bit, on caches the library filled), with the
fields where the kernel reads them; and the kernels lower for CUDA sm_90 where jax >= 0.11.2
and its CUDA plugin are installed. ``TestMosaicGPU`` runs the compiled kernel against the
XLA reference on the H200 (skipped elsewhere).
"""

import dataclasses
import functools
import importlib.util
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import kv_with_sinks, query
from tolerances import tol

import oscar_jax as oj
from oscar_jax import attention as att
from oscar_jax import record
from oscar_jax import sharding as osh
from pallas_kernels.decode import mosaic as mk
from pallas_kernels.decode.mosaic import _dequant as mk_dq
from pallas_kernels.decode.mosaic import _merge as mk_merge
from pallas_kernels.decode.mosaic import _warp as mk_warp

D = 128
PT = "per_token"
FM = "fused_mosaic"  # the ring as the partials kernel's last split, the splits merged by Mosaic
SG = "single"  # one launch: one split a (b, h) walks records and ring and stores the output


def _cache(seed, b, lengths, h=2, param_dtype="float16", max_len=640, bits=2, d=D, **kw):
    cfg = oj.preset("oscar", bits=bits, param_dtype=param_dtype, **kw)
    k, v = kv_with_sinks(seed, b, max(lengths), h, d, jnp.bfloat16, sinks=(0, 1))
    c = oj.init_cache(cfg, batch=b, max_len=max_len, num_kv_heads=h, head_dim=d,
                      dtype=jnp.bfloat16)  # fmt: skip
    return oj.prefill(c, k, v, jnp.asarray(lengths, jnp.int32))


def _bits(x):
    x = jnp.asarray(x)
    if x.dtype in (jnp.float16, jnp.bfloat16):
        x = jax.lax.bitcast_convert_type(x, jnp.uint16)
    elif x.dtype == jnp.float32:
        x = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return np.asarray(x)


@pytest.mark.parametrize(
    "lengths,param_dtype,block,norms,bits,d",
    [
        ([640, 200], "float16", 256, "per_head", 2, 128),  # ragged: few quantized tokens
        ([100, 333, 640], "bfloat16", 128, "per_head", 2, 128),  # a row all in the ring
        ([517], "float16", 64, "per_token", 2, 128),  # one norm over all KV heads
        ([640, 200], "bfloat16", 256, "per_head", 4, 128),
        ([100, 517], "float16", 64, "per_token", 4, 128),
        ([640, 100], "float16", 128, "per_head", 2, 64),
        ([333, 517], "bfloat16", 256, "per_token", 4, 64),
        ([640, 200], "bfloat16", 64, "per_head", 2, 256),
        ([517], "float16", 128, "per_token", 4, 256),
    ],
)
def test_record_layout_is_an_exact_permutation(lengths, param_dtype, block, norms, bits, d):
    c = _cache(len(lengths), len(lengths), lengths, param_dtype=param_dtype,
               norm_granularity=norms, bits=bits, d=d)  # fmt: skip
    pdt = jnp.dtype(param_dtype)
    rec, kn = mk.fragment_layout(c.k_codes, c.k_scale, c.k_zero, c.k_norm, c.v_codes,
                                 c.v_scale, c.v_zero, param_dtype=pdt,
                                 block_tokens=block)  # fmt: skip
    b, h, lq = c.batch, c.num_kv_heads, c.quant_capacity
    assert rec.shape == (b, h, -(-lq // block) * block // mk.TILE, record.record_words(bits, d))
    assert rec.dtype == jnp.uint32
    back = mk.fragment_layout_inverse(rec, kn, lq, param_dtype=pdt)
    want = dict(k_codes=c.k_codes, k_scale=c.k_scale, k_zero=c.k_zero, v_codes=c.v_codes,
                v_scale=c.v_scale, v_zero=c.v_zero,
                k_norm=jnp.broadcast_to(c.k_norm, (b, h, lq)).astype(jnp.float32))  # fmt: skip
    for name, x in want.items():
        assert back[name].shape == x.shape, name
        np.testing.assert_array_equal(_bits(back[name]), _bits(x), err_msg=name)
    assert np.asarray(kn)[:, :, lq:].sum() == 0  # padding past the capacity


def test_record_fields_sit_where_the_kernel_reads_them():
    """The index formulas of the module docstring against the planar arrays."""
    c = _cache(7, 2, [640, 300])
    rec, _ = mk.fragment_layout(c.k_codes, c.k_scale, c.k_zero, c.k_norm, c.v_codes,
                                c.v_scale, c.v_zero, param_dtype=jnp.float16,
                                block_tokens=256)  # fmt: skip
    r = np.asarray(rec)
    ck = np.asarray(oj.unpack(c.k_codes, 2))  # [B, H, Lq, D]
    cv = np.asarray(oj.unpack(c.v_codes, 2))
    ks, kz = _bits(c.k_scale), _bits(c.k_zero)
    vs, vz = _bits(c.v_scale), _bits(c.v_zero)
    rng = np.random.default_rng(0)
    for _ in range(300):
        bi, hi, n = rng.integers(2), rng.integers(2), rng.integers(c.quant_capacity // 64)
        tid, cb, rh, e = rng.integers(128), rng.integers(16), rng.integers(2), rng.integers(2)
        w, lane = divmod(tid, 32)
        j, p = lane % 4, 2 * (cb % 4) + rh
        word = int(r[bi, hi, n, 4 * tid + cb // 4])
        tok, ch = 64 * n + 16 * w + lane // 4 + 8 * rh, 8 * cb + 2 * j + e
        assert (word >> (2 * p + 16 * e)) & 3 == ck[bi, hi, tok, ch]
        mt, cbv = rng.integers(2), rng.integers(8)
        p = 2 * (cbv % 4) + rh
        word = int(r[bi, hi, n, 512 + 256 * (cbv // 4) + 2 * tid + mt])
        tok, ch = 64 * n + 8 * cbv + 2 * j + e, 64 * mt + 16 * w + lane // 4 + 8 * rh
        assert (word >> (2 * p + 16 * e)) & 3 == cv[bi, hi, tok, ch]
        gi = rng.integers(2)
        for off, bits in ((0, ks), (64, kz)):
            word = int(r[bi, hi, n, 1024 + 128 * gi + off + 16 * (cb // 4) + 4 * j + cb % 4])
            assert (word >> (16 * e)) & 0xFFFF == bits[bi, hi, 2 * n + gi, 8 * cb + 2 * j + e]
        grp = 2 * mt + w // 2
        for sz, bits in ((0, vs), (1, vz)):
            word = int(r[bi, hi, n, 1280 + (2 * (cbv // 4) + sz) * 64 + 16 * grp + 4 * j
                         + cbv % 4])  # fmt: skip
            assert (word >> (16 * e)) & 0xFFFF == bits[bi, hi, 64 * n + 8 * cbv + 2 * j + e, grp]


@pytest.mark.parametrize("bits,d", [(2, 128), (4, 128), (2, 64), (4, 64), (2, 256), (4, 256)])
def test_half_words_split_a_record_by_token_half(bits, d):
    """Every word of a record belongs to one half (the code words hold tokens of one G-group
    only), the halves partition all but the pad, and a half-record written by
    ``group_words`` has nothing outside its half."""
    kt, _, vt, _ = record._code_tables(bits, d)
    for t in (kt, vt):
        assert (t // mk.G == t[:, :1] // mk.G).all()
    m = record.half_words(bits, d)
    assert not (m[0] & m[1]).any()
    assert (m[0] | m[1]).sum() == record.offsets(bits, d)[3] + 2 * d
    assert record.record_format(record.record_words(bits, d)) == (bits, d)
    c = _cache(3, 1, [640], bits=bits, d=d)
    w = record.group_words(c.k_codes[:, :, 32:64], c.k_scale[:, :, 1:2], c.k_zero[:, :, 1:2],
                           c.v_codes[:, :, 32:64], c.v_scale[:, :, 32:64], c.v_zero[:, :, 32:64],
                           jnp.ones((1,), jnp.int32), param_dtype=jnp.float16)  # fmt: skip
    assert not np.asarray(w)[..., ~m[1]].any() and np.asarray(w)[..., m[1]].any()


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("param_dtype", ["float16", "bfloat16"])
def test_raw_unpack_reads_every_plane_as_offset_plus_code(bits, param_dtype):
    """The "raw" unpack (``raw_magic``: one LOP3 onto an exponent chosen per plane) gives
    offset + code exactly for every plane of a code word, both 16-bit halves, every code:
    the warp kernel's folded scales rely on it (the offset goes back by an mma of
    constants)."""
    pdt = jnp.dtype(param_dtype)
    words = np.random.default_rng(7).integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
    mask = (1 << bits) - 1
    for p in range(record.pairs_per_word(bits)):
        got, off = mk_dq.emulate_raw(words, p, bits=bits, param_dtype=pdt)
        want = np.stack([(words >> (bits * p)) & mask, (words >> (16 + bits * p)) & mask], -1)
        np.testing.assert_array_equal(got - off, want.astype(np.float64), err_msg=f"{p=}")
        assert off == float(2 ** round(np.log2(off))) and off <= 1024, off


@pytest.mark.parametrize("bits,param_dtype,unpack,d", [
    (2, "float16", "lop3", 128), (2, "bfloat16", "lop3", 128), (2, "float16", "shift", 128),
    (4, "float16", "lop3", 128), (4, "bfloat16", "lop3", 128), (4, "bfloat16", "shift", 128),
    (2, "bfloat16", "lop3", 64), (4, "float16", "lop3", 64), (2, "float16", "lop3", 256),
    (4, "bfloat16", "lop3", 256),
])  # fmt: skip
def test_kernel_unpack_gives_every_threads_fragments(bits, param_dtype, unpack, d):
    """The kernel's unpack (``plane_plan``: shift, mask, magic, FMA back to the code, FMA
    with the scale / zero pair), emulated in numpy on a real record for every thread of the
    warpgroup and every register of its K and V^T wgmma fragments, equals the planar
    dequantization code * scale + zero rounded once to the parameter dtype: the layout, the
    word / plane a register is read from and the magic's exactness, at INT2 and INT4, for
    head_dim 64, 128 and 256."""
    pdt = jnp.dtype(param_dtype)
    c = _cache(5, 1, [640], param_dtype=param_dtype, bits=bits, d=d)
    rec, _ = mk.fragment_layout(c.k_codes, c.k_scale, c.k_zero, c.k_norm, c.v_codes,
                                c.v_scale, c.v_zero, param_dtype=pdt, block_tokens=64)  # fmt: skip
    r = np.asarray(rec)[0, :, :]  # [H, n, W]
    kc_, vc_, kp_, vp_ = record.offsets(bits, d)
    ppw, per = record.pairs_per_word(bits), record.load_words(bits, d)
    ck = np.asarray(oj.unpack(c.k_codes, bits))[0].astype(np.float64)  # [H, Lq, D]
    cv = np.asarray(oj.unpack(c.v_codes, bits))[0].astype(np.float64)
    f64 = lambda x: np.asarray(x[0], np.float32).astype(np.float64)  # noqa: E731
    ks, kz, vs, vz = f64(c.k_scale), f64(c.k_zero), f64(c.v_scale), f64(c.v_zero)

    def halves(word):  # uint32 -> [..., 2] param_dtype (low, high)
        return np.stack([word & 0xFFFF, word >> 16], -1).astype(np.uint16).view(pdt)

    n = np.arange(r.shape[1])[None, :, None]
    for tid in range(128):
        w, lane = divmod(tid, 32)
        j = lane % 4
        e = np.arange(2)
        for cb in range(d // 8):
            for rh in range(2):
                reg = 2 * cb + rh
                word = r[:, :, kc_ + record.code_word(reg // ppw, tid, per)]
                g = w // 2
                s_ = halves(r[:, :, kp_ + d * g + record.key_param_word(j, cb)])
                z_ = halves(r[:, :, kp_ + d * g + d // 2 + record.key_param_word(j, cb)])
                got = mk_dq.emulate_fragment(word, reg % ppw, s_, z_, bits=bits,
                                             param_dtype=pdt, unpack=unpack)  # fmt: skip
                tok = 64 * n + 16 * w + lane // 4 + 8 * rh  # [1, n, 1]
                ch = 8 * cb + 2 * j + e  # [2]
                hh = np.arange(r.shape[0])[:, None, None]
                want = ck[hh, tok, ch] * ks[hh, tok // 32, ch] + kz[hh, tok // 32, ch]
                np.testing.assert_array_equal(got, want.astype(pdt), err_msg=f"K {tid} {reg}")
        for mt in range(d // 64):
            grp = 2 * mt + w // 2
            for cb in range(8):
                for rh in range(2):
                    reg = 16 * mt + 2 * cb + rh
                    word = r[:, :, vc_ + record.value_code_word(reg // ppw, tid, bits, d)]
                    pos = d // 2 * (2 * (cb // 4)) + 16 * grp + 4 * j + cb % 4
                    s_, z_ = halves(r[:, :, vp_ + pos]), halves(r[:, :, vp_ + pos + d // 2])
                    got = mk_dq.emulate_fragment(word, reg % ppw, s_, z_, bits=bits,
                                                 param_dtype=pdt, unpack=unpack)  # fmt: skip
                    tok = 64 * n + 8 * cb + 2 * j + e
                    ch = 64 * mt + 16 * w + lane // 4 + 8 * rh
                    hh = np.arange(r.shape[0])[:, None, None]
                    want = cv[hh, tok, ch] * vs[hh, tok, grp] + vz[hh, tok, grp]
                    np.testing.assert_array_equal(got, want.astype(pdt), err_msg=f"V {tid} {reg}")


@pytest.mark.parametrize("param_dtype,d,bits", [
    ("float16", 128, 2), ("bfloat16", 128, 2), ("float16", 64, 2), ("bfloat16", 256, 2),
    ("float16", 128, 4), ("bfloat16", 128, 4), ("bfloat16", 64, 4), ("float16", 256, 4),
])  # fmt: skip
def test_warp_kernel_value_fragments_come_from_the_owners_words(param_dtype, d, bits):
    """The warp kernel's V^T A registers, emulated for every thread as the kernel reads them
    (INT2: the owner's word 2 mt + w // 2, shifted right by 8 (w % 2) bits; INT4: its word
    4 mt + w; then plane 2 kh + rh in place, the scale / zero pair at ``value_param_word``),
    equal the planar dequantization of the channel and tokens that register holds in an
    mma.sync m16n8k16 A fragment."""
    pdt = jnp.dtype(param_dtype)
    c = _cache(6, 1, [640], param_dtype=param_dtype, d=d, bits=bits)
    rec, _ = mk.fragment_layout(c.k_codes, c.k_scale, c.k_zero, c.k_norm, c.v_codes,
                                c.v_scale, c.v_zero, param_dtype=pdt, block_tokens=64)  # fmt: skip
    r = np.asarray(rec)[0]  # [H, n, W]
    _, vc_, _, vp_ = record.offsets(bits, d)
    cv = np.asarray(oj.unpack(c.v_codes, bits))[0].astype(np.float64)
    f64 = lambda x: np.asarray(x[0], np.float32).astype(np.float64)  # noqa: E731
    vs, vz = f64(c.v_scale), f64(c.v_zero)

    def halves(word):
        return np.stack([word & 0xFFFF, word >> 16], -1).astype(np.uint16).view(pdt)

    n = np.arange(r.shape[1])[None, :, None]
    hh = np.arange(r.shape[0])[:, None, None]
    for w in range(4):
        for lane in range(32):
            j = lane % 4
            for mt16 in range(d // 16):
                for kh in range(2):
                    ps = r[:, :, vp_ + mk_warp.value_param_word(d, w, lane, mt16 // 2, 0, kh)]
                    pz = r[:, :, vp_ + mk_warp.value_param_word(d, w, lane, mt16 // 2, 1, kh)]
                    for rh in range(2):
                        owner, f, p = mk_warp.value_source(bits, d, w, lane, mt16, rh, kh)
                        assert owner == 32 * (mt16 % 4) + lane
                        # the kernel's address: class w // 2 (INT2) or w (INT4) of the owner's
                        # words, block mt16 // 4 of its d / 64
                        cls = w // 2 if bits == 2 else w
                        at = 128 * (d // 64) * cls + d // 64 * owner + mt16 // 4
                        assert at == record.value_code_word(f, owner, bits, d)
                        word = r[:, :, vc_ + at]
                        if bits == 2:
                            assert (f, p) == (2 * (mt16 // 4) + w // 2, 4 * (w % 2) + 2 * kh + rh)
                            word = word >> (8 * (w % 2))
                        else:
                            assert (f, p) == (4 * (mt16 // 4) + w, 2 * kh + rh)
                        got = mk_dq.emulate_fragment(word, 2 * kh + rh, halves(ps), halves(pz),
                                                     bits=bits, param_dtype=pdt)  # fmt: skip
                        tok = 64 * n + 16 * w + 2 * j + 8 * kh + np.arange(2)
                        ch = 16 * mt16 + lane // 4 + 8 * rh
                        want = cv[hh, tok, ch] * vs[hh, tok, ch // 32] + vz[hh, tok, ch // 32]
                        np.testing.assert_array_equal(
                            got, want.astype(pdt), err_msg=f"{w} {lane} {mt16} {rh} {kh}"
                        )


def _mma_a(regs):  # [32 lanes, n regs, 2] -> the m16n8k16 (n = 4) / m16n8k8 (n = 2) A
    a = np.zeros((16, 8 * regs.shape[1] // 2))
    for lane in range(32):
        g, j = divmod(lane, 4)
        for i in range(regs.shape[1]):
            a[g + 8 * (i % 2), 2 * j + 8 * (i // 2) + np.arange(2)] = regs[lane, i]
    return a


def _mma_b(regs):  # [32 lanes, n regs, 2] -> the B [8 n, 8] (n = 2 or 1)
    b = np.zeros((8 * regs.shape[1], 8))
    for lane in range(32):
        g, j = divmod(lane, 4)
        for i in range(regs.shape[1]):
            b[2 * j + 8 * i + np.arange(2), g] = regs[lane, i]
    return b


@pytest.mark.parametrize("bits,param_dtype,d", [
    (2, "float16", 128), (2, "bfloat16", 64), (4, "float16", 256), (4, "bfloat16", 128),
    (2, "float16", 256), (4, "float16", 64), (2, "bfloat16", 256), (4, "bfloat16", 256),
])  # fmt: skip
def test_folded_warp_arithmetic_equals_the_dequantized_products(bits, param_dtype, d):
    """The warp kernel's fold="kv" arithmetic, emulated register for register and mma for
    mma (raw codes offset + code, scales on the query's / P's B fragments rounded as HMUL2,
    the offset mma of ``fold_constants``, the zero mma on the loaded quads against
    ``fold_inputs``' pairs and the m16n8k8 pairs), equals K q and V^T P of the planar
    dequantization for every warp of a record, to the 16-bit rounding of s q and s P."""
    pdt = jnp.dtype(param_dtype)
    rtol = 4e-3 if param_dtype == "float16" else 3e-2
    c = _cache(8, 1, [640], param_dtype=param_dtype, d=d, bits=bits)
    rec, _ = mk.fragment_layout(c.k_codes, c.k_scale, c.k_zero, c.k_norm, c.v_codes,
                                c.v_scale, c.v_zero, param_dtype=pdt, block_tokens=64)  # fmt: skip
    r = np.asarray(rec)[0, 1, 3]  # one record (tokens 192-255) of KV head 1
    kc_, vc_, kp_, vp_ = record.offsets(bits, d)
    ppw, per = record.pairs_per_word(bits), record.load_words(bits, d)
    f64 = lambda x: np.asarray(x[0, 1], np.float32).astype(np.float64)  # noqa: E731
    kdq = np.asarray(oj.unpack(c.k_codes, bits))[0, 1].astype(np.float64) * np.repeat(
        f64(c.k_scale), 32, 0) + np.repeat(f64(c.k_zero), 32, 0)  # fmt: skip
    vdq = np.asarray(oj.unpack(c.v_codes, bits))[0, 1].astype(np.float64) * np.repeat(
        f64(c.v_scale), 32, -1) + np.repeat(f64(c.v_zero), 32, -1)  # fmt: skip

    def halves(word):
        w = np.asarray(word, np.uint32)
        return np.stack([w & 0xFFFF, w >> 16], -1).astype(np.uint16).view(pdt).astype(np.float64)

    def hmul(a, b):  # HMUL2: the product rounded once to the parameter dtype
        return (a * b).astype(pdt).astype(np.float64)

    qt = jax.random.normal(jax.random.key(5), (1, 1, 8, d)).astype(pdt)
    qx = np.asarray(mk_warp.fold_inputs(mk_warp.query_fragments(qt), bits, pdt))[0, 0]
    qw, qz, kx = qx[:, : d // 8], qx[:, d // 8 : d // 4], qx[:, d // 4 :]
    q = np.asarray(qt[0, 0], np.float64)  # [8 heads, d]
    p = np.asarray(jax.random.uniform(jax.random.key(6), (64, 8)).astype(pdt), np.float64)
    for w in range(4):
        g = w // 2
        lanes = np.arange(32)
        tids, jj = 32 * w + lanes, lanes % 4
        # keys: S^T [16 tok, 8 heads]
        kpw = record.key_param_word(jj[:, None], np.arange(d // 8))  # [32, cb]
        sw = halves(r[kp_ + d * g + kpw])  # [32, cb, 2]
        zw = halves(r[kp_ + d * g + d // 2 + kpw])
        qs = hmul(halves(qw), sw)
        s_t = np.zeros((16, 8))
        for kk in range(d // 16):
            a, ao = np.zeros((32, 4, 2)), np.zeros((32, 4, 2))
            for i, (cb, rh) in enumerate((2 * kk + c_, rh) for c_ in (0, 1) for rh in (0, 1)):
                reg = 2 * cb + rh
                word = r[kc_ + np.array([record.code_word(reg // ppw, t, per) for t in tids])]
                a[:, i], off = mk_dq.emulate_raw(word, reg % ppw, bits=bits, param_dtype=pdt)
                ao[:, i] = halves(kx[:, 2 * (cb % 4) + rh])
                np.testing.assert_array_equal(ao[:, i], -off)
            b = _mma_b(qs[:, 2 * kk : 2 * kk + 2])
            s_t += _mma_a(a) @ b + _mma_a(ao) @ b
        z1, z2 = np.zeros((16, 8)), np.zeros((16, 8))
        for i in range(d // 32):
            zq = _mma_a(zw[:, 4 * i : 4 * i + 4])
            z1 += zq @ _mma_b(halves(qz[:, 4 * i : 4 * i + 2]))
            z2 += zq @ _mma_b(halves(qz[:, 4 * i + 2 : 4 * i + 4]))
        s_t += (z1[0] + z2[8])[None, :]  # row gid of z1, row gid + 8 of z2
        want = kdq[192 + 16 * w : 208 + 16 * w] @ q.T
        scale = np.abs(kdq[192 + 16 * w : 208 + 16 * w]) @ np.abs(q.T)
        np.testing.assert_array_less(np.abs(s_t - want), rtol * scale.max(), err_msg=f"K {w}")
        # values: O^T [d, 8 heads] from P [16 tok, 8 heads] of this warp's tokens
        pw = p[16 * w : 16 * w + 16]
        breg = np.stack([np.stack([pw[2 * jj + 8 * kh + e, lanes // 4] for e in (0, 1)], -1)
                         for kh in (0, 1)], 1)  # [32, 2 regs, 2]  # fmt: skip
        o_t = np.zeros((d, 8))
        for mt16 in range(d // 16):
            grp = mt16 // 2
            par = [[halves(r[vp_ + np.array([mk_warp.value_param_word(d, w, ln, grp, sz, kh)
                                              for ln in lanes])]) for kh in (0, 1)]
                   for sz in (0, 1)]  # fmt: skip
            bs = np.stack([hmul(breg[:, kh], par[0][kh]) for kh in (0, 1)], 1)
            a, ao = np.zeros((32, 4, 2)), np.zeros((32, 4, 2))
            for i, (kh, rh) in enumerate((kh, rh) for kh in (0, 1) for rh in (0, 1)):
                ws = []
                for ln in lanes:
                    owner, f, pl = mk_warp.value_source(bits, d, w, ln, mt16, rh, kh)
                    word = r[vc_ + record.value_code_word(f, owner, bits, d)]
                    ws.append(word >> (8 * (w % 2)) if bits == 2 else word)
                a[:, i], off = mk_dq.emulate_raw(np.array(ws), 2 * kh + rh, bits=bits,
                                                 param_dtype=pdt)  # fmt: skip
                ao[:, i] = halves(kx[:, 8 + 2 * kh + rh])
                np.testing.assert_array_equal(ao[:, i], -off)
            tile = _mma_a(a) @ _mma_b(bs) + _mma_a(ao) @ _mma_b(bs)
            zp = np.stack(par[1], 1)  # [32, kh, 2]: the m16n8k8 A [z kh 0, z kh 1]
            zt = (_mma_a(zp) @ _mma_b(breg[:, :1]))[0] + (_mma_a(zp) @ _mma_b(breg[:, 1:]))[8]
            o_t[16 * mt16 : 16 * mt16 + 16] = tile + zt[None, :]
        want = vdq[192 + 16 * w : 208 + 16 * w].T @ pw
        scale = np.abs(vdq[192 + 16 * w : 208 + 16 * w]).T @ pw
        np.testing.assert_array_less(np.abs(o_t - want), rtol * scale.max(), err_msg=f"V {w}")


def test_warp_kernel_query_fragments_are_b_operands():
    """``query_fragments``: lane l's word 2 kk + half holds Q^T[16 kk + 2 j + 8 half + e,
    head l // 4] (e the 16-bit half), the B fragment of mma.sync m16n8k16."""
    d = 64
    qt = jax.random.normal(jax.random.key(3), (2, 3, 8, d)).astype(jnp.float16)
    got = np.asarray(mk_warp.query_fragments(qt))
    q16 = np.asarray(jax.lax.bitcast_convert_type(qt, jnp.uint16)).astype(np.uint32)
    for lane in range(32):
        h, j = divmod(lane, 4)
        for kk in range(d // 16):
            for half in range(2):
                c0 = 16 * kk + 2 * j + 8 * half
                want = q16[:, :, h, c0] | (q16[:, :, h, c0 + 1] << 16)
                np.testing.assert_array_equal(got[:, :, lane, 2 * kk + half], want)


@pytest.mark.parametrize("rotation,d,g", [("hadamard", 128, 4), ("randomized_hadamard", 128, 7),
                                           ("randomized_hadamard", 64, 3)])  # fmt: skip
def test_warp_kernel_query_rotation_is_the_caches(rotation, d, g):
    """``prep_q``'s passes emulated thread by thread (128 threads; the sign bit of element
    c flipped by bit c % 32 of ``sign_words``' word c // 32, then pair p = t + 128 k of the
    stage of stride h at row p // (D/2), i0 = ((j >> log h) << (log h + 1)) | (j & (h - 1)),
    j = p % (D/2), i1 = i0 + h), times the 1 / sqrt(D) the kernel folds into its query
    scale, are the cache's rotation of the query (``hadamard.rotate``, float32)."""
    from oscar_jax import hadamard

    cfg = oj.preset("oscar", bits=2, rotation=rotation, rotation_seed=5)
    signs = hadamard.fwht_signs(cfg, d)
    words = mk_warp.sign_words(signs)
    x = np.asarray(jax.random.normal(jax.random.key(1), (g, d)), np.float32)
    q = x.copy()
    for e in range(g * d):  # the copy pass
        row, col = divmod(e, d)
        bit = (words[col >> 5] >> (col & 31)) & 1
        q[row, col] = (q.view(np.uint32)[row, col] ^ np.uint32(bit << 31)).view(np.float32)
    h = 1
    while h < d:
        lg = h.bit_length() - 1
        new = q.copy()
        for p in range(g * d // 2):
            row, jj = divmod(p, d // 2)
            i0 = ((jj >> lg) << (lg + 1)) | (jj & (h - 1))
            i1 = i0 + h
            new[row, i0], new[row, i1] = q[row, i0] + q[row, i1], q[row, i0] - q[row, i1]
        q, h = new, 2 * h
    want = np.asarray(hadamard.rotate(jnp.asarray(x), cfg, dense=False))
    np.testing.assert_allclose(q / np.sqrt(d), want, rtol=1e-5, atol=1e-5)


def test_fwht_signs_name_the_rotations_a_kernel_can_apply():
    """R = H diag(signs) for the Hadamard kinds; None where R is not one Walsh-Hadamard
    transform of the head (random orthogonal, no rotation, a head_dim not a power of two)."""
    from oscar_jax import hadamard

    for rotation in ("hadamard", "randomized_hadamard"):
        cfg = oj.preset("oscar", bits=2, rotation=rotation, rotation_seed=3)
        s = hadamard.fwht_signs(cfg, 64)
        np.testing.assert_allclose(hadamard.hadamard_matrix(64) * s[None, :],
                                   hadamard.rotation_matrix(cfg, 64))  # fmt: skip
    assert hadamard.fwht_signs(oj.preset("oscar", bits=2, rotation="random_orthogonal"), 64) is None
    assert hadamard.fwht_signs(oj.preset("oscar", bits=2, rotation="hadamard"), 96) is None
    assert hadamard.fwht_signs(oj.preset("kivi", bits=2), 64) is None  # rotation "none"
    with pytest.raises(ValueError, match="the in-kernel query rotation is the warp kernel's"):
        mk_merge._partials_raw(jnp.ones((1, 1, 4, 128)), jnp.zeros((1, 1, 1, 1600), jnp.uint32),
                               jnp.ones((1, 1, 64)), jnp.ones((1,), jnp.int32),
                               signs=np.ones(128))  # fmt: skip


def test_unsupported_caches_are_named():
    planar = _cache(1, 1, [300])
    assert mk.unsupported_reason(planar, convert=True) is None
    assert "layout='record'" in mk.unsupported_reason(planar)
    assert "g=17" in mk.unsupported_reason(planar, 17, convert=True)
    c4 = oj.init_cache(oj.preset("oscar", bits=3), batch=1, max_len=640, num_kv_heads=2,
                       head_dim=D)  # fmt: skip
    assert "bits=3" in mk.unsupported_reason(c4)
    c96 = oj.init_cache(oj.preset("oscar", bits=2), batch=1, max_len=640, num_kv_heads=2,
                        head_dim=96)  # fmt: skip
    assert "head_dim=96" in mk.unsupported_reason(c96)
    for d in (64, 256):  # covered, once the cache holds records
        cd = oj.init_cache(oj.preset("oscar", bits=2), batch=1, max_len=640, num_kv_heads=2,
                           head_dim=d)  # fmt: skip
        assert mk.unsupported_reason(cd, 4, convert=True) is None
    with pytest.raises(ValueError, match="bits=3"):
        mk.decode_attention_mosaic(jnp.ones((1, 4, D)), c4)
    with pytest.raises(ValueError, match="block_tokens=100"):
        mk.Int2DecodeConfig(block_tokens=100)


@pytest.mark.parametrize(
    "b,lq,want",
    [(1, 131072, 32), (8, 32768, 4), (48, 4096, 2), (1, 4096, 16), (4, 131072, 8)],
)
def test_splits_fill_whole_rounds_of_resident_programs(b, lq, want):
    """8 KV heads, 132 SMs x 2 resident programs: B H s programs in whole rounds."""
    cfg = mk.Int2DecodeConfig()
    s = cfg.num_splits(b, 8, lq)
    assert s == want
    rounds = -(-(b * 8 * s) // 264)
    ts = range(1, min(lq // 256, 64) + 1)
    assert rounds / s <= 1.05 * min(-(-(b * 8 * t) // 264) / t for t in ts)
    assert mk.Int2DecodeConfig(waves=2).num_splits(b, 8, lq) == min(-(-264 // (8 * b)), lq // 256)
    assert mk.Int2DecodeConfig(splits=3).num_splits(b, 8, lq) == 3


def test_fused_merge_is_the_lse_merge_of_its_splits():
    """merge="fused"'s XLA part: S quantized splits (rotated value basis) and the ring's split
    last, merged by log-sum-exp; an empty split (max -1e30, sum 0) and an empty row give 0."""
    rng = np.random.default_rng(0)
    b, h, s, g, d = 2, 2, 4, 3, 128
    acc = rng.normal(size=(b, h, s + 1, d // 64, 64, mk.NPAD)).astype(np.float32)
    m2 = rng.normal(size=(b, h, s + 1, mk.NPAD)).astype(np.float32) * 4
    rs = rng.uniform(0.5, 2.0, size=(b, h, s + 1, mk.NPAD)).astype(np.float32)  # row sums
    m2[0, 0, 1], rs[0, 0, 1], acc[0, 0, 1] = -1e30, 0.0, 0.0  # a split with no token
    m2[1, 1], rs[1, 1], acc[1, 1] = -1e30, 0.0, 0.0  # a row with no token at all
    ml = np.stack([m2, rs], 3)
    rot = np.linalg.qr(rng.normal(size=(d, d)))[0].astype(np.float32)
    got = mk.merge_splits_with_ring_split(
        jnp.asarray(acc), jnp.asarray(ml), g=g, unrotate=lambda x: x @ rot, out_dtype=jnp.float32
    )
    a = np.swapaxes(acc.reshape(b, h, s + 1, d, mk.NPAD), -1, -2)[..., :g, :].astype(np.float64)
    mm, ll = m2[..., :g].astype(np.float64), rs[..., :g].astype(np.float64)
    w = np.exp2(mm - mm.max(2, keepdims=True))
    num = np.einsum("bhsgd,bhsg->bhgd", a[:, :, :s], w[:, :, :s]) @ rot
    num += a[:, :, s] * w[:, :, s, :, None]
    den = (ll * w).sum(2)
    want = np.where(den[..., None] > 0, num / np.where(den > 0, den, 1)[..., None], 0)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)
    assert not np.asarray(got)[1, 1].any()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_ring_query_pair_keeps_the_query_to_16_bits(dtype):
    """The ring's query as a 16-bit pair: hi + lo equals the scaled f32 query to ~16
    mantissa bits (one 16-bit rounding keeps 8 in bfloat16), so the ring's scores K hi +
    K lo, two wgmma with f32 accumulation, carry the query's precision. Under jit, as the
    backend builds it: on a GPU, XLA's excess-precision rule once dropped the round trip
    that made lo, so lo was 0 (this test then fails on the GPU, not on the CPU)."""
    from pallas_kernels.decode.mosaic import _ring

    q = jnp.asarray(np.random.default_rng(3).normal(size=(2, 3, 7, 64)) * 3, jnp.float32)
    want = np.asarray(_ring.ring_query(q, None, jnp.float32))  # [B, H, D, NPAD]
    pair = jax.jit(_ring.ring_query_pair, static_argnums=(1, 2))(q, None, dtype)
    assert pair.shape == (2, 3, 2, 64, mk.NPAD) and pair.dtype == dtype
    got = np.asarray(pair[:, :, 0], np.float32) + np.asarray(pair[:, :, 1], np.float32)
    one = np.asarray(pair[:, :, 0], np.float32)
    bits = 8 if dtype == jnp.bfloat16 else 11  # the mantissa bits of one rounding
    # float16's lo of a small element is subnormal: absolute steps of 2^-24
    np.testing.assert_allclose(got, want, rtol=2.0 ** -(2 * bits - 1), atol=2.0**-24)
    assert np.abs(one - want).max() > 4 * np.abs(got - want).max()  # the lo half matters
    assert not got[..., 7:].any()  # heads past g stay zero


def test_merge_step_balances_the_splits_over_the_fewest_steps():
    assert [mk.merge_step_for(8, s) for s in (1, 2, 4, 8, 16, 32, 33, 12, 7, 9)] == [
        1, 2, 4, 8, 8, 8, 7, 6, 7, 5,
    ]  # fmt: skip
    for cap in (1, 3, 8):
        for s in range(1, 80):
            step = mk.merge_step_for(cap, s)
            steps = -(-s // step)
            assert step <= cap and steps == -(-s // cap)  # no more steps than needed
            assert 0 <= steps * step - s < steps  # slots past the splits: fewer than a step


def _lowering_stack() -> str | None:
    """Why the kernels cannot be lowered for CUDA here (None: they can)."""
    version = tuple(int(x) for x in jax.__version__.split(".")[:3] if x.isdigit())
    if version < (0, 11, 2):
        return f"jax {jax.__version__}: the kernels need jax >= 0.11.2"
    if importlib.util.find_spec("jax_plugins") is None:
        return "no CUDA plugin (jax-cuda13-plugin) to lower for sm_90"
    return None


TMA_ALIGN = 128  # bytes: the shared-memory alignment of a TMA copy's destination


def _pipeline_slot_bytes(spec, dtype) -> int:
    """Bytes of one slot of ``spec``'s block (squeezed dimensions left out)."""
    dims = [n for n in spec.block_shape if isinstance(n, int)]
    return int(np.prod(dims)) * jnp.dtype(dtype).itemsize


@pytest.fixture
def lowering_stack(monkeypatch):
    """Skip where jax 0.11.2 + the CUDA plugin are missing; CI's Mosaic step sets
    OSCAR_REQUIRE_MOSAIC_LOWERING=1 so that a missing stack fails instead of skipping.

    Every lowering test also checks the kernels' pipelines: ``emit_pipeline`` keeps the
    slots of an input block back to back, so a slot that is not a multiple of 128 bytes
    puts the next one, a TMA destination, off alignment: CUDA_ERROR_MISALIGNED_ADDRESS
    compiled, while lowering and the interpreter pass (it happened: an 8-column merge)."""
    reason = _lowering_stack()
    if reason is not None:
        if os.environ.get("OSCAR_REQUIRE_MOSAIC_LOWERING") == "1":
            pytest.fail(f"the Mosaic lowering check must run here: {reason}")
        pytest.skip(reason)
    from jax.experimental.pallas import mosaic_gpu as plgpu

    real = plgpu.emit_pipeline

    def aligned_pipeline(body, *, in_specs=(), **kw):
        pipe = real(body, in_specs=in_specs, **kw)

        def run(*refs):
            for spec, ref in zip(in_specs, refs, strict=False):  # inputs, then outputs
                n = _pipeline_slot_bytes(spec, ref.dtype)
                assert n % TMA_ALIGN == 0, (spec.block_shape, ref.dtype, n)
            return pipe(*refs)

        return run

    monkeypatch.setattr(plgpu, "emit_pipeline", aligned_pipeline)


@pytest.mark.usefixtures("lowering_stack")
@pytest.mark.parametrize("final", [None, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("splits,merge_step,stages,pdl", [
    (1, 8, None, False), (5, 2, None, False), (33, 8, None, False), (12, 8, None, False),
    (33, 8, 5, False), (12, 4, 2, False), (12, 8, None, True),
])  # fmt: skip
def test_split_merge_lowers_and_runs_interpreted(splits, merge_step, stages, pdl, final):
    """The merge launch without a ring (``merge="fused_mosaic"``'s second launch) lowers for
    sm_90 and, run by Mosaic's GPU interpreter on the CPU, equals the LSE merge in XLA: the
    steps of ``merge_step_for`` (the last one past the split count), an empty split, and
    a (row, head) whose splits are all empty (output 0). The interpreter reads the slots
    past the split count as zeros, as TMA does. ``final``: the output written by the
    kernel as the library returns it ([B, H, g, D] in that dtype, g = 5 of 16 padded
    heads), a row whose flags carry the poison bit all NaN, the others untouched.
    ``stages``: the pipeline depth (``merge_stages``; 5 at 33 splits: every step in flight).
    ``pdl``: the kernel waits on the launch before it (lowered; the interpreter leaves the
    wait out, ``_pdl``)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rng = np.random.default_rng(splits)
    b, h, d = 2, 3, 128
    acc = jnp.asarray(rng.normal(size=(b, h, splits, d // 64, 64, mk.NPAD)), jnp.float32)
    # maxima far below 0: a slot past the split count read as max 0 (unmasked) would weigh
    # every real split by 2^-200 = 0 in float32
    m = rng.normal(size=(b, h, splits, mk.NPAD)) * 4 - 200
    lsum = np.abs(rng.normal(size=(b, h, splits, mk.NPAD))) + 0.1
    m[0, 0, splits // 2], lsum[0, 0, splits // 2] = -1e30, 0.0  # an empty split
    m[1, 2], lsum[1, 2] = -1e30, 0.0  # no token at all
    ml = jnp.asarray(np.stack([m, lsum], axis=3), jnp.float32)
    step = mk.merge_step_for(merge_step, splits)
    g, poison = 5, 4
    flags = jnp.array([poison | 1, 2], jnp.int32)  # row 0 poisoned, row 1 another flag only
    fin = None if final is None else (g, jnp.dtype(final), flags, poison)
    fn = jax.jit(lambda a, x: mk.int2_merge_ring(a, x, None, None, None, None, None, step=step,
                                                 final=fin, stages=stages,
                                                 pdl=pdl))  # fmt: skip
    hlo = fn.trace(acc, ml).lower(lowering_platforms=("cuda",)).as_text()
    assert ("griddepcontrol.wait" in hlo) == pdl
    with plgpu.force_gpu_interpret_mode():
        got = fn(acc, ml)  # [B, H, D / 64, 64, NPAD]: out^T (final: [B, H, g, D])
    a = jnp.swapaxes(acc.reshape(b, h, splits, d, mk.NPAD), -1, -2)
    num, den = mk_merge.weigh_splits(a, ml[..., 0, :], ml[..., 1, :], jnp.max(ml[..., 0, :], 2))
    want = mk_merge.normalized(num, den, jnp.float32)
    if final is None:
        got = jnp.swapaxes(got.reshape(b, h, d, mk.NPAD), -1, -2)
    else:
        assert got.shape == (b, h, g, d) and got.dtype == jnp.dtype(final)
        assert np.all(np.isnan(np.asarray(got[0], np.float32)))
        got, want = got[1:].astype(jnp.float32), want[1:, :, :g]
    t = tol(final or jnp.float32)
    chex.assert_trees_all_close(got, want, atol=t["atol"], rtol=t["rtol"])
    assert not np.any(np.asarray(got[-1, 2]))


@pytest.mark.usefixtures("lowering_stack")
@pytest.mark.parametrize("splits,merge_step,final", [
    (33, 8, jnp.bfloat16), (1, 8, jnp.float32), (12, 3, jnp.float16),
])  # fmt: skip
def test_split_merge_of_8_columns_lowers_and_equals_16(splits, merge_step, final):
    """``merge_columns=8``: the split merge reads heads 0-7 of the partials only (half the
    bytes; the step made even, so every (m, l) slot stays 128-byte aligned, which the
    fixture checks). Lowered for sm_90 and, interpreted, bit-equal to the 16-column merge of
    the same step on the g = 5 heads stored; a poisoned row NaN."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rng = np.random.default_rng(100 + splits)
    b, h, d, g, poison = 2, 3, 128, 5, 4
    acc = jnp.asarray(rng.normal(size=(b, h, splits, d // 64, 64, mk.NPAD)), jnp.float32)
    m = rng.normal(size=(b, h, splits, mk.NPAD)) * 4 - 200
    lsum = np.abs(rng.normal(size=(b, h, splits, mk.NPAD))) + 0.1
    m[1, 2], lsum[1, 2] = -1e30, 0.0  # no token at all
    ml = jnp.asarray(np.stack([m, lsum], axis=3), jnp.float32)
    flags = jnp.array([poison, 0], jnp.int32)
    step = mk.merge_step_for(merge_step, splits)

    def merge(columns, step):
        fin = (g, jnp.dtype(final), flags, poison)
        return jax.jit(lambda a, x: mk.int2_merge_ring(a, x, *(None,) * 5, step=step, final=fin,
                                                       columns=columns))  # fmt: skip

    even = step + step % 2
    merge(8, even).trace(acc, ml).lower(lowering_platforms=("cuda",))
    with plgpu.force_gpu_interpret_mode():
        # the same (even) step: the same order of the online max's updates
        got, want = merge(8, even)(acc, ml), merge(mk.NPAD, even)(acc, ml)
    assert np.all(np.isnan(np.asarray(got[0], np.float32)))
    np.testing.assert_array_equal(_bits(got), _bits(want))
    with pytest.raises(ValueError, match="merge_columns=8 must be 16, or 8"):
        jax.eval_shape(merge(8, 3), acc, ml)  # an odd step
    with pytest.raises(ValueError, match="merge_columns=4 must be 8 or 16"):
        mk.Int2DecodeConfig(merge_columns=4)


@pytest.mark.usefixtures("lowering_stack")
@pytest.mark.parametrize("block,g,stage,bits,d", [
    (256, 4, "full", 2, 128), (128, 7, "full", 2, 128), (256, 4, "keys", 2, 128),
    (256, 4, "full", 4, 128), (64, 3, "full", 4, 128), (128, 4, "dequant", 4, 128),
    (256, 3, "full", 2, 64), (128, 7, "full", 4, 64), (128, 4, "full", 2, 256),
    (64, 1, "full", 4, 256),
])  # fmt: skip
def test_kernels_lower_for_sm90(block, g, stage, bits, d):
    cfg = mk.Int2DecodeConfig(block_tokens=block, stage=stage)
    s = jax.ShapeDtypeStruct
    b, h, lq = 2, 2, 1024
    q = s((b, h, g, d), jnp.float32)
    rec = s((b, h, lq // 64, record.record_words(bits, d)), jnp.uint32)
    kn, nq = s((b, h, lq), jnp.float32), s((b,), jnp.int32)
    f = jax.jit(lambda q, r, n, nq: mk.int2_decode_partials(q, r, n, nq, cfg=cfg))
    f.trace(q, rec, kn, nq).lower(lowering_platforms=("cuda",))
    if stage == "full":
        ring = (s((b, h, 160, d), jnp.bfloat16), s((b, h, 160, d), jnp.bfloat16),
                s((b,), jnp.int32))  # lengths  # fmt: skip
        calls = (
            mk.int2_decode_attention_2launch,
            mk.int2_decode_attention_fused,
            functools.partial(mk.int2_decode_attention_2launch, ring_in_kernel=True),
        )
        for call in calls:
            fn = jax.jit(lambda *a, call=call: call(*a, cfg=cfg))
            fn.trace(q, q, rec, kn, nq, *ring).lower(lowering_platforms=("cuda",))


def test_layout_1_probe_is_a_warp_kernel_stage():
    with pytest.raises(ValueError, match="probe of kernel='warp'"):
        mk.Int2DecodeConfig(stage="probe_v1")
    assert mk.Int2DecodeConfig(kernel="warp", stage="probe_v1").stage == "probe_v1"


@pytest.mark.usefixtures("lowering_stack")
@pytest.mark.parametrize("bits,d", [(2, 128), (4, 64), (2, 256)])
def test_warp_kernel_layout_1_probe_lowers_for_sm90(bits, d):
    """The timing control of record layout 2 (``stage="probe_v1"``: layout 1's loads)."""
    cfg = mk.Int2DecodeConfig(kernel="warp", stage="probe_v1")
    s = jax.ShapeDtypeStruct
    q, rec = s((1, 2, 4, d), jnp.float32), s((1, 2, 16, record.record_words(bits, d)), jnp.uint32)
    kn, nq = s((1, 2, 1024), jnp.float32), s((1,), jnp.int32)
    f = jax.jit(lambda q, r, n, nq: mk.int2_decode_partials(q, r, n, nq, cfg=cfg))
    f.trace(q, rec, kn, nq).lower(lowering_platforms=("cuda",))


def test_profile_dir_is_a_warp_kernel_knob():
    with pytest.raises(ValueError, match="profile_dir='/tmp/x' is a knob of kernel='warp'"):
        mk.Int2DecodeConfig(profile_dir="/tmp/x")


@pytest.mark.usefixtures("lowering_stack")
def test_folded_warp_kernel_refuses_bfloat16_parameters():
    cfg = mk.Int2DecodeConfig(kernel="warp", fold="v")
    s = jax.ShapeDtypeStruct
    q, rec = s((1, 2, 4, D), jnp.float32), s((1, 2, 16, record.record_words(2, D)), jnp.uint32)
    kn, nq = s((1, 2, 1024), jnp.float32), s((1,), jnp.int32)
    f = jax.jit(lambda q, r, n, nq: mk.int2_decode_partials(q, r, n, nq, cfg=cfg,
                                                            param_dtype="bfloat16"))  # fmt: skip
    with pytest.raises(ValueError, match="fold='v' takes float16 parameters"):
        f.trace(q, rec, kn, nq)


@pytest.mark.usefixtures("lowering_stack")
@pytest.mark.parametrize("block,g,d,pdt,bits", [
    (256, 4, 128, "float16", 2), (128, 7, 64, "bfloat16", 2), (64, 8, 256, "float16", 2),
    (128, 1, 128, "bfloat16", 2), (128, 4, 128, "float16", 4), (256, 3, 64, "bfloat16", 4),
    (64, 8, 256, "bfloat16", 4),
])  # fmt: skip
@pytest.mark.parametrize("fold", ["none", "k", "v", "kv"])
def test_warp_kernel_lowers_for_sm90(block, g, d, pdt, bits, fold):
    if fold != "none":
        pdt = "float16"  # the folded kernel takes float16 parameters only
    cfg = mk.Int2DecodeConfig(block_tokens=block, kernel="warp", fold=fold)
    s = jax.ShapeDtypeStruct
    b, h, lq = 2, 2, 1024
    q = s((b, h, g, d), jnp.float32)
    rec = s((b, h, lq // 64, record.record_words(bits, d)), jnp.uint32)
    kn, nq = s((b, h, lq), jnp.float32), s((b,), jnp.int32)
    f = jax.jit(lambda q, r, n, nq: mk.int2_decode_partials(q, r, n, nq, cfg=cfg, param_dtype=pdt))
    f.trace(q, rec, kn, nq).lower(lowering_platforms=("cuda",))
    if fold == "none":  # the ring as the last split (wgmma in a CTA of the warp kernel)
        ring = (s((b, h, 160, d), jnp.bfloat16), s((b, h, 160, d), jnp.bfloat16),
                s((b,), jnp.int32))  # lengths  # fmt: skip
        fn = jax.jit(lambda *a: mk.int2_decode_attention_2launch(
            *a, cfg=cfg, param_dtype=pdt, ring_in_kernel=True))  # fmt: skip
        fn.trace(q, q, rec, kn, nq, *ring).lower(lowering_platforms=("cuda",))
        # the one-launch call: one split a (b, h), the ring and the output in its CTA
        flags = s((b,), jnp.int32)
        fn = jax.jit(lambda *a, f: mk.int2_decode_attention_1launch(
            *a, cfg=cfg, param_dtype=pdt, out_dtype=jnp.bfloat16, flags=f, poison=1))  # fmt: skip
        fn.trace(q, q, rec, kn, nq, *ring, f=flags).lower(lowering_platforms=("cuda",))


@pytest.mark.usefixtures("lowering_stack")
@pytest.mark.parametrize("merge,rotate_values,bits,d", [
    ("xla", True, 2, 128), ("mosaic", False, 2, 128), ("xla", True, 4, 128),
    ("mosaic", False, 4, 128), ("xla", True, 2, 64), ("mosaic", False, 4, 256),
    ("fused", True, 2, 128), ("fused", False, 4, 64), ("fused_mosaic", False, 2, 128),
    ("fused_mosaic", False, 4, 256), ("single", False, 2, 128), ("single", False, 4, 64),
])  # fmt: skip
def test_backend_on_a_record_cache_lowers_for_sm90(merge, rotate_values, bits, d):
    """The "mosaic" backend's call on a layout='record' cache (its arrays read as they are)."""
    c = _cache(3, 2, [600, 130], rotate_values=rotate_values, layout="record", bits=bits, d=d)
    fn = jax.jit(lambda q, c: mk.decode_attention_mosaic(q, c, merge=merge))
    fn.trace(query(3, 2, 8, d), c).lower(lowering_platforms=("cuda",))


@pytest.mark.usefixtures("lowering_stack")
@pytest.mark.parametrize("merge,kernel,bits,d", [
    ("mosaic", "wgmma", 2, 128), ("fused", "wgmma", 4, 64), ("fused_mosaic", "warp", 2, 128),
    ("single", "warp", 4, 64), ("xla", "warp", 2, 128),
])  # fmt: skip
def test_ring_query_pair_lowers_for_sm90(merge, kernel, bits, d):
    """``ring_query="pair"``: every kernel that walks the ring (the merge launch, the wgmma
    and warp kernels' ring split, the one launch) lowers with the (2, D, 16) query; the
    XLA merge has no ring walk and ignores it."""
    c = _cache(3, 2, [600, 130], rotate_values=merge in ("xla", "fused"), layout="record",
               bits=bits, d=d)  # fmt: skip
    cfg = mk.Int2DecodeConfig(kernel=kernel, ring_query="pair", block_tokens=64)
    fn = jax.jit(lambda q, c: mk.decode_attention_mosaic(q, c, merge=merge, cfg=cfg))
    fn.trace(query(3, 2, 8, d), c).lower(lowering_platforms=("cuda",))


@pytest.mark.usefixtures("lowering_stack")
@pytest.mark.parametrize("merge,ring_query,bits,d,prep", [
    ("fused_mosaic", "pair", 2, 128, "kernel"), ("fused_mosaic", "bf16", 4, 64, "kernel"),
    ("single", "pair", 4, 64, "kernel"), ("single", "bf16", 2, 128, "kernel"),
    ("mosaic", "pair", 2, 64, "kernel"), ("mosaic", "bf16", 4, 128, "kernel"),
    ("single", "pair", 2, 64, "xla"), ("mosaic", "pair", 2, 64, "xla"),
])  # fmt: skip
def test_prep_in_kernel_lowers_for_sm90(merge, ring_query, bits, d, prep):
    """``prep="kernel"``: the kernel that walks the ring (the warp kernel's ring split,
    ``fused_mosaic``; the one launch, ``single``; the merge launch, ``mosaic``) makes the
    ring's query, and the kernels the rows' nq, so no XLA op runs before the launch; with
    ``merge_stages`` the split merge's deeper pipeline lowers beside it. ``prep="xla"``:
    both made by XLA fusions before the launch."""
    c = _cache(3, 2, [600, 130], rotate_values=False, layout="record", bits=bits, d=d)
    cfg = mk.Int2DecodeConfig(kernel="warp", ring_query=ring_query, prep=prep,
                              block_tokens=64, merge_stages=3)  # fmt: skip
    fn = jax.jit(lambda q, c: mk.decode_attention_mosaic(q, c, merge=merge, cfg=cfg))
    hlo = fn.trace(query(3, 2, 8, d), c).lower(lowering_platforms=("cuda",)).as_text()
    # the ring's query (heads padded to NPAD) in XLA only under prep="xla"
    assert ("stablehlo.pad" in hlo) == (prep == "xla")
    # nq = G floor(max(length - R, 0) / G) in XLA only under prep="xla"
    assert ("stablehlo.divide" in hlo) == (prep == "xla")


@pytest.mark.parametrize("group,residual", [(32, 128), (64, 64), (16, 0), (32, 96)])
def test_quantized_of_equals_the_caches_count(group, residual):
    """What the kernels compute from a row's length under ``prep="kernel"`` is the cache's
    nq exactly (lengths 0, below the ring, on and off group boundaries)."""
    rng = np.random.default_rng(group + residual)
    n = jnp.asarray(np.r_[0, 1, residual, residual + group - 1, residual + group,
                          rng.integers(0, 70000, 64)], jnp.int32)  # fmt: skip
    kcfg = oj.KVQuantConfig(group_size=group, residual_length=residual)
    got = jax.jit(lambda x: mk.quantized_of(x, kcfg))(n)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(oj.cache.quantized_count(n, kcfg)))
    assert mk.quantized_of(n, None) is n


def test_ring_query_is_validated():
    with pytest.raises(ValueError, match="ring_query='hi' must be 'bf16' or 'pair'"):
        mk.Int2DecodeConfig(ring_query="hi")
    assert mk.Int2DecodeConfig().ring_query == "pair"
    assert mk.Int2DecodeConfig().prep == "kernel" and mk.Int2DecodeConfig().merge_stages is None
    with pytest.raises(ValueError, match="prep='gpu' must be 'xla' or 'kernel'"):
        mk.Int2DecodeConfig(prep="gpu")
    with pytest.raises(ValueError, match="merge_stages=0 must be None or >= 1"):
        mk.Int2DecodeConfig(merge_stages=0)
    # 64 splits at 8 a step: 8 steps of 33,792 bytes would not fit shared memory
    acc = jax.ShapeDtypeStruct((1, 2, 64, 2, 64, mk.NPAD), jnp.float32)
    ml = jax.ShapeDtypeStruct((1, 2, 64, 2, mk.NPAD), jnp.float32)
    with pytest.raises(ValueError, match="merge_stages=8 puts 8 steps of 33792 bytes"):
        jax.eval_shape(lambda a, m: mk.int2_merge_ring(a, m, *(None,) * 5, step=8, stages=8),
                       acc, ml)  # fmt: skip


@pytest.mark.usefixtures("lowering_stack")
@pytest.mark.parametrize("merge,launches", [
    ("auto", ["oscar_decode_int2_warp_partials"]),
    ("fused", ["oscar_decode_int2_warp_partials"]),
    ("mosaic", ["oscar_decode_int2_warp_partials", "oscar_decode_int2_ring_merge"]),
    ("fused_mosaic", ["oscar_decode_int2_warp_partials", "oscar_decode_split_merge"]),
])  # fmt: skip
def test_backend_on_long_rows_lowers_the_default_kernel(merge, launches):
    """A record cache of 16K quantized tokens: the backend's default call lowers with the
    warp kernel under every merge (its ring split under "fused" and "fused_mosaic"), and
    the second launch's kind follows the merge."""
    c = _cache(9, 2, [16600, 2900], max_len=16384 + 512, layout="record",
               rotate_values=merge not in ("mosaic", "fused_mosaic"))  # fmt: skip
    fn = jax.jit(lambda q, c: mk.decode_attention_mosaic(q, c, merge=merge))
    text = fn.trace(query(4, 2, 8, D), c).lower(lowering_platforms=("cuda",)).as_text()
    names = ("oscar_decode_int2_warp_partials", "oscar_decode_int2_partials",
             "oscar_decode_int2_ring_merge", "oscar_decode_split_merge")  # fmt: skip
    assert [n for n in names if n in text] == launches
    # the Mosaic merges leave the query's rotation to the warp kernel: no GEMM before it
    assert ("dot_general" in text) == (merge not in ("mosaic", "fused_mosaic"))


def test_auto_merge_puts_the_ring_where_it_costs_no_round():
    """merge="auto": XLA for rotated values; else the ring split in the kernel unless its
    CTAs open a new round of resident CTAs when there are fewer than 3."""
    pick = {(b, n): mk.auto_merge(mk.default_config(n), b, 8, n, False)
            for b, n in ((1, 131072), (8, 32768), (48, 4096), (1, 4096), (2, 131072))}  # fmt: skip
    assert pick == {
        (1, 131072): "fused_mosaic",  # 256 CTAs + 8 ring: 264, one round of 2 x 132
        (8, 32768): "mosaic",  # 256 + 64: a second round
        (48, 4096): "fused_mosaic",  # 768 CTAs, 3 rounds
        (1, 4096): "fused_mosaic",
        (2, 131072): "mosaic",  # 256 + 16
    }
    assert mk.auto_merge(mk.default_config(4096), 1, 8, 4096, True) == "xla"
    # the warp kernel, B x H CTAs filling >= 85% of their rounds of resident slots: one launch
    warp = {b: mk.auto_merge(mk.default_config(4096, rows=b * 8), b, 8, 4096, False)
            for b in (32, 33, 40, 48, 64, 67)}  # fmt: skip
    assert warp == {
        32: "single", 33: "single",  # 256 and 264 CTAs on 2 x 132 slots
        40: "fused_mosaic",  # 320: 61% of 2 rounds of 264, 81% of one of 396
        48: "single",  # 384: 97% of 3 x 132 (128-token blocks)
        64: "single",  # 512: 97% of 2 rounds of 264
        67: "fused_mosaic",  # 536: 68% either way
    }  # fmt: skip
    assert mk.auto_merge(mk.default_config(4096, rows=384), 48, 8, 4096, True) == "xla"


@pytest.mark.parametrize("merge", ["mosaic", "fused_mosaic", "single"])
def test_mosaic_merges_refuse_rotated_values(merge):
    """The second launch merges the splits as they are (no un-rotation of the values)."""
    c = _cache(9, 1, [600], layout="record")  # rotate_values=True
    with pytest.raises(ValueError, match=f"merge='{merge}' needs values stored unrotated"):
        mk.decode_attention_mosaic(query(4, 1, 4, D), c, merge=merge)


def test_default_config_fits_the_stages_in_shared_memory():
    assert [mk.default_config(n).block_tokens for n in (64, 128, 320, 512)] == [64, 128, 64, 256]
    got = {(b, d): mk.default_config(4096, b, d) for b in (2, 4) for d in (64, 128, 256)}
    assert {k: (c.block_tokens, c.max_concurrent_steps) for k, c in got.items()} == {
        (2, 64): (256, 3), (4, 64): (256, 3), (2, 128): (256, 3), (4, 128): (256, 2),
        (2, 256): (128, 3), (4, 256): (128, 2),
    }  # fmt: skip
    for (b, d), c in got.items():  # two programs an SM: their stages within STAGE_BYTES
        rec = record.record_words(b, d) * 4 + 256
        assert c.max_concurrent_steps * rec * c.block_tokens // 64 <= mk.STAGE_BYTES
    # the warp kernel wherever it covers the cache (head_dim <= 128, g <= 8), any length
    kernels = {
        (b, d, g, n): mk.default_config(n, b, d, g).kernel
        for b in (2, 4)
        for d in (64, 128, 256)
        for g in (None, 8, 9)
        for n in (512, 4096, 16384)
    }
    assert {k for k, v in kernels.items() if v == "warp"} == {
        (b, d, g, n) for b in (2, 4) for d in (64, 128) for g in (None, 8)
        for n in (512, 4096, 16384)
    }  # fmt: skip
    # INT2 rows filling 3 CTAs an SM better than 2 (for the one-launch call): 128-token blocks
    got = {(bits, r): mk.default_config(4096, bits, 128, 4, rows=r)
           for bits in (2, 4) for r in (320, 384, 512)}  # fmt: skip
    assert {k: (c.block_tokens, c.ctas_per_sm) for k, c in got.items()} == {
        (2, 320): (256, 2), (2, 384): (128, 3), (2, 512): (256, 2),
        (4, 320): (256, 2), (4, 384): (256, 2), (4, 512): (256, 2),
    }  # fmt: skip


def _mosaic_launches(hlo: str) -> list[str]:
    """The serialized Mosaic module of each Mosaic GPU custom call in lowered text."""
    return hlo.split("custom_call @mosaic_gpu_v2")[1:]


@pytest.mark.usefixtures("lowering_stack")
@pytest.mark.parametrize("merge,kernel,launches", [
    ("fused_mosaic", "warp", 2), ("mosaic", "warp", 2), ("mosaic", "wgmma", 2),
    ("single", "warp", 1), ("xla", "warp", 1),
])  # fmt: skip
def test_pdl_lowers_with_every_launch_marked(merge, kernel, launches):
    """``pdl=True``: every Mosaic launch of the call waits on the one before it in the kernel
    (``griddepcontrol.wait``), which also makes Mosaic launch it with programmatic stream
    serialization (``mosaic_gpu.uses_pdl``), and the partials kernels release the next
    launch (``griddepcontrol.launch_dependents``); the merge launches release nothing. With
    ``pdl=False`` (the default) none of the three is in any launch."""
    c = _cache(3, 2, [600, 130], rotate_values=False, layout="record")
    assert mk.Int2DecodeConfig().pdl is False
    for pdl in (False, True):
        cfg = mk.Int2DecodeConfig(kernel=kernel, block_tokens=64, pdl=pdl)
        fn = jax.jit(functools.partial(mk.decode_attention_mosaic, merge=merge, cfg=cfg))
        hlo = fn.trace(query(3, 2, 8, D), c).lower(lowering_platforms=("cuda",)).as_text()
        mods = _mosaic_launches(hlo)
        assert len(mods) == launches, (merge, kernel, len(mods))
        for mod in mods:
            merging = "_merge" in mod
            assert ("mosaic_gpu.uses_pdl" in mod) == pdl
            assert ("griddepcontrol.wait" in mod) == pdl
            assert ("griddepcontrol.launch_dependents" in mod) == (pdl and not merging)
        assert sum("_merge" in m for m in mods) == launches - 1


@pytest.mark.usefixtures("lowering_stack")
@pytest.mark.parametrize("merge,splits", [("fused_mosaic", None), ("fused_mosaic", 6),
                                          ("mosaic", None)])  # fmt: skip
def test_merge_columns_8_lowers_through_the_backend(merge, splits):
    """``merge_columns=8`` through the backend's call: the split merge after the ring split
    reads 8 columns with its step made even (6 splits + the ring's: 7, read 8 a step; the fixture
    checks every slot's TMA alignment); the merge that walks the ring reads all 16."""
    c = _cache(3, 2, [1900, 130], max_len=2048 + 160, rotate_values=False, layout="record")
    cfg = mk.Int2DecodeConfig(kernel="warp", block_tokens=64, merge_columns=8, splits=splits)
    fn = jax.jit(functools.partial(mk.decode_attention_mosaic, merge=merge, cfg=cfg))
    hlo = fn.trace(query(3, 2, 8, D), c).lower(lowering_platforms=("cuda",)).as_text()
    assert len(_mosaic_launches(hlo)) == 2


def test_pdl_is_validated():
    with pytest.raises(ValueError, match="pdl='yes' must be a bool"):
        mk.Int2DecodeConfig(pdl="yes")


@pytest.mark.usefixtures("lowering_stack")
def test_backend_on_many_short_rows_lowers_the_warp_kernel():
    """48 rows x 8 KV heads x 4K tokens (1.5M token-heads): the default call lowers with the
    warp kernel and, values unrotated and 384 CTAs without splits, as one launch
    (``auto_merge``: "single")."""
    kv = oj.preset("oscar", rotate_values=False).replace(layout="record")

    def make():
        k, v = (jnp.ones((48, 4096, 8, D), jnp.bfloat16),) * 2
        c = oj.init_cache(kv, batch=48, max_len=4096, num_kv_heads=8, head_dim=D)
        return oj.prefill(c, k, v, jnp.full((48,), 4000, jnp.int32))

    c = jax.eval_shape(make)  # shapes only: nothing is quantized on the CPU
    fn = jax.jit(lambda q, c: mk.decode_attention_mosaic(q, c))
    text = fn.trace(query(5, 48, 32, D), c).lower(lowering_platforms=("cuda",)).as_text()
    launches = ("oscar_decode_int2_warp_single", "oscar_decode_int2_warp_partials",
                "oscar_decode_split_merge", "oscar_decode_int2_ring_merge")  # fmt: skip
    assert [n for n in launches if n in text] == ["oscar_decode_int2_warp_single"]


@pytest.mark.usefixtures("lowering_stack")
def test_shard_partial_lowers_for_sm90():
    """The "mosaic" quantized_partial (sequence shards) on a record cache, at an offset."""
    c = _cache(4, 2, [400, 90], layout="record", max_len=640)
    q_rot = jax.ShapeDtypeStruct((2, 2, 4, D), jnp.float32)
    cfg = mk.default_config(64)
    fn = jax.jit(lambda q, c: mk.quantized_partial_mosaic(q, c, 0.1, offset=64, cfg=cfg))
    fn.trace(q_rot, c).lower(lowering_platforms=("cuda",))


def _qdtype(param_dtype):
    """Queries (and so outputs) in float32 for float16 parameters: a bfloat16 output's own
    rounding (2^-9 relative) would exceed float16's bound and hide the kernel's error."""
    return jnp.float32 if param_dtype == "float16" else jnp.bfloat16


class TestMosaicGPU:
    """The compiled kernel against the XLA reference (H200; skipped without a GPU)."""

    @pytest.fixture(autouse=True)
    def _gpu(self):
        if not oj.gpu_available() or _lowering_stack() is not None:
            pytest.skip("the Mosaic GPU kernel needs a Hopper GPU and jax >= 0.11.2")

    @pytest.mark.parametrize(
        "lengths,g,param_dtype,knobs",
        [
            ([4000], 4, "float16", dict(block_tokens=256)),
            ([2080, 0, 150], 4, "bfloat16", dict(block_tokens=256)),  # empty row, all-ring row
            ([1100, 2047], 7, "float16", dict(block_tokens=128)),
            ([990, 481], 3, "float16", dict(block_tokens=64)),
            ([1600, 700], 1, "float16", dict(block_tokens=256)),
            ([3000, 1234], 4, "float16", dict(unpack="lop")),
            ([2900, 77], 6, "bfloat16", dict(unpack="lop", block_tokens=128)),
            ([3000, 1234], 4, "float16", dict(overlap_keys=True)),
            ([2500, 900], 7, "bfloat16", dict(overlap_keys=True, unpack="lop")),
            ([3100, 0, 640], 4, "float16", dict(unpack="lop3", block_tokens=128)),
            ([2222, 1000], 3, "bfloat16", dict(unpack="lop3", overlap_keys=True)),
            ([2048, 333], 8, "float16", dict(unpack="lop3", overlap_keys=True, block_tokens=64)),
            # INT4 records (the "bits" entry picks the cache's code width)
            ([4000, 0, 150], 4, "float16", dict(bits=4)),
            ([2080, 1111], 7, "bfloat16", dict(bits=4, block_tokens=128)),
            ([990, 481], 3, "float16", dict(bits=4, block_tokens=64)),
            ([1600, 700], 1, "bfloat16", dict(bits=4, max_concurrent_steps=2)),
            ([2900, 77], 6, "float16", dict(bits=4, unpack="shift", block_tokens=128)),
            ([2048, 333], 8, "bfloat16", dict(bits=4, unpack="lop")),
            # head_dim 64 (SmolLM2 g = 3, Qwen2.5 g = 7) and 256 (Gemma 3 g = 4)
            ([4000, 0, 150], 3, "float16", dict(d=64)),
            ([2080, 1111], 7, "bfloat16", dict(d=64, block_tokens=128)),
            ([990, 481], 4, "float16", dict(d=64, bits=4, block_tokens=64)),
            ([2900, 77], 6, "bfloat16", dict(d=64, bits=4)),
            ([4000, 0, 150], 4, "float16", dict(d=256, block_tokens=128)),
            ([1100, 2047], 1, "bfloat16", dict(d=256, block_tokens=64)),
            (
                [2222, 1000],
                4,
                "bfloat16",
                dict(d=256, bits=4, block_tokens=128, max_concurrent_steps=2),
            ),
            ([990, 481], 8, "float16", dict(d=256, bits=4, block_tokens=64)),
        ],
    )
    def test_matches_xla(self, lengths, g, param_dtype, knobs):
        self._check(lengths, g, param_dtype, knobs)

    @pytest.mark.parametrize(
        "lengths,g,param_dtype,knobs",
        [
            ([4000, 0, 150], 4, "float16", dict()),
            ([2080, 1111], 7, "bfloat16", dict(block_tokens=128)),
            ([990, 481], 3, "float16", dict(block_tokens=64)),
            ([1600, 700, 33], 1, "bfloat16", dict(max_concurrent_steps=2)),
            ([2048, 333], 8, "float16", dict(block_tokens=128)),
            ([4000, 0, 150], 3, "bfloat16", dict(d=64)),
            ([2900, 77], 7, "float16", dict(d=64, block_tokens=128)),
            ([4000, 0, 150], 4, "float16", dict(d=256, block_tokens=128)),
            ([1100, 2047], 2, "bfloat16", dict(d=256, block_tokens=64)),
            ([4000, 0, 150], 4, "float16", dict(bits=4, block_tokens=128)),
            ([2080, 1111], 7, "bfloat16", dict(bits=4)),
            ([990, 481], 3, "float16", dict(bits=4, d=64, block_tokens=64)),
            ([1100, 2047], 8, "bfloat16", dict(bits=4, d=256, block_tokens=64)),
        ],
    )
    @pytest.mark.parametrize("fold", ["none", "kv"])
    def test_warp_kernel_matches_xla(self, lengths, g, param_dtype, knobs, fold):
        """The warp-level kernel (mma.sync, each warp its own tokens of every record), with
        the codes dequantized in registers and with the scales folded into Q and P (float16
        parameters only: bfloat16 is refused by name)."""
        if fold != "none" and param_dtype == "bfloat16":
            with pytest.raises(ValueError, match="fold='kv' takes float16"):
                self._check(lengths, g, param_dtype, dict(knobs, kernel="warp", fold=fold))
            return
        self._check(lengths, g, param_dtype, dict(knobs, kernel="warp", fold=fold))

    def test_profiled_warp_kernel_traces_its_phases(self, tmp_path):
        """``profile_dir``: the same partials, and a trace of every CTA with one step region a
        block it walked (Mosaic's profiler, written on the host after the call)."""
        from benchmarks import mosaic_timeline as tl

        lengths, g, d = [3000, 700], 4, D
        c = _cache(9, 2, lengths, param_dtype="float16", max_len=4096 + 160, d=d)
        qr = jax.random.normal(jax.random.PRNGKey(3), (2, 2, g, d), jnp.float32)
        cfg = mk.Int2DecodeConfig(kernel="warp", block_tokens=256)
        rec, kn, nq, _ = mk.kernel_inputs(c, block_tokens=cfg.block_tokens)
        plain = jax.jit(lambda q: mk.int2_decode_partials(q, rec, kn, nq, cfg=cfg))(qr)
        traced = jax.jit(
            lambda q: mk.int2_decode_partials(
                q, rec, kn, nq, cfg=dataclasses.replace(cfg, profile_dir=str(tmp_path))
            )
        )(qr)
        jax.effects_barrier()
        chex.assert_trees_all_close(traced, plain, atol=1e-5, rtol=1e-5)
        (path,) = tmp_path.glob("*trace.json")
        ctas = tl.read_trace(str(path))
        bps, s = cfg.split_plan(2, 2, rec.shape[2] * 64)
        assert len(ctas) == 2 * 2 * s
        steps = sorted(sum(p[0] == "step" for p in c["phases"]) for c in ctas)
        want = sorted(int(np.clip(-(-(n - si * bps * 256) // 256), 0, bps))
                      for n in np.asarray(nq) for _ in range(2) for si in range(s))  # fmt: skip
        assert steps == want
        summary = tl.summarise(ctas, 1.98)
        assert summary["ctas"] == len(ctas) and summary["span_us"] > 0

    def _check(self, lengths, g, param_dtype, knobs):
        knobs = dict(knobs)
        bits, d = knobs.pop("bits", 2), knobs.pop("d", D)
        c = _cache(sum(lengths), len(lengths), lengths, param_dtype=param_dtype,
                   max_len=4096 + 160, bits=bits, d=d)  # fmt: skip
        q = query(len(lengths), len(lengths), 2 * g, d, _qdtype(param_dtype))
        cfg = mk.Int2DecodeConfig(**knobs)
        got = jax.jit(lambda q, c: mk.decode_attention_mosaic(q, c, cfg=cfg, convert=True))(q, c)
        want = oj.decode_attention(q, c, implementation="xla")
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        assert err <= tol(param_dtype)["max_rel"] * float(jnp.max(jnp.abs(want))), err

    @pytest.mark.parametrize("g,param_dtype,d,merge", [
        (4, "float16", 128, "auto"), (7, "bfloat16", 64, "mosaic"), (3, "float16", 128, "fused"),
        (8, "bfloat16", 128, "fused_mosaic"),
    ])  # fmt: skip
    def test_default_config_on_long_rows_matches_xla(self, g, param_dtype, d, merge):
        """A record cache of 16K quantized tokens: the backend's default (the warp kernel,
        with its ring split under "fused" / "fused_mosaic") against XLA."""
        lengths = [16600, 2900, 0]
        c = _cache(9, 3, lengths, param_dtype=param_dtype, max_len=16384 + 512,
                   d=d, layout="record",
                   rotate_values=merge not in ("mosaic", "fused_mosaic"))  # fmt: skip
        assert mk.default_config(c.quant_capacity, 2, d, g).kernel == "warp"
        q = query(4, 3, 2 * g, d, _qdtype(param_dtype))
        got = jax.jit(lambda q, c: mk.decode_attention_mosaic(q, c, merge=merge))(q, c)
        want = oj.decode_attention(q, c, implementation="xla")
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        assert err <= tol(param_dtype)["max_rel"] * float(jnp.max(jnp.abs(want))), err

    @pytest.mark.parametrize(
        "lengths,g,param_dtype,knobs",
        [
            ([3000, 0, 150], 4, "float16", dict()),
            ([2000, 1999], 7, "bfloat16", dict(unpack="lop", block_tokens=128)),
            ([3900, 0, 161], 4, "float16", dict(merge_step=4, unpack="lop3")),
            ([1500, 2500], 6, "bfloat16", dict(merge_step=8, block_tokens=64, unpack="lop3")),
            ([3000, 0, 150], 4, "bfloat16", dict(bits=4)),
            ([2000, 1999], 7, "float16", dict(bits=4, block_tokens=128)),
            ([3000, 0, 150], 3, "bfloat16", dict(d=64)),
            ([2000, 1999], 7, "float16", dict(d=64, bits=4, merge_step=4)),
            ([3900, 0, 161], 4, "float16", dict(d=256, block_tokens=128)),
            (
                [1500, 2500],
                2,
                "bfloat16",
                dict(d=256, bits=4, block_tokens=128, max_concurrent_steps=2),
            ),
        ],
    )
    def test_two_launches_match_xla(self, lengths, g, param_dtype, knobs):
        """The ring and the LSE merge in the second Mosaic launch (values unrotated)."""
        knobs = dict(knobs)
        bits, d = knobs.pop("bits", 2), knobs.pop("d", D)
        c = _cache(sum(lengths) + 1, len(lengths), lengths, param_dtype=param_dtype,
                   max_len=4096 + 160, rotate_values=False, bits=bits, d=d)  # fmt: skip
        q = query(len(lengths) + 1, len(lengths), 2 * g, d, _qdtype(param_dtype))
        cfg = mk.Int2DecodeConfig(**knobs)
        got = jax.jit(
            lambda q, c: mk.decode_attention_mosaic(q, c, cfg=cfg, merge="mosaic", convert=True)
        )(q, c)
        want = oj.decode_attention(q, c, implementation="xla")
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        assert err <= tol(param_dtype)["max_rel"] * float(jnp.max(jnp.abs(want))), err

    @pytest.mark.parametrize(
        "lengths,g,param_dtype,kw",
        [
            ([3000, 0, 150], 4, "float16", dict()),  # values rotated, an empty row
            ([2000, 1999], 7, "bfloat16", dict(rotate_values=False, block_tokens=128)),
            ([990, 481], 3, "float16", dict(d=64)),
            ([3100, 33], 8, "bfloat16", dict(d=256, bits=4, rotate_values=False)),
            ([2900, 0, 77], 6, "float16", dict(bits=4, d=64, block_tokens=64)),
            # the warp kernel's ring split (a wgmma walk in one of its CTAs); XLA or Mosaic merge
            ([3000, 0, 150], 4, "float16", dict(kernel="warp")),
            ([2000, 1999], 7, "bfloat16", dict(kernel="warp", block_tokens=128, bits=4)),
            ([990, 481], 8, "float16", dict(kernel="warp", d=64, rotate_values=False, merge=FM)),
            (
                [3100, 0, 33],
                3,
                "bfloat16",
                dict(kernel="warp", rotate_values=False, bits=4, merge=FM),
            ),
            ([2900, 77], 1, "float16", dict(rotate_values=False, merge=FM)),
            # one launch: the ring walked after the records by the same CTA (rows of 0 and 33)
            ([990, 481], 8, "float16", dict(kernel="warp", d=64, rotate_values=False, merge=SG)),
            (
                [3100, 0, 33],
                3,
                "bfloat16",
                dict(kernel="warp", rotate_values=False, bits=4, merge=SG),
            ),  # fmt: skip
            (
                [2000, 1999],
                7,
                "float16",
                dict(kernel="warp", block_tokens=128, rotate_values=False, merge=SG),
            ),  # fmt: skip
            # the warp kernel rotating the query itself (signed Hadamard), or not (GEMM)
            (
                [3000, 0, 150],
                4,
                "float16",
                dict(kernel="warp", rotate_values=False, rotation="randomized_hadamard", merge=FM),
            ),
            (
                [990, 481],
                3,
                "bfloat16",
                dict(
                    kernel="warp",
                    d=64,
                    rotate_values=False,
                    rotation="randomized_hadamard",
                    merge="mosaic",
                ),  # fmt: skip
            ),
            (
                [2000, 1999],
                7,
                "bfloat16",
                dict(kernel="warp", rotate_values=False, rotation="random_orthogonal", merge=FM),
            ),
        ],
    )
    def test_fused_ring_split_matches_xla(self, lengths, g, param_dtype, kw):
        """merge="fused" / "fused_mosaic": the ring walked by one more split of the partials
        kernel, the splits merged in XLA / by the second launch."""
        kw = dict(kw)
        merge = kw.pop("merge", "fused")
        knobs = {k: kw.pop(k) for k in ("block_tokens", "kernel") if k in kw}
        d = kw.get("d", D)
        c = _cache(sum(lengths) + 3, len(lengths), lengths, param_dtype=param_dtype,
                   max_len=4096 + 160, **kw)  # fmt: skip
        q = query(len(lengths) + 3, len(lengths), 2 * g, d, _qdtype(param_dtype))
        cfg = mk.Int2DecodeConfig(**knobs) if knobs else None
        got = jax.jit(lambda q, c: mk.decode_attention_mosaic(q, c, cfg=cfg, merge=merge,
                                                              convert=True))(q, c)  # fmt: skip
        want = oj.decode_attention(q, c, implementation="xla")
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        assert err <= tol(param_dtype)["max_rel"] * float(jnp.max(jnp.abs(want))), err

    @pytest.mark.parametrize("merge,kernel,lengths,knobs", [
        ("fused_mosaic", "warp", [70000, 0, 333], dict(pdl=True)),
        ("mosaic", "warp", [9000, 150, 40000], dict(pdl=True)),
        ("mosaic", "wgmma", [30000, 2500], dict(pdl=True)),
        ("single", "warp", [5000] * 40, dict(pdl=True)),
        ("xla", "warp", [65000, 3], dict(pdl=True)),
        ("fused_mosaic", "warp", [70000, 0, 333], dict(merge_columns=8)),
        ("fused_mosaic", "warp", [20000, 4000, 64], dict(merge_columns=8, pdl=True)),
        ("mosaic", "warp", [9000, 150], dict(merge_columns=8)),  # the ring's merge: 16 read
    ])  # fmt: skip
    def test_launch_knobs_change_no_bit(self, merge, kernel, lengths, knobs):
        """``pdl=True`` and ``merge_columns=8`` compiled: four calls chained in one program,
        each one's query the previous one's output scaled by an XLA op, so every partials
        launch reads what the launch (or fusion) just before it wrote and a PDL wait in the
        wrong place would read stale data; equal bit for bit to the call without the knobs
        (the 8-column merge: within tolerance, its step may differ), whose first call is the
        reference's."""
        b = len(lengths)
        c = _cache(13, b, lengths, max_len=max(lengths) + 512, rotate_values=False,
                   layout="record")  # fmt: skip
        q0 = query(14, b, 8, D, jnp.bfloat16)
        base = dataclasses.replace(
            mk.default_config(c.quant_capacity, 2, D, 4, rows=b * c.num_kv_heads), kernel=kernel
        )

        def chain(cfg):
            def run(q, c):
                outs = []
                for _ in range(4):
                    q = mk.decode_attention_mosaic(q, c, cfg=cfg, merge=merge) * 3.0
                    outs.append(q)
                return jnp.stack(outs)

            return np.asarray(jax.jit(run)(q0, c).astype(jnp.float32))

        got, want = chain(dataclasses.replace(base, **knobs)), chain(base)
        if "merge_columns" in knobs and merge == "fused_mosaic":
            # its step made even (7 splits a step -> 8) regroups the online max's updates:
            # float32 rounding, then bfloat16's, may differ, so within the dtype's tolerance
            err = float(np.max(np.abs(got - want)))
            assert err <= tol("bfloat16")["max_rel"] * float(np.max(np.abs(want))), err
        else:
            np.testing.assert_array_equal(got, want)
        ref = oj.decode_attention(q0, c, implementation="xla").astype(jnp.float32) * 3.0
        err = float(jnp.max(jnp.abs(want[0] - ref)))
        assert err <= tol("bfloat16")["max_rel"] * float(jnp.max(jnp.abs(ref))), err

    @pytest.mark.parametrize("merge,knobs", [
        ("fused_mosaic", dict(kernel="warp")), ("mosaic", dict()),
        ("fused_mosaic", dict(kernel="warp", bits=4, d=64)), ("single", dict(kernel="warp")),
        ("single", dict(kernel="warp", bits=4, d=64)),
    ])  # fmt: skip
    def test_second_launch_writes_the_final_output(self, merge, knobs):
        """The merge launch writes [B, Hq, D] in the query's dtype itself: the heads past g
        not stored, the other rows as the XLA reference, a row with FLAG_NONFINITE all NaN
        (the kernel's poisoning, not ``poison_flagged_rows``) and only that row."""
        knobs = dict(knobs)
        bits, d, g = knobs.pop("bits", 2), knobs.pop("d", D), 3
        lengths = [3000, 2222, 0, 1500]
        c = _cache(11, 4, lengths, max_len=4096 + 160, rotate_values=False, bits=bits, d=d)
        c = dataclasses.replace(c, flags=c.flags.at[1].set(oj.FLAG_NONFINITE))
        q = query(12, 4, 2 * g, d, jnp.bfloat16)
        cfg = mk.Int2DecodeConfig(**knobs)
        got = jax.jit(lambda q, c: mk.decode_attention_mosaic(q, c, cfg=cfg, merge=merge,
                                                              convert=True))(q, c)  # fmt: skip
        assert got.shape == q.shape and got.dtype == q.dtype
        assert np.all(np.isnan(np.asarray(got[1], np.float32)))
        keep = np.array([0, 2, 3])
        want = oj.decode_attention(q, c, implementation="xla").astype(jnp.float32)[keep]
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32)[keep] - want)))
        assert err <= tol("bfloat16")["max_rel"] * float(jnp.max(jnp.abs(want))), err

    @pytest.mark.parametrize(
        "b,merge,knobs",
        [
            (48, "fused", dict()),
            (16, "fused", dict(splits=1, d=64)),
            (48, "xla", dict()),
            (48, "mosaic", dict()),
            (48, "mosaic", dict(merge_step=1)),
            (16, "xla", dict(splits=1)),
            (16, "mosaic", dict(splits=1)),
            (40, "xla", dict(splits=1)),
            (48, "xla", dict(bits=4)),
            (24, "mosaic", dict(bits=4, block_tokens=128)),
            (48, "mosaic", dict(d=64)),
            (24, "xla", dict(d=256, block_tokens=128)),
            (48, "xla", dict(kernel="warp", block_tokens=128)),
            (48, "mosaic", dict(kernel="warp", block_tokens=128)),
            (48, "fused_mosaic", dict(kernel="warp", block_tokens=128)),
            (48, "fused", dict(kernel="warp")),
            (16, "fused_mosaic", dict(kernel="warp", splits=1)),
            (24, "fused_mosaic", dict(kernel="warp", bits=4, block_tokens=128)),
            (48, "single", dict(kernel="warp")),
            (48, "single", dict(kernel="warp", block_tokens=128)),
            (24, "single", dict(kernel="warp", bits=4, d=64)),
        ],
    )
    def test_many_rows_match_xla(self, b, merge, knobs):
        """16-48 rows x 8 KV heads (hundreds of CTAs a launch, several an SM), ragged: the
        second launch gave wrong rows there on the H200 (relative error 0.2-165) while the
        one- to eight-row cases above were right."""
        knobs = dict(knobs)
        bits, d = knobs.pop("bits", 2), knobs.pop("d", D)
        lengths = [int(x) for x in np.random.default_rng(b).integers(900, 4000, b)]
        c = _cache(b + 7, b, lengths, h=8, max_len=4096, rotate_values=False, bits=bits, d=d)
        q = query(b + 8, b, 32, d, jnp.float16)
        cfg = mk.Int2DecodeConfig(**knobs)
        fn = jax.jit(lambda q, c: mk.decode_attention_mosaic(q, c, cfg=cfg, merge=merge,
                                                             convert=True))  # fmt: skip
        want = oj.decode_attention(q, c, implementation="xla").astype(jnp.float32)
        bound = tol("float16")["max_rel"] * float(jnp.max(jnp.abs(want)))
        for run in range(3):  # a race shows as a run that differs
            got = fn(q, c).astype(jnp.float32)
            row_err = np.asarray(jnp.max(jnp.abs(got - want), axis=(1, 2)))  # [B]
            bad = np.flatnonzero(row_err > bound)
            assert not len(bad), (  # which rows, how long, how wrong: a race or a ring bug
                f"run {run}: rows {bad.tolist()} of lengths {[lengths[i] for i in bad]} "
                f"err {row_err[bad].tolist()} > {bound}"
            )

    @pytest.mark.parametrize(
        "lengths,g,param_dtype,kw",
        [
            ([4000, 0, 150], 4, "float16", dict()),  # values rotated (XLA merge)
            ([2080, 1999], 7, "bfloat16", dict(rotate_values=False)),  # values unrotated
            ([3100, 640, 33], 3, "float16", dict(rotate_values=False, norm_granularity=PT)),
            ([1234, 2900], 8, "bfloat16", dict(norm_granularity=PT)),
            ([4000, 0, 150], 4, "bfloat16", dict(bits=4)),
            ([2080, 1999], 7, "float16", dict(bits=4, rotate_values=False, norm_granularity=PT)),
            ([3100, 640, 33], 3, "bfloat16", dict(d=64, norm_granularity=PT)),
            ([2080, 0, 1999], 7, "float16", dict(d=64, bits=4, rotate_values=False)),
            ([1234, 2900], 4, "bfloat16", dict(d=256)),
            ([4000, 150], 4, "float16", dict(d=256, bits=4, rotate_values=False)),
        ],
    )
    @pytest.mark.parametrize("kernel", ["default", "wgmma", "prep"])
    def test_backend_on_a_record_cache_matches_xla(self, lengths, g, param_dtype, kw, kernel):
        """``decode_attention(implementation="mosaic")`` on a layout='record' cache written by
        prefill and 40 decode steps (flushed groups, rows ending mid-record) vs XLA; "wgmma":
        the default config with the wgmma kernel (the default's kernel at head_dim 256);
        "prep": the warp kernel with the default ``prep="kernel"`` (the kernels computing nq
        from the lengths and the kernel that walks the ring making its query) under the
        ring split, the one launch and the merge launch's ring walk (after the warp and the
        wgmma kernel), with every merge step in flight; then ``prep="xla"`` (both made by
        XLA fusions) under the ring split and the merge launch."""
        b, h, d = len(lengths), 2, kw.get("d", D)
        if kernel == "prep" and (kw.get("rotate_values", True) or d > 128):
            pytest.skip("values stored rotated (the XLA merge) or head_dim 256 (the wgmma "
                        "kernel): no warp kernel walks the ring")  # fmt: skip
        c = _cache(sum(lengths) + 2, b, lengths, param_dtype=param_dtype, max_len=4096 + 160,
                   layout="record", **kw)  # fmt: skip
        step = jax.jit(oj.append)
        for i in range(40):
            k, v = kv_with_sinks(500 + i, b, 1, h, d, jnp.bfloat16, sinks=())
            c = step(c, k[:, 0], v[:, 0])
        q = query(len(lengths) + 2, b, h * g, d, _qdtype(param_dtype))
        if kernel == "default":
            call = functools.partial(oj.decode_attention, implementation="mosaic")
        elif kernel == "prep":
            cfg = mk.default_config(c.quant_capacity, kw.get("bits", 2), d, g, rows=b * h)
            cfg = dataclasses.replace(cfg, kernel="warp", prep="kernel", merge_stages=5)
            want = oj.decode_attention(q, c, implementation="xla")
            xla_prep = dataclasses.replace(cfg, prep="xla")
            wgmma = dataclasses.replace(cfg, kernel="wgmma")
            for merge, cf in [("fused_mosaic", cfg), ("single", cfg), ("mosaic", cfg),
                              ("mosaic", wgmma), ("fused_mosaic", xla_prep),
                              ("mosaic", xla_prep)]:  # fmt: skip
                got = jax.jit(functools.partial(mk.decode_attention_mosaic, cfg=cf,
                                                merge=merge))(q, c)  # fmt: skip
                err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
                assert err <= tol(param_dtype)["max_rel"] * float(jnp.max(jnp.abs(want))), (
                    merge,
                    cf.prep,
                    err,
                )
            return
        else:
            cfg = mk.default_config(c.quant_capacity, kw.get("bits", 2), d, g, rows=b * h)
            cfg = dataclasses.replace(cfg, kernel=kernel)
            call = functools.partial(mk.decode_attention_mosaic, cfg=cfg)
        got = jax.jit(call)(q, c)
        want = oj.decode_attention(q, c, implementation="xla")  # = the planar cache's
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        assert err <= tol(param_dtype)["max_rel"] * float(jnp.max(jnp.abs(want))), err


class TestShardPartialOnGPU:
    """The "mosaic" quantized_partial against the XLA one (H200; skipped elsewhere)."""

    @pytest.fixture(autouse=True)
    def _gpu(self):
        if not oj.gpu_available() or _lowering_stack() is not None:
            pytest.skip("needs a Hopper GPU and jax >= 0.11.2")

    @pytest.mark.parametrize("offset,g,d", [(0, 4, 128), (128, 7, 128), (4096, 3, 128),
                                            (64, 3, 64), (128, 2, 256)])  # fmt: skip
    def test_matches_xla(self, offset, g, d):
        c = _cache(6, 3, [1900, 0, 700], layout="record", max_len=2048 + 128 + 64, d=d)
        q_rot = jax.random.normal(jax.random.key(2), (3, 2, g, d), jnp.float32)
        got = jax.jit(lambda q, c: mk.quantized_partial_mosaic(q, c, 0.09, offset=offset))(q_rot, c)
        want = jax.jit(lambda q, c: att.quantized_partial(q, c, 0.09, offset=offset))(q_rot, c)
        # What the merge across shards uses: the shard's normalised output and its
        # log-sum-exp (natural-log units). The unnormalised (acc, l) themselves are relative
        # to the max of scores from a float16-rounded query, so they differ by a common
        # factor. A shard with no token of a row: m -inf, l 0, acc 0 exactly.
        acc, m, den = (np.asarray(x, np.float64) for x in got)
        acc_w, m_w, l_w = (np.asarray(x, np.float64) for x in want)
        empty = l_w == 0
        np.testing.assert_array_equal(den == 0, empty)
        assert np.all(np.isneginf(m[empty])) and np.all(acc[empty] == 0)
        t = tol("float16")["max_rel"]
        ok = ~empty
        if not ok.any():
            return
        out, out_w = acc[ok] / den[ok, None], acc_w[ok] / l_w[ok, None]
        err = np.max(np.abs(out - out_w)) / np.max(np.abs(out_w))
        lse, lse_w = m[ok] + np.log(den[ok]), m_w[ok] + np.log(l_w[ok])
        lerr = np.max(np.abs(lse - lse_w))
        assert err <= t, f"normalised output: max rel error {err:.2e} > {t}"
        bound = t * max(1.0, np.max(np.abs(lse_w)))
        assert lerr <= bound, f"log-sum-exp: max error {lerr:.2e} > {bound:.2e}"

    def test_sequence_sharded_backend_matches_xla(self):
        mesh = jax.make_mesh((1, 1, 1), ("data", "model", "sequence"))
        c = _cache(7, 2, [1500, 333], layout="record", rotate_values=False, max_len=2048 + 128)
        q = query(7, 2, 8, D, jnp.float32)
        got = osh.sharded_decode_attention(q, c, mesh, implementation="mosaic")
        want = osh.sharded_decode_attention(q, c, mesh, implementation="xla")
        atol = tol("float16")["max_rel"] * float(jnp.max(jnp.abs(want)))
        chex.assert_trees_all_close(got, want, atol=atol)


class TestAutoOnGPU:
    """implementation="auto" on the H200 (skipped elsewhere): Mosaic for a record cache,
    Triton for a planar one, each equal to naming the backend."""

    @pytest.fixture(autouse=True)
    def _gpu(self):
        if not oj.gpu_available() or _lowering_stack() is not None:
            pytest.skip("needs a Hopper GPU and jax >= 0.11.2")

    def test_auto_picks_the_kernels(self):
        planar = _cache(5, 2, [1500, 333], rotate_values=False, max_len=2048 + 128)
        record = oj.convert_layout(planar, "record")
        q = query(5, 2, 8, D, jnp.float32)
        assert oj.backends.choose("decode_attention", record, 4)[0] == "mosaic"
        assert oj.backends.choose("decode_attention", planar, 4)[0] == "triton"
        for c, name in ((record, "mosaic"), (planar, "triton")):
            got = jax.jit(lambda q, c: oj.decode_attention(q, c))(q, c)
            want = jax.jit(lambda q, c, n=name: oj.decode_attention(q, c, implementation=n))(q, c)
            chex.assert_trees_all_equal(got, want)
