"""Proposal E (``bias_offset``, ``group_mean``) and A (``compact``): the offsets are
taken out exactly, and what they fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oscar_jax as oj
from models import layers
from oscar_jax import methods as M
from oscar_jax.methods import base


def _rope_tables(t, d, theta=1e6):
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    f = np.arange(t)[:, None] * inv
    emb = np.concatenate([f, f], axis=-1)
    return jnp.asarray(np.cos(emb), jnp.float32), jnp.asarray(np.sin(emb), jnp.float32)


def _keys_with_bias(t=128, h=2, d=64, scale=30.0, seed=0):
    """Keys [1, H, T, D] = RoPE(noise) + RoPE(b), with a large bias b; and c [T, H, D]."""
    kb, kn = jax.random.split(jax.random.PRNGKey(seed))
    bias = jax.random.normal(kb, (h * d,)) * scale
    cos, sin = _rope_tables(t, d)
    c = M.rope_key_offset(bias, cos, sin, h)
    noise = jax.random.normal(kn, (1, t, h, d))
    k = layers.apply_rope(noise, cos[None], sin[None]) + c[None]
    return jnp.swapaxes(k, 1, 2), c, bias


def test_rope_key_offset_is_the_models_rope_of_the_bias():
    t, h, d = 40, 3, 64
    bias = jax.random.normal(jax.random.PRNGKey(1), (h * d,))
    cos, sin = _rope_tables(t, d, theta=1e4)
    want = layers.apply_rope(jnp.broadcast_to(bias.reshape(1, 1, h, d), (1, t, h, d)),
                             cos[None], sin[None])[0]  # fmt: skip
    got = M.rope_key_offset(bias, cos, sin, h)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    with pytest.raises(ValueError, match="bias.shape"):
        M.rope_key_offset(bias[:-1], cos, sin, h)
    with pytest.raises(ValueError, match="cos.shape"):
        M.rope_key_offset(bias, cos[:, :8], sin[:, :8], h)


def test_bias_offset_equals_oscar_on_the_bias_free_keys_plus_the_offset():
    k, c, _ = _keys_with_bias()
    cfg = M.OscarBias()
    kh, _ = cfg.fake_quant_kv(k, k, c)
    off = jnp.swapaxes(c, 0, 1)[None]
    want = oj.fake_quant_keys(jnp.swapaxes(k - off, 1, 2), cfg.base("oscar"))
    np.testing.assert_allclose(np.asarray(kh - off), np.asarray(jnp.swapaxes(want, 1, 2)),
                               atol=1e-3)  # fmt: skip
    with pytest.raises(ValueError, match="key_offset.shape"):
        cfg.fake_quant_kv(k, k, c[:5])


def test_bias_offset_fixes_what_the_rotation_breaks():
    """With a large RoPE-turned bias OScaR's key error is dominated by it; with the
    offset taken out it is far smaller (only the bias-free part is quantized)."""
    k, c, _ = _keys_with_bias(scale=40.0)
    err = lambda kh: float(jnp.sum((kh - k) ** 2))  # noqa: E731
    oscar = jnp.swapaxes(oj.fake_quant_keys(jnp.swapaxes(k, 1, 2), oj.preset("oscar")), 1, 2)
    fixed, _ = M.OscarBias().fake_quant_kv(k, k, c)
    assert err(fixed) < 0.01 * err(oscar)


def test_group_mean_is_stored_and_added_back():
    b, h, t, d = 1, 2, 64, 64
    k = jax.random.normal(jax.random.PRNGKey(2), (b, h, t, d)) + 100.0  # a constant offset
    cfg = M.OscarGroupMean()
    kh, _ = cfg.fake_quant_kv(k, k)
    mu = jnp.mean(k.reshape(b, h, 2, 32, d), axis=3, keepdims=True)
    mu = jnp.broadcast_to(base.round_fp(mu, "float16"), (b, h, 2, 32, d)).reshape(k.shape)
    want = base.oscar_keys_fake_quant(k, cfg.base("oscar"), mu)
    np.testing.assert_array_equal(np.asarray(kh), np.asarray(want))
    # a group of one repeated key is its own mean: back exactly (up to fp16's rounding)
    rep = jnp.broadcast_to(k[:, :, :1], k.shape)
    kr, _ = cfg.fake_quant_kv(rep, rep)
    np.testing.assert_allclose(np.asarray(kr), np.asarray(rep), rtol=2.0**-11)


def test_shared_exponent_norms_relative_precision_and_range():
    n = jnp.asarray([[[1000.0, 3.0, 0.1, 0.0] * 8]])  # [1, 1, 32], beyond e4m3's 448
    s = M.shared_exponent_norms(n, 32)
    assert np.all(np.isfinite(np.asarray(s)))
    nz = np.asarray(n) > 0
    rel = np.abs(np.asarray(s)[nz] / np.asarray(n)[nz] - 1)
    assert rel.max() <= 2.0**-4 + 1e-7  # e4m3's relative step / 2 down to 2^-14 of the max
    assert np.all(np.asarray(s)[~nz] == 0)


def test_compact_parameters_are_fp8_values():
    cfg = M.OscarCompact()
    k, c, _ = _keys_with_bias(scale=5.0)
    kh, vh = cfg.fake_quant_kv(k, k, c)
    assert np.all(np.isfinite(np.asarray(kh))) and np.all(np.isfinite(np.asarray(vh)))
    rel = float(jnp.sum((kh - k) ** 2) / jnp.sum((k - jnp.swapaxes(c, 0, 1)[None]) ** 2))
    assert rel < 0.3
