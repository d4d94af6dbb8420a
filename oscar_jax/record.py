"""The "record" layout of the INT2 quantized cache: what the Mosaic GPU decode kernel reads.

A cache made with ``KVQuantConfig(layout="record")`` holds its quantized part as one
1600-word record per 64 tokens per (row, KV head) plus a float32 norm per token and head,
instead of the planar code / parameter arrays (``oscar_jax.cache``). The records are an
exact permutation of the planar arrays (``fragment_layout`` and its inverse
``fragment_layout_inverse``, bit for bit), fixed at quantize time so that each thread of
the kernel's warpgroup loads exactly the words of its wgmma register fragments
(``pallas_kernels.decode.mosaic``). Covered: INT2, head_dim 128, G = 32 (key token groups
and value channel groups), float16 / bfloat16 parameters (``KVQuantConfig.record_reason``).


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

A flushed group of G = 32 tokens fills one half of a record: K code words [0, 256) or
[256, 512), V code words 512 + 4 tid + 2 mt + half, K params [1024 + 128 half, + 128),
V params [1280 + 128 half, + 128) (``HALF_WORDS``); ``group_words`` builds them.
``RECORD_VERSION`` names this permutation in saved files (``oscar_jax.persistence``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from oscar_jax import quant

D = 128  # head_dim covered
G = 32  # group size (key tokens per group, value channels per group)
TILE = 64  # tokens per wgmma M tile = tokens per record
WORDS = 1600  # uint32 words per record
OFFSETS = (0, 512, 1024, 1280)  # K codes, V codes, K params, V params (words)
_KC, _VC, _KP, _VP = OFFSETS
RECORD_VERSION = 1  # bump when the permutation changes (saved files name it)


def _code_tables():
    """For every (word, bit slot) of the 1024 code words of a record: the (token, channel)
    of its K code (words 0..511) and V code (words 512..1023). Returns int arrays
    [512, 16] of token and channel for K and V (slot s = 2-bit field s: bits 2s..2s+1,
    s = p + 8 e)."""
    kt = np.zeros((512, 16), np.int64)
    kc = np.zeros((512, 16), np.int64)
    vt = np.zeros((512, 16), np.int64)
    vch = np.zeros((512, 16), np.int64)
    for tid in range(128):
        w, lane = divmod(tid, 32)
        j = lane % 4
        for cb in range(16):
            for rh in range(2):
                for e in range(2):
                    word = 4 * tid + cb // 4
                    slot = 2 * (cb % 4) + rh + 8 * e
                    kt[word, slot] = 16 * w + lane // 4 + 8 * rh
                    kc[word, slot] = 8 * cb + 2 * j + e
        for mt in range(2):
            for cb in range(8):
                for rh in range(2):
                    for e in range(2):
                        word = 4 * tid + 2 * mt + cb // 4
                        slot = 2 * (cb % 4) + rh + 8 * e
                        vch[word, slot] = 64 * mt + 16 * w + lane // 4 + 8 * rh
                        vt[word, slot] = 8 * cb + 2 * j + e
    return kt, kc, vt, vch


_KT, _KCH, _VT, _VCH = _code_tables()
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
    """Planar cache arrays -> (rec [B, H, Lp/64, 1600] uint32, kn [B, H, Lp] float32).

    k_codes, v_codes [B, H, Lq, 32] uint8 (INT2 planar, head_dim 128);
    k_scale, k_zero [B, H, Lq/32, 128]; k_norm [B, H or 1, Lq]; v_scale, v_zero [B, H, Lq, 4].
    Lp = Lq rounded up to block_tokens (zero records past Lq). Parameters are stored as
    ``param_dtype`` (exact when they already are of that dtype).
    """
    b, h, lq, pb = k_codes.shape
    if pb != D // 4 or lq % G:
        raise ValueError(
            f"k_codes.shape={k_codes.shape} must be [B, H, Lq, {D // 4}], Lq % {G} = 0"
        )
    lp = -(-lq // block_tokens) * block_tokens
    pad = lp - lq
    n = lp // TILE

    def padt(x, axis, amount):
        cfgp = [(0, 0)] * x.ndim
        cfgp[axis] = (0, amount)
        return jnp.pad(x, cfgp)

    kq = padt(quant.unpack(k_codes, 2), 2, pad).reshape(b, h, n, TILE, D).astype(jnp.uint32)
    vq = padt(quant.unpack(v_codes, 2), 2, pad).reshape(b, h, n, TILE, D).astype(jnp.uint32)
    kw = kq[:, :, :, _KT, _KCH]  # [b, h, n, 512, 16]
    vw = vq[:, :, :, _VT, _VCH]
    shifts = (2 * np.arange(16)).astype(np.uint32)
    kwords = _or_reduce(kw << shifts)
    vwords = _or_reduce(vw << shifts)
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
    rec = jnp.concatenate([kwords, vwords, kp, vp, jnp.zeros((b, h, n, 64), jnp.uint32)], -1)
    kn = jnp.broadcast_to(k_norm.astype(jnp.float32), (b, h, lq))
    kn = padt(kn, 2, pad)
    return rec, kn


def _or_reduce(x):
    out = x[..., 0]
    for i in range(1, x.shape[-1]):
        out = out | x[..., i]
    return out


def fragment_layout_inverse(rec, kn, lq, *, param_dtype=jnp.float16):
    """Exact inverse of ``fragment_layout`` (codes, parameters as param_dtype, norms f32)."""
    b, h, n, _ = rec.shape
    shifts = (2 * np.arange(16)).astype(np.uint32)
    kw = (rec[..., _KC:_VC, None] >> shifts) & 3  # [b, h, n, 512, 16]
    vw = (rec[..., _VC:_KP, None] >> shifts) & 3
    kq = jnp.zeros((b, h, n, TILE, D), jnp.uint8).at[:, :, :, _KT, _KCH].set(kw.astype(jnp.uint8))
    vq = jnp.zeros((b, h, n, TILE, D), jnp.uint8).at[:, :, :, _VT, _VCH].set(vw.astype(jnp.uint8))
    kq = kq.reshape(b, h, n * TILE, D)[:, :, :lq]
    vq = vq.reshape(b, h, n * TILE, D)[:, :, :lq]

    def unwords(w):
        lo = (w & 0xFFFF).astype(jnp.uint16)
        hi = (w >> 16).astype(jnp.uint16)
        x = jnp.stack([lo, hi], -1).reshape(w.shape[:-1] + (2 * w.shape[-1],))
        return jax.lax.bitcast_convert_type(x, param_dtype)

    kp = unwords(rec[..., _KP:_VP]).reshape(b, h, n, 2, 2, D)
    inv_k = np.argsort(_KP_CH)
    ks = kp[..., 0, :][..., inv_k].reshape(b, h, n * 2, D)[:, :, : lq // G]
    kz = kp[..., 1, :][..., inv_k].reshape(b, h, n * 2, D)[:, :, : lq // G]
    vp = unwords(rec[..., _VP:1536]).reshape(b, h, n, 2, 2, D // G, 32)
    inv_v = np.argsort(_VP_TOK)
    vs = jnp.swapaxes(vp[:, :, :, :, 0][..., inv_v], -1, -2).reshape(b, h, n * TILE, D // G)
    vz = jnp.swapaxes(vp[:, :, :, :, 1][..., inv_v], -1, -2).reshape(b, h, n * TILE, D // G)
    return dict(
        k_codes=quant.pack(kq, 2), k_scale=ks, k_zero=kz, k_norm=kn[:, :, :lq],
        v_codes=quant.pack(vq, 2), v_scale=vs[:, :, :lq], v_zero=vz[:, :, :lq],
    )  # fmt: skip


def _half_words() -> np.ndarray:
    """[2, 1600] bool: the words of a record that hold tokens [0, 32) / [32, 64)."""
    tid = np.arange(128)
    m = np.zeros((2, WORDS), bool)
    for half in range(2):
        m[half, _KC + 256 * half : _KC + 256 * (half + 1)] = True
        for mt in range(2):
            m[half, _VC + 4 * tid + 2 * mt + half] = True
        m[half, _KP + 128 * half : _KP + 128 * (half + 1)] = True
        m[half, _VP + 128 * half : _VP + 128 * (half + 1)] = True
    return m


HALF_WORDS = _half_words()


def group_words(
    k_codes: Array, k_scale: Array, k_zero: Array, v_codes: Array, v_scale: Array,
    v_zero: Array, half: Array, *, param_dtype,
) -> Array:  # fmt: skip
    """One group of G = 32 tokens -> its half-record words [B, H, 1600] uint32.

    k_codes, v_codes [B, H, 32, 32] uint8 (planar INT2); k_scale, k_zero [B, H, 1, 128];
    v_scale, v_zero [B, H, 32, 4]; half [B] int32 (0: tokens 0..31 of the record, 1:
    32..63). The words of the other half (``HALF_WORDS[1 - half]``) and the pad are zero,
    so merging into a record is ``where(HALF_WORDS[half], words, record)``.
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
    """The half-record words [B, H, 1600] of flushed groups (``ek``, ``ev`` [B, H, G, ...])
    stored at quantized position nq [B] (``group_words``). Computed where the groups are
    encoded (under the flush's ``lax.cond``): outside it XLA ran this permutation for every
    layer on every decode step."""
    return group_words(ek.codes, ek.scale, ek.zero, ev.codes, ev.scale, ev.zero, _half(nq),
                       param_dtype=param_dtype)  # fmt: skip


