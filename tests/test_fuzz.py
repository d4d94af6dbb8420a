"""Property-based fuzzing of the public ops: finite in -> finite out, within the error bound.

Inputs are drawn as (shape, dtype, config, seed, magnitude, pattern) and built with
numpy from the seed: magnitudes 10^e for e in [-44, 30] (float32: subnormal to 1e30;
float16 / bfloat16 stay in their range), patterns "normal", "constant" (constant
quantization groups), "zeros" (zero vectors), "outlier" (one element 10^6 times the
rest), "mixed" (per-token magnitudes spread over 10 decades).

The bound (``quant`` docstring): for a group with stored scale s and zero z (in
the param dtype), every element has |x - x_hat| <= s/2 + ulp(z)/2 + levels*ulp(s)/2
(the rounding of the stored z and s to their dtype) + float32 arithmetic slack. Keys
are quantized as x = R k / n (rotation R orthonormal, n the stored token norm), so
||k - k_hat||_2 <= n * ||e||_2 with e the per-element bound of the token's channels;
values as x = R v, so ||v - v_hat||_2 <= ||e||_2. Attention: each output channel lies
within [min, max] of the dequantized values of the row's valid tokens (a convex
combination), up to float32 slack.

CI runs the "ci" hypothesis profile (``tests/conftest.py``): derandomized, no shrinking,
each property's own small example count. ``OSCAR_HYPOTHESIS_PROFILE=long`` selects the
"long" profile: the counts times ``SCALE["long"]`` (or ``OSCAR_FUZZ_SCALE``), with
shrinking; ``OSCAR_FUZZ_EXAMPLES=n`` raises every count to at least n.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import tol

import oscar_jax as oj
from oscar_jax import codec, quant

PROFILE = os.environ.get("OSCAR_HYPOTHESIS_PROFILE", "ci")
SCALE = {"ci": 1, "long": 12}
FACTOR = int(os.environ.get("OSCAR_FUZZ_SCALE", SCALE.get(PROFILE, 1)))
N = int(os.environ.get("OSCAR_FUZZ_EXAMPLES", "0"))


def fuzz(n: int):
    """The loaded profile's settings with ``n`` (the CI count) scaled for the profile."""
    return settings(settings.get_profile(PROFILE), max_examples=max(n * FACTOR, N))


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
PATTERNS = ("normal", "constant", "zeros", "outlier", "mixed")
F32 = np.finfo(np.float32)


def max_exp(dtype: str) -> int:
    """Largest decade whose values (times 1e6 outliers, rotation growth) stay finite."""
    return {"float32": 30, "bfloat16": 30, "float16": -2}[dtype]


def min_exp(dtype: str) -> int:
    return {"float32": -44, "bfloat16": -44, "float16": -7}[dtype]


@st.composite
def magnitudes(draw, dtype: str, param_dtype: str = "bfloat16"):
    hi = max_exp(dtype)
    if param_dtype == "float16":
        hi = min(hi, -2)  # scales/zeros of |x| <= 1e4 fit float16
    return draw(st.integers(min_exp(dtype), hi))


