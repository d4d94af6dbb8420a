"""The immutable per-layer OScaR KV cache: a registered pytree with static capacity.

This module holds the pytree, ``init_cache``, ``prefill`` and the read side
(``dequantize``, byte counts); ``append`` and the group flush live in ``oscar_jax.ring``.

Layout (head-major so that a decode kernel's tile of tokens is contiguous).
Legend: B batch, H KV heads, Hn norm heads (H or 1), Lq quantized capacity,
S residual slots, D head_dim, Db packed bytes per token, G key group,
Gv value group.

  k_codes [B, H, Lq, Db] uint8    k_scale, k_zero [B, H, Lq/G, D]   k_norm [B, Hn, Lq]
  v_codes [B, H, Lq, Db] uint8    v_scale, v_zero [B, H, Lq, D/Gv]
  k_res, v_res [B, H, S, D] (cache dtype, original basis)
  lengths [B] int32 (tokens stored per row)   flags [B] int32 (FLAG_* bits)

Row i with n_i tokens holds its oldest nq_i = G * floor(max(0, n_i - R) / G)
tokens quantized at positions [0, nq_i) and the rest, n_i - nq_i in
[min(n_i, R), R + G - 1], in the residual ring: token t lives in slot t mod S,
S = R + G. When an append brings a row's residual to R + G tokens, its oldest
G are quantized as one group (a "flush") and their slots zeroed. The state is
canonical: every unused position is zero, so ``append`` token by token and
``prefill`` of the same tokens give bit-identical pytrees. For ``bf16`` the
quantized part is empty and the ring has S = max_len slots (no flush).

Lq is rounded up to a multiple of max(G, 256) tokens, the decode kernel's tile.

``cfg.layout == "record"`` (INT2 or INT4, G = 32, D = 64, 128 or 256, 16-bit parameters)
stores the quantized part as the Mosaic GPU decode kernel reads it (``oscar_jax.record``):
k_codes holds the records rec [B, H, Lq/64, W] uint32 (W = ``record.record_words(bits, D)``:
1600 at INT2, 2560 at INT4 for D = 128), k_norm the
norms kn [B, H, Lq] float32, and k_scale, k_zero, v_codes, v_scale, v_zero are empty
(length 0 along the token axis); ``rec`` / ``kn`` name them. The records are an
exact permutation of the planar arrays: prefill and the flushes write the same
bits as ``record.planar_to_record`` of the planar cache given the same writes.
Readers of the planar arrays go through ``quantized_parts`` (the exact inverse)
or call ``check_layout`` (the Triton kernels: a ValueError naming the layout).

Capacity: an ``append`` to a full row writes nothing, keeps its length and
sets ``FLAG_OVERFLOW`` in ``flags`` (under ``jit`` nothing can raise). Non-finite
keys or values set ``FLAG_NONFINITE`` for that row; other rows are untouched.

Bad rows (what a row with NaN/Inf yields). Flags are sticky: they are OR-ed in by
``prefill`` (which resets them) and ``append`` and never cleared by later appends.

* NaN/Inf in a key or value of row i (a valid token; padding past ``lengths`` is
  ignored) sets ``FLAG_NONFINITE`` in ``flags[i]``; so does finite input whose
  encoding overflows float32 (a stored scale, zero or norm that is not finite:
  magnitudes near 1e37 and above for rotated configs, see ``_nonfinite_encoding``).
* The bad values are stored as they come while in the full-precision ring; a flush
  then encodes them with no guarantee: a NaN key gets norm 0 (stored as a zero key),
  codes of NaN elements are 0, scales/zeros may be NaN, Inf or finite. So
  ``dequantize`` of a flagged row returns unspecified values (NaN, Inf or finite).
* ``decode_attention`` (both implementations) returns NaN for every query head of a
  flagged row, from the step the bad token entered on, until a new ``prefill``
  (``attention.poison_flagged_rows``): without that, the attention of a bad row can
  come out finite and plausible (a zeroed key, an Inf key scoring -inf and dropping
  its token), i.e. garbage that looks like output.
* No other row is affected: every op is row-independent (no reduction over the
  batch), so the outputs of the clean rows are bit-identical with and without the
  poisoned row (``tests/test_reliability.py``).
* Under ``jit`` nothing raises; ``oscar_jax.checks.check_cache`` turns the flags into
  a ``checkify`` error naming the row (``oscar_jax.checks.checked``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from oscar_jax import backends, codec, record
from oscar_jax.config import KVQuantConfig
from oscar_jax.eager import compiled

FLAG_OVERFLOW = 1  # an append found the row full; the token was dropped
FLAG_NONFINITE = 2  # a key or value of the row held NaN or Inf
FLAG_BAD_LENGTH = 4  # prefill got a length outside [0, T]; it was clipped
KERNEL_TILE = 256


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "k_codes", "k_scale", "k_zero", "k_norm", "v_codes", "v_scale", "v_zero",
        "k_res", "v_res", "lengths", "flags",
    ],
    meta_fields=["cfg", "max_len"],
)  # fmt: skip
@dataclasses.dataclass(frozen=True)
class KVCache:
    k_codes: Array
    k_scale: Array
    k_zero: Array
    k_norm: Array
    v_codes: Array
    v_scale: Array
    v_zero: Array
    k_res: Array
    v_res: Array
    lengths: Array
    flags: Array
    cfg: KVQuantConfig
    max_len: int

    def __post_init__(self):
        if self.cfg.layout == "auto":  # the arrays' shapes depend on the layout
            raise ValueError(
                "cfg.layout='auto' must be decided before a cache holds the config "
                "(init_cache and models.prepare decide it: storage_layout)"
            )

    @property
    def batch(self) -> int:
        return self.k_res.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_res.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k_res.shape[3]

    @property
    def dtype(self):
        return self.k_res.dtype

    @property
    def slots(self) -> int:
        return self.k_res.shape[2]

    @property
    def slots_total(self) -> int:
        """Ring slots of the whole cache (differs from ``slots`` inside a shard_map shard)."""
        c = self.cfg
        return c.residual_length + c.group_size if c.quantized else self.max_len

    @property
    def quant_capacity(self) -> int:
        return self.k_norm.shape[2]  # tokens in both layouts (k_codes holds records in one)

    @property
    def rec(self) -> Array:
        """[B, H, Lq/64, W] uint32: the records of a layout='record' cache."""
        check_layout(self, "record", "rec")
        return self.k_codes

    @property
    def kn(self) -> Array:
        """[B, H, Lq] float32: the token norms of a layout='record' cache."""
        check_layout(self, "record", "kn")
        return self.k_norm

    def num_quantized(self) -> Int[Array, " B"]:
        """nq per row: tokens in the quantized part."""
        return quantized_count(self.lengths, self.cfg)


def check_layout(cache: KVCache, want: str, what: str) -> None:
    """ValueError naming ``what`` unless the cache's quantized part has layout ``want``."""
    if cache.cfg.layout != want:
        raise ValueError(
            f"{what} needs a cache of layout={want!r}; this one has layout={cache.cfg.layout!r} "
            "(KVQuantConfig.layout; convert_layout converts a cache exactly)"
        )


