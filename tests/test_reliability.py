"""Bad rows stay in their row, flags become checkify errors, capacity never wraps, determinism."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import models
import oscar_jax as oj
from models.stopping import STOP_CAPACITY, STOP_NONE

SMALL = dict(residual_length=32, group_size=32)
B, H, HQ, D = 4, 2, 4, 64


def _data(seed, t, b=B):
    kk, kv, kq = jax.random.split(jax.random.key(seed), 3)
    k = jax.random.normal(kk, (b, t, H, D))
    v = jax.random.normal(kv, (b, t, H, D))
    q = jax.random.normal(kq, (b, HQ, D))
    return k, v, q


def _run(cfg, k, v, q, n_prefill, impl="xla", lengths=None):
    """prefill n_prefill tokens, append the rest one by one; decode after every step."""
    c = oj.init_cache(cfg, batch=k.shape[0], max_len=k.shape[1] + 4, num_kv_heads=H,
                      head_dim=D, dtype=jnp.float32)  # fmt: skip
    c = jax.jit(oj.prefill)(c, k[:, :n_prefill], v[:, :n_prefill], lengths)
    step = jax.jit(oj.append)
    dec = jax.jit(lambda q, c: oj.decode_attention(q, c, implementation=impl))
    outs = [dec(q, c)]
    for t in range(n_prefill, k.shape[1]):
        c = step(c, k[:, t], v[:, t])
        outs.append(dec(q, c))
    return c, jnp.stack(outs, 1)  # [B, steps, HQ, D]


# -- non-finite input cannot spread -------------------------------------------------
@pytest.mark.parametrize(
    "method, where, bad, impl",
    [
        ("oscar", "k_quantized", jnp.nan, "xla"),  # flushed into the INT2 part by prefill
        ("oscar", "v_ring", jnp.inf, "xla"),  # still in the full-precision ring
        ("kivi", "k_append", -jnp.inf, "xla"),  # appended, then flushed
        ("oscar", "v_append", jnp.nan, "pallas"),
        ("kivi", "k_quantized", jnp.inf, "pallas"),  # no rotation: the Pallas merge poisons
        ("bf16", "k_ring", jnp.nan, "xla"),
    ],
)
def test_poisoned_row_cannot_spread(method, where, bad, impl):
    cfg = oj.preset("bf16") if method == "bf16" else oj.preset(method, bits=2, **SMALL)
    t, n0 = 110, 70
    k, v, q = _data(0, t)
    pos = {"k_quantized": 3, "v_ring": 60, "k_append": 75, "v_append": 80, "k_ring": 50}[where]
    arr = k if where.startswith("k") else v
    poisoned = arr.at[2, pos, 1, 5].set(bad)
    kp, vp = (poisoned, v) if where.startswith("k") else (k, poisoned)
    c_clean, o_clean = _run(cfg, k, v, q, n0, impl)
    c_bad, o_bad = _run(cfg, kp, vp, q, n0, impl)
    first = max(0, pos - n0 + 1)  # first output after the bad token entered the cache
    assert c_bad.flags.tolist() == [0, 0, oj.FLAG_NONFINITE, 0]
    assert c_clean.flags.tolist() == [0] * B
    clean_rows = np.array([0, 1, 3])
    np.testing.assert_array_equal(o_bad[clean_rows], o_clean[clean_rows])  # bit for bit
    chex.assert_trees_all_equal(
        jax.tree_util.tree_map(lambda x: x[clean_rows], c_bad),
        jax.tree_util.tree_map(lambda x: x[clean_rows], c_clean),
    )
    np.testing.assert_array_equal(o_bad[2, :first], o_clean[2, :first])
    # what the bad row yields from then on: NaN for every query head (poison_flagged_rows)
    assert np.all(np.isnan(np.asarray(o_bad[2, first:])))


# -- checkify -----------------------------------------------------------------------
def _cache(b=3, max_len=70):
    cfg = oj.preset("oscar", **SMALL)
    return oj.init_cache(cfg, batch=b, max_len=max_len, num_kv_heads=H, head_dim=D,
                         dtype=jnp.float32)  # fmt: skip


def test_check_cache_names_flag_and_row():
    k, v, _ = _data(1, 70, b=3)
    c = oj.prefill(_cache(), k, v, jnp.array([70, 10, 5]))

    def step(c, kt, vt):
        c = oj.append(c, kt, vt)
        oj.check_cache(c)
        return c

    f = jax.jit(checkify.checkify(step))
    err, c1 = f(c, k[:, 0], v[:, 0])  # row 0 is full
    assert "FLAG_OVERFLOW in row 0" in err.get()
    assert c1.lengths.tolist() == [70, 11, 6]
    c_ok = oj.prefill(_cache(), k, v, jnp.array([60, 10, 5]))
    err, _ = f(c_ok, k[:, 0], v[:, 0])
    assert err.get() is None
    err, _ = f(c_ok, k[:, 0], v[:, 0].at[2, 1, 3].set(jnp.nan))
    assert "FLAG_NONFINITE in row 2" in err.get()
    c_bad = jax.jit(oj.prefill)(_cache(), k, v, jnp.array([60, 71, 5]))
    with pytest.raises(checkify.JaxRuntimeError, match="FLAG_BAD_LENGTH in row 1"):
        oj.checked(lambda c: c)(c_bad)
    with pytest.raises(checkify.JaxRuntimeError, match="FLAG_NONFINITE in row 1"):
        oj.checked(oj.append)(c_ok, k[:, 0].at[1, 0, 0].set(jnp.inf), v[:, 0])
    out = oj.checked(oj.append)(c_ok, k[:, 0], v[:, 0])
    assert out.lengths.tolist() == [61, 11, 6]
    assert oj.checks.describe_rows(c_bad.flags) == {1: ["FLAG_BAD_LENGTH"]}
    # masks select the flags to enforce
    oj.checked(lambda c: c, mask=oj.FLAG_OVERFLOW)(c_bad)


def test_check_cache_on_layer_stacked_caches():
    k, v, _ = _data(2, 40, b=3)
    one = lambda kk: oj.prefill(_cache(), kk, v)  # noqa: E731
    stacked = jax.vmap(one)(jnp.stack([k, k.at[1, 0, 0, 0].set(jnp.nan)]))
    assert stacked.flags.shape == (2, 3)
    with pytest.raises(checkify.JaxRuntimeError, match="FLAG_NONFINITE in row 1"):
        oj.checked(lambda c: c)(stacked)
    err, _ = checkify.checkify(lambda c: oj.checks.check_finite(c.k_res[1]) or c)(stacked)
    assert "non-finite values in row 1" in err.get()


# -- capacity -----------------------------------------------------------------------
@pytest.mark.parametrize("method", ["oscar", "bf16"])
def test_decoding_past_capacity_is_reported_never_wraps(method):
    cfg = oj.preset("bf16") if method == "bf16" else oj.preset(method, bits=2, **SMALL)
    max_len = 96
    k, v, q = _data(3, max_len + 6, b=2)
    c = oj.init_cache(cfg, batch=2, max_len=max_len, num_kv_heads=H, head_dim=D,
                      dtype=jnp.float32)  # fmt: skip
    c = oj.prefill(c, k[:, :90], v[:, :90], jnp.array([90, 50]))
    step = jax.jit(oj.append)
    dec = jax.jit(oj.decode_attention)

    def checked_step(c, kt, vt):
        c = oj.append(c, kt, vt)
        oj.check_cache(c)
        return c

    cstep = jax.jit(checkify.checkify(checked_step))
    for t in range(90, 96):
        err, _ = cstep(c, k[:, t], v[:, t])
        assert err.get() is None
        c = step(c, k[:, t], v[:, t])
    full, out_full = c, dec(q, c)
    assert c.lengths.tolist() == [96, 56] and c.flags.tolist() == [0, 0]
    for t in range(96, 102):  # row 0 is full: 6 appends past capacity under jit
        err, _ = cstep(c, k[:, t], v[:, t])
        assert "FLAG_OVERFLOW in row 0" in err.get()
        c = step(c, k[:, t], v[:, t])
    assert c.lengths.tolist() == [96, 62]
    assert c.flags.tolist() == [oj.FLAG_OVERFLOW, 0]
    row0 = lambda x: x[0]  # noqa: E731
    # row 0: every array bit-identical to the full cache (nothing overwritten or wrapped)
    chex.assert_trees_all_equal(
        jax.tree_util.tree_map(row0, dataclasses_replace_flags(c, full.flags)),
        jax.tree_util.tree_map(row0, full),
    )
    np.testing.assert_array_equal(dec(q, c)[0], out_full[0])


def dataclasses_replace_flags(c, flags):
    import dataclasses

    return dataclasses.replace(c, flags=flags)


def _tiny_model():
    cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                             num_heads=2, num_kv_heads=1, head_dim=16)  # fmt: skip
    return models.CausalLM(cfg)


def test_generate_reports_overflow_per_row():
    """generate(return_info=True): per-row flags (OR over layers), cache lengths and the stop
    reason show why; the overflowing row stops (pad ids), the other one runs on."""
    m = _tiny_model()
    ids = np.arange(2 * 12, dtype=np.int32).reshape(2, 12) % 64
    kv = oj.preset("oscar", bits=2, residual_length=16, group_size=16)
    out, info = models.generate(m, ids, 10, kv=kv, lengths=np.array([12, 4]), stop_tokens=(),
                                max_len=16, return_info=True)  # fmt: skip
    # row 0: prompt 12 + 9 decode appends > 16 -> overflow; row 1: 4 + 9 = 13 fits
    assert np.asarray(info["flags"]).tolist() == [oj.FLAG_OVERFLOW, 0]
    assert np.asarray(info["cache_lengths"]).tolist() == [16, 13]
    assert oj.checks.describe_rows(info["flags"]) == {0: ["FLAG_OVERFLOW"]}
    assert out.shape == (2, 10)
    # row 0: 4 appends fill it, the 5th (token 4) overflows: tokens 5.. are the pad id (0)
    assert np.asarray(info["stop_reason"]).tolist() == [STOP_CAPACITY, STOP_NONE]
    assert np.asarray(info["num_tokens"]).tolist() == [5, 10]
    assert np.all(np.asarray(out)[0, 5:] == 0)


# -- determinism --------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_bit_identical_repeated_runs(impl):
    cfg = oj.preset("oscar", bits=2, **SMALL)
    k, v, q = _data(5, 100, b=2)

    @jax.jit
    def start(k, v):
        c = oj.init_cache(cfg, batch=2, max_len=104, num_kv_heads=H, head_dim=D,
                          dtype=jnp.bfloat16)  # fmt: skip
        return oj.prefill(c, k, v, jnp.array([90, 61]), implementation=impl)

    @jax.jit
    def step(c, kt, vt):
        c = oj.append(c, kt, vt, implementation=impl)
        return c, oj.decode_attention(q, c, implementation=impl)

    def run():
        c, outs = start(k[:, :94], v[:, :94]), []
        for t in (94, 95, 96):  # row 0 flushes at 96 (R + G = 64 past 32 quantized)
            c, o = step(c, k[:, t], v[:, t])
            outs.append(o)
        return c, jnp.stack(outs)

    a = run()
    b = run()
    jax.clear_caches()  # and after recompiling
    c = run()
    chex.assert_trees_all_equal(a, b)
    chex.assert_trees_all_equal(a, c)
