"""``oscar_eval.fisher``: the gradients KVQuant's Fisher-weighted codebooks are fitted with."""

from __future__ import annotations

import numpy as np

from oscar_eval import calibrate as ecal
from oscar_eval.common import parse_method
from oscar_eval.fisher import layer_grads


def test_layer_grads_are_zero_exactly_where_no_scored_prediction_reads(tiny):
    """The last position's key and value are read only by the last query, whose next
    token is not scored: their gradients are exactly 0; earlier ones are not."""
    cfg = tiny.config
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))
    gk, gv = layer_grads(tiny, ids)
    want = (cfg.num_layers, 2, cfg.num_kv_heads, 24, cfg.head_dim)
    assert gk.shape == want and gv.shape == want
    assert np.all(gk[:, :, :, -1] == 0) and np.all(gv[:, :, :, -1] == 0)
    assert np.all(np.abs(gk[:, :, :, :-1]).max(axis=(0, 2, 4)) > 0)
    assert np.all(np.abs(gv[:, :, :, :-1]).max(axis=(0, 2, 4)) > 0)


def test_calibrate_hands_gradients_only_to_the_fisher_method(tiny):
    ids = np.random.default_rng(1).integers(0, tiny.config.vocab_size, (2, 64))
    plain, fisher = ecal.calibrate(
        tiny, [parse_method(n, 16, 16) for n in ("kvquant2", "kvquant2_fisher1")], ids
    )
    assert not plain.kv.fisher and fisher.kv.fisher
    for name in ("k_levels", "v_levels"):
        a, b = plain.kv.calibration.arrays[name], fisher.kv.calibration.arrays[name]
        assert a.shape == b.shape == (tiny.config.num_layers, 4)
        assert np.all(np.diff(b, axis=1) > 0) and not np.allclose(a, b)
