"""oscarbo (E + KVQuant's dense-and-sparse outliers): outliers come back exactly, are
counted and stay out of the range; without outliers it is E; the k-bias offset is
added back; fitted levels; bytes add up."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax import hadamard, quant
from oscar_jax.methods import base
from oscar_jax.methods import parse_name as P


def _kv(shape=(1, 2, 64, 64), seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(k1, shape) + 0.3, jax.random.normal(k2, shape) - 0.2


def _fq(cfg, *args, **kw):
    return jax.jit(cfg.fake_quant_kv)(*args, **kw)


def _rel(a, b) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_names_fields_and_calibration_flag():
    c = P("oscarbo2_ko5_vo2")
    assert (c.k_outliers, c.v_outliers, c.fitted_levels) == (5, 2, False)
    assert not c.needs_calibration and c.needs_key_bias
    assert P("oscarbo2_nuq1").needs_calibration
    assert type(P("oscarb2")).__name__ == "OscarBias"  # the longer name does not shadow E
    with pytest.raises(ValueError, match="nuq1"):
        P("oscarbo2_uni1")
    with pytest.raises(ValueError, match="k_outliers"):
        _fq(P("oscarbo2_ko256"), *_kv((1, 1, 32, 8)))  # G x D = 256
    with pytest.raises(ValueError, match="fitted"):
        _fq(P("oscarbo2_nuq1"), *_kv())


def test_outliers_in_the_rotated_space_exact_counted_and_out_of_the_range():
    cfg = P("oscarbo2_ko5_vo2")
    k, v = _kv()
    u, n = base.oscar_keys_scaled(k, cfg.base("oscar"))
    u = u.at[0, 1, 3, 7].set(5.0)  # a planted outlier
    lv = jnp.linspace(0.0, 1.0, 4)
    u01, out, uh = jax.jit(cfg._keys)(u, lv)
    assert bool(out[0, 1, 3, 7])
    assert np.all(np.asarray(out).reshape(1, 2, 2, 32, 64).sum(axis=(3, 4)) == 5)
    np.testing.assert_array_equal(uh[out], quant.round_to_dtype(u, "float16")[out])
    # the range is the non-outliers': every normalised non-outlier in [0, 1], both ends hit
    inner = np.where(np.asarray(out), np.nan, np.asarray(u01)).reshape(1, 2, 2, 32, 64)
    assert np.nanmin(inner) >= 0 and np.nanmax(inner) <= 1
    assert np.allclose(np.nanmax(inner, axis=3), 1, atol=2e-3)  # fp16 scale rounding
    vr = hadamard.rotate(v, cfg.base("oscar"))
    _, vout, vh = jax.jit(cfg._values)(vr, lv)
    assert np.all(np.asarray(vout).sum(-1) == 2)
    np.testing.assert_array_equal(vh[vout], quant.round_to_dtype(vr, "float16")[vout])


def test_without_outliers_it_is_E_and_outliers_cut_the_error_of_heavy_tails():
    k, v = _kv((1, 1, 64, 64))
    t = jax.random.t(jax.random.PRNGKey(5), 2.0, k.shape)  # heavy-tailed keys and values
    k, v = k + t, v + 0.5 * t
    off = jax.random.normal(jax.random.PRNGKey(3), (64, 1, 64)) * 3.0  # [T, H, D]
    kb = k + jnp.swapaxes(off, 0, 1)[None]
    ke, ve = _fq(P("oscarb2"), kb, v, off)
    k0, v0 = _fq(P("oscarbo2_ko0_vo0"), kb, v, off)
    # same key path and value quantizer; only where the scale is rounded to fp16 differs
    # (the range, or the range / 3): a small fraction of the quantization error
    assert _rel(k0, ke) < 0.1 * _rel(ke, kb) and _rel(v0, ve) < 0.1 * _rel(ve, v)
    ko, vo = _fq(P("oscarbo2"), kb, v, off)
    assert _rel(ko, kb) < 0.97 * _rel(ke, kb) and _rel(vo, v) < 0.97 * _rel(ve, v)


def test_the_offset_is_taken_out_and_added_back():
    k, v = _kv()
    off = jax.random.normal(jax.random.PRNGKey(4), (64, 2, 64)) * 10.0
    cfg = P("oscarbo2")
    k1, v1 = _fq(cfg, k + jnp.swapaxes(off, 0, 1)[None], v, off)
    k0, v0 = _fq(cfg, k, v)
    np.testing.assert_allclose(k1 - jnp.swapaxes(off, 0, 1)[None], k0, atol=2e-4)
    np.testing.assert_array_equal(v1, v0)
    with pytest.raises(ValueError, match="key_offset"):
        _fq(cfg, k, v, off[:32])


def test_fitted_levels_sorted_per_layer_and_better_than_uniform():
    k, v = _kv((1, 1, 64, 16))
    kl, vl = jnp.stack([k, 2 * k]), jnp.stack([v, v * v])  # [L=2, N=1, H, T, D]
    off = np.zeros((2, 64, 1, 16), np.float32)
    cfg = P("oscarbo2_nuq1").fit(kl, vl, (None, None), off)
    for name in ("k_levels", "v_levels"):
        lv = cfg.calibration.arrays[name]
        assert lv.shape == (2, 4) and np.all(np.diff(lv, axis=1) > 0)
        assert lv.min() >= 0 and lv.max() <= 1
    kh, _ = _fq(cfg, k, v, state=cfg.calibrated_state(0))
    ku, _ = _fq(P("oscarbo2"), k, v)
    assert _rel(kh, k) < _rel(ku, k)
    with pytest.raises(NotImplementedError):
        P("oscarbo2").fit(kl, vl, (None, None))


@pytest.mark.parametrize(
    ("name", "d", "total"),
    [("oscarbo2", 64, 55.5), ("oscarbo2", 128, 103.5), ("oscarbo2", 256, 199.5),
     ("oscarbo2_ko0_vo0", 64, 50.0), ("oscarbo2_nuq1", 64, 55.5),
     ("oscarbo2_ko40_vo2", 64, 50 + 40 * 4 / 32 + 2 * 3)],
)  # fmt: skip
def test_bytes_are_oscars_plus_kvquants_outliers(name, d, total):
    parts = P(name).bytes_per_token(d)
    assert parts["total"] == pytest.approx(total)
    assert parts["k_norm"] == 2 and parts["k_codes"] == d / 4
    # D = 256: a key group of 32 x 256 entries needs a 2-byte index, a value token 1 byte
    if name == "oscarbo2" and d == 256:
        assert (parts["k_outliers"], parts["v_outliers"]) == (20 * 4 / 32, 3)
