"""The comparison methods (``oscar_jax.methods``): names, validation, byte accounting,
finite output on zero / constant input, and the evaluation's hook."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oscar_jax as oj
from oscar_eval.common import parse_method
from oscar_eval.ppl import cached_attention
from oscar_jax import methods as M

NAMES = [
    "oscarb2",
    "oscarm2",
    "kivi2_sink1",
    "kivi2_sink4",
    "ott2_n1",
    "turbo2",
    "oscarc2",
    "oscarbo2",
]


def _kv(seed=0, b=2, h=2, t=64, d=64):
    kk, kv = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(kk, (b, h, t, d)) * 3.0, jax.random.normal(kv, (b, h, t, d))


def test_names_map_to_their_classes_and_library_names_pass_through():
    assert isinstance(M.parse_name("oscarb2"), M.OscarBias)
    assert isinstance(M.parse_name("oscarm4"), M.OscarGroupMean)
    assert M.parse_name("kivi2_sink4").sinks == 4
    assert M.parse_name("ott2_n2").pool == 2
    assert isinstance(M.parse_name("turbo2"), M.TurboQuant)
    assert M.parse_name("oscarc2").param_dtype == "float8_e4m3fn"
    assert M.parse_name("oscarb2_r64_g64").residual_length == 64
    assert M.parse_name("oscarb2_r64_g64").group_size == 64
    for lib in ("kivi2", "oscar2", "oscar2_pertoken", "bf16"):
        assert M.parse_name(lib) is None
    assert parse_method("kivi2_sink4").kv == M.KiviSinks(sinks=4)
    assert isinstance(parse_method("kivi2").kv, oj.KVQuantConfig)


@pytest.mark.parametrize(
    "name", ["ott2_n32", "ott2_x3", "turbo8", "kivi2_sink4_n1", "oscarb2_r30", "oscarb5"]
)
def test_bad_names_raise_value_error_naming_the_method(name):
    with pytest.raises(ValueError, match="must"):
        parse_method(name)


def test_field_validation():
    with pytest.raises(ValueError, match="sinks"):
        M.KiviSinks(sinks=-1)
    with pytest.raises(ValueError, match="group_size"):
        M.OTT(group_size=24)
    with pytest.raises(ValueError, match="param_dtype"):
        M.OscarBias(param_dtype="int8")
    with pytest.raises(ValueError, match="shape"):
        M.OscarBias().fake_quant_kv(jnp.zeros((2, 64, 64)), jnp.zeros((2, 64, 64)))
    with pytest.raises(ValueError, match="multiple of group_size"):
        M.OTT().fake_quant_kv(jnp.zeros((1, 1, 40, 64)), jnp.zeros((1, 1, 40, 64)))


def test_the_real_cache_refuses_a_comparison_method():
    with pytest.raises(ValueError):
        oj.init_cache(M.OscarBias(), batch=1, max_len=64, num_kv_heads=1, head_dim=64)


@pytest.mark.parametrize("name", NAMES)
def test_zero_and_constant_input_stay_finite_and_exact(name):
    cfg = M.parse_name(name)
    z = jnp.zeros((1, 2, 64, 64))
    kh, vh = cfg.fake_quant_kv(z, z)
    assert np.all(np.asarray(kh) == 0) and np.all(np.asarray(vh) == 0)
    c = jnp.full((1, 2, 64, 64), 1.5)
    kh, vh = cfg.fake_quant_kv(c, c)
    assert np.all(np.isfinite(np.asarray(kh))) and np.all(np.isfinite(np.asarray(vh)))


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_error_is_int2_sized_and_shapes_kept(name):
    cfg = M.parse_name(name)
    k, v = _kv()
    kh, vh = jax.jit(cfg.fake_quant_kv)(k, v)
    assert kh.shape == k.shape and vh.shape == v.shape and kh.dtype == jnp.float32
    for x, xh in ((k, kh), (v, vh)):
        rel = float(jnp.sum((xh - x) ** 2) / jnp.sum(x**2))
        assert 0.0 < rel < 0.3, rel


def test_bytes_per_token_library_layouts():
    d = 64
    assert M.bytes_per_token(oj.preset("kivi", bits=2), d)["total"] == 48.0
    assert M.bytes_per_token(oj.preset("oscar", bits=2), d)["total"] == 50.0
    per_tok = oj.preset("oscar", bits=2, norm_granularity="per_token")
    assert M.bytes_per_token(per_tok, d, num_kv_heads=2)["k_norm"] == 1.0
    assert M.bytes_per_token(oj.preset("bf16"), d)["total"] == 256.0
    # DESIGN.md's figure at head_dim 128: 32 + 32 codes, 16 + 16 params, 2 norm = 98
    assert M.bytes_per_token(oj.preset("oscar", bits=2), 128)["total"] == 98.0
    with pytest.raises(ValueError, match="must be"):
        M.bytes_per_token("oscar2", d)


@pytest.mark.parametrize(
    ("name", "total"),
    [("oscarb2", 50.0), ("oscarm2", 54.0), ("kivi2_sink1", 48.125), ("kivi2_sink4", 48.5),
     ("ott2_n1", 48 + (256 + 1) / 32), ("turbo2", 36.0), ("oscarc2", 41.03125),
     ("oscarbo2", 55.5)],
)  # fmt: skip
def test_bytes_per_token_of_every_method_at_head_dim_64(name, total):
    parts = M.parse_name(name).bytes_per_token(64, context=2048)
    assert parts["total"] == pytest.approx(total)
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))


def test_cached_attention_hook_without_offset_equals_oscar_and_sees_the_method():
    key = jax.random.PRNGKey(3)
    q = jax.random.normal(key, (1, 96, 4, 64))
    k = jax.random.normal(jax.random.fold_in(key, 1), (1, 96, 2, 64))
    v = jax.random.normal(jax.random.fold_in(key, 2), (1, 96, 2, 64))
    # values rotated in the fake-quant space equal the library's folded path up to rounding
    a = cached_attention(q, k, v, oj.preset("oscar", bits=2, residual_length=32))
    b = cached_attention(q, k, v, M.OscarBias(residual_length=32))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    c = cached_attention(q, k, v, M.TurboQuant(residual_length=32))
    assert float(jnp.max(jnp.abs(c - a))) > 1e-3