def convert_layout(cache: KVCache, layout: str) -> KVCache:
    """The cache with its quantized part in ``layout`` ("planar" or "record"), bit-exact both
    ways (reads and writes the whole quantized part: a conversion, not a decode step)."""
    cfg = cache.cfg.replace(layout=layout)  # validates layout
    cfg.validate_head_dim(cache.head_dim)
    if layout == cache.cfg.layout or not cfg.quantized:
        return dataclasses.replace(cache, cfg=cfg)
    fields = {n: getattr(cache, n) for n in record.PLANAR}
    pdt = cfg.scale_dtype
    if layout == "record":
        fields = record.planar_to_record(fields, param_dtype=pdt)
    else:
        hn = cache.num_kv_heads if cfg.norm_granularity == "per_head" else 1
        fields = record.record_to_planar(fields, param_dtype=pdt, norm_heads=hn,
                                         norm_dtype=cfg.norm_jnp_dtype)  # fmt: skip
    return dataclasses.replace(cache, cfg=cfg, **fields)


def quantized_count(n: Array, cfg: KVQuantConfig) -> Array:
    if not cfg.quantized:
        return jnp.zeros_like(n)
    g, r = cfg.group_size, cfg.residual_length
    return _div(jnp.maximum(n - r, 0), g) * g


