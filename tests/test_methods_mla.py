"""Proposal D on random MLA-shaped tensors (no MLA weights exist here): the latent's
rotation folds into W_UK / W_UV exactly, the per-token norm makes each token's code
scale-free, and with planted low-norm sinks OScaR's latent errors are below KIVI's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax.methods import mla
from oscar_jax.methods.rotation import hadamard_matrix

DC, DR, T = 256, 32, 128


def _cache(seed=0):
    """Latent and RoPE key with channel outliers, an offset, and sinks at 0 and 70."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    gain = jnp.ones(DC).at[::37].set(6.0)
    c = jax.random.normal(k1, (1, T, DC)) * gain + 0.3
    kr = jax.random.normal(k2, (1, T, DR)) * 2.0
    sink = jnp.ones((1, T, 1)).at[:, jnp.array([0, 70])].set(1 / 30)
    return c * sink, kr * sink


def test_the_latent_rotation_folds_into_w_uk_and_w_uv_exactly():
    rng = np.random.default_rng(0)
    w_uk, w_uv = rng.standard_normal((4, 16, DC)), rng.standard_normal((4, 16, DC))
    q, c = rng.standard_normal((4, 16)), rng.standard_normal((T, DC))
    h = hadamard_matrix(DC)
    s = np.einsum("hk,hkc,tc->ht", q, w_uk, c)
    s_rot = np.einsum("hk,hkc,tc->ht", q, w_uk @ h.T, c @ h.T)  # W_UK H^T, cache H c
    np.testing.assert_allclose(s_rot, s, rtol=1e-10, atol=1e-9)
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    o = np.einsum("hkc,ht,tc->hk", w_uv, p, c)
    o_rot = np.einsum("hkc,ht,tc->hk", w_uv @ h.T, p, c @ h.T)
    np.testing.assert_allclose(o_rot, o, rtol=1e-10, atol=1e-9)


def test_a_tokens_code_is_scale_free_under_the_joint_norm():
    c, kr = _cache(1)
    f = jax.jit(lambda c, kr: mla.latent_fake_quant(c, kr, 2, 32, param_dtype="float32"))
    a = f(c, kr)
    b = f(c.at[:, 5].multiply(1 / 32), kr.at[:, 5].multiply(1 / 32))  # one token, both streams
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(y[:, 5]), np.asarray(x[:, 5]) / 32, rtol=1e-5,
                                   atol=1e-7)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(y[:, 6:]), np.asarray(x[:, 6:]))


def test_oscar_on_the_latent_beats_kivi_on_the_sinks_and_the_scores():
    c, kr = _cache(2)
    q_c = jax.random.normal(jax.random.PRNGKey(7), (8, DC))
    q_r = jax.random.normal(jax.random.PRNGKey(8), (8, DR))

    @jax.jit
    def errors(c, kr):
        out = {}
        for name, kw in {"kivi": dict(rotate=False, norm=None), "oscar": dict(norm="joint"),
                         "oscar_streams": dict(norm="per_stream")}.items():  # fmt: skip
            ch, krh = mla.latent_fake_quant(c, kr, 2, 32, **kw)
            sink = jnp.linalg.norm(ch[0, 0] - c[0, 0]) / jnp.linalg.norm(c[0, 0])
            s = q_c @ c[0].T + q_r @ kr[0].T
            sh = q_c @ ch[0].T + q_r @ krh[0].T
            out[name] = (sink, jnp.mean(jnp.abs(sh - s)[:, jnp.array([0, 70])]))
        return out

    e = {k: tuple(float(x) for x in v) for k, v in errors(c, kr).items()}
    assert e["oscar"][0] < 0.5 * e["kivi"][0], e  # the sink's latent
    assert e["oscar"][1] < 0.5 * e["kivi"][1], e  # the sinks' scores
    assert e["oscar_streams"][0] < 0.5 * e["kivi"][0], e
    with pytest.raises(ValueError, match="norm"):
        mla.latent_fake_quant(c, kr, norm="l1")
