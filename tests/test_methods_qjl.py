"""TurboQuant_prod: the fake-quant key's score is the QJL estimator, which is unbiased
over the sketch; one bit of the budget goes to it; bytes add up."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax import methods as M
from oscar_jax.methods import turbo


def test_score_of_the_fake_quant_key_is_the_qjl_estimator():
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 2, 32, 64)) + 0.2
    q = jax.random.normal(jax.random.PRNGKey(1), (64,))
    kh = jax.jit(lambda x: turbo.qjl_fake_quant(x, 2, 0, "float32"))(x)
    x_mse = jax.jit(lambda x: turbo.codebook_fake_quant(x, 1, 0, "float32"))(x)
    r = np.asarray(x - x_mse, np.float64)
    s = turbo.qjl_matrix(64, 0)
    est = np.asarray(q @ x_mse.reshape(-1, 64).T, np.float64) + math.sqrt(math.pi / 2) / 64 * (
        np.linalg.norm(r.reshape(-1, 64), axis=-1)
        * (np.sign(r.reshape(-1, 64) @ s.T) @ (s @ np.asarray(q, np.float64)))
    )
    np.testing.assert_allclose(np.asarray(kh.reshape(-1, 64) @ q), est, rtol=1e-4, atol=1e-4)


def test_the_estimator_is_unbiased_over_the_sketch():
    rng = np.random.default_rng(0)
    d, n = 64, 4000
    q, r = rng.standard_normal(d), rng.standard_normal(d)
    s = rng.standard_normal((n, d, d))
    est = (
        math.sqrt(math.pi / 2)
        / d
        * np.linalg.norm(r)
        * np.einsum("nd,nd->n", np.sign(s @ r), s @ q)
    )
    se = est.std() / math.sqrt(n)
    assert abs(est.mean() - q @ r) < 4 * se, (est.mean(), q @ r, se)


def test_values_mse_keys_prod_and_bytes():
    cfg = M.parse_name("turboq2")
    assert cfg.needs_key_bias
    k = jax.random.normal(jax.random.PRNGKey(2), (1, 1, 32, 64))
    kh, vh = jax.jit(cfg.fake_quant_kv)(k, k)
    mse = jax.jit(lambda x: turbo.codebook_fake_quant(x, 2, 1, cfg.norm_dtype))(k)
    np.testing.assert_allclose(np.asarray(vh), np.asarray(mse), atol=1e-6)
    assert not np.allclose(np.asarray(kh), np.asarray(vh))
    assert M.bytes_per_token(cfg, 64)["total"] == 16 + 16 + 2 + 2 + 2
    with pytest.raises(ValueError, match="QJL"):
        M.TurboQuantProd(bits=1)
    assert jnp.all(jnp.isfinite(kh))