def make(shape, seed: int, exp: int, pattern: str, dtype: str, group_axis: int = 1, g: int = 1):
    """A float array of ``shape`` and ``dtype`` (numpy) with magnitude 10^exp and the pattern."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    if pattern == "constant":  # constant along groups of g on group_axis
        sl = [slice(None)] * len(shape)
        sl[group_axis] = slice(None, None, g)
        x = np.repeat(x[tuple(sl)], g, axis=group_axis)[tuple(slice(0, s) for s in shape)]
    elif pattern == "zeros":
        x[..., rng.integers(0, shape[-1]) :] = 0.0
        x[:, rng.integers(0, shape[1]) if shape[1] else 0] = 0.0
    elif pattern == "outlier":
        x = x * 1e-6
        idx = tuple(int(rng.integers(0, s)) for s in shape)
        x[idx] = 1.0 if rng.random() < 0.5 else -1.0
    elif pattern == "mixed":
        x = x * 10.0 ** rng.integers(-10, 1, size=shape[:2] + (1,) * (len(shape) - 2))
    x = x * 10.0**exp
    np_dt = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    return x.astype(np_dt)


def ulp(y, dtype) -> np.ndarray:
    """Spacing of ``dtype`` at |y| (the smallest subnormal step below the normal range)."""
    fi = ml_dtypes.finfo(dtype)
    a = np.maximum(np.abs(np.asarray(y, np.float64)), float(fi.smallest_normal))
    return 2.0 ** (np.floor(np.log2(a)) - fi.nmant)


def elem_bound(scale, zero, levels, param_dtype):
    """Per-group bound on |x - x_hat| from the stored scale/zero (float64)."""
    s = np.abs(np.asarray(scale, np.float64))
    z = np.asarray(zero, np.float64)
    dt = jnp.dtype(param_dtype)
    rnd = 0.5 * ulp(z, dt) + levels * 0.5 * ulp(s, dt)
    slack = 4 * F32.eps * (levels * s + np.abs(z)) + 2 * levels * float(F32.tiny)
    return s / 2 + rnd + slack


def finite(x) -> bool:
    return bool(np.all(np.isfinite(np.asarray(x, np.float32))))


# -- quantize_groups: the primitive -------------------------------------------------
@fuzz(25)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    param_dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
    bits=st.sampled_from([1, 2, 3, 4, 8]),
    log_g=st.integers(0, 6),
    groups=st.sampled_from([1, 3]),
    rows=st.sampled_from([1, 4]),
    pattern=st.sampled_from(PATTERNS),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_quantize_groups_bound(dtype, param_dtype, bits, log_g, groups, rows, pattern, seed, data):
    g = 1 << log_g
    exp = data.draw(magnitudes(dtype, param_dtype))
    x = make((rows, groups * g), seed, exp, pattern, dtype, group_axis=1, g=g)
    codes, scale, zero = quant.quantize_groups(jnp.asarray(x), bits, g, 1, param_dtype)
    levels = (1 << bits) - 1
    assert int(jnp.max(codes)) <= levels
    assert finite(scale) and finite(zero)
    xh = quant.dequantize_groups(codes, scale, zero, g, 1)
    assert finite(xh)
    err = np.abs(np.asarray(xh, np.float64) - np.asarray(x, np.float64))
    bound = np.repeat(elem_bound(scale, zero, levels, param_dtype), g, axis=1)
    assert np.all(err <= bound), float(np.max(err - bound))
    if pattern == "constant" and param_dtype == "float32" and dtype == "float32":
        # scale 0 -> exact, except float32 subnormals: XLA on CPU flushes them to zero
        # (found by the long profile: 1.26e-39 -> 0.0; within the bound's tiny32 term)
        xh = np.asarray(xh)
        normal = np.abs(x) >= F32.tiny
        np.testing.assert_array_equal(xh[normal], x[normal])
        assert np.all((xh[~normal] == x[~normal]) | (xh[~normal] == 0.0))


# -- fake quantization of keys and values ---------------------------------------------
def _cfg(method, bits, g, granularity="per_head", rotation="hadamard", param_dtype="float16"):
    kw = dict(bits=bits, group_size=g, residual_length=0, norm_granularity=granularity,
              param_dtype=param_dtype)  # fmt: skip
    if method in ("oscar", "rotation_only"):
        kw["rotation"] = rotation
    return oj.preset(method, **kw)


@fuzz(6)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    method=st.sampled_from(["kivi", "ots_only", "rotation_only", "oscar"]),
    bits=st.sampled_from([1, 2, 3, 4, 8]),
    log_g=st.integers(3, 6),
    d=st.sampled_from([64, 80]),
    t=st.sampled_from([1, 37, 64]),
    granularity=st.sampled_from(["per_head", "per_token"]),
    pattern=st.sampled_from(PATTERNS),
    param_dtype=st.sampled_from(["bfloat16", "float16"]),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_fake_quant_keys_values_bound(
    dtype, method, bits, log_g, d, t, granularity, pattern, param_dtype, seed, data
):
    g = 1 << log_g
    if d % min(g, d):
        g = 16
    cfg = _cfg(method, bits, g, granularity, param_dtype=param_dtype)
    exp = data.draw(magnitudes(dtype, param_dtype))  # float16 parameters bound the range
    b, h = 2, 2
    k = make((b, t, h, d), seed, exp, pattern, dtype, group_axis=1, g=g)
    v = make((b, t, h, d), seed + 1, exp, pattern, dtype, group_axis=3, g=cfg.value_group(d))
    kh = jax.jit(oj.fake_quant_keys, static_argnums=1)(jnp.asarray(k), cfg)
    vh = jax.jit(oj.fake_quant_values, static_argnums=1)(jnp.asarray(v), cfg)
    assert kh.dtype == k.dtype and vh.dtype == v.dtype
    assert finite(kh) and finite(vh)
    eps = float(ml_dtypes.finfo(k.dtype).eps)
    levels = cfg.levels
    k64, v64 = np.asarray(k, np.float64), np.asarray(v, np.float64)
    sub = float(ml_dtypes.finfo(k.dtype).smallest_subnormal) if k.dtype != np.float32 else 0.0
    abs_slack = 64 * float(F32.tiny) * np.sqrt(d) + sub * np.sqrt(d)

    # values: per token, ||v - v_hat|| <= ||e|| (rotation orthonormal) + output rounding
    ev = codec.encode_values_xla(jnp.swapaxes(jnp.asarray(v), 1, 2), cfg)
    e = np.repeat(elem_bound(ev.scale, ev.zero, levels, cfg.param_dtype), cfg.value_group(d), -1)
    bound_v = np.sqrt(np.sum(e**2, -1)).swapaxes(1, 2)  # [B, T, H]
    err_v = np.linalg.norm(np.asarray(vh, np.float64) - v64, axis=-1)
    nv = np.linalg.norm(v64, axis=-1)
    assert np.all(err_v <= bound_v * (1 + 1e-5) + (eps + 1e-5) * (nv + bound_v) + abs_slack)

    # keys: per token, ||k - k_hat|| <= n * ||e|| with e per (group of G tokens, channel)
    tp = -(-t // g) * g
    kp = np.concatenate([k, np.repeat(k[:, -1:], tp - t, axis=1)], 1) if tp > t else k
    ek = codec.encode_keys_xla(jnp.swapaxes(jnp.asarray(kp), 1, 2), cfg)
    e = np.repeat(elem_bound(ek.scale, ek.zero, levels, cfg.param_dtype), g, 2)  # [B,H,Tp,D]
    n = np.asarray(ek.norm, np.float64)[..., None]  # [B, Hn, Tp, 1]
    bound_k = (n * np.sqrt(np.sum(e**2, -1, keepdims=True)))[..., 0].swapaxes(1, 2)[:, :t]
    err_k = np.linalg.norm(np.asarray(kh, np.float64) - k64, axis=-1)
    nk = np.linalg.norm(k64, axis=-1)
    assert np.all(err_k <= bound_k * (1 + 1e-5) + (eps + 1e-5) * (nk + bound_k) + abs_slack), float(
        np.max(err_k - bound_k)
    )


# -- cache ops: prefill, append, dequantize, decode_attention --------------------------
def _cache_cfg(method, bits, g, granularity="per_head"):
    if method == "bf16":
        return oj.preset("bf16")
    return oj.preset(method, bits=bits, group_size=g, residual_length=g,
                     norm_granularity=granularity)  # fmt: skip


@fuzz(4)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    method=st.sampled_from(["bf16", "kivi", "oscar"]),
    bits=st.sampled_from([2, 4]),
    g=st.sampled_from([16, 32]),
    granularity=st.sampled_from(["per_head", "per_token"]),
    lengths=st.lists(st.integers(0, 96), min_size=2, max_size=2),
    extra=st.sampled_from([0, 37]),
    pattern=st.sampled_from(PATTERNS),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_cache_ops_finite_bounded(
    dtype, method, bits, g, granularity, lengths, extra, pattern, seed, data
):
    """prefill (ragged) + append steps: flags clean, dequantize exact on the ring and equal to
    fake quantization on the quantized part, decode inside the values' hull."""
    cfg = _cache_cfg(method, bits, g, granularity)
    exp = data.draw(magnitudes(dtype))
    b, h, hq, d, t = len(lengths), 2, 4, 64, 96  # fixed shapes: one compilation per config
    max_len = t + extra + 3
    k = make((b, t + extra, h, d), seed, exp, pattern, dtype, group_axis=1, g=g)
    v = make((b, t + extra, h, d), seed + 1, exp, pattern, dtype, group_axis=3, g=g)
    q = make((b, hq, d), seed + 2, 0, "normal", dtype)
    cache = oj.init_cache(cfg, batch=b, max_len=max_len, num_kv_heads=h, head_dim=d,
                          dtype=jnp.dtype(dtype))  # fmt: skip
    n = np.asarray(lengths)
    cache = jax.jit(oj.prefill)(cache, jnp.asarray(k[:, :t]), jnp.asarray(v[:, :t]), n)
    step = jax.jit(oj.append)
    # continue each row with its own next tokens (row i's token j at position n_i + j)
    full_k = [np.concatenate([k[i, : n[i]], k[i, t:]]) for i in range(b)]
    full_v = [np.concatenate([v[i, : n[i]], v[i, t:]]) for i in range(b)]
    for j in range(extra):
        cache = step(cache, jnp.asarray(k[:, t + j]), jnp.asarray(v[:, t + j]))
    assert cache.flags.tolist() == [0] * b
    assert cache.lengths.tolist() == (n + extra).tolist()
    kd, vd = jax.jit(oj.dequantize)(cache)
    assert finite(kd) and finite(vd)
    nq = np.asarray(cache.num_quantized())
    for i in range(b):
        m, mq = int(n[i] + extra), int(nq[i])
        np.testing.assert_array_equal(np.asarray(kd[i, mq:m]), full_k[i][mq:m].astype(np.float32))
        np.testing.assert_array_equal(np.asarray(vd[i, mq:m]), full_v[i][mq:m].astype(np.float32))
        np.testing.assert_array_equal(np.asarray(kd[i, m:]), 0)
        if mq:
            fk = oj.fake_quant_keys(jnp.asarray(full_k[i][None, :mq]), cfg)
            fv = oj.fake_quant_values(jnp.asarray(full_v[i][None, :mq]), cfg)
            for got, want in ((kd[i, :mq], fk[0]), (vd[i, :mq], fv[0])):
                want = np.asarray(want, np.float32)
                scale = float(np.max(np.abs(want))) or 1.0
                err = float(np.max(np.abs(np.asarray(got) - want)))
                sub = float(ml_dtypes.finfo(jnp.dtype(dtype)).smallest_subnormal)
                assert err <= tol(dtype)["rtol"] * scale + sub, (err, scale)  # + output rounding
    out = np.asarray(jax.jit(oj.decode_attention)(jnp.asarray(q), cache), np.float64)
    assert finite(out)
    # convex hull (per channel box) of the dequantized values of the valid tokens
    for i in range(b):
        m = int(n[i] + extra)
        if m == 0:
            np.testing.assert_array_equal(out[i], 0)
            continue
        vv = np.asarray(vd[i, :m], np.float64)  # [m, H, D]
        lo, hi = vv.min(0), vv.max(0)  # [H, D]
        rep = hq // h
        lo, hi = np.repeat(lo, rep, 0), np.repeat(hi, rep, 0)
        span = np.max(np.abs(vv)) * (tol(dtype)["rtol"] + 1e-5) + 1e-37
        assert np.all(out[i] >= lo - span) and np.all(out[i] <= hi + span)


