"""``fake_quant_keys`` / ``fake_quant_values`` on non-finite input: as in the cache, the
row that holds a NaN / Inf comes back all NaN, the other rows bit-identical."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oscar_jax as oj

FNS = {"keys": oj.fake_quant_keys, "values": oj.fake_quant_values}
CFGS = {
    "oscar2": oj.preset("oscar", bits=2),
    "kivi2": oj.preset("kivi", bits=2),
    "oscar4_pertoken": oj.preset("oscar", bits=4, norm_granularity="per_token"),
}


def _x(b=3, t=70, h=2, d=64, dtype=jnp.float32):  # t % 32 != 0: the padded last group too
    return jax.random.normal(jax.random.PRNGKey(7), (b, t, h, d), dtype) * 2.0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("cfg", list(CFGS))
@pytest.mark.parametrize("which", list(FNS))
def test_nonfinite_row_comes_back_nan_other_rows_bit_identical(which, cfg, bad):
    fn, cfg = FNS[which], CFGS[cfg]
    x = _x()
    ref = np.asarray(fn(x, cfg))
    assert np.isfinite(ref).all()
    y = x.at[1, 40, 1, 5].set(bad)  # one element of one token of row 1
    out = np.asarray(fn(y, cfg))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert np.isnan(out[1]).all()  # the bad token, its group and its row: visibly bad
    np.testing.assert_array_equal(out[[0, 2]], ref[[0, 2]])  # bit-identical
    # the same row alone in a batch of one: the clean rows do not depend on the batch
    np.testing.assert_array_equal(np.asarray(fn(x[:1], cfg)), ref[:1])


@pytest.mark.parametrize("which", list(FNS))
def test_bfloat16_input_and_jit(which):
    fn, cfg = FNS[which], CFGS["oscar2"]
    x = _x(dtype=jnp.bfloat16)
    y = x.at[0, 3, 0, 0].set(jnp.nan)
    out = np.asarray(jax.jit(fn, static_argnums=1)(y, cfg).astype(jnp.float32))
    ref = np.asarray(fn(x, cfg).astype(jnp.float32))
    assert np.isnan(out[0]).all() and np.isfinite(ref).all()
    np.testing.assert_array_equal(out[1:], ref[1:])


@pytest.mark.parametrize("which", list(FNS))
def test_finite_overflowing_encoding_is_nan_too(which):
    """float16 parameters hold |x| <= 65504: a row beyond that is flagged, as in the cache."""
    fn, cfg = FNS[which], oj.preset("kivi", bits=2, param_dtype="float16")
    x = _x().at[2].multiply(1e6)
    out = np.asarray(fn(x, cfg))
    assert np.isnan(out[2]).all() and np.isfinite(out[:2]).all()


@pytest.mark.parametrize("which", list(FNS))
@pytest.mark.parametrize("cfg", list(CFGS))
def test_zero_and_constant_input_stay_finite(which, cfg):
    fn, cfg = FNS[which], CFGS[cfg]
    x = jnp.concatenate([jnp.zeros((1, 64, 2, 64)), jnp.full((1, 64, 2, 64), 3.25)], axis=0)
    out = np.asarray(fn(x, cfg))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[0], 0.0)


def test_bf16_is_the_identity_nan_included():
    x = _x().at[0, 1, 0, 0].set(jnp.nan)
    for fn in FNS.values():
        out = np.asarray(fn(x, oj.preset("bf16")))
        np.testing.assert_array_equal(out, np.asarray(x))  # NaN stays where it was