def _div(x: Array, k: int) -> Array:
    """x // k for x >= 0 (one integer division: jnp's floor division adds sign fix-ups)."""
    return jax.lax.div(x, jnp.asarray(k, x.dtype))


def _rem(x: Array, k: int) -> Array:
    """x mod k for x >= 0."""
    return jax.lax.rem(x, jnp.asarray(k, x.dtype))


def _check_int(name: str, val) -> None:
    if isinstance(val, bool) or not isinstance(val, int | np.integer) or val < 1:
        raise ValueError(f"{name}={val!r} must be a positive int")


def storage_layout(cfg, *, head_dim: int, num_kv_heads: int = 1, group: int = 1,
                   attention="auto", sharded: bool = False):  # fmt: skip
    """``cfg`` with ``layout="auto"`` made concrete (other layouts are returned as they are).

    "record" where decode attention ``attention`` over such a cache runs the Mosaic kernel:
    named "mosaic", or "auto" choosing it (``backends.choose``: a Hopper GPU with jax >=
    0.11.2 and the kernel's coverage of the config, head_dim and ``group`` query heads per
    KV head); "planar" otherwise, and under a mesh (``sharded``; the planar layout's sharded
    paths are the ones checked on every mesh). Decided from static facts, before a cache exists.
    """
    if cfg.layout != "auto":
        return cfg
    planar = cfg.replace(layout="planar")
    if sharded or cfg.record_reason(head_dim) is not None:
        return planar
    record = cfg.replace(layout="record")
    name = attention if callable(attention) else backends.canonical("decode_attention", attention)
    if name == "mosaic":
        return record
    if name != "auto" or not backends.gpu_available():
        return planar
    shape = jax.eval_shape(lambda: init_cache(  # one record's shapes, for the coverage check
        record, batch=1, max_len=record.residual_length + 64, num_kv_heads=num_kv_heads,
        head_dim=head_dim))  # fmt: skip
    return record if backends.choose("decode_attention", shape, group)[0] == "mosaic" else planar


