"""``benchmarks.real_model_keys.method_keys``: cache presets and comparison methods alike."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import oscar_jax as oj
from benchmarks.real_model_keys import method_keys
from oscar_eval.common import parse_method


def _keys(seed: int = 0):
    """k [1, 64, 2, 64] post-RoPE-like keys plus a large, token-varying offset (a RoPE'd
    k bias), and the same keys without it."""
    rng = np.random.default_rng(seed)
    k_nb = rng.normal(size=(1, 64, 2, 64)).astype(np.float32)
    t = np.arange(64)[:, None, None]
    freq = rng.uniform(0.1, 1.5, size=(1, 2, 64))
    off = (30.0 * np.cos(t * freq + rng.uniform(0, 6, size=(1, 2, 64)))).astype(np.float32)
    return k_nb + off[None], k_nb


def test_presets_go_through_fake_quant_keys():
    k, k_nb = _keys()
    kv = parse_method("oscar2").kv
    want = np.asarray(oj.fake_quant_keys(jnp.asarray(k), kv), np.float32)
    np.testing.assert_array_equal(method_keys(kv, k, k_nb), want)


def test_bias_offset_method_gets_the_offset():
    """oscarb2 takes the offset out before quantizing and adds it back: its error is a
    fraction of oscar2's on keys dominated by the offset, and it is not oscar2's result."""
    k, k_nb = _keys(1)
    err = lambda kh: float(((kh - k) ** 2).sum() / (k**2).sum())  # noqa: E731
    e_b = err(method_keys(parse_method("oscarb2").kv, k, k_nb))
    e_o = err(method_keys(parse_method("oscar2").kv, k, k_nb))
    assert e_b < 0.25 * e_o, (e_b, e_o)
    # without a bias (k_nb None) the method gets no offset: OScaR's own keys path
    e_none = err(method_keys(parse_method("oscarb2").kv, k, None))
    assert e_none > 2 * e_b


def test_calibrated_methods_are_refused():
    k, k_nb = _keys()
    with pytest.raises(ValueError, match="calibrated"):
        method_keys(parse_method("kvquant2").kv, k, k_nb)
