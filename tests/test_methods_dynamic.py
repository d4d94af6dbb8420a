"""Proposal C: high-TNI groups stay in the window (exactly), at most P of them, chosen
causally, within OScaR's full-precision budget and bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax import methods as M
from oscar_jax.methods import dynamic


def _keys(t=128, seed=0):
    k = jax.random.normal(jax.random.PRNGKey(seed), (1, 2, t, 32)) + 0.1
    v = jax.random.normal(jax.random.PRNGKey(seed + 1), (1, 2, t, 32))
    return k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)  # as the cache holds them


def test_pins_the_first_p_groups_with_a_small_norm_token_causally():
    n = jnp.ones((1, 1, 128)) + 0.01 * jnp.arange(128)
    for pos in (0, 40, 70, 100):  # sinks in groups 0, 1, 2, 3 (G = 32)
        n = n.at[0, 0, pos].set(0.05)
    pin = np.asarray(dynamic.pinned_groups(n, 32, 4.0, 2))[0, 0]
    assert pin[:64].all() and not pin[64:].any()  # the first two only
    # causal: what happens after a group never changes its decision
    later = np.asarray(dynamic.pinned_groups(n.at[0, 0, 100].set(1.0), 32, 4.0, 2))[0, 0]
    np.testing.assert_array_equal(pin, later)
    assert not np.asarray(dynamic.pinned_groups(n * 0 + 1.0, 32, 4.0, 2)).any()


def test_pinned_tokens_come_back_exactly_the_rest_is_oscarb():
    k, v = _keys()
    k = k.at[0, 1, 5].multiply(0.01)  # a sink in head 1, group 0
    cfg = M.parse_name("oscard2", group_size=32)
    kh, vh = jax.jit(cfg.fake_quant_kv)(k, v)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    np.testing.assert_array_equal(f32(kh[0, 1, :32]), f32(k[0, 1, :32]))
    np.testing.assert_array_equal(f32(vh[0, 1, :32]), f32(v[0, 1, :32]))
    ob, ovh = jax.jit(M.OscarBias(residual_length=cfg.residual_length).fake_quant_kv)(k, v)
    np.testing.assert_allclose(np.asarray(kh[0, 0]), np.asarray(ob[0, 0]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(kh[0, 1, 32:]), np.asarray(ob[0, 1, 32:]), atol=1e-6)


def test_budget_is_oscars_window_and_bytes_are_oscars():
    cfg = M.parse_name("oscard2")
    assert (cfg.residual_length, cfg.pins, cfg.budget) == (64, 2, 128)
    c1 = M.parse_name("oscard2_p1_r256")
    assert (c1.residual_length, c1.budget) == (224, 256)
    assert M.parse_name("oscard2_t2").tni == 2.0
    assert M.bytes_per_token(cfg, 64) == M.bytes_per_token(M.OscarBias(), 64)
    with pytest.raises(ValueError, match="tni"):
        M.OscarDynamic(tni=1.0)
    with pytest.raises(ValueError):
        M.parse_name("oscard2_p5")  # R' = 128 - 160 < 0