# -- XLA vs Pallas (interpret) --------------------------------------------------------
@fuzz(2)
@given(
    bits=st.sampled_from([2]),
    method=st.sampled_from(["oscar"]),
    lengths=st.lists(st.integers(0, 150), min_size=2, max_size=2),
    exp=st.integers(-15, 4),
    pattern=st.sampled_from(PATTERNS),
    seed=st.integers(0, 2**31 - 1),
)
def test_xla_and_pallas_agree(bits, method, lengths, exp, pattern, seed):
    """Decode (and the fused encoder) of the two implementations agree within tolerances,
    keys and values over the same magnitudes and patterns (the kernel's value dot is
    bfloat16, so no float16 window applies to values)."""
    cfg = oj.preset(method, bits=bits, group_size=32, residual_length=32)
    b, h, hq, d, t = 2, 1, 2, 64, 150
    k = make((b, t, h, d), seed, exp, pattern, "float32", group_axis=1, g=32)
    v = make((b, t, h, d), seed + 1, exp, pattern, "float32", 3, 32)
    q = jnp.asarray(make((b, hq, d), seed + 2, 0, "normal", "float32"))
    c0 = oj.init_cache(cfg, batch=b, max_len=t + 8, num_kv_heads=h, head_dim=d,
                       dtype=jnp.float32)  # fmt: skip
    cx = oj.prefill(c0, jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths))
    cp = oj.prefill(c0, jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths),
                    implementation="pallas")  # fmt: skip
    # the fused encoder: codes may differ by one level at exact rounding ties (its docstring)
    kx, vx = oj.dequantize(cx)
    kp, vp = oj.dequantize(cp)
    for a, bb in ((kx, kp), (vx, vp)):
        scale = float(jnp.max(jnp.abs(a))) or 1.0
        diff = np.asarray(jnp.abs(a - bb) > 1e-5 * scale)
        assert diff.mean() <= 0.01, diff.mean()
    ox = oj.decode_attention(q, cx, implementation="xla")
    op = oj.decode_attention(q, cx, implementation="pallas")
    assert finite(ox) and finite(op)
    ref = float(jnp.max(jnp.abs(vx))) or 1.0  # relative to the values' magnitude
    # the kernel's MMA operands are 16-bit (pallas_kernels/decode/int_kernel.py): float16 tolerance
    assert float(jnp.max(jnp.abs(op - ox))) <= tol(jnp.float16)["max_rel"] * ref


