"""KIVI + sink tokens and OTT: the full-precision tokens come back exactly and are left
out of their group's min/max; everything else is KIVI."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oscar_jax as oj
from oscar_jax import methods as M
from oscar_jax.methods import base


def _kv(b=2, h=2, t=96, d=64, seed=5):
    kk, kv = jax.random.split(jax.random.PRNGKey(seed))
    k = (jax.random.normal(kk, (b, h, t, d)) * 2.0).astype(jnp.bfloat16).astype(jnp.float32)
    v = jax.random.normal(kv, (b, h, t, d)).astype(jnp.bfloat16).astype(jnp.float32)
    return k, v


def _kivi(x, which):
    fn = oj.fake_quant_keys if which == "k" else oj.fake_quant_values
    return jnp.swapaxes(fn(jnp.swapaxes(x, 1, 2), oj.preset("kivi")), 1, 2)


def test_masked_quantizer_without_mask_is_kivi():
    k, _ = _kv()
    got = base.masked_group_fake_quant(k, jnp.zeros(k.shape[:3], bool), 2, 32, "float16")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_kivi(k, "k")))


def test_masked_quantizer_excludes_kept_tokens_from_min_max():
    k, _ = _kv(b=1, h=1, t=32)
    k = k.at[0, 0, 3].set(500.0)  # an outlier token that would blow the range up
    keep = jnp.zeros((1, 1, 32), bool).at[0, 0, 3].set(True)
    got = base.masked_group_fake_quant(k, keep, 2, 32, "float16")
    rest = jnp.delete(k, 3, axis=2)
    assert got.shape == k.shape
    np.testing.assert_array_equal(np.asarray(got[0, 0, 3]), np.asarray(k[0, 0, 3]))
    lo = jnp.min(rest, axis=2)
    hi = jnp.max(rest, axis=2)
    others = jnp.delete(got, 3, axis=2)
    assert bool(jnp.all(others >= lo[:, :, None] - 1e-2))
    assert bool(jnp.all(others <= hi[:, :, None] + 1e-2))
    # every group all kept: scale 0, exact, finite
    allk = base.masked_group_fake_quant(k, jnp.ones((1, 1, 32), bool), 2, 32, "float16")
    np.testing.assert_array_equal(np.asarray(allk), np.asarray(k))


@pytest.mark.parametrize("s", [0, 1, 4])
def test_sinks_are_exact_and_the_rest_is_kivi_beyond_group_zero(s):
    k, v = _kv()
    kh, vh = M.KiviSinks(sinks=s).fake_quant_kv(k, v)
    np.testing.assert_array_equal(np.asarray(kh[:, :, :s]), np.asarray(k[:, :, :s]))
    np.testing.assert_array_equal(np.asarray(vh[:, :, :s]), np.asarray(v[:, :, :s]))
    # groups after the first do not see the sinks: bit-identical to KIVI there
    np.testing.assert_array_equal(np.asarray(kh[:, :, 32:]), np.asarray(_kivi(k, "k")[:, :, 32:]))
    np.testing.assert_array_equal(np.asarray(vh[:, :, s:]), np.asarray(_kivi(v, "v")[:, :, s:]))
    if s == 0:
        np.testing.assert_array_equal(np.asarray(kh), np.asarray(_kivi(k, "k")))


def test_sinks_help_a_low_norm_sink():
    k, v = _kv(b=1, h=1, t=64)
    k = k.at[:, :, 0].multiply(0.02)  # TNI: a sink key 50x smaller
    k = k.astype(jnp.bfloat16).astype(jnp.float32)  # as the cache holds it
    e = lambda kh: float(jnp.sum((kh[:, :, 0] - k[:, :, 0]) ** 2))  # noqa: E731
    assert e(M.KiviSinks(sinks=1).fake_quant_kv(k, v)[0]) == 0.0 < e(_kivi(k, "k"))


@pytest.mark.parametrize("n", [1, 2])
def test_ott_pool_is_the_n_smallest_l1_keys_per_group_and_exact(n):
    k, v = _kv()
    cfg = M.OTT(pool=n)
    keep = cfg.keep_mask(k)
    assert keep.shape == k.shape[:3]
    counts = np.asarray(keep).reshape(2, 2, 3, 32).sum(-1)
    assert np.all(counts == n)
    l1 = np.abs(np.asarray(k)).sum(-1).reshape(2, 2, 3, 32)
    kept = np.asarray(keep).reshape(2, 2, 3, 32)
    assert np.all(l1[kept].reshape(2, 2, 3, n).max(-1) <= np.where(kept, np.inf, l1).min(-1))
    kh, vh = cfg.fake_quant_kv(k, v)
    sel = np.asarray(keep)
    np.testing.assert_array_equal(np.asarray(kh)[sel], np.asarray(k)[sel])
    np.testing.assert_array_equal(np.asarray(vh)[sel], np.asarray(v)[sel])
    want = base.masked_group_fake_quant(k, keep, 2, 32, "float16")
    np.testing.assert_array_equal(np.asarray(kh), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(vh)[~sel], np.asarray(_kivi(v, "v"))[~sel])


def test_ott_zero_pool_is_kivi():
    k, v = _kv()
    kh, vh = M.OTT(pool=0).fake_quant_kv(k, v)
    np.testing.assert_array_equal(np.asarray(kh), np.asarray(_kivi(k, "k")))
    np.testing.assert_array_equal(np.asarray(vh), np.asarray(_kivi(v, "v")))


def test_pool_bytes():
    assert M.OTT(pool=2).bytes_per_token(128)["outlier_pool"] == 2 * (512 + 1) / 32
    assert M.KiviSinks(sinks=4).bytes_per_token(64, context=1024)["sink_kv"] == 1.0
    with pytest.raises(ValueError, match="context"):
        M.KiviSinks().bytes_per_token(64, context=0)
