"""The comparison methods through the evaluation's cache-exact forward on a tiny model:
the k-bias offset reaches the method, and fixes what a large k bias does to OScaR."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
import oscar_jax as oj
from oscar_eval import ppl as eval_ppl
from oscar_jax import methods as M

SMALL = dict(residual_length=16, group_size=16)


def _model(bias: float):
    cfg = models.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                             num_heads=4, num_kv_heads=2, head_dim=32, qkv_bias=bias > 0,
                             rope_theta=1e6)  # fmt: skip
    m = models.CausalLM(cfg, rngs=nnx.Rngs(0))
    p = m.params()
    p["lm_head"] = p["lm_head"] * 8.0
    p["layers"] = {k: (v * 6.0 if k.startswith("w") else v) for k, v in p["layers"].items()}
    if bias:
        bk = jax.random.normal(jax.random.PRNGKey(9), p["layers"]["bk"].shape) * bias
        p["layers"]["bk"] = bk.astype(p["layers"]["bk"].dtype)
    m.set_params(p)
    return m


def _ids(t=96):
    return jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, t)), jnp.int32)


def test_key_offset_only_for_methods_that_want_it_and_layers_with_a_bias():
    m = _model(20.0)
    lp = jax.tree.map(lambda a: a[0], m.params()["layers"])
    pos = jnp.broadcast_to(jnp.arange(40), (1, 40))
    off = eval_ppl.key_offset(m.config, M.OscarBias(), lp, pos)
    assert off.shape == (40, 2, 32)
    assert eval_ppl.key_offset(m.config, M.OTT(), lp, pos) is None
    assert eval_ppl.key_offset(m.config, oj.preset("oscar"), lp, pos) is None
    lp0 = jax.tree.map(lambda a: a[0], _model(0.0).params()["layers"])
    assert eval_ppl.key_offset(m.config, M.OscarBias(), lp0, pos) is None


def test_without_a_bias_the_offset_method_is_oscar():
    m, ids = _model(0.0), _ids()
    a = eval_ppl.cached_logits(m, ids, oj.preset("oscar", **SMALL))
    b = eval_ppl.cached_logits(m, ids, M.OscarBias(**SMALL))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("name", ["turbo2", "ott2_n1", "kivi2_sink4", "oscarm2", "oscarc2"])
def test_every_method_runs_through_the_forward_finite(name):
    from oscar_eval.common import parse_method  # noqa: PLC0415

    kv = parse_method(name, 16, 16).kv
    out = eval_ppl.cached_logits(_model(5.0), _ids(64), kv)
    assert np.all(np.isfinite(np.asarray(out)))


def test_a_large_k_bias_hurts_oscar_and_the_offset_repairs_it():
    m, ids = _model(20.0), _ids()
    ref = eval_ppl.cached_logits(m, ids, oj.preset("bf16"))
    err = lambda kv: float(jnp.mean((eval_ppl.cached_logits(m, ids, kv) - ref) ** 2))  # noqa: E731
    e_oscar, e_fixed = err(oj.preset("oscar", **SMALL)), err(M.OscarBias(**SMALL))
    assert e_fixed < 0.5 * e_oscar, (e_fixed, e_oscar)
