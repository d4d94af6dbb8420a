"""Proposal B: the fitted rotations are orthogonal, PCA-then-Hadamard evens out the
per-channel second moments, and the method is OScaR under its rotation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax import methods as M
from oscar_jax.methods import rotation


def _aniso(n=4096, d=32, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((d, d)) * np.geomspace(10.0, 0.1, d)  # very uneven directions
    return rng.standard_normal((n, d)) @ a.T + 0.5


def test_hadamard_and_fitted_rotations_are_orthogonal():
    for d in (8, 64):
        h = rotation.hadamard_matrix(d)
        np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-12)
    with pytest.raises(ValueError, match="power of two"):
        rotation.hadamard_matrix(12)
    r = rotation.pca_hadamard(_aniso())
    np.testing.assert_allclose(r @ r.T, np.eye(32), atol=1e-10)
    q = rotation.random_orthogonal(32, np.random.default_rng(1))
    np.testing.assert_allclose(q @ q.T, np.eye(32), atol=1e-10)


def test_pca_then_hadamard_evens_the_channels_second_moments():
    x = _aniso()
    m2 = lambda y: np.mean(y**2, axis=0)  # noqa: E731
    fitted = m2(x @ rotation.pca_hadamard(x).T)
    np.testing.assert_allclose(fitted, fitted.mean(), rtol=1e-6)  # exactly even
    had = m2(x @ rotation.hadamard_matrix(32).T)
    assert had.max() / had.min() > 1.5  # the plain Hadamard does not


def test_fit_per_layer_and_head_and_the_method_is_oscar_under_it():
    k = jax.random.normal(jax.random.PRNGKey(0), (2, 1, 2, 64, 32)) * jnp.linspace(3, 0.2, 32)
    v = jax.random.normal(jax.random.PRNGKey(1), (2, 1, 2, 64, 32))
    cfg = M.parse_name("oscarp8").fit(k, v, None)
    rot = cfg.calibration.arrays["rotation"]
    assert rot.shape == (2, 2, 32, 32)
    for li in range(2):
        for h in range(2):
            np.testing.assert_allclose(rot[li, h] @ rot[li, h].T, np.eye(32), atol=1e-5)
    assert not np.allclose(rot[0, 0], rot[1, 0])
    kh, vh = jax.jit(cfg.fake_quant_kv)(k[0], v[0], state=cfg.calibrated_state(0))
    np.testing.assert_allclose(np.asarray(kh), np.asarray(k[0]), atol=0.05)  # 8 bits: near exact
    ro = M.parse_name("oscaro2").fit(k, v, None)
    assert ro.calibration != cfg.calibration and hash(ro) != hash(cfg)
    assert M.bytes_per_token(cfg.replace(bits=2), 64)["total"] == 50.0
    with pytest.raises(ValueError, match="fitted"):
        M.parse_name("oscarp2").fake_quant_kv(k[0], v[0])
    with pytest.raises(ValueError, match="rotation"):
        M.OscarRotation(rotation="pca")


def test_select_keeps_the_rotation_with_the_smaller_query_weighted_key_error():
    """oscars: a head whose queries ignore the channel with the widest key groups keeps
    KIVI's channels (no rotation); one whose queries read only that channel is rotated (the
    rotation takes the error out of it); each choice has the smaller E[e^T C_q e]."""
    d, t = 32, 128
    kk = jax.random.normal(jax.random.PRNGKey(2), (1, 2, 2, t, d))  # [L, N, H, T, D]
    wide = 3.0 * jnp.sin(jnp.arange(t) * 1.0)  # a fast-turning offset in channel 0
    k = kk.at[..., 0].add(wide)
    v = jax.random.normal(jax.random.PRNGKey(3), k.shape)
    ignore = np.eye(d)
    ignore[0, 0] = 0.0  # head 0: queries never read channel 0
    only = np.zeros((d, d))
    only[0, 0] = 1.0  # head 1: queries read channel 0 alone
    cq = np.stack([ignore, only])[None]  # [L, H, D, D]
    cfg = M.parse_name("oscars2").fit(k, v, None, query_cov=cq)
    assert cfg.needs_queries and not M.parse_name("oscarp2").needs_queries
    np.testing.assert_array_equal(cfg.calibration.arrays["hadamard"], [[0.0, 1.0]])
    assert cfg.calibration_note().startswith("Hadamard kept in 1 of 2 (layer, KV head) pairs")
    assert cfg.calibration_note().endswith(": -H")
    assert M.parse_name("oscarp2").calibration_note() is None
    rot = cfg.calibration.arrays["rotation"]
    np.testing.assert_allclose(rot[0, 0], np.eye(d))
    np.testing.assert_allclose(rot[0, 1], rotation.hadamard_matrix(d), atol=1e-6)
    base = cfg.base("oscar")
    for h in range(2):
        errs = []
        for r in (np.eye(d), rotation.hadamard_matrix(d)):
            r2 = jnp.asarray(np.stack([r, r]), jnp.float32)
            e = M.base.oscar_keys_fake_quant(k[0], base, None, rotation=r2) - k[0]
            errs.append(float(jnp.einsum("ntd,de,nte->", e[:, h], cq[0, h], e[:, h])))
        assert errs[h] < errs[1 - h]  # the chosen candidate is the better one
    kh, _ = jax.jit(cfg.fake_quant_kv)(k[0], v[0], state=cfg.calibrated_state(0))
    assert np.isfinite(np.asarray(kh)).all()
    with pytest.raises(ValueError, match="query_cov"):
        M.parse_name("oscars2").fit(k, v, None)


def test_select_weighted_by_attention_judges_the_keys_that_take_the_attention():
    """oscars2_attn1: with every weight on one token, the pick is the candidate with the
    smaller e^T C_q e on that token (here the opposite of the uniform pick); uniform
    weights reproduce the unweighted selection; missing or misshapen weights raise."""
    d, t = 32, 128
    kk = jax.random.normal(jax.random.PRNGKey(2), (1, 2, 2, t, d))
    k = kk.at[..., 0].add(3.0 * jnp.sin(jnp.arange(t) * 1.0))
    v = jax.random.normal(jax.random.PRNGKey(3), k.shape)
    ignore = np.eye(d)
    ignore[0, 0] = 0.0
    cq = np.stack([ignore, ignore])[None]  # both heads: queries never read channel 0
    plain = M.parse_name("oscars2").fit(k, v, None, query_cov=cq)
    np.testing.assert_array_equal(plain.calibration.arrays["hadamard"], [[0.0, 0.0]])
    cfg = M.parse_name("oscars2_attn1")
    assert cfg.criterion == "attention" and cfg.needs_attention and cfg.needs_queries
    assert not plain.needs_attention
    ones = np.ones((1, 2, 2, t), np.float32)
    same = cfg.fit(k, v, None, query_cov=cq, key_weight=ones)
    np.testing.assert_array_equal(same.calibration.arrays["hadamard"], [[0.0, 0.0]])
    # per-token errors of both candidates on head 1; all weight on a token the rotation wins
    base = cfg.base("oscar")
    per = []
    for r in (np.eye(d), rotation.hadamard_matrix(d)):
        r2 = jnp.asarray(np.stack([r, r]), jnp.float32)
        e = M.base.oscar_keys_fake_quant(k[0], base, None, rotation=r2) - k[0]
        per.append(np.asarray(jnp.einsum("ntd,de,nte->nt", e[:, 1], cq[0, 1], e[:, 1])))
    n, tok = np.unravel_index(np.argmax(per[0] - per[1]), per[0].shape)
    assert per[1][n, tok] < per[0][n, tok]
    w = np.zeros((1, 2, 2, t), np.float32)
    w[0, :, 0] = 1.0  # head 0: uniform, keeps its plain pick
    w[0, n, 1, tok] = 1.0
    picked = cfg.fit(k, v, None, query_cov=cq, key_weight=w)
    np.testing.assert_array_equal(picked.calibration.arrays["hadamard"], [[0.0, 1.0]])
    assert "weighted by attention" in picked.calibration_note()
    with pytest.raises(ValueError, match="key_weight"):
        cfg.fit(k, v, None, query_cov=cq)
    with pytest.raises(ValueError, match="key_weight"):
        cfg.fit(k, v, None, query_cov=cq, key_weight=w[:, :1])
    with pytest.raises(ValueError, match="select"):
        rotation.OscarRotation(bits=2, criterion="attention")
    with pytest.raises(ValueError, match="criterion"):
        rotation.OscarRotation(bits=2, rotation="select", criterion="softmax")
    with pytest.raises(ValueError, match="exclude"):
        M.parse_name("oscars2_attn1_out1")


def test_select_by_output_error_picks_the_candidate_whose_attention_output_is_closer():
    """oscars2_out1: per head, the candidate with the smaller ||softmax(q k_hat^T) v -
    softmax(q k^T) v||^2 over the sampled queries (recomputed here in numpy, causal)."""
    d, t, hq = 32, 128, 4
    rng = np.random.default_rng(7)
    kk = jax.random.normal(jax.random.PRNGKey(2), (1, 2, 2, t, d))
    k = kk.at[..., 0].add(3.0 * jnp.sin(jnp.arange(t) * 1.0))
    k = k.at[:, :, :, 0].multiply(0.05)  # a short first key (a sink)
    v = jax.random.normal(jax.random.PRNGKey(3), k.shape)
    pos = np.array([5, 40, 90, 127], np.int32)
    q = rng.standard_normal((1, 2, hq, len(pos), d)).astype(np.float32) * 2.0
    q[:, :, :, :, 0] *= 6.0  # queries leaning on the channel with the wide groups
    cq = np.broadcast_to(np.eye(d), (1, 2, d, d))
    cfg = M.parse_name("oscars2_out1")
    assert cfg.criterion == "output" and cfg.needs_query_samples and not cfg.needs_attention
    got = cfg.fit(k, v, None, query_cov=cq, queries=q, query_pos=pos)
    base = cfg.base("oscar")
    kn, vn = np.asarray(k[0], np.float64), np.asarray(v[0], np.float64)
    qg = q[0].astype(np.float64).reshape(2, 2, hq // 2, len(pos), d)
    mask = np.arange(t)[None, :] <= pos[:, None]

    def out(kx):
        s = np.einsum("nhgsd,nhtd->nhgst", qg, kx) / np.sqrt(d)
        s = np.where(mask, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("nhgst,nhtd->nhgsd", p / p.sum(-1, keepdims=True), vn)

    errs = []
    for r in (rotation.hadamard_matrix(d), np.eye(d)):
        r2 = jnp.asarray(np.stack([r, r]), jnp.float32)
        kh = np.asarray(M.base.oscar_keys_fake_quant(k[0], base, None, rotation=r2), np.float64)
        errs.append(((out(kh) - out(kn)) ** 2).sum(axis=(0, 2, 3, 4)))
    assert not np.allclose(errs[0], errs[1], rtol=1e-3)  # the choice is not a tie
    np.testing.assert_array_equal(got.calibration.arrays["hadamard"][0], errs[0] <= errs[1])
    assert "attention output" in got.calibration_note()
    with pytest.raises(ValueError, match="queries"):
        cfg.fit(k, v, None, query_cov=cq)
    with pytest.raises(ValueError, match="queries"):
        cfg.fit(k, v, None, query_cov=cq, queries=q, query_pos=pos[:2])


def test_select_by_calibration_nll_keeps_the_whole_model_candidate_with_the_smallest_loss():
    """oscars2_nll1: the candidates are every head rotated, none, and the score and output
    selections; the fitted config is the one the loss ranks first, and the note lists all
    four losses."""
    d, t, hq = 32, 128, 4
    kk = jax.random.normal(jax.random.PRNGKey(2), (2, 2, 2, t, d))  # [L, N, H, T, D]
    k = kk.at[..., 0].add(3.0 * jnp.sin(jnp.arange(t) * 1.0))
    v = jax.random.normal(jax.random.PRNGKey(3), k.shape)
    q = np.random.default_rng(1).standard_normal((2, 2, hq, 16, d)).astype(np.float32)
    pos = np.arange(t - 16, t, dtype=np.int32)
    ignore = np.eye(d)
    ignore[0, 0] = 0.0
    cq = np.stack([np.stack([ignore, np.eye(d)])] * 2)  # [L, H, D, D]
    cfg = M.parse_name("oscars2_nll1")
    assert cfg.needs_loss and cfg.needs_query_samples and cfg.needs_queries
    seen = []

    def loss(c):  # prefers the config that rotates the fewest heads, then records it
        seen.append(c.calibration.arrays["hadamard"].copy())
        return float(c.calibration.arrays["hadamard"].sum())

    got = cfg.fit(k, v, None, query_cov=cq, queries=q, query_pos=pos, loss=loss)
    assert len(seen) == 4
    np.testing.assert_array_equal(seen[0], np.ones((2, 2)))  # "all" first, then "none"
    np.testing.assert_array_equal(got.calibration.arrays["hadamard"], np.zeros((2, 2)))
    np.testing.assert_allclose(
        got.calibration.arrays["rotation"], np.broadcast_to(np.eye(d), (2, 2, d, d))
    )
    note = got.calibration_note()
    assert "none 0.0000 *" in note and "all 4.0000" in note and "score" in note and "output" in note
    inverse = cfg.fit(k, v, None, query_cov=cq, queries=q, query_pos=pos,
                      loss=lambda c: -float(c.calibration.arrays["hadamard"].sum()))  # fmt: skip
    np.testing.assert_array_equal(inverse.calibration.arrays["hadamard"], np.ones((2, 2)))
    with pytest.raises(ValueError, match="loss"):
        cfg.fit(k, v, None, query_cov=cq, queries=q, query_pos=pos)
    with pytest.raises(ValueError, match="exclude"):
        M.parse_name("oscars2_out1_nll1")