def group_update(ek, ev, nq: Array, heads: int, *, param_dtype,
                 words: Array | None = None) -> tuple[Array, Array, Array]:  # fmt: skip
    """What storing a flushed group (EncodedKeys ``ek``, EncodedValues ``ev`` [B, H, G, ...])
    at quantized position nq [B] changes in a record cache: (words [B, H, 1600] of its
    half-record, zero elsewhere; mask [B, 1600] bool of that half's words, merged into record
    nq // 64 as ``where(mask, words, record)``; norms [B, heads, G] float32 for
    kn[nq : nq + G]). ``words``: ``flush_words`` already computed. The XLA write
    (``oscar_jax.ring``) and the fused kernel's share it."""
    if words is None:
        words = flush_words(ek, ev, nq, param_dtype=param_dtype)
    norm = jnp.broadcast_to(ek.norm.astype(jnp.float32), (nq.shape[0], heads, G))
    return words, jnp.asarray(HALF_WORDS)[_half(nq)], norm


PLANAR = ("k_codes", "k_scale", "k_zero", "k_norm", "v_codes", "v_scale", "v_zero")


def planar_to_record(fields: dict, *, param_dtype) -> dict:
    """A cache's planar quantized arrays (``PLANAR``, Lq a multiple of 64) -> the same fields
    of a record-layout cache: k_codes = rec [B, H, Lq/64, 1600] uint32, k_norm = kn
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
