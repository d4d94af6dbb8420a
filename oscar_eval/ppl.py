"""Perplexity with every token attending to the KV cache exactly as it would while decoding.

Decoding token t (``models.generate``'s step) first appends its key/value to the
cache, which then holds n = t + 1 tokens: the oldest
``nq(t) = G * floor(max(0, t + 1 - R) / G)`` quantized (whole groups, see
``oscar_jax.cache``), the rest, the current token included (unless R = 0 and the
append completed a group), in full precision in the ring. Query t then attends to
keys j <= t, key j read from the quantized part when j < nq(t), else at full
precision.

A quantized token's dequantized key and value never change after its flush: keys
are quantized per channel over aligned groups of G tokens [iG, (i+1)G), token
norms and value groups are per token. So one encoding of all full groups of the
sequence (``oscar_jax.codec.encode``, the cache's own encoder and numerics: rotation,
token norms of either granularity, parameter dtypes) plus a per-(t, j) mask gives
every query the cache it would see: ``cached_attention`` is the parallel form,
and ``tests/test_eval.py`` checks it against token-by-token decoding through the
real cache (``models.prefill`` + ``models.decode_step``). As in ``models.generate``,
the value rotation is folded into W_V / W_O and the cache config gets
``rotate_values=False``; the scores of quantized keys are taken in the rotated
basis (rotated query against ``decode_keys(..., rotated=True)``) as
``oscar_jax.decode_attention`` does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

import oscar_jax as oj
from models import layers
from models.config import ModelConfig
from models.model import CausalLM
from oscar_eval.common import Method, Progress, bootstrap_ppl
from oscar_eval.settings import PPL_SCORES
from oscar_jax import codec, hadamard
from oscar_jax import methods as oscar_methods

HIGHEST = jax.lax.Precision.HIGHEST
CHUNK = 256  # queries per block: the scores of one block are [B, Hkv, g, CHUNK, T]


def cache_kv_config(kv: oj.KVQuantConfig) -> oj.KVQuantConfig:
    """The config the model hands its caches: value rotation folded into the weights."""
    return kv.replace(rotate_values=False) if kv.rotate_values else kv


def _attend_block(qg, q_rot, k, v, k_deq, v_deq, q_pos, kv, scale):
    """One block of C queries at positions q_pos [C] over all T keys (see cached_attention)."""
    t = k.shape[1]
    j = jnp.arange(t)[None, :]
    causal = j <= q_pos[:, None]  # [C, T]
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=HIGHEST)
    if k_deq is None:
        quant = jnp.zeros_like(causal)
    else:
        nq = oj.cache.quantized_count(q_pos + 1, kv)  # tokens quantized when q_pos is decoded
        quant = j < nq[:, None]
        s_q = jnp.einsum("bqhgd,bkhd->bhgqk", q_rot, k_deq, precision=HIGHEST)
        s = jnp.where(quant, s_q, s)
    s = jnp.where(causal, s * scale, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(causal, p, 0.0)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", jnp.where(quant, 0.0, p), v, precision=HIGHEST)
    if k_deq is not None:
        o_q = jnp.einsum("bhgqk,bkhd->bqhgd", jnp.where(quant, p, 0.0), v_deq, precision=HIGHEST)
        if kv.rotate_values:  # only when the caller did not fold the value rotation
            o_q = hadamard.unrotate(o_q, kv)
        o = o + o_q
    return o


def cached_attention(
    q: Float[Array, "B T Hq D"],
    k: Float[Array, "B T Hkv D"],
    v: Float[Array, "B T Hkv D"],
    kv: oj.KVQuantConfig,
    *,
    chunk: int = CHUNK,
    cache_dtype=None,
    key_offset: Float[Array, "T Hkv D"] | None = None,
    method_kw: dict | None = None,
) -> Float[Array, "B T Hq D"]:
    """Causal attention in which query t sees the cache as it is when token t is decoded.

    q, k (after RoPE) and v as the model hands them to the cache; returns q's dtype.
    ``cache_dtype`` (default k's) is the dtype the cache stores k/v in before encoding.
    A comparison method (``oscar_jax.methods``) quantizes through its own
    ``fake_quant_kv``, in the original basis; ``key_offset`` and ``method_kw`` (from
    ``method_inputs``: ``key_offset``, ``rope``, ``state``) are what it is handed.
    """
    b, t, hq, d = q.shape
    h = k.shape[2]
    cdt = jnp.dtype(cache_dtype or k.dtype)
    k, v = k.astype(cdt), v.astype(cdt)
    qg = q.astype(jnp.float32).reshape(b, t, h, hq // h, d)
    tq = (t // kv.group_size) * kv.group_size if kv.quantized else 0
    k_deq = v_deq = None
    q_rot = qg
    if tq and isinstance(kv, oscar_methods.MethodConfig):
        kw = dict(method_kw or {})
        if key_offset is not None:
            kw["key_offset"] = key_offset
        if kw.get("key_offset") is not None:
            kw["key_offset"] = kw["key_offset"][:tq]
        if "rope" in kw:
            kw["rope"] = tuple(x[:tq] for x in kw["rope"])
        kd, vd = kv.fake_quant_kv(
            jnp.swapaxes(k, 1, 2)[:, :, :tq], jnp.swapaxes(v, 1, 2)[:, :, :tq], **kw
        )
        pad = ((0, 0), (0, t - tq), (0, 0), (0, 0))
        k_deq, v_deq = (jnp.pad(jnp.swapaxes(x, 1, 2), pad) for x in (kd, vd))
    elif tq:
        ek, ev = codec.encode(
            jnp.swapaxes(k, 1, 2)[:, :, :tq], jnp.swapaxes(v, 1, 2)[:, :, :tq], kv
        )
        pad = ((0, 0), (0, t - tq), (0, 0), (0, 0))
        k_deq = jnp.pad(jnp.swapaxes(codec.decode_keys(ek, kv), 1, 2), pad)  # rotated basis
        v_deq = jnp.pad(jnp.swapaxes(codec.decode_values(ev, kv), 1, 2), pad)
        if kv.rotate_keys:
            q_rot = hadamard.rotate(qg, kv)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    scale = float(1.0 / np.sqrt(d))
    attend = functools.partial(_attend_block, kv=kv, scale=scale)
    if t <= chunk or t % chunk:
        o = attend(qg, q_rot, kf, vf, k_deq, v_deq, jnp.arange(t))
    else:
        n = t // chunk
        blocks = lambda x: jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)
        pos = jnp.arange(t).reshape(n, chunk)
        o = jax.lax.map(
            lambda a: attend(a[0], a[1], kf, vf, k_deq, v_deq, a[2]),
            (blocks(qg), blocks(q_rot), pos),
        )
        o = jnp.moveaxis(o, 0, 1)
    return o.reshape(b, t, hq, d).astype(q.dtype)


def key_offset(mc: ModelConfig, kv, lp, positions) -> Array | None:
    """[T, Hkv, D]: the RoPE'd k bias a comparison method takes out of the keys
    (``oscar_jax.methods.bias_offset``; positions [B, T], the same in every row), or None
    when the method wants none, the layer has no k bias, or a qk-norm follows the bias."""
    if not getattr(kv, "needs_key_bias", False) or lp.get("bk") is None or mc.qk_norm:
        return None
    cos, sin = layers.rope_cos_sin(mc, positions[0])
    return oscar_methods.rope_key_offset(lp["bk"], cos, sin, mc.num_kv_heads)


def method_inputs(mc: ModelConfig, kv, lp, positions) -> dict:
    """What a comparison method's ``fake_quant_kv`` is handed besides k and v, by what
    it declares: ``key_offset`` (``key_offset``), ``rope`` (cos, sin [T, D] of the
    positions, for a method that quantizes pre-RoPE keys) and ``state`` (this layer's
    calibration arrays, scanned with the layers: ``with_method_state``)."""
    out: dict = {}
    if not isinstance(kv, oscar_methods.MethodConfig):
        return out
    out["key_offset"] = key_offset(mc, kv, lp, positions)
    if kv.needs_rope:
        out["rope"] = layers.rope_cos_sin(mc, positions[0])
    if kv.calibration is not None:
        out["state"] = lp["method_state"]
    return out


def with_method_state(lays: dict, kv) -> dict:
    """The stacked layer params with a calibrated method's per-layer arrays added
    (``method_state``), so that ``lax.scan`` hands each layer its slice."""
    cal = getattr(kv, "calibration", None)
    if cal is None:
        return lays
    return {**lays, "method_state": {k: jnp.asarray(a) for k, a in cal.arrays.items()}}


def forward_cached(
    mc: ModelConfig, params, ids, kv: oj.KVQuantConfig, keep_norms: bool = False, cache_dtype=None
):
    """Hidden states [B, T, Hd] (pre final norm) with cache-exact attention in every layer.

    ``params`` must have the value rotation of ``kv`` folded in when ``kv.rotate_values``
    is False but the method rotates values (``CausalLM.folded_params``); with
    ``keep_norms`` also the l2 norm of every key, [L, B, T, Hkv] float32.
    ``cache_dtype`` (default: the params') is the dtype the caches store K/V in.
    """
    b, t = ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = layers.embed(params, ids, mc)

    def step(x, lp):
        mi = method_inputs(mc, kv, lp, positions)
        attend = lambda q, k, v: cached_attention(q, k, v, kv, cache_dtype=cache_dtype,  # noqa: E731
                                                  method_kw=mi)  # fmt: skip
        x, (k, _) = layers.block(mc, lp, x, positions, attend)
        norms = jnp.linalg.norm(k.astype(jnp.float32), axis=-1) if keep_norms else None
        return x, norms

    lays = with_method_state(params["layers"], kv)
    return _scan_layers(mc, step, x, lays, positions, cache_dtype, keep_norms)


def _scan_layers(mc: ModelConfig, step, x, lays, positions, cache_dtype, keep_norms: bool):
    """``lax.scan`` of ``step`` over the stacked layers. Gemma 3's sliding-window layers
    attend instead in full precision (K/V in the cache dtype) over their window, as
    decoding does (their cache is ``models.window``'s ring)."""
    if not mc.local_layers:
        return jax.lax.scan(step, x, lays)

    def local(x, lp):
        cd = jnp.dtype(cache_dtype or x.dtype)
        attend = lambda q, k, v: layers.causal_attention(  # noqa: E731
            q, k.astype(cd), v.astype(cd), window=mc.sliding_window
        )
        x, (k, _) = layers.block(mc, lp, x, positions, attend, local=True)
        norms = jnp.linalg.norm(k.astype(jnp.float32), axis=-1) if keep_norms else None
        return x, norms

    kinds = jnp.asarray([mc.is_local(i) for i in range(mc.num_layers)])
    return jax.lax.scan(lambda x, a: jax.lax.cond(a[1], local, step, x, a[0]), x, (lays, kinds))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _nll_jit(mc: ModelConfig, kv: oj.KVQuantConfig, keep_norms: bool, cache_dtype, params, ids):
    x, norms = forward_cached(mc, params, ids, kv, keep_norms, cache_dtype)
    logits = layers.lm_head(mc, params, x[:, :-1])  # [B, T-1, V]
    lp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(lp, ids[:, 1:, None], axis=-1)[..., 0]
    return nll, norms


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _logits_jit(mc: ModelConfig, kv: oj.KVQuantConfig, cache_dtype, params, ids):
    x, _ = forward_cached(mc, params, ids, kv, cache_dtype=cache_dtype)
    return layers.lm_head(mc, params, x)


def _dtype_name(m: CausalLM, cache_dtype) -> str:
    return jnp.dtype(cache_dtype or m.dtype).name


def cached_logits(m: CausalLM, ids, kv: oj.KVQuantConfig, cache_dtype=None) -> Array:
    """[B, T] -> [B, T, V] float32 logits with each token attending to the cache as in decoding.

    ``cache_dtype``: what the caches store K/V in (default the model's dtype, as in
    ``models.generate``).
    """
    ids = m.check_ids(ids)
    dt = _dtype_name(m, cache_dtype)
    return _logits_jit(m.config, cache_kv_config(kv), dt, m.folded_params(kv), jnp.asarray(ids))


def _sds(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def nll_program(m: CausalLM, kv: oj.KVQuantConfig, batch: int, t: int, cache_dtype=None):
    """A thunk compiling ``window_nll``'s program for windows [batch, t] (for
    ``oscar_eval.programs.Precompiler``: the later call finds it compiled)."""
    mc, ckv, dt = m.config, cache_kv_config(kv), _dtype_name(m, cache_dtype)
    params = _sds(m.folded_params(kv))
    ids = jax.ShapeDtypeStruct((batch, t), jnp.int32)
    return lambda: _nll_jit.lower(mc, ckv, False, dt, params, ids).compile()


def window_nll(
    m: CausalLM, windows, kv: oj.KVQuantConfig, *, batch: int = 1, keep_norms: bool = False,
    cache_dtype=None, progress: Progress | None = None,
):  # fmt: skip
    """Per-token NLL [N, T-1] (float64) of each window [N, T] (and key norms [N, L, T, Hkv]).

    Windows run ``batch`` at a time (the last batch is padded by repetition, which
    keeps one compilation per shape).
    """
    windows = m.check_ids(windows)
    n = len(windows)
    if n == 0:
        raise ValueError("windows must hold at least one window")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"{batch=} must be a positive int")
    params, ckv = m.folded_params(kv), cache_kv_config(kv)
    nlls, norms = [], []
    for i in range(0, n, batch):
        chunk = windows[i : i + batch]
        k = len(chunk)
        if k < batch:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - k, axis=0)])
        nll, nrm = _nll_jit(m.config, ckv, keep_norms, _dtype_name(m, cache_dtype), params,
                            jnp.asarray(chunk))  # fmt: skip
        nlls.append(np.asarray(nll, np.float64)[:k])
        if keep_norms:
            norms.append(np.swapaxes(np.asarray(nrm), 0, 1)[:k])  # [k, L, T, H]
        if progress is not None:
            progress.update(k)
    nll = np.concatenate(nlls)
    return (nll, np.concatenate(norms)) if keep_norms else (nll, None)


