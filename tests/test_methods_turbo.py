"""TurboQuant-style codebook quantizer: the Lloyd-Max levels, codes on the codebook,
norms kept, rotation orthogonal."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oscar_jax as oj
from oscar_jax import hadamard
from oscar_jax import methods as M
from oscar_jax.methods import turbo


def test_lloyd_max_levels_are_the_known_gaussian_ones():
    np.testing.assert_allclose(M.lloyd_max_gaussian(1), [-0.7979, 0.7979], atol=1e-4)
    np.testing.assert_allclose(M.lloyd_max_gaussian(2), [-1.5104, -0.4528, 0.4528, 1.5104],
                               atol=1e-4)  # fmt: skip
    np.testing.assert_allclose(M.lloyd_max_gaussian(3)[4:], [0.2451, 0.7560, 1.3439, 2.1520],
                               atol=1e-3)  # fmt: skip
    for b in (1, 2, 3, 4):
        lv = M.lloyd_max_gaussian(b)
        assert len(lv) == 2**b and np.all(np.diff(lv) > 0)
        np.testing.assert_allclose(lv, -lv[::-1], atol=1e-12)
    with pytest.raises(ValueError, match="bits"):
        M.lloyd_max_gaussian(5)


def test_codebook_mse_on_gaussian_is_lloyd_maxs():
    """2-bit Lloyd-Max on N(0, 1) has MSE 0.1175 (per coordinate, relative)."""
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 4, 512, 128))
    xh = turbo.codebook_fake_quant(x, 2, 0, "float32")
    rel = float(jnp.sum((xh - x) ** 2) / jnp.sum(x**2))
    assert abs(rel - 0.1175) < 0.01


def test_codes_lie_on_the_codebook_times_the_norm():
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 1, 32, 64)) * 5.0
    xh = turbo.codebook_fake_quant(x, 2, 3, "float32")
    cfg = oj.preset("rotation_only", rotation="randomized_hadamard", rotation_seed=3)
    y = hadamard.rotate(xh, cfg)  # back in the rotated basis
    n = jnp.linalg.norm(x, axis=-1, keepdims=True)
    u = np.asarray(y / n * math.sqrt(64))
    lv = M.lloyd_max_gaussian(2)
    assert np.abs(u[..., None] - lv).min(-1).max() < 1e-4


def test_turbo_method_quantizes_keys_and_values_with_their_own_signs():
    k = jax.random.normal(jax.random.PRNGKey(2), (1, 2, 64, 64))
    kh, vh = M.TurboQuant().fake_quant_kv(k, k)
    assert float(jnp.max(jnp.abs(kh - vh))) > 0  # different random signs for K and V
    assert np.all(np.isfinite(np.asarray(kh)))
    with pytest.raises(ValueError, match="bits"):
        M.TurboQuant(bits=8)
    with pytest.raises(ValueError, match="seed"):
        M.TurboQuant(seed=-1)


def test_turbo_with_the_bias_offset_is_turbo_on_the_bias_free_keys():
    k = jax.random.normal(jax.random.PRNGKey(4), (1, 2, 64, 64))
    c = jax.random.normal(jax.random.PRNGKey(5), (64, 2, 64)) * 30.0
    off = jnp.swapaxes(c, 0, 1)[None]
    got, _ = M.TurboQuantBias().fake_quant_kv(k + off, k, c)
    want = turbo.codebook_fake_quant(k, 2, 0, "bfloat16") + off
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-3)
    plain, _ = M.TurboQuantBias().fake_quant_kv(k, k)
    np.testing.assert_array_equal(
        np.asarray(plain), np.asarray(M.TurboQuant().fake_quant_kv(k, k)[0])
    )
    assert isinstance(M.parse_name("turbob2"), M.TurboQuantBias)
    assert M.parse_name("turbob2").bytes_per_token(64)["total"] == 36.0
