"""``qcov``: the other OSCAR (arXiv 2605.17757): its fitted rotations, clipping ratios,
sinks, bytes, name, and the calibration that hands it the query statistics."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import models
from models import layers
from oscar_eval import calibrate as ecal
from oscar_eval.common import parse_method
from oscar_jax import methods as om
from oscar_jax.methods import base, qcov
from oscar_jax.methods.rotation import hadamard_matrix


def _model():
    cfg = models.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                             num_heads=4, num_kv_heads=2, head_dim=32, qkv_bias=True)  # fmt: skip
    return models.CausalLM(cfg, rngs=nnx.Rngs(0))


def _spd(rng, d, spread=1.0):
    a = rng.standard_normal((d, d))
    q, _ = np.linalg.qr(a)
    return (q * np.exp(spread * rng.standard_normal(d))) @ q.T


def test_bit_reversal_is_a_permutation_and_an_involution():
    np.testing.assert_array_equal(qcov.bit_reversal(8), [0, 4, 2, 6, 1, 5, 3, 7])
    for d in (1, 2, 64, 128):
        p = qcov.bit_reversal(d)
        np.testing.assert_array_equal(np.sort(p), np.arange(d))
        np.testing.assert_array_equal(p[p], np.arange(d))
    with pytest.raises(ValueError, match="d=12"):
        qcov.bit_reversal(12)


def test_spectral_rotation_is_orthogonal_and_hadamard_permuted_for_isotropic_queries():
    rng = np.random.default_rng(0)
    r = qcov.spectral_rotation(_spd(rng, 32, 2.0))
    np.testing.assert_allclose(r @ r.T, np.eye(32), atol=1e-10)
    # its rows are H P applied to the eigenvectors: every rotated channel carries tr(C) / D
    c = _spd(rng, 16)
    np.testing.assert_allclose(np.diag(qcov.spectral_rotation(c) @ c @ qcov.spectral_rotation(c).T),
                               np.trace(c) / 16, rtol=1e-9)  # fmt: skip
    hp = hadamard_matrix(32)[qcov.bit_reversal(32)]
    np.testing.assert_allclose(qcov.spectral_rotation(3.0 * np.eye(32)), hp, atol=1e-12)
    with pytest.raises(ValueError, match=r"cov.shape=\(4, 5\)"):
        qcov.spectral_rotation(np.ones((4, 5)))


def _anisotropic(rng, n=2, t=256, d=32):
    """Keys with a few large channels, queries that weigh other directions most."""
    ks = np.ones(d)
    ks[[3, 17]] = 8.0
    k = rng.standard_normal((1, n, 1, t, d)) * ks
    qdir = np.linalg.qr(rng.standard_normal((d, d)))[0]
    qs = np.exp(-0.4 * np.arange(d))
    q = (rng.standard_normal((n * t, d)) * qs) @ qdir.T
    cq = (q.T @ q / len(q))[None, None]
    v = rng.standard_normal((1, n, 1, t, d))
    return k, v, cq


def _score_err(kh, k, cq):
    e = (np.asarray(kh, np.float64) - k).reshape(-1, k.shape[-1])
    return float(np.einsum("md,de,me->", e, cq, e) / len(e))


def test_fit_rotations_orthogonal_clips_in_range_and_query_weighted_error_drops():
    rng = np.random.default_rng(1)
    k, v, cq = _anisotropic(rng)
    cfg = parse_method("qcov2_sink0", 16, 16).kv
    fitted = cfg.fit(k, v, None, query_cov=cq)
    arr = fitted.calibration.arrays
    assert arr["rot_k"].shape == arr["rot_v"].shape == (1, 1, 32, 32)
    for name in ("rot_k", "rot_v"):
        np.testing.assert_allclose(arr[name][0, 0] @ arr[name][0, 0].T, np.eye(32), atol=1e-5)
    for name in ("clip_k", "clip_v"):
        assert arr[name].shape == (1, 1) and 0 < arr[name].min() and arr[name].max() <= 1
    assert arr["clip_k"][0, 0] < 1  # INT2 on near-Gaussian coordinates: clipping pays
    # fresh keys of the same law: the fitted rotation + clip against unfitted ones
    kt = rng.standard_normal((1, 1, 256, 32)) * k.std(axis=(0, 1, 2, 3))
    kt = jnp.asarray(kt, jnp.float32)
    c0 = cq[0, 0]
    kh, _ = fitted.fake_quant_kv(kt, kt, state=fitted.calibrated_state(0))
    err_fit = _score_err(kh, np.asarray(kt), c0)
    one = jnp.ones(1)
    err_id = _score_err(qcov.rotated_fake_quant(kt, jnp.eye(32)[None], one, 2, 128, "float16"),
                        np.asarray(kt), c0)  # fmt: skip
    hp = jnp.asarray(hadamard_matrix(32)[qcov.bit_reversal(32)], jnp.float32)[None]
    err_h = _score_err(qcov.rotated_fake_quant(kt, hp, one, 2, 128, "float16"), np.asarray(kt), c0)
    assert err_fit < 0.8 * err_id and err_fit < err_h, (err_fit, err_id, err_h)
    # the ablation without the eigenbases (H P, its own clip): here, keys whose large
    # channels the queries do not weigh, it is lower still (U_Q ignores the keys' spread)
    u0 = parse_method("qcov2_sink0_u0", 16, 16).kv.fit(k, v, None, query_cov=cq)
    np.testing.assert_allclose(u0.calibration.arrays["rot_k"][0, 0], hp[0], atol=1e-6)
    kh0, _ = u0.fake_quant_kv(kt, kt, state=u0.calibrated_state(0))
    assert _score_err(kh0, np.asarray(kt), c0) < err_fit
    with pytest.raises(ValueError, match="needs query_cov"):
        cfg.fit(k, v, None)
    with pytest.raises(ValueError, match=r"query_cov.shape=\(1, 1, 16, 16\)"):
        cfg.fit(k, v, None, query_cov=cq[..., :16, :16])


def test_sinks_exact_rest_quantized_and_shapes_checked():
    rng = np.random.default_rng(2)
    k, v, cq = _anisotropic(rng, n=1, t=64)
    cfg = parse_method("qcov2_sink5", 16, 16).kv.fit(k, v, None, query_cov=cq)
    kk, vv = (jnp.asarray(x[0], jnp.float32) for x in (k, v))
    kh, vh = cfg.fake_quant_kv(kk, vv, state=cfg.calibrated_state(0))
    for x, xh in ((kk, kh), (vv, vh)):
        np.testing.assert_array_equal(xh[:, :, :5], base.round_fp(x[:, :, :5], "bfloat16"))
        assert np.all(np.abs(np.asarray(xh[:, :, 5:] - x[:, :, 5:])).max(axis=-1) > 0)
    assert kh.dtype == jnp.float32 and kh.shape == kk.shape
    with pytest.raises(ValueError, match="must be \\[H, D, D\\]"):
        cfg.fake_quant_kv(kk[..., :16], vv[..., :16], state=cfg.calibrated_state(0))
    with pytest.raises(ValueError, match="must be fitted first"):
        parse_method("qcov2").kv.fake_quant_kv(kk, vv)


def test_bias_offset_takes_the_rope_bias_out_and_only_then_wants_it():
    rng = np.random.default_rng(5)
    k, v, cq = _anisotropic(rng, n=1, t=64)
    off = 40.0 * rng.standard_normal((1, 64, 1, 32))  # [L, T, H, D]: a large RoPE'd bias
    kb = k + np.swapaxes(off, 1, 2)[:, None]
    assert not parse_method("qcov2").kv.needs_key_bias
    errs = []
    for name in ("qcov2_sink0", "qcov2_sink0_b1"):
        cfg = parse_method(name, 16, 16).kv
        cfg = cfg.fit(kb, v, None, off if cfg.needs_key_bias else None, query_cov=cq)
        kk, vv = (jnp.asarray(x[0], jnp.float32) for x in (kb, v))
        kh, _ = cfg.fake_quant_kv(kk, vv, jnp.asarray(off[0], jnp.float32),
                                  state=cfg.calibrated_state(0))  # fmt: skip
        errs.append(_score_err(kh, kb[0], cq[0, 0]))
    assert errs[1] < 0.05 * errs[0], errs


def test_token_fake_quant_per_group_and_clip():
    x = jnp.asarray(np.random.default_rng(3).standard_normal((3, 16)), jnp.float32)
    out = qcov.token_fake_quant(x, 2, 8, jnp.ones((3, 1)), "float32")
    for g in (slice(0, 8), slice(8, 16)):  # each group's min and max come back exactly
        np.testing.assert_allclose(out[:, g].min(-1), x[:, g].min(-1), rtol=1e-6)
        np.testing.assert_allclose(out[:, g].max(-1), x[:, g].max(-1), rtol=1e-6)
        assert all(len(np.unique(np.asarray(r))) <= 4 for r in out[:, g])
    half = qcov.token_fake_quant(x, 2, 16, 0.5, "float32")
    np.testing.assert_allclose(half.max(-1), 0.5 * x.max(-1), rtol=1e-6)
    np.testing.assert_array_equal(qcov.token_fake_quant(jnp.zeros((2, 8)), 2, 8, 1.0,
                                                        "float16"), 0.0)  # fmt: skip


def test_bytes_count_codes_token_params_and_amortised_sinks():
    b = om.bytes_per_token(parse_method("qcov2").kv, 64)
    assert b == {"k_codes": 16.0, "v_codes": 16.0, "k_params": 4.0, "v_params": 4.0,
                 "sink_kv": 8.0, "total": 48.0}  # fmt: skip
    b = parse_method("qcov2_c32_sink0").kv.bytes_per_token(128, 4096)
    assert b["k_params"] == b["v_params"] == 16.0 and b["sink_kv"] == 0 and b["total"] == 96.0
    assert parse_method("qcov4").kv.bytes_per_token(128)["total"] == 2 * 64 + 8 + 16
    with pytest.raises(ValueError, match="context=0"):
        parse_method("qcov2").kv.bytes_per_token(64, 0)


def test_name_parses_and_bad_suffixes_raise_naming_the_value():
    cfg = om.parse_name("qcov2")
    assert isinstance(cfg, om.QCov) and cfg.needs_queries and cfg.needs_calibration
    assert (cfg.bits, cfg.sinks, cfg.channel_group, cfg.residual_length, cfg.group_size) == (
        2, 64, 128, 128, 32)  # fmt: skip
    cfg = om.parse_name("qcov3_sink4_c32_r64_g16")
    assert (cfg.bits, cfg.sinks, cfg.channel_group, cfg.residual_length, cfg.group_size) == (
        3, 4, 32, 64, 16)  # fmt: skip
    assert not om.parse_name("qcov2_u0").spectral and om.parse_name("qcov2_u1").spectral
    assert om.parse_name("qcov2_b1").bias_offset and om.parse_name("qcov2_b1").needs_key_bias
    assert om.FAMILIES["qcov"] is om.QCov and om.parse_name("kivi2") is None
    with pytest.raises(ValueError, match=r"qcov2_n3.*\['n'\].*sink<S>, c<C>, u0, b1"):
        om.parse_name("qcov2_n3")
    with pytest.raises(ValueError, match="channel_group=24"):
        om.parse_name("qcov2_c24")
    with pytest.raises(ValueError, match="bits=5"):
        om.parse_name("qcov5")
    with pytest.raises(ValueError, match="sinks=-1"):
        om.QCov(sinks=-1)
    with pytest.raises(ValueError, match="spectral=2"):
        om.QCov(spectral=2)
    with pytest.raises(ValueError, match="bias_offset=1"):
        om.QCov(bias_offset=1)


@dataclasses.dataclass(frozen=True)
class _Spy(base.MethodConfig):
    """A calibrated method that only records what ``fit`` was handed."""

    needs_calibration = True
    seen: tuple = ()

    def fit(self, k, v, rope, key_offset=None, **kw):
        return self.replace(seen=tuple(sorted(kw)))


def test_calibration_hands_query_statistics_only_to_methods_that_need_them():
    m = _model()
    cal = np.random.default_rng(4).integers(1, 256, (2, 64))
    from oscar_eval.common import Method

    spy = Method("spy", _Spy())
    assert ecal.calibrate(m, [spy], cal)[0].kv.seen == ()  # no query pass at all
    mts = ecal.calibrate(m, [spy, parse_method("qcov2_sink4", 16, 16),
                             parse_method("oscarp2", 16, 16),
                             parse_method("qcov2_sink4_b1", 16, 16)], cal)  # fmt: skip
    assert mts[0].kv.seen == ()  # oscarp's fit (no **kw) would raise if handed any
    assert mts[1].kv.calibration.arrays["rot_k"].shape == (2, 2, 32, 32)
    assert mts[2].kv.calibration.arrays["rotation"].shape == (2, 2, 32, 32)
    a, b = (mts[i].kv.calibration.arrays for i in (1, 3))  # same statistics, bias out
    np.testing.assert_array_equal(a["rot_k"], b["rot_k"])
    # the statistics are the second moments of layer 0's real queries and outputs
    k, v, cq, co = ecal.layer_kv_stats(m, cal)
    k0, v0 = ecal.layer_kv(m, cal)
    np.testing.assert_array_equal(k, k0)
    np.testing.assert_array_equal(v, v0)
    mc, p = m.config, m.params()
    lp = jax.tree_util.tree_map(lambda a: a[0], p["layers"])
    pos = jnp.broadcast_to(jnp.arange(64), (2, 64))
    h = layers.norm(mc, layers.embed(p, jnp.asarray(cal), mc), lp["attn_norm"])
    q, kq, vq = layers.qkv(mc, lp, h, pos, False)
    o = layers.causal_attention(q, kq, vq)
    for x, got in ((q, cq[0]), (o, co[0])):
        xg = np.asarray(x, np.float64).reshape(2, 64, 2, 2, 32)
        want = np.einsum("bthgd,bthge->hde", xg, xg) / (2 * 64 * 2)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("t,chunk", [(96, 256), (512, 128)])
def test_key_attention_weight_is_the_squared_causal_attention_summed_over_queries(t, chunk):
    """``key_attention_weight`` (the weights of oscars2_attn1) against the softmax written
    out in numpy; query blocks (``chunk``) change nothing."""
    rng = np.random.default_rng(t)
    b, hq, h, d = 2, 4, 2, 16
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, t, h, d)) * 2.0, jnp.float32)
    got = np.asarray(ecal.key_attention_weight(q, k, chunk=chunk))
    qg = np.asarray(q, np.float64).reshape(b, t, h, hq // h, d)
    s = np.einsum("bqhgd,bkhd->bhgqk", qg, np.asarray(k, np.float64)) / np.sqrt(d)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, (p**2).sum(axis=(2, 3)), rtol=1e-4, atol=1e-6)
    assert got.shape == (b, h, t)


def test_calibration_hands_key_weights_only_to_the_attention_weighted_selection():
    m = _model()
    cal = np.random.default_rng(5).integers(1, 256, (2, 64))
    from oscar_eval.common import Method

    mts = ecal.calibrate(m, [Method("spy", _SpyQ()), parse_method("oscars2_attn1", 16, 16),
                             parse_method("oscars2", 16, 16), parse_method("oscars2_out1", 16, 16),
                             parse_method("oscars2_nll1", 16, 16)], cal)  # fmt: skip
    assert mts[0].kv.seen == ("output_cov", "query_cov")
    for mt in mts[1:]:
        assert mt.kv.calibration.arrays["hadamard"].shape == (2, 2)
    # nll1: the four candidates' calibration NLLs, the chosen one the smallest of them
    losses = dict(x.split()[:2] for x in mts[4].kv.chosen.replace(" *", "").split(", "))
    assert set(losses) == {"all", "none", "score", "output"}
    assert mts[4].kv.chosen.count("*") == 1
    star = mts[4].kv.chosen.split(" *")[0].split(", ")[-1].split()[0]
    assert float(losses[star]) == min(map(float, losses.values()))
    best = ecal.calibration_nll(m, cal, mts[4].kv)
    assert np.isclose(best, float(losses[star]), atol=1e-4)
    k, v, cq, co, kw, qs = ecal.layer_kv_stats(m, cal, attention=True, queries=True)
    assert kw.shape == (2, 2, 2, 64) and np.isfinite(kw).all()
    np.testing.assert_array_equal(ecal.query_positions(64), np.arange(64))
    assert qs.shape == (2, 2, 4, 64, 32)  # [L, N, Hq, S, D]
    assert list(ecal.query_positions(1024, 256)[[0, -1]]) == [0, 1023]
    # every query's probabilities sum to 1, so a head's squared mass is at most T per window
    assert (kw > 0).all() and (kw.sum(-1) <= 64 * 2 + 1e-3).all()


@dataclasses.dataclass(frozen=True)
class _SpyQ(_Spy):
    needs_queries = True


@given(t=st.integers(1, 5000), n=st.integers(1, 600))
@settings(max_examples=60, deadline=None)
def test_query_positions_spread_over_the_window(t, n):
    """Sorted, distinct, within the window, the first and last position included, min(n, t)
    of them."""
    pos = ecal.query_positions(t, n)
    assert pos.dtype == np.int32 and len(pos) == min(n, t)
    assert (np.diff(pos) > 0).all() and pos[-1] == t - 1 and (pos[0] == 0 or n == 1)


def test_calibration_runs_gemma3_sliding_window_layers_as_the_model_does():
    """Gemma 3's local layers attend over their window in the calibration pass: every
    layer's key norms equal the evaluation's full-precision forward (``keep_norms``), which
    would differ from the second layer on if a local layer saw the whole prompt; and the
    whole-model selection fits on such a model."""
    mc = models.gemma3_270m().replace(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=32, query_pre_attn_scalar=24.0, sliding_window=8,
        local_layers=(0, 2), max_position_embeddings=512,
    )  # fmt: skip
    m = models.CausalLM(mc, rngs=nnx.Rngs(1))
    cal = np.random.default_rng(6).integers(1, 256, (2, 64))
    k, _ = ecal.layer_kv(m, cal)  # [L, N, H, T, D]
    import oscar_jax as oj
    from oscar_eval import ppl as eval_ppl

    _, norms = eval_ppl.forward_cached(mc, m.params(), jnp.asarray(cal), oj.preset("bf16"),
                                       keep_norms=True, cache_dtype="float32")  # fmt: skip
    want = np.swapaxes(np.asarray(norms), 2, 3)  # [L, B, T, H] -> [L, B, H, T]
    # float32 on both sides: ~1e-7 of the largest norm; a full-prompt local layer: ~3e-5
    np.testing.assert_allclose(np.linalg.norm(k, axis=-1), want, rtol=0,
                               atol=2e-6 * np.abs(want).max())  # fmt: skip
    mt = ecal.calibrate(m, [parse_method("oscars2_nll1", 16, 16)], cal)[0]
    assert mt.kv.calibration.arrays["hadamard"].shape == (4, 2) and "*" in mt.kv.chosen
