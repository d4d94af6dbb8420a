"""The "record" layout of the INT2 / INT4 quantized cache, which the Mosaic GPU kernel reads.

A cache made with ``KVQuantConfig(layout="record")`` holds its quantized part as one record
per 64 tokens per (row, KV head) -- 1600 uint32 words at INT2, 2560 at INT4
(``record_words``) -- plus a float32 norm per token and head, instead of the planar code /
parameter arrays (``oscar_jax.cache``). The records are an exact permutation of the planar
arrays (``fragment_layout`` and its inverse ``fragment_layout_inverse``, bit for bit), fixed
at quantize time so that each thread of the kernel's warpgroup loads exactly the words of
its wgmma register fragments (``pallas_kernels.decode.mosaic``). Covered: INT2 and INT4,
head_dim 128, G = 32 (key token groups and value channel groups), float16 / bfloat16
parameters (``KVQuantConfig.record_reason``).

Record layout of one 64-token tile (uint32 words; "tid" is the thread of the warpgroup,
w = tid // 32 its warp, l = tid % 32 its lane, j = l % 4; b the bits, P = 16 / b the
f16x2 fragment registers a code word fills (8 at INT2, 4 at INT4); a thread's f-th code
word of a tensor sits at ``code_word(f, tid)`` = 512 (f // 4) + 4 tid + f % 4 from the
tensor's first code word, so that each thread loads its words 16 bytes at a time and a
warp's loads are conflict-free):
  K codes [0, 256 b): register r = 2 cb + rh of the [64 tok, 128 ch] A fragment (cb in
                0..15, rh in 0..1) is in word f = r // P, plane p = r % P: bits
                b (p + P e) hold the code of token 16 w + l // 4 + 8 rh, channel
                8 cb + 2 j + e (e in 0..1: the low / high 16-bit half)
  V codes [256 b, 512 b): register r = 2 cb + rh of channel half mt's [64 ch, 64 tok] V^T
                fragment (cb in 0..7) is in word f = (16 mt + r) // P, plane r % P: the
                code of channel 64 mt + 16 w + l // 4 + 8 rh, token 8 cb + 2 j + e
  (INT2: K word 4 tid + cb // 4, V word 512 + 4 tid + 2 mt + cb // 4, p = 2 (cb % 4) + rh.)
  K params [512 b, + 256), 16-bit values two to a word (position 2i in the low half of
                word i, 2i + 1 in the high half): [group g in 0..1][scale, zero][128
                positions], channel 8 cb + 2 j + e of token group 2 n + g at position
                32 j + 2 cb + e, i.e. word 16 j + cb (+ 128 g + 64 sz), half e
  V params [512 b + 256, + 256), same packing: [chunk c in 0..1 (32 tokens)][scale, zero]
                [value group 0..3][32 positions], token 32 c + 16 kk + 2 j + (0, 1, 8, 9)[e']
                at position 8 j + 4 kk + e', i.e. token 8 cb + 2 j + e of group grp at word
                64 (2 (cb // 4) + sz) + 16 grp + 4 j + cb % 4, half e
  INT2: [1536, 1600) zero (pad: 1600 = 25 x 64 words, the TMA box is <= 256 per
                dimension); INT4: 2560 = 40 x 64 words, no pad.
Norms: kn [B, H, Lp] float32 (token norm, 0 past Lq). nq [B] int32: the quantized tokens of
each row (any 0 <= nq <= Lp; tokens >= nq are masked).

A flushed group of G = 32 tokens fills one half of a record: the code words of warps 0-1
(K) or of the tokens' column blocks (V), one key group's params, one value chunk's
(``half_words``); ``group_words`` builds them. ``RECORD_VERSION`` names these permutations
in saved files (``oscar_jax.persistence``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from oscar_jax import quant

D = 128  # head_dim covered
G = 32  # group size (key tokens per group, value channel groups)
TILE = 64  # tokens per wgmma M tile = tokens per record
BITS = (2, 4)  # code widths the layout holds
RECORD_VERSION = 1  # bump when a permutation changes (saved files name it)


def record_words(bits: int = 2) -> int:
    """uint32 words per record: 1600 for INT2 (25 x 64, the last 64 a pad), 2560 for INT4
    (40 x 64)."""
    return {2: 1600, 4: 2560}[bits]


def offsets(bits: int = 2) -> tuple[int, int, int, int]:
    """Word offsets of (K codes, V codes, K params, V params) in a record of ``bits``."""
    vc = 256 * bits  # 512 code words a tensor at INT2, 1024 at INT4
    return 0, vc, 2 * vc, 2 * vc + 256


def bits_of(last_dim: int, what: str = "record") -> int:
    """The code width of a record array from its last dimension (words a record)."""
    for b in BITS:
        if record_words(b) == last_dim:
            return b
    raise ValueError(f"{what} last dimension {last_dim} must be one of "
                     f"{[record_words(b) for b in BITS]} (INT2, INT4 records)")  # fmt: skip


WORDS = record_words(2)  # the INT2 record's
OFFSETS = offsets(2)


def pairs_per_word(bits: int) -> int:
    """f16x2 fragment registers one code word fills: 8 at INT2, 4 at INT4."""
    return 16 // bits


def code_word(f: int, tid):
    """Word (relative to its tensor's codes) of thread ``tid``'s f-th code word: groups of
    four words a thread (one 16-byte load), the group k of all 128 threads contiguous (512
    words), so a warp's loads are conflict-free."""
    return 512 * (f // 4) + 4 * tid + f % 4


@functools.cache
def _code_tables(bits: int = 2):
    """For every (word, bit slot) of a record's code words: the (token, channel) of its K
    code (the first 256 bits words) and of its V code (the next 256 bits). Returns int arrays
    [256 bits, 32 / bits] of token and channel for K and V (slot s = the s-th ``bits``-wide
    field, s = p + (16 / bits) e: plane p of 16-bit half e)."""
    ppw = pairs_per_word(bits)
    nw, slots = 256 * bits, 32 // bits
    kt, kc = np.zeros((nw, slots), np.int64), np.zeros((nw, slots), np.int64)
    vt, vch = np.zeros((nw, slots), np.int64), np.zeros((nw, slots), np.int64)
    for tid in range(128):
        w, lane = divmod(tid, 32)
        j = lane % 4
        for cb in range(16):  # K: register r = 2 cb + rh of the [64 tok, 128 ch] A fragment
            for rh in range(2):
                r = 2 * cb + rh
                word = code_word(r // ppw, tid)
                for e in range(2):
                    slot = r % ppw + ppw * e
                    kt[word, slot] = 16 * w + lane // 4 + 8 * rh
                    kc[word, slot] = 8 * cb + 2 * j + e
        for mt in range(2):  # V^T: channel half mt, register r = 2 cb + rh of [64 ch, 64 tok]
            for cb in range(8):
                for rh in range(2):
                    r = 2 * cb + rh
                    word = code_word((16 * mt + r) // ppw, tid)
                    for e in range(2):
                        slot = r % ppw + ppw * e
                        vch[word, slot] = 64 * mt + 16 * w + lane // 4 + 8 * rh
                        vt[word, slot] = 8 * cb + 2 * j + e
    return kt, kc, vt, vch


# key params: position -> channel (positions 32 j + 2 cb + e)
_KP_CH = np.array([8 * cb + 2 * j + e for j in range(4) for cb in range(16) for e in range(2)])
# value params: position within a 32-token chunk -> token offset
_VP_TOK = np.array(
    [16 * kk + 2 * j + (0, 1, 8, 9)[e] for j in range(4) for kk in range(2) for e in range(4)]
)


def _bits16(x, dtype):
    return jax.lax.bitcast_convert_type(x.astype(dtype), jnp.uint16).astype(jnp.uint32)


def _pair_words(x16):
    """[.., 2n] uint32 holding 16-bit patterns -> [.., n] words (element 2i low half)."""
    return x16[..., 0::2] | (x16[..., 1::2] << 16)


def fragment_layout(k_codes, k_scale, k_zero, k_norm, v_codes, v_scale, v_zero, *,
                    param_dtype=jnp.float16, block_tokens=256):  # fmt: skip
    """Planar cache arrays -> (rec [B, H, Lp/64, W] uint32, kn [B, H, Lp] float32).

    k_codes, v_codes [B, H, Lq, 128 bits / 8] uint8 (planar INT2 or INT4, head_dim 128; the
    width gives the bits, W = ``record_words(bits)``); k_scale, k_zero [B, H, Lq/32, 128];
    k_norm [B, H or 1, Lq]; v_scale, v_zero [B, H, Lq, 4]. Lp = Lq rounded up to block_tokens
    (zero records past Lq). Parameters are stored as ``param_dtype`` (exact when they
    already are of that dtype).
    """
    b, h, lq, pb = k_codes.shape
    bits = {D // 4: 2, D // 2: 4}.get(pb)
    if bits is None or lq % G:
        raise ValueError(
            f"k_codes.shape={k_codes.shape} must be [B, H, Lq, {D // 4} or {D // 2}] (INT2, "
            f"INT4), Lq % {G} = 0"
        )
    kt, kch, vt, vch = _code_tables(bits)
    lp = -(-lq // block_tokens) * block_tokens
    pad = lp - lq
    n = lp // TILE

    def padt(x, axis, amount):
        cfgp = [(0, 0)] * x.ndim
        cfgp[axis] = (0, amount)
        return jnp.pad(x, cfgp)

    def codes(x):
        x = padt(quant.unpack(x, bits), 2, pad)
        return x.reshape(b, h, n, TILE, D).astype(jnp.uint32)

    shifts = (bits * np.arange(32 // bits)).astype(np.uint32)
    kwords = _or_reduce(codes(k_codes)[:, :, :, kt, kch] << shifts)  # [b, h, n, 256 bits]
    vwords = _or_reduce(codes(v_codes)[:, :, :, vt, vch] << shifts)
    # key params [b, h, n, 2 groups, 2 (s, z), 128 positions]
    ks = padt(k_scale, 2, pad // G).reshape(b, h, n, 2, D)
    kz = padt(k_zero, 2, pad // G).reshape(b, h, n, 2, D)
    kp = jnp.stack(
        [_bits16(ks[..., _KP_CH], param_dtype), _bits16(kz[..., _KP_CH], param_dtype)], 4
    )
    kp = _pair_words(kp).reshape(b, h, n, 256)
    # value params [b, h, n, 2 chunks, 2 (s, z), 4 groups, 32 positions]
    vs = padt(v_scale, 2, pad).reshape(b, h, n, 2, 32, D // G)
    vz = padt(v_zero, 2, pad).reshape(b, h, n, 2, 32, D // G)
    vs = jnp.swapaxes(vs[:, :, :, :, _VP_TOK, :], -1, -2)  # [b, h, n, 2, 4, 32]
    vz = jnp.swapaxes(vz[:, :, :, :, _VP_TOK, :], -1, -2)
    vp = jnp.stack([_bits16(vs, param_dtype), _bits16(vz, param_dtype)], 4)
    vp = _pair_words(vp).reshape(b, h, n, 256)
    npad = record_words(bits) - offsets(bits)[3] - 256
    parts = [kwords, vwords, kp, vp] + ([jnp.zeros((b, h, n, npad), jnp.uint32)] if npad else [])
    rec = jnp.concatenate(parts, -1)
    kn = jnp.broadcast_to(k_norm.astype(jnp.float32), (b, h, lq))
    kn = padt(kn, 2, pad)
    return rec, kn


def _or_reduce(x):
    out = x[..., 0]
    for i in range(1, x.shape[-1]):
        out = out | x[..., i]
    return out


def fragment_layout_inverse(rec, kn, lq, *, param_dtype=jnp.float16):
    """Exact inverse of ``fragment_layout`` (codes, parameters as param_dtype, norms f32);
    the record's width gives the bits."""
    b, h, n, nw = rec.shape
    bits = bits_of(nw, "rec")
    kc_, vc_, kp_, vp_ = offsets(bits)
    kt, kch, vt, vch = _code_tables(bits)
    shifts = (bits * np.arange(32 // bits)).astype(np.uint32)
    mask = (1 << bits) - 1
    kw = (rec[..., kc_:vc_, None] >> shifts) & mask  # [b, h, n, 256 bits, 32 / bits]
    vw = (rec[..., vc_:kp_, None] >> shifts) & mask
    kq = jnp.zeros((b, h, n, TILE, D), jnp.uint8).at[:, :, :, kt, kch].set(kw.astype(jnp.uint8))
    vq = jnp.zeros((b, h, n, TILE, D), jnp.uint8).at[:, :, :, vt, vch].set(vw.astype(jnp.uint8))
    kq = kq.reshape(b, h, n * TILE, D)[:, :, :lq]
    vq = vq.reshape(b, h, n * TILE, D)[:, :, :lq]

    def unwords(w):
        lo = (w & 0xFFFF).astype(jnp.uint16)
        hi = (w >> 16).astype(jnp.uint16)
        x = jnp.stack([lo, hi], -1).reshape(w.shape[:-1] + (2 * w.shape[-1],))
        return jax.lax.bitcast_convert_type(x, param_dtype)

    kp = unwords(rec[..., kp_:vp_]).reshape(b, h, n, 2, 2, D)
    inv_k = np.argsort(_KP_CH)
    ks = kp[..., 0, :][..., inv_k].reshape(b, h, n * 2, D)[:, :, : lq // G]
    kz = kp[..., 1, :][..., inv_k].reshape(b, h, n * 2, D)[:, :, : lq // G]
    vp = unwords(rec[..., vp_ : vp_ + 256]).reshape(b, h, n, 2, 2, D // G, 32)
    inv_v = np.argsort(_VP_TOK)
    vs = jnp.swapaxes(vp[:, :, :, :, 0][..., inv_v], -1, -2).reshape(b, h, n * TILE, D // G)
    vz = jnp.swapaxes(vp[:, :, :, :, 1][..., inv_v], -1, -2).reshape(b, h, n * TILE, D // G)
    return dict(
        k_codes=quant.pack(kq, bits), k_scale=ks, k_zero=kz, k_norm=kn[:, :, :lq],
        v_codes=quant.pack(vq, bits), v_scale=vs[:, :, :lq], v_zero=vz[:, :, :lq],
    )  # fmt: skip


@functools.cache
def half_words(bits: int = 2) -> np.ndarray:
    """[2, record_words(bits)] bool: the words of a record that hold tokens [0, 32) / [32,
    64) (every code word holds tokens of one half; the key params of token group g = half,
    the value params of chunk c = half)."""
    kc_, vc_, kp_, vp_ = offsets(bits)
    kt, _, vt, _ = _code_tables(bits)
    m = np.zeros((2, record_words(bits)), bool)
    for half in range(2):
        m[half, kc_:vc_] = kt[:, 0] // G == half
        m[half, vc_:kp_] = vt[:, 0] // G == half
        m[half, kp_ + 128 * half : kp_ + 128 * (half + 1)] = True
        m[half, vp_ + 128 * half : vp_ + 128 * (half + 1)] = True
    return m


def group_words(
    k_codes: Array, k_scale: Array, k_zero: Array, v_codes: Array, v_scale: Array,
    v_zero: Array, half: Array, *, param_dtype,
) -> Array:  # fmt: skip
    """One group of G = 32 tokens -> its half-record words [B, H, W] uint32.

    k_codes, v_codes [B, H, 32, 128 bits / 8] uint8 (planar INT2 or INT4); k_scale, k_zero
    [B, H, 1, 128]; v_scale, v_zero [B, H, 32, 4]; half [B] int32 (0: tokens 0..31 of the
    record, 1: 32..63). The words of the other half (``half_words(bits)[1 - half]``) and the
    pad are zero, so merging into a record is ``where(half_words(bits)[half], words, record)``.
    """
    b, h = k_codes.shape[:2]
    first = (half == 0).reshape(b, 1, 1, 1)

    def tile(x):  # the group at tokens (or key groups) [0, n) or [n, 2n) of a 64-token tile
        z = jnp.zeros_like(x)
        return jnp.where(first, jnp.concatenate([x, z], 2), jnp.concatenate([z, x], 2))

    norm = jnp.zeros((b, h, TILE), jnp.float32)
    rec, _ = fragment_layout(tile(k_codes), tile(k_scale), tile(k_zero), norm, tile(v_codes),
                             tile(v_scale), tile(v_zero), param_dtype=param_dtype,
                             block_tokens=TILE)  # fmt: skip
    return rec[:, :, 0]


def _half(nq: Array) -> Array:
    """[B] int32: which half of record nq // 64 the group at quantized position nq fills."""
    return jax.lax.rem(jax.lax.div(jnp.maximum(nq.astype(jnp.int32), 0), jnp.int32(G)),
                       jnp.int32(2))  # fmt: skip


def flush_words(ek, ev, nq: Array, *, param_dtype) -> Array:
    """The half-record words [B, H, W] of flushed groups (``ek``, ``ev`` [B, H, G, ...])
    stored at quantized position nq [B] (``group_words``). Computed where the groups are
    encoded (under the flush's ``lax.cond``): outside it XLA ran this permutation for every
    layer on every decode step."""
    return group_words(ek.codes, ek.scale, ek.zero, ev.codes, ev.scale, ev.zero, _half(nq),
                       param_dtype=param_dtype)  # fmt: skip


def group_update(ek, ev, nq: Array, heads: int, *, param_dtype,
                 words: Array | None = None) -> tuple[Array, Array, Array]:  # fmt: skip
    """What storing a flushed group (EncodedKeys ``ek``, EncodedValues ``ev`` [B, H, G, ...])
    at quantized position nq [B] changes in a record cache: (words [B, H, W] of its
    half-record, zero elsewhere; mask [B, W] bool of that half's words, merged into record
    nq // 64 as ``where(mask, words, record)``; norms [B, heads, G] float32 for
    kn[nq : nq + G]). ``words``: ``flush_words`` already computed. The XLA write
    (``oscar_jax.ring``) and the fused kernel's share it."""
    if words is None:
        words = flush_words(ek, ev, nq, param_dtype=param_dtype)
    norm = jnp.broadcast_to(ek.norm.astype(jnp.float32), (nq.shape[0], heads, G))
    mask = jnp.asarray(half_words(bits_of(words.shape[-1], "words")))[_half(nq)]
    return words, mask, norm


PLANAR = ("k_codes", "k_scale", "k_zero", "k_norm", "v_codes", "v_scale", "v_zero")


def planar_to_record(fields: dict, *, param_dtype) -> dict:
    """A cache's planar quantized arrays (``PLANAR``, Lq a multiple of 64) -> the same fields
    of a record-layout cache: k_codes = rec [B, H, Lq/64, W] uint32, k_norm = kn
    [B, H, Lq] float32, the other five empty (length 0 along the token axis). Exact."""
    rec, kn = fragment_layout(*(fields[n] for n in PLANAR), param_dtype=param_dtype,
                              block_tokens=TILE)  # fmt: skip
    out = {n: fields[n][:, :, :0] for n in PLANAR}
    out.update(k_codes=rec, k_norm=kn)
    return out


def record_to_planar(fields: dict, *, param_dtype, norm_heads: int | None = None,
                     norm_dtype=None) -> dict:  # fmt: skip
    """Inverse of ``planar_to_record`` (exact): the planar arrays of a record-layout cache's
    fields. ``norm_heads``=1 keeps one norm per token (per-token norms, equal over heads) and
    ``norm_dtype`` casts the norms back (exact for norms that came from it); None: float32
    norms [B, H, Lq], which the library's decoders take as well."""
    kn = fields["k_norm"]
    out = fragment_layout_inverse(fields["k_codes"], kn, kn.shape[2], param_dtype=param_dtype)
    if norm_heads is not None:
        out["k_norm"] = out["k_norm"][:, :norm_heads]
    if norm_dtype is not None:
        out["k_norm"] = out["k_norm"].astype(norm_dtype)
    return out
