"""The "record" layout of the INT2 / INT4 quantized cache, which the Mosaic GPU kernel reads.

A cache made with ``KVQuantConfig(layout="record")`` holds its quantized part as one record
per 64 tokens per (row, KV head) -- 4 d (bits + 1) uint32 words for head_dim d (1600 at
INT2 and 2560 at INT4 for d = 128; ``record_words``) -- plus a float32 norm per token and
head, instead of the planar code / parameter arrays (``oscar_jax.cache``). The records are
an exact permutation of the planar arrays (``fragment_layout`` and its inverse
``fragment_layout_inverse``, bit for bit), fixed at quantize time so that each thread of
the kernel's warpgroup loads exactly the words of its wgmma register fragments
(``pallas_kernels.decode.mosaic``). Covered: INT2 and INT4, head_dim 64, 128 and 256,
G = 32 (key token groups and value channel groups), float16 / bfloat16 parameters
(``KVQuantConfig.record_reason``).

Record layout of one 64-token tile (uint32 words; "tid" is the thread of the warpgroup,
w = tid // 32 its warp, l = tid % 32 its lane, j = l % 4; b the bits, d the head_dim, P =
16 / b the f16x2 fragment registers a code word fills (8 at INT2, 4 at INT4), T = d b / 64
the code words a thread holds of a tensor and u = min(4, T) the words it loads at once; a
thread's f-th K code word sits at ``code_word(f, tid, u)`` = 128 u (f // u) + u tid + f % u
from the tensor's first code word, so that a warp's loads are conflict-free; its f-th V code
word at ``value_code_word(f, tid)`` = 128 M (f % C) + M tid + f // C (C = 16 / P words a
64-channel block, M = d / 64 blocks): the words of one class f % C of every thread first, so
that the warp-level kernel's warp w, which reads class w // 2 (INT2) or w (INT4) of its
owner threads, loads M contiguous words a lane with the lanes contiguous):
  K codes [0, 2 d b): register r = 2 cb + rh of the [64 tok, d ch] A fragment (cb in
                0..d/8-1, rh in 0..1) is in word f = r // P, plane p = r % P: bits
                b (p + P e) hold the code of token 16 w + l // 4 + 8 rh, channel
                8 cb + 2 j + e (e in 0..1: the low / high 16-bit half)
  V codes [2 d b, 4 d b): register r = 2 cb + rh of channel block mt's [64 ch, 64 tok] V^T
                fragment (mt in 0..d/64-1, cb in 0..7) is in word f = (16 mt + r) // P,
                plane r % P: the code of channel 64 mt + 16 w + l // 4 + 8 rh, token
                8 cb + 2 j + e
  (INT2, d = 128: K word 4 tid + cb // 4, V word 512 + 256 (cb // 4) + 2 tid + mt, p =
                2 (cb % 4) + rh.)
  K params [4 d b, + 2 d), 16-bit values two to a word (position 2i in the low half of
                word i, 2i + 1 in the high half): [group g in 0..1][scale, zero][d
                positions], channel 8 cb + 2 j + e of token group 2 n + g in word
                16 (cb // 4) + 4 j + cb % 4 (+ d g + d/2 sz), half e
                (``key_param_word``: a thread's 16-byte load k holds cb = 4k..4k+3, and
                the 4 distinct loads of a warp (one a j) fill 64 contiguous bytes, in
                distinct banks)
  V params [4 d b + 2 d, + 2 d), same packing: [chunk c in 0..1 (32 tokens)][scale, zero]
                [value group 0..d/32-1][32 positions], token 32 c + 16 kk + 2 j + (0, 1, 8,
                9)[e'] at position 8 j + 4 kk + e', i.e. token 8 cb + 2 j + e of group grp
                at word d/2 (2 (cb // 4) + sz) + 16 grp + 4 j + cb % 4, half e
  INT2 at d = 128: [1536, 1600) zero (the layout's first form, kept for saved files); no
                other format has a pad (rows of 64 words: the TMA box is <= 256 a
                dimension, 80 rows at most).
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

DIMS = (64, 128, 256)  # head_dims the layout holds
D = 128  # the default head_dim
G = 32  # group size (key tokens per group, value channel groups)
TILE = 64  # tokens per wgmma M tile = tokens per record
BITS = (2, 4)  # code widths the layout holds
RECORD_VERSION = 2  # bump when a permutation changes (saved files name it); 2: key params
# interleaved by j (``key_param_word``), V code words by class (``value_code_word``); 1: key
# params by j in blocks of d / 8 words, V code words as K's


def _check_format(bits: int, d: int) -> None:
    if bits not in BITS or d not in DIMS:
        raise ValueError(f"({bits=}, {d=}) must have bits in {BITS} and d (head_dim) in {DIMS}")


def record_words(bits: int = 2, d: int = D) -> int:
    """uint32 words per record: 4 d (bits + 1) (codes 4 d bits, parameters 4 d), plus a
    64-word zero pad for INT2 at d = 128 (the layout's first form: 1600 = 25 x 64; saved
    files keep it). 1600 / 2560 at d = 128, 768 / 1280 at 64, 3072 / 5120 at 256."""
    _check_format(bits, d)
    return 4 * d * (bits + 1) + (64 if (bits, d) == (2, 128) else 0)


def record_format(last_dim: int, what: str = "record") -> tuple[int, int]:
    """(bits, head_dim) of a record array from its last dimension (words a record; every
    format has its own count)."""
    for b in BITS:
        for d in DIMS:
            if record_words(b, d) == last_dim:
                return b, d
    raise ValueError(f"{what} last dimension {last_dim} must be one of "
                     f"{sorted(record_words(b, d) for b in BITS for d in DIMS)} (INT2 / INT4 "
                     f"records of head_dim {DIMS})")  # fmt: skip


def offsets(bits: int = 2, d: int = D) -> tuple[int, int, int, int]:
    """Word offsets of (K codes, V codes, K params, V params) in a record of ``bits``, ``d``."""
    vc = 2 * d * bits  # 512 code words a tensor at INT2, d = 128
    return 0, vc, 2 * vc, 2 * vc + 2 * d


WORDS = record_words(2)  # the INT2 record's at d = 128
OFFSETS = offsets(2)


def pairs_per_word(bits: int) -> int:
    """f16x2 fragment registers one code word fills: 8 at INT2, 4 at INT4."""
    return 16 // bits


def thread_words(bits: int = 2, d: int = D) -> int:
    """Code words a thread holds of one tensor of a record: its d / 4 fragment registers
    over ``pairs_per_word`` (4 at INT2, d = 128; 2 at INT2, d = 64; 16 at INT4, d = 256)."""
    return d // 4 // pairs_per_word(bits)


def load_words(bits: int = 2, d: int = D) -> int:
    """Code words a thread loads at once: 4 (16 bytes), or all of them where it has fewer."""
    return min(4, thread_words(bits, d))


def value_code_word(f: int, tid, bits: int = 2, d: int = D):
    """Word (relative to the V codes) of thread ``tid``'s f-th V code word: class c = f % C
    (C = 16 / ``pairs_per_word``, the words of one 64-channel block), then thread, then block
    m = f // C (M = d / 64 of them): a warp reading one class of 32 consecutive threads loads
    M contiguous words a lane, the lanes contiguous (no bank conflict, no unused word)."""
    c, m = 16 // pairs_per_word(bits), d // 64
    return 128 * m * (f % c) + m * tid + f // c


def code_word(f: int, tid, per: int = 4):
    """Word (relative to its tensor's codes) of thread ``tid``'s f-th code word: groups of
    ``per`` words a thread (one load: ``load_words``), the group k of all 128 threads
    contiguous, so a warp's loads are conflict-free."""
    return 128 * per * (f // per) + per * tid + f % per


@functools.cache
def _code_tables(bits: int = 2, d: int = D):
    """For every (word, bit slot) of a record's code words: the (token, channel) of its K
    code (the first 2 d bits words) and of its V code (the next 2 d bits). Returns int
    arrays [2 d bits, 32 / bits] of token and channel for K and V (slot s = the s-th
    ``bits``-wide field, s = p + (16 / bits) e: plane p of 16-bit half e)."""
    ppw, per = pairs_per_word(bits), load_words(bits, d)
    nw, slots = 2 * d * bits, 32 // bits
    kt, kc = np.zeros((nw, slots), np.int64), np.zeros((nw, slots), np.int64)
    vt, vch = np.zeros((nw, slots), np.int64), np.zeros((nw, slots), np.int64)
    for tid in range(128):
        w, lane = divmod(tid, 32)
        j = lane % 4
        for cb in range(d // 8):  # K: register r = 2 cb + rh of the [64 tok, d ch] A fragment
            for rh in range(2):
                r = 2 * cb + rh
                word = code_word(r // ppw, tid, per)
                for e in range(2):
                    slot = r % ppw + ppw * e
                    kt[word, slot] = 16 * w + lane // 4 + 8 * rh
                    kc[word, slot] = 8 * cb + 2 * j + e
        for mt in range(d // 64):  # V^T: channel block mt, register r = 2 cb + rh of [64, 64]
            for cb in range(8):
                for rh in range(2):
                    r = 2 * cb + rh
                    word = value_code_word((16 * mt + r) // ppw, tid, bits, d)
                    for e in range(2):
                        slot = r % ppw + ppw * e
                        vch[word, slot] = 64 * mt + 16 * w + lane // 4 + 8 * rh
                        vt[word, slot] = 8 * cb + 2 * j + e
    return kt, kc, vt, vch


def key_param_word(j, cb):
    """Word (within a token group's scale or zero block of d / 2 words) of the key parameter
    pair of channels 8 cb + 2 j + (0, 1): the K A fragment's thread column j = lane % 4 and
    channel block cb. Interleaved by j, so that the kernels' 16-byte loads (cb = 4k..4k+3 a
    load) of a warp's 4 distinct j read 64 contiguous bytes: no bank conflict."""
    return 16 * (cb // 4) + 4 * j + cb % 4


@functools.cache
def _upgrade_index(version: int, bits: int, d: int) -> np.ndarray:
    """[W] int: record words of ``version`` -> this version's (new[i] = old[index[i]])."""
    if version != 1:
        raise ValueError(f"{version=} must be 1 or {RECORD_VERSION} (the record layouts known)")
    idx = np.arange(record_words(bits, d))
    vc, kp = offsets(bits, d)[1:3]
    per = load_words(bits, d)
    for tid in range(128):  # version 1: V code words at code_word(f, tid, per), as K's
        for f in range(thread_words(bits, d)):
            idx[vc + value_code_word(f, tid, bits, d)] = vc + code_word(f, tid, per)
    for blk in range(4):  # the [token group][scale, zero] blocks of d / 2 words
        base = kp + blk * (d // 2)
        for j in range(4):
            for cb in range(d // 8):  # version 1: word d / 8 j + cb of the block
                idx[base + key_param_word(j, cb)] = base + d // 8 * j + cb
    return idx


def upgrade_records(rec: Array, version: int) -> Array:
    """rec [..., W] uint32 records of an older ``RECORD_VERSION`` -> this version's (an
    exact word permutation: version 1 differs in where the V code words and the key params
    sit)."""
    if version == RECORD_VERSION:
        return rec
    bits, d = record_format(rec.shape[-1])
    return rec[..., _upgrade_index(version, bits, d)]


@functools.cache
def _kp_channels(d: int = D) -> np.ndarray:
    """Key params: position -> channel (channel 8 cb + 2 j + e at position 2
    ``key_param_word(j, cb)`` + e)."""
    out = np.zeros(d, np.int64)
    for j in range(4):
        for cb in range(d // 8):
            for e in range(2):
                out[2 * key_param_word(j, cb) + e] = 8 * cb + 2 * j + e
    return out


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

    k_codes, v_codes [B, H, Lq, d bits / 8] uint8 (planar INT2 or INT4); k_scale, k_zero
    [B, H, Lq/32, d] (d, the head_dim, in ``DIMS``); k_norm [B, H or 1, Lq]; v_scale,
    v_zero [B, H, Lq, d/32]. W = ``record_words(bits, d)``. Lp = Lq rounded up to
    block_tokens (zero records past Lq). Parameters are stored as ``param_dtype`` (exact
    when they already are of that dtype).
    """
    b, h, lq, pb = k_codes.shape
    d = k_scale.shape[-1]
    bits = {d // 4: 2, d // 2: 4}.get(pb)
    if bits is None or lq % G or d not in DIMS:
        raise ValueError(
            f"k_codes.shape={k_codes.shape}, k_scale.shape={k_scale.shape} must be [B, H, Lq, "
            f"d / 4 or d / 2] (INT2, INT4) and [.., d] with d in {DIMS}, Lq % {G} = 0"
        )
    kt, kch, vt, vch = _code_tables(bits, d)
    lp = -(-lq // block_tokens) * block_tokens
    pad = lp - lq
    n = lp // TILE

    def padt(x, axis, amount):
        cfgp = [(0, 0)] * x.ndim
        cfgp[axis] = (0, amount)
        return jnp.pad(x, cfgp)

    def codes(x):
        x = padt(quant.unpack(x, bits), 2, pad)
        return x.reshape(b, h, n, TILE, d).astype(jnp.uint32)

    shifts = (bits * np.arange(32 // bits)).astype(np.uint32)
    kwords = _or_reduce(codes(k_codes)[:, :, :, kt, kch] << shifts)  # [b, h, n, 2 d bits]
    vwords = _or_reduce(codes(v_codes)[:, :, :, vt, vch] << shifts)
    # key params [b, h, n, 2 groups, 2 (s, z), d positions]
    kpc = _kp_channels(d)
    ks = padt(k_scale, 2, pad // G).reshape(b, h, n, 2, d)
    kz = padt(k_zero, 2, pad // G).reshape(b, h, n, 2, d)
    kp = jnp.stack([_bits16(ks[..., kpc], param_dtype), _bits16(kz[..., kpc], param_dtype)], 4)
    kp = _pair_words(kp).reshape(b, h, n, 2 * d)
    # value params [b, h, n, 2 chunks, 2 (s, z), d / 32 groups, 32 positions]
    vs = padt(v_scale, 2, pad).reshape(b, h, n, 2, 32, d // G)
    vz = padt(v_zero, 2, pad).reshape(b, h, n, 2, 32, d // G)
    vs = jnp.swapaxes(vs[:, :, :, :, _VP_TOK, :], -1, -2)  # [b, h, n, 2, d / 32, 32]
    vz = jnp.swapaxes(vz[:, :, :, :, _VP_TOK, :], -1, -2)
    vp = jnp.stack([_bits16(vs, param_dtype), _bits16(vz, param_dtype)], 4)
    vp = _pair_words(vp).reshape(b, h, n, 2 * d)
    npad = record_words(bits, d) - offsets(bits, d)[3] - 2 * d
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
    the record's width gives the bits and the head_dim (``record_format``)."""
    b, h, n, nw = rec.shape
    bits, d = record_format(nw, "rec")
    kc_, vc_, kp_, vp_ = offsets(bits, d)
    kt, kch, vt, vch = _code_tables(bits, d)
    shifts = (bits * np.arange(32 // bits)).astype(np.uint32)
    mask = (1 << bits) - 1
    kw = (rec[..., kc_:vc_, None] >> shifts) & mask  # [b, h, n, 2 d bits, 32 / bits]
    vw = (rec[..., vc_:kp_, None] >> shifts) & mask
    kq = jnp.zeros((b, h, n, TILE, d), jnp.uint8).at[:, :, :, kt, kch].set(kw.astype(jnp.uint8))
    vq = jnp.zeros((b, h, n, TILE, d), jnp.uint8).at[:, :, :, vt, vch].set(vw.astype(jnp.uint8))
    kq = kq.reshape(b, h, n * TILE, d)[:, :, :lq]
    vq = vq.reshape(b, h, n * TILE, d)[:, :, :lq]

    def unwords(w):
        lo = (w & 0xFFFF).astype(jnp.uint16)
        hi = (w >> 16).astype(jnp.uint16)
        x = jnp.stack([lo, hi], -1).reshape(w.shape[:-1] + (2 * w.shape[-1],))
        return jax.lax.bitcast_convert_type(x, param_dtype)

    kp = unwords(rec[..., kp_:vp_]).reshape(b, h, n, 2, 2, d)
    inv_k = np.argsort(_kp_channels(d))
    ks = kp[..., 0, :][..., inv_k].reshape(b, h, n * 2, d)[:, :, : lq // G]
    kz = kp[..., 1, :][..., inv_k].reshape(b, h, n * 2, d)[:, :, : lq // G]
    vp = unwords(rec[..., vp_ : vp_ + 2 * d]).reshape(b, h, n, 2, 2, d // G, 32)
    inv_v = np.argsort(_VP_TOK)
    vs = jnp.swapaxes(vp[:, :, :, :, 0][..., inv_v], -1, -2).reshape(b, h, n * TILE, d // G)
    vz = jnp.swapaxes(vp[:, :, :, :, 1][..., inv_v], -1, -2).reshape(b, h, n * TILE, d // G)
    return dict(
        k_codes=quant.pack(kq, bits), k_scale=ks, k_zero=kz, k_norm=kn[:, :, :lq],
        v_codes=quant.pack(vq, bits), v_scale=vs[:, :, :lq], v_zero=vz[:, :, :lq],
    )  # fmt: skip


@functools.cache
def half_words(bits: int = 2, d: int = D) -> np.ndarray:
    """[2, record_words(bits, d)] bool: the words of a record that hold tokens [0, 32) /
    [32, 64) (every code word holds tokens of one half; the key params of token group g =
    half, the value params of chunk c = half)."""
    kc_, vc_, kp_, vp_ = offsets(bits, d)
    kt, _, vt, _ = _code_tables(bits, d)
    m = np.zeros((2, record_words(bits, d)), bool)
    for half in range(2):
        m[half, kc_:vc_] = kt[:, 0] // G == half
        m[half, vc_:kp_] = vt[:, 0] // G == half
        m[half, kp_ + d * half : kp_ + d * (half + 1)] = True
        m[half, vp_ + d * half : vp_ + d * (half + 1)] = True
    return m


def group_words(
    k_codes: Array, k_scale: Array, k_zero: Array, v_codes: Array, v_scale: Array,
    v_zero: Array, half: Array, *, param_dtype,
) -> Array:  # fmt: skip
    """One group of G = 32 tokens -> its half-record words [B, H, W] uint32.

    k_codes, v_codes [B, H, 32, d bits / 8] uint8 (planar INT2 or INT4); k_scale, k_zero
    [B, H, 1, d]; v_scale, v_zero [B, H, 32, d / 32]; half [B] int32 (0: tokens 0..31 of
    the record, 1: 32..63). The words of the other half (``half_words(bits, d)[1 - half]``)
    and the pad are zero, so merging into a record is ``where(half_words(bits, d)[half],
    words, record)``.
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
    mask = jnp.asarray(half_words(*record_format(words.shape[-1], "words")))[_half(nq)]
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