def init_cache(
    cfg: KVQuantConfig,
    *,
    batch: int,
    max_len: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.bfloat16,
    attention=None,
) -> KVCache:
    """An empty cache for one layer that can hold ``max_len`` tokens per row.

    ``attention``: the decode attention backend that will read the cache ("auto", "mosaic",
    ...); it decides a ``layout="auto"`` config's layout (``storage_layout``; for
    "auto", assuming at most 16 query heads per KV head). None (default): an "auto" layout
    is "planar", the layout every backend but Mosaic reads. ``models.prepare`` decides it
    from the model and its backends. The cache's ``cfg`` names the layout chosen."""
    if not isinstance(cfg, KVQuantConfig):
        raise ValueError(f"cfg={cfg!r} must be a KVQuantConfig (see oscar_jax.preset)")
    for name, val in (("batch", batch), ("max_len", max_len), ("num_kv_heads", num_kv_heads)):
        _check_int(name, val)
    cfg.validate_head_dim(head_dim)
    cfg = storage_layout(cfg, head_dim=head_dim, num_kv_heads=num_kv_heads,
                         attention="xla" if attention is None else attention)  # fmt: skip
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"{dtype=} must be a floating dtype")
    b, h, d = batch, num_kv_heads, head_dim
    if cfg.quantized:
        g, r = cfg.group_size, cfg.residual_length
        raw = (max(0, max_len - r) // g) * g
        tile = max(g, KERNEL_TILE)
        lq = -(-raw // tile) * tile
        slots = r + g
        db = d * cfg.bits // 8
        gv = cfg.value_group(d)
    else:
        lq, slots, db, gv, g = 0, max_len, 0, d, 1
    hn = h if cfg.norm_granularity == "per_head" else 1
    pdt, ndt = cfg.scale_dtype, cfg.norm_jnp_dtype
    z = jnp.zeros
    lp = lq if cfg.layout == "planar" else 0  # the planar arrays' token axis
    if cfg.layout == "record":
        nw = record.record_words(cfg.bits, d)
        codes, norms = z((b, h, lq // record.TILE, nw), jnp.uint32), z((b, h, lq))
    else:
        codes, norms = z((b, h, lq, db), jnp.uint8), z((b, hn, lq), ndt)
    return KVCache(
        k_codes=codes,
        k_scale=z((b, h, lp // g, d), pdt),
        k_zero=z((b, h, lp // g, d), pdt),
        k_norm=norms,
        v_codes=z((b, h, lp, db), jnp.uint8),
        v_scale=z((b, h, lp, d // gv), pdt),
        v_zero=z((b, h, lp, d // gv), pdt),
        k_res=z((b, h, slots, d), dtype),
        v_res=z((b, h, slots, d), dtype),
        lengths=z((b,), jnp.int32),
        flags=z((b,), jnp.int32),
        cfg=cfg,
        max_len=max_len,
    )


def _check_kv(cache: KVCache, k, v, rank: int, what: str) -> None:
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache={type(cache).__name__} must be a KVCache (see init_cache)")
    for name, x in (("k", k), ("v", v)):
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) != rank:
            raise ValueError(f"{name}.shape={shape} must have rank {rank}: {what}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name}.dtype={x.dtype} must be floating")
    if k.shape != v.shape:
        raise ValueError(f"k.shape={k.shape} must equal v.shape={v.shape}")
    b, h, d = k.shape[0], k.shape[-2], k.shape[-1]
    want = (cache.batch, cache.num_kv_heads, cache.head_dim)
    if (b, h, d) != want:
        raise ValueError(
            f"k.shape={k.shape} must have (batch, num_kv_heads, head_dim)={want} to match the cache"
        )


def _nonfinite_rows(k, v) -> Array:
    axes = tuple(range(1, k.ndim))
    bad = ~(jnp.all(jnp.isfinite(k), axis=axes) & jnp.all(jnp.isfinite(v), axis=axes))
    return jnp.where(bad, FLAG_NONFINITE, 0).astype(jnp.int32)


def _nonfinite_encoding(ek: codec.EncodedKeys, ev: codec.EncodedValues, levels: int) -> Array:
    """[B] bool: a row whose stored scales, zeros or norms are not finite.

    Finite input can still overflow float32 inside the encoder (the rotation grows a
    vector by up to sqrt(D), a group's range max - min can exceed the float32 max):
    such a row is flagged FLAG_NONFINITE like a row with NaN/Inf input. So is a group
    whose top value ``zero + levels * scale`` overflows the parameter dtype: the Pallas
    decode kernel dequantizes in 16 bits (float16 parameters: values near 65504).
    """
    f32 = jnp.float32
    tops = [(z.astype(f32) + levels * s.astype(f32)).astype(s.dtype)
            for s, z in ((ek.scale, ek.zero), (ev.scale, ev.zero))]  # fmt: skip
    bad = None
    for x in (ek.scale, ek.zero, ek.norm, ev.scale, ev.zero, *tops):
        r = ~jnp.all(jnp.isfinite(x.astype(f32)), axis=tuple(range(1, x.ndim)))
        bad = r if bad is None else bad | r
    return bad


def _residual_tokens(
    nq: Array, n: Array, slots: int, offset=0, count: int | None = None
) -> tuple[Array, Array]:
    """Token index held by ring slots offset..offset+count-1, and validity: [B, count] each."""
    count = slots if count is None else count
    s = offset + jnp.arange(count, dtype=jnp.int32)[None, :]
    t = nq[:, None] + jnp.mod(s - nq[:, None], slots)
    return t, t < n[:, None]


@compiled(arrays=("cache", "k", "v", "lengths"))
def prefill(
    cache: KVCache,
    k: Float[Array, "B T H D"],
    v: Float[Array, "B T H D"],
    lengths: Int[Array, " B"] | None = None,
    *,
    implementation: str = "xla",
    **options,
) -> KVCache:
    """Write a prompt of T tokens (row i: its first lengths[i]) into the cache.

    The previous contents are replaced (prefill starts a sequence). Lengths outside
    [0, T] are clipped and flagged with FLAG_BAD_LENGTH. ``implementation`` picks
    the encoder of the quantized part ("xla" or "pallas"); ``options`` go to it.
    """
    _check_kv(cache, k, v, 4, "[batch, tokens, num_kv_heads, head_dim]")
    b, t = k.shape[:2]
    if t > cache.max_len:
        raise ValueError(f"prompt length T={t} must be <= the cache's max_len={cache.max_len}")
    cfg = cache.cfg
    if lengths is None:
        n = jnp.full((b,), t, jnp.int32)
        bad = jnp.zeros((b,), jnp.int32)
    else:
        lengths = jnp.asarray(lengths)
        if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise ValueError(f"lengths.shape={lengths.shape} must be ({b},) of integers")
        n = jnp.clip(lengths, 0, t).astype(jnp.int32)
        bad = jnp.where(n != lengths, FLAG_BAD_LENGTH, 0).astype(jnp.int32)
    empty = init_cache(  # planar; a record cache is converted at the end (exact)
        cfg.replace(layout="planar"), batch=b, max_len=cache.max_len,
        num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim, dtype=cache.dtype,
    )  # fmt: skip
    kh = jnp.swapaxes(k, 1, 2)  # [B, H, T, D]
    vh = jnp.swapaxes(v, 1, 2)
    valid_tok = (jnp.arange(t)[None, :] < n[:, None])[:, None, :, None]
    flags = bad | _nonfinite_rows(jnp.where(valid_tok, kh, 0), jnp.where(valid_tok, vh, 0))
    nq = quantized_count(n, cfg)
    fields = {}
    if cfg.quantized:
        g, r = cfg.group_size, cfg.residual_length
        tq = (max(0, t - r) // g) * g  # static upper bound of nq
        if tq:
            ek, ev = codec.encode(
                kh[:, :, :tq].astype(cache.dtype), vh[:, :, :tq].astype(cache.dtype), cfg,
                implementation=implementation, **options,
            )  # fmt: skip
            tok_ok = jnp.arange(tq)[None, :] < nq[:, None]  # [B, tq]
            grp_ok = tok_ok[:, ::g]

            def put(dst, src, ok, axis_len):
                m = ok.reshape(b, 1, axis_len, *([1] * (src.ndim - 3)))
                src = jnp.where(m, src, jnp.zeros((), src.dtype))
                return dst.at[:, :, :axis_len].set(src.astype(dst.dtype))

            fields = dict(
                k_codes=put(empty.k_codes, ek.codes, tok_ok, tq),
                k_scale=put(empty.k_scale, ek.scale, grp_ok, tq // g),
                k_zero=put(empty.k_zero, ek.zero, grp_ok, tq // g),
                k_norm=put(empty.k_norm, ek.norm, tok_ok, tq),
                v_codes=put(empty.v_codes, ev.codes, tok_ok, tq),
                v_scale=put(empty.v_scale, ev.scale, tok_ok, tq),
                v_zero=put(empty.v_zero, ev.zero, tok_ok, tq),
            )
            overflow = _nonfinite_encoding(
                codec.EncodedKeys(None, *(fields[f] for f in ("k_scale", "k_zero", "k_norm"))),
                codec.EncodedValues(None, fields["v_scale"], fields["v_zero"]),
                cfg.levels,
            )
            flags = flags | jnp.where(overflow, FLAG_NONFINITE, 0).astype(jnp.int32)
    tok, ok = _residual_tokens(nq, n, cache.slots)
    idx = jnp.clip(tok, 0, t - 1)[:, None, :, None]
    okm = ok[:, None, :, None]

    def ring(x):
        g_ = jnp.take_along_axis(
            x, jnp.broadcast_to(idx, x.shape[:2] + idx.shape[2:3] + x.shape[3:]), 2
        )
        return jnp.where(okm, g_, 0).astype(cache.dtype)

    out = dataclasses.replace(
        empty, k_res=ring(kh), v_res=ring(vh), lengths=n, flags=flags, **fields
    )
    return convert_layout(out, cfg.layout)


def quantized_parts(cache: KVCache) -> tuple[codec.EncodedKeys, codec.EncodedValues]:
    """The quantized part as encoded blocks (all Lq positions; rows valid up to nq). A
    record-layout cache is read through the exact inverse (float32 norms [B, H, Lq])."""
    f = {n: getattr(cache, n) for n in record.PLANAR}
    if cache.cfg.layout == "record" and cache.quant_capacity:
        f = record.record_to_planar(f, param_dtype=cache.cfg.scale_dtype)
    return (
        codec.EncodedKeys(f["k_codes"], f["k_scale"], f["k_zero"], f["k_norm"]),
        codec.EncodedValues(f["v_codes"], f["v_scale"], f["v_zero"]),
    )


@compiled(arrays=("cache",))
def dequantize(cache: KVCache) -> tuple[Float[Array, "B L H D"], Float[Array, "B L H D"]]:
    """Keys and values as stored, [B, max_len, H, D] float32, original basis, zeros past length."""
    b, h, d, L = cache.batch, cache.num_kv_heads, cache.head_dim, cache.max_len
    n, nq = cache.lengths, cache.num_quantized()
    k = jnp.zeros((b, h, L, d), jnp.float32)
    v = jnp.zeros((b, h, L, d), jnp.float32)
    lq = min(cache.quant_capacity, L)
    if lq:
        ek, ev = quantized_parts(cache)
        kq = codec.decode_keys(ek, cache.cfg, rotated=False)[:, :, :lq]
        vq = codec.decode_values(ev, cache.cfg, rotated=False)[:, :, :lq]
        m = (jnp.arange(lq)[None, :] < nq[:, None])[:, None, :, None]
        k = k.at[:, :, :lq].set(jnp.where(m, kq, 0))
        v = v.at[:, :, :lq].set(jnp.where(m, vq, 0))
    tok, ok = _residual_tokens(nq, n, cache.slots)
    pos = jnp.where(ok, tok, L)  # invalid slots scatter out of bounds and are dropped
    rows = jnp.arange(b)[:, None]
    k = (
        jnp.swapaxes(k, 1, 2)
        .at[rows, pos]
        .set(jnp.swapaxes(cache.k_res, 1, 2).astype(jnp.float32), mode="drop")
    )
    v = (
        jnp.swapaxes(v, 1, 2)
        .at[rows, pos]
        .set(jnp.swapaxes(cache.v_res, 1, 2).astype(jnp.float32), mode="drop")
    )
    return k, v


def bytes_per_token(cache: KVCache) -> tuple[float, int]:
    """(quantized bytes per token, residual bytes per token) over all heads of one row."""
    cfg, h, d = cache.cfg, cache.num_kv_heads, cache.head_dim
    res = 2 * h * d * jnp.dtype(cache.dtype).itemsize
    if not cfg.quantized:
        return 0.0, res
    if cfg.layout == "record":  # a record per 64 tokens and a float32 norm, per head
        return h * (record.record_words(cfg.bits, d) * 4 / record.TILE + 4), res
    p = jnp.dtype(cfg.scale_dtype).itemsize
    hn = cache.k_norm.shape[1]
    per = 2 * h * d * cfg.bits / 8  # K and V codes
    per += h * 2 * d * p / cfg.group_size  # K scale + zero, amortised over G tokens
    per += h * 2 * (d // cfg.value_group(d)) * p  # V scale + zero
    per += hn * jnp.dtype(cfg.norm_dtype).itemsize
    return per, res


def cache_nbytes(cache: KVCache) -> int:
    """Bytes the cache holds for the tokens stored (codes, params, norms, residual); host-side."""
    n = np.asarray(cache.lengths, np.int64)
    nq = np.asarray(cache.num_quantized(), np.int64)
    per_q, per_r = bytes_per_token(cache)
    return int(round(float(np.sum(nq) * per_q + np.sum(n - nq) * per_r)))


def cache_capacity_nbytes(cache: KVCache) -> int:
    """Bytes allocated by the cache's arrays (what the device holds)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache)))