def test_pallas_decode_large_values_finite():
    """Values ~1e5, beyond float16: with bfloat16 parameters the bfloat16 value dot stays
    finite; with float16 parameters (the default) the row is flagged, not silently inf."""
    k = jax.random.normal(jax.random.key(0), (1, 96, 1, 64))
    v = jax.random.normal(jax.random.key(1), (1, 96, 1, 64)) * 1e5
    q = jax.random.normal(jax.random.key(2), (1, 2, 64))
    for pdt in ("bfloat16", "float16"):
        cfg = oj.preset("oscar", bits=2, group_size=32, residual_length=32, param_dtype=pdt)
        c = oj.init_cache(cfg, batch=1, max_len=100, num_kv_heads=1, head_dim=64,
                          dtype=jnp.float32)  # fmt: skip
        c = oj.prefill(c, k, v)
        if pdt == "float16":
            assert int(c.flags[0]) & oj.FLAG_NONFINITE
            continue
        assert not int(c.flags[0])
        assert finite(oj.decode_attention(q, c, implementation="xla"))
        assert finite(oj.decode_attention(q, c, implementation="pallas"))


@pytest.mark.parametrize("mag", [1e-6, 1e-7, 1e-20])
def test_pallas_decode_small_values_precision(mag):
    """Value scales below float16's normal range (6.1e-5) keep their precision (bf16 dot)."""
    cfg = oj.preset("oscar", bits=2, group_size=32, residual_length=32)
    k = jax.random.normal(jax.random.key(0), (1, 96, 1, 64))
    v = jax.random.normal(jax.random.key(1), (1, 96, 1, 64)) * mag
    q = jax.random.normal(jax.random.key(2), (1, 2, 64))
    c = oj.init_cache(cfg, batch=1, max_len=100, num_kv_heads=1, head_dim=64, dtype=jnp.float32)
    c = oj.prefill(c, k, v)
    ox = oj.decode_attention(q, c, implementation="xla")
    op = oj.decode_attention(q, c, implementation="pallas")
    ref = float(jnp.max(jnp.abs(oj.dequantize(c)[1])))
    assert float(jnp.max(jnp.abs(op - ox))) <= tol(jnp.float16)["max_rel"] * ref


def test_encoder_overflow_is_flagged_not_silent():
    """Finite input whose encoding overflows float32 (|v| ~ 1e38: the rotation sums 64 of
    them) -> FLAG_NONFINITE, at prefill and at a flush."""
    cfg = oj.preset("oscar", bits=2, group_size=32, residual_length=32)
    k = jax.random.normal(jax.random.key(0), (2, 96, 1, 64))
    v = jax.random.normal(jax.random.key(1), (2, 96, 1, 64))
    v = v.at[1].set(jnp.clip(v[1], -1.5, 1.5) * 1e38)
    assert finite(v)
    c = oj.init_cache(cfg, batch=2, max_len=200, num_kv_heads=1, head_dim=64, dtype=jnp.float32)
    c1 = oj.prefill(c, k, v)
    assert c1.flags.tolist() == [0, oj.FLAG_NONFINITE]
    step = jax.jit(oj.append)
    c2 = oj.prefill(c, k[:, :63], v[:, :63])
    assert c2.flags.tolist() == [0, 0]  # all in the ring so far
    c2 = step(c2, k[:, 63], v[:, 63])  # 64 tokens = R + G: flush of group 0
    assert c2.flags.tolist() == [0, oj.FLAG_NONFINITE]
