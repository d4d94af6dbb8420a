"""The paper's diagnosis on synthetic keys, measured (not constructed to favour a method)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import oscar_jax as oj
from oscar_jax import diagnostics as dg


class DiagnosisTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        self.q, self.k, self.v, self.sink = dg.synthetic_kv(
            jax.random.PRNGKey(0), tokens=512, sink_norm_ratio=50.0, sinks=(0, 1, 2)
        )

    def test_tni_ratio_sees_the_sinks(self):
        r = dg.tni_ratio(self.k)
        assert r.shape == (1, 2)
        np.testing.assert_allclose(np.asarray(r), 50.0, rtol=1e-3)

    @parameterized.parameters(2, 4)
    def test_token_scaling_rescues_sink_keys(self, bits):
        rep = {m: dg.reconstruction_report(self.q, self.k, self.v, oj.preset(m, bits=bits),
                                           self.sink)
               for m in ("kivi", "ots_only", "rotation_only", "oscar")}  # fmt: skip
        kivi = rep["kivi"]["sink_key_rel_err"]
        for m in ("ots_only", "oscar"):
            # sink norm 50x below the median: KIVI's error on them is ~50x larger
            assert rep[m]["sink_key_rel_err"] * 30 < kivi, (m, rep[m], kivi)
            # and the sinks are no longer worse off than the other tokens
            assert rep[m]["sink_key_rel_err"] < 2 * rep[m]["other_key_rel_err"]
        assert rep["rotation_only"]["sink_key_rel_err"] * 5 > kivi  # rotation alone: no rescue
        for r in rep.values():
            assert all(np.isfinite(x) for x in r.values())

    def test_group_mse_grows_with_squared_norm_range(self):
        # KIVI keys: groups whose token norms span ranges from 0 to large; MSE ~ range^2
        key = jax.random.PRNGKey(1)
        g, ng, d = 32, 24, 64
        base = jax.random.normal(key, (1, g * ng, 1, d))
        base = base / jnp.linalg.norm(base, axis=-1, keepdims=True)
        spread = jnp.linspace(0.0, 20.0, ng)
        u = jax.random.uniform(jax.random.fold_in(key, 1), (ng, g))
        norms = 1.0 + spread[:, None] * u  # norm range grows across groups
        k = base * norms.reshape(1, -1, 1, 1)
        cfg = oj.preset("kivi", bits=2)
        mse = np.asarray(dg.group_key_mse(k, cfg))[0, :, 0]
        rng = np.asarray(dg.group_norm_range(k, g))[0, :, 0]
        corr = np.corrcoef(rng**2, mse)[0, 1]
        assert corr > 0.9, corr
        assert mse[-1] > 50 * mse[1]

    def test_tni_of_zero_norm_is_inf_not_nan(self):
        k = self.k.at[:, 5].set(0.0)
        assert bool(jnp.all(jnp.isinf(dg.tni_ratio(k))))
        for m in ("kivi", "oscar", "ots_only"):
            kh = oj.fake_quant_keys(k, oj.preset(m))
            assert bool(jnp.all(jnp.isfinite(kh)))
            if oj.preset(m).token_scaling:  # norm 0 is stored: the key comes back exactly 0
                np.testing.assert_array_equal(np.asarray(kh[:, 5]), 0.0)

    def test_cli_runs(self, tmp_path=None):
        from oscar_jax.__main__ import method_table

        rows = method_table(0, 128, 64, bits_list=(2,))
        assert {r["method"] for r in rows} == {"kivi", "ots_only", "rotation_only", "oscar"}
        assert all(np.isfinite(r["attn_rel_err"]) for r in rows)


if __name__ == "__main__":
    pytest.main([__file__])
