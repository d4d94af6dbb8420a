"""KVQuant-style method: the codebook is fitted and sorted, outliers come back exactly
and stay out of the range, RoPE is undone and redone exactly, bytes add up."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax import methods as M
from oscar_jax import quant
from oscar_jax.methods import base, kvquant


def _rope(t: int, d: int):
    inv = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    emb = np.concatenate([np.arange(t)[:, None] * inv] * 2, axis=-1)
    return jnp.asarray(np.cos(emb), jnp.float32), jnp.asarray(np.sin(emb), jnp.float32)


def _kv(shape=(1, 2, 64, 64), seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(k1, shape) + 0.3, jax.random.normal(k2, shape) - 0.2


def test_lloyd_recovers_the_centres_of_a_four_point_mixture_sorted():
    rng = np.random.default_rng(0)
    centres = np.array([0.05, 0.3, 0.55, 0.95])
    x = rng.choice(centres, 20_000) + rng.normal(0, 0.01, 20_000)
    lv = kvquant.lloyd(rng.permutation(x), 4)
    assert np.all(np.diff(lv) > 0)
    np.testing.assert_allclose(lv, centres, atol=3e-3)
    with pytest.raises(ValueError, match="samples"):
        kvquant.lloyd(np.ones(3), 4)


def test_fit_gives_sorted_levels_per_layer_in_the_unit_interval_that_beat_uniform():
    k, v = _kv((1, 2, 64, 32))
    kl, vl = jnp.stack([k, 2 * k]), jnp.stack([v, v * v])  # [L=2, N=1, H, T, D]
    cfg = M.parse_name("kvquant2").fit(kl, vl, _rope(64, 32))
    for name in ("k_levels", "v_levels"):
        lv = cfg.calibration.arrays[name]
        assert lv.shape == (2, 4) and np.all(np.diff(lv, axis=1) > 0)
        assert lv.min() >= 0 and lv.max() <= 1
    # the fitted levels have a lower rounding error on the normalised values than uniform
    u, out, _ = jax.jit(cfg._values)(v[0:1])
    s = jnp.asarray(u)[~np.asarray(out)]
    err = lambda lv: float(jnp.mean((kvquant.codebook_round(s, jnp.asarray(lv)) - s) ** 2))  # noqa: E731
    assert err(cfg.calibration.arrays["v_levels"][0]) < err(np.linspace(0, 1, 4))


def test_outliers_exact_counted_and_out_of_the_range():
    cfg = M.KVQuant(k_outliers=5, v_outliers=2, group_size=32)
    k, v = _kv((1, 2, 64, 64))
    k = k.at[0, 1, 3, 7].set(40.0)  # a planted outlier
    u, out, _ = jax.jit(cfg._keys)(k)
    assert out.shape == k.shape and bool(out[0, 1, 3, 7])
    assert np.all(np.asarray(out).reshape(1, 2, 2, 32, 64).sum(axis=(3, 4)) == 5)
    _, vout, _ = jax.jit(cfg._values)(v)
    assert np.all(np.asarray(vout).sum(-1) == 2)
    lv = jnp.asarray([0.0, 0.3, 0.7, 1.0])
    _, _, kh = jax.jit(cfg._keys)(k, lv)
    sel = np.asarray(out)
    exact = np.asarray(quant.round_to_dtype(k, "float16"))
    np.testing.assert_array_equal(np.asarray(kh)[sel], exact[sel])
    # the outlier did not stretch its channel's range: the others keep a small error
    others = np.asarray(jnp.abs(kh - k))[0, 1, :32, 7][np.arange(32) != 3]
    assert others.max() < 2.0
    assert float(jnp.max(u)) <= 1.0 and float(jnp.min(u)) >= 0.0


def test_rope_undone_and_redone_and_a_pre_rope_bias_costs_nothing():
    cos, sin = _rope(64, 64)
    x = jax.random.normal(jax.random.PRNGKey(3), (1, 2, 64, 64))
    back = jax.jit(lambda x: base.rope_rotate(base.rope_rotate(x, cos, sin), cos, sin, True))(x)
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), atol=1e-5)
    cfg = M.KVQuant(k_outliers=0, v_outliers=0)
    st = {"k_levels": jnp.linspace(0, 1, 4), "v_levels": jnp.linspace(0, 1, 4)}
    k, v = _kv((1, 2, 64, 64), 1)
    bias = jax.random.normal(jax.random.PRNGKey(4), (64,)) * 30.0  # constant per channel pre-RoPE

    @jax.jit
    def err(kp):
        kr = base.rope_rotate(kp, cos, sin)
        kh, _ = cfg.fake_quant_kv(kr, v, rope=(cos, sin), state=st)
        return jnp.mean((kh - kr) ** 2)

    e = [float(err(k)), float(err(k + bias))]
    assert abs(e[1] - e[0]) < 0.05 * e[0] + 1e-3, e


def test_needs_rope_and_a_fit_and_counts_its_bytes():
    cfg = M.parse_name("kvquant2")
    assert cfg.needs_rope and cfg.needs_calibration
    k, v = _kv()
    with pytest.raises(ValueError, match="rope"):
        cfg.fake_quant_kv(k, v)
    with pytest.raises(ValueError, match="fitted"):
        cfg.fake_quant_kv(k, v, rope=_rope(64, 64))
    b = M.bytes_per_token(cfg, 64)
    assert b["total"] == 16 + 16 + 8 + 8 + 20 * 4 / 32 + 3 == 53.5
    assert M.bytes_per_token(cfg, 128)["total"] == 32 + 32 + 16 + 16 + 2.5 + 3
    assert M.parse_name("kvquant2_g64").group_size == 64
    dense = M.parse_name("kvquant2_ko0_vo0")
    assert (dense.k_outliers, dense.v_outliers) == (0, 0)
    assert M.bytes_per_token(dense, 64)["total"] == 48.0
    abl = M.parse_name("kvquant2_uni1_post1")
    assert abl.uniform and not abl.pre_rope and M.parse_name("kvquant2").pre_rope


def test_weighted_lloyd_takes_each_cells_weighted_mean_and_refuses_bad_weights():
    x = np.array([0.0, 0.0, 1.0, 1.0])
    np.testing.assert_allclose(kvquant.lloyd(x, 1, weights=[1, 1, 3, 3]), [0.75])
    np.testing.assert_allclose(kvquant.lloyd(x, 1), [0.5])
    for bad in ([1, 1, 1], [1, -1, 1, 1], [0, 0, 0, 0], [1, np.nan, 1, 1]):
        with pytest.raises(ValueError, match="weights"):
            kvquant.lloyd(x, 1, weights=bad)


def test_fisher_fit_lowers_the_fisher_weighted_error_and_needs_gradients():
    """The Fisher-weighted codebook beats the plain one on the objective it minimises,
    sum grad^2 scale^2 (u - Q(u))^2 over the entries (here the values of one layer)."""
    k, v = _kv((2, 2, 64, 32), seed=3)
    rng = np.random.default_rng(1)
    gv = jnp.asarray(
        rng.standard_cauchy(v.shape) * (np.arange(32) < 4), jnp.float32
    )  # few channels
    gk = jnp.asarray(rng.normal(size=k.shape), jnp.float32)
    kl, vl, rope = k[None], v[None], _rope(64, 32)
    with pytest.raises(ValueError, match="grads"):
        M.parse_name("kvquant2").replace(fisher=True).fit(kl, vl, rope)
    plain = M.parse_name("kvquant2").fit(kl, vl, rope)
    fish = (
        M.parse_name("kvquant2").replace(fisher=True).fit(kl, vl, rope, grads=(gk[None], gv[None]))
    )
    u, out, _ = jax.jit(plain._values)(v)
    w = kvquant.entry_weights(v, gv, out, -1, 32, "float16")
    keep = ~np.asarray(out)

    def obj(cfg):
        lv = jnp.asarray(cfg.calibration.arrays["v_levels"][0])
        return float(jnp.sum((w * (kvquant.codebook_round(u, lv) - u) ** 2)[keep]))

    assert obj(fish) < obj(plain)
    assert not np.allclose(
        fish.calibration.arrays["k_levels"], plain.calibration.arrays["k_levels"]
    )