SCORES = PPL_SCORES


def score_start(t: int, score: str = "all") -> int:
    """Index into a window's per-token NLL [T-1] (entry i scores token i + 1) where scoring
    starts: 0 for ``"all"``; for ``"second_half"`` the entry of token T // 2, so that only
    tokens at positions T // 2 .. T-1 count (each sees at least T // 2 tokens of history,
    most of it quantized, instead of the first R + G positions that see no quantized key)."""
    if score not in SCORES:
        raise ValueError(f"{score=} must be one of {SCORES}")
    if isinstance(t, bool) or not isinstance(t, int | np.integer) or t < 2:
        raise ValueError(f"{t=} must be an int >= 2 (tokens per window)")
    return 0 if score == "all" else max(t // 2 - 1, 0)


def perplexity(
    m: CausalLM, windows, methods: list[Method], *, batch: int = 1, ref: str = "bf16",
    memo: dict | None = None, cache_dtype=None, show_progress: bool = True, seed: int = 0,
    score: str = "all",
) -> list[dict]:  # fmt: skip
    """Perplexity of each method over the windows, with 95% bootstrap CIs over windows.

    One row per method (``bootstrap_ppl``'s fields plus bits, R, G), with the paired
    difference to the method named ``ref`` when that one is among the methods or in
    ``memo`` (a dict name -> per-window NLL sums, filled and reused across calls; one
    ``cache_dtype`` and one ``score`` per memo). ``score``: which tokens of a window
    count, ``"all"`` (every token after the first) or ``"second_half"`` (``score_start``).
    """
    memo = {} if memo is None else memo
    t = int(np.asarray(windows).shape[1])
    start = score_start(t, score)
    todo = [mt for mt in sorted(methods, key=lambda mt: mt.name != ref) if mt.name not in memo]
    for mt in todo:
        bar = Progress(len(windows), f"ppl {mt.name:<20}", enabled=show_progress)
        nll, _ = window_nll(m, windows, mt.kv, batch=batch, cache_dtype=cache_dtype, progress=bar)
        memo[mt.name] = nll[:, start:].sum(axis=1)
    count = np.full(len(windows), t - 1 - start, np.float64)
    rows = []
    for mt in methods:
        other = memo.get(ref) if mt.name != ref else None
        r = bootstrap_ppl(memo[mt.name], count, other, seed=seed)
        rows.append({"method": mt.name, "bits": mt.kv.bits, "R": mt.kv.residual_length,
                     "G": mt.kv.group_size, **r})  # fmt: skip
    return rows
