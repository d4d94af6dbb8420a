"""The calibrated methods through the evaluation: ``calibrate`` fits them on a model's
own keys, ``method_inputs`` hands RoPE tables and each layer's state, and at 8 bits the
cache-exact logits stay at bf16's."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
import oscar_jax as oj
from oscar_eval import calibrate as ecal
from oscar_eval import ppl as eval_ppl
from oscar_eval.common import parse_method


def _model():
    cfg = models.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                             num_heads=4, num_kv_heads=2, head_dim=32, qkv_bias=True)  # fmt: skip
    return models.CausalLM(cfg, rngs=nnx.Rngs(0))


def test_calibrated_methods_fit_per_layer_and_kvquant_runs_near_bf16_at_8_bits():
    m = _model()
    rng = np.random.default_rng(0)
    cal, ids = rng.integers(1, 256, (2, 64)), jnp.asarray(rng.integers(1, 256, (1, 64)))
    names = ["kvquant8", "oscarp8", "kivi2"]
    mts = ecal.calibrate(m, [parse_method(n, 16, 16) for n in names], cal)
    assert [mt.name for mt in mts] == names and mts[2].kv == parse_method("kivi2", 16, 16).kv
    assert mts[0].kv.calibration.arrays["k_levels"].shape == (2, 256)
    assert mts[1].kv.calibration.arrays["rotation"].shape == (2, 2, 32, 32)
    ref = np.asarray(eval_ppl.cached_logits(m, ids, oj.preset("bf16")))
    out = np.asarray(eval_ppl.cached_logits(m, ids, mts[0].kv))  # rope + per-layer state
    np.testing.assert_allclose(out, ref, atol=0.05)


def test_method_inputs_by_what_the_method_declares():
    m = _model()
    lays = eval_ppl.with_method_state(m.params()["layers"], oj.preset("oscar"))
    assert "method_state" not in lays
    lp = {k: a[0] for k, a in lays.items()}
    pos = jnp.broadcast_to(jnp.arange(32), (1, 32))
    kv = parse_method("kvquant2").kv
    mi = eval_ppl.method_inputs(m.config, kv, lp, pos)
    assert mi["key_offset"] is None and mi["rope"][0].shape == (32, 32) and "state" not in mi
    assert eval_ppl.method_inputs(m.config, oj.preset("oscar"), lp, pos) == {}
    assert eval_ppl.method_inputs(m.config, parse_method("oscarb2").kv, lp, pos)[
        "key_offset"
    ].shape == (32, 2, 32)


def test_calibrate_heldout_fits_on_the_windows_after_the_scored_ones_only_when_needed():
    m = _model()
    text = np.random.default_rng(1).integers(1, 256, 400)
    kivi = [parse_method("kivi2", 16, 16)]
    assert ecal.calibrate_heldout(m, kivi, text[:8], 64, 4) == (kivi, None)  # text not read
    mts, note = ecal.calibrate_heldout(m, [parse_method("kvquant2", 16, 16)], text, 64, 2)
    assert note.startswith("calibrated methods fitted on the 2 windows of 64 tokens")
    assert mts[0].kv.calibration is not None
    with pytest.raises(ValueError, match="calibration needs 2 beyond the 5 scored"):
        ecal.calibrate_heldout(m, [parse_method("kvquant2", 16, 16)], text, 64, 5)


def test_eval_fits_the_calibrated_methods_on_the_windows_after_the_scored(tiny, tmp_path):
    import oscar_eval

    held = np.random.default_rng(4).integers(2, 256, 400)
    s = oscar_eval.Settings(methods="bf16,kvquant2", tasks="ppl", ctx=64, ppl_windows=3,
                            residual_length=16, group_size=16, show_progress=False,
                            compile_workers=0)  # fmt: skip
    res = oscar_eval.run_eval(tiny, held, str(tmp_path), s)
    assert (
        "calibrated methods fitted on the 2 windows of 64 tokens after the scored ones"
        in res["notes"]
    )
    assert [r["method"] for r in res["ppl"]] == ["bf16", "kvquant2"]
