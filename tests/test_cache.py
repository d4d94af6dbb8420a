"""The cache pytree: append == prefill bit for bit, ragged rows independent, capacity, errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from helpers import kv_with_sinks, small_cfg

import oscar_jax as oj

METHODS = ("bf16", "kivi", "ots_only", "rotation_only", "oscar")


def _fill_by_append(cache, k, n_steps):
    step = jax.jit(oj.append)
    for i in range(n_steps):
        cache = step(cache, k[0][:, i], k[1][:, i])
    return cache


class CacheTest(parameterized.TestCase):
    @parameterized.parameters(
        [("bf16", "per_head", 16)]
        + [(m, g, b) for m in METHODS[1:] for g in ("per_head", "per_token") for b in (2, 4)]
    )
    def test_append_equals_prefill_bitwise(self, method, granularity, bits):
        kw = {} if method == "bf16" else dict(norm_granularity=granularity, bits=bits)
        cfg = small_cfg(method, **kw)
        b, t, h, d = 1, 167, 2, 64
        k, v = kv_with_sinks(1, b, t, h, d)
        empty = oj.init_cache(
            cfg, batch=b, max_len=200, num_kv_heads=h, head_dim=d, dtype=jnp.float32
        )
        want = oj.prefill(empty, k, v)
        got = _fill_by_append(empty, (k, v), t)
        chex.assert_trees_all_equal(got, want)
        if cfg.quantized:
            assert int(want.num_quantized()[0]) == 96  # (167 - 64) // 32 * 32

    def test_ragged_rows_equal_rows_alone(self):
        cfg = small_cfg("oscar", norm_granularity="per_token")
        b, t, h, d = 3, 150, 2, 64
        k, v = kv_with_sinks(2, b, t, h, d)
        lengths = jnp.array([150, 7, 97])
        mk = lambda bb: oj.init_cache(
            cfg, batch=bb, max_len=200, num_kv_heads=h, head_dim=d, dtype=jnp.float32
        )
        full = jax.jit(oj.prefill)(mk(b), k, v, lengths)
        for i in range(b):
            n = int(lengths[i])
            alone = oj.prefill(mk(1), k[i : i + 1, :n], v[i : i + 1, :n])
            row = jax.tree_util.tree_map(lambda x, i=i: x[i : i + 1], full)
            chex.assert_trees_all_equal(row, alone)
        # and appending continues each row independently
        k2, v2 = kv_with_sinks(3, b, 40, h, d)
        c = full
        step = jax.jit(oj.append)
        for s in range(40):
            c = step(c, k2[:, s], v2[:, s])
        for i in range(b):
            n = int(lengths[i])
            kk = jnp.concatenate([k[i : i + 1, :n], k2[i : i + 1]], 1)
            vv = jnp.concatenate([v[i : i + 1, :n], v2[i : i + 1]], 1)
            alone = oj.prefill(mk(1), kk, vv)
            chex.assert_trees_all_equal(
                jax.tree_util.tree_map(lambda x, i=i: x[i : i + 1], c), alone
            )

    @chex.variants(with_jit=True, without_jit=True)
    def test_dequantize_places_tokens_and_zeros_past_length(self):
        cfg = small_cfg("oscar", bits=8)
        k, v = kv_with_sinks(4, 2, 130, 2, 64)
        c = oj.init_cache(cfg, batch=2, max_len=140, num_kv_heads=2, head_dim=64, dtype=jnp.float32)
        c = oj.prefill(c, k, v, jnp.array([130, 50]))
        kd, vd = self.variant(oj.dequantize)(c)
        assert kd.shape == (2, 140, 2, 64)
        np.testing.assert_array_equal(kd[1, 50:], 0)
        np.testing.assert_array_equal(kd[0, 130:], 0)
        np.testing.assert_array_equal(kd[1, :50], k[1, :50])  # all residual: exact
        assert int(c.num_quantized()[0]) == 64
        np.testing.assert_array_equal(kd[0, 64:130], k[0, 64:130])  # residual part exact
        rel = jnp.linalg.norm(kd[0, :64] - k[0, :64]) / jnp.linalg.norm(k[0, :64])
        assert float(rel) < 0.02  # INT8 quantized part
        relv = jnp.linalg.norm(vd[0, :64] - v[0, :64]) / jnp.linalg.norm(v[0, :64])
        assert float(relv) < 0.02

    def test_append_compiles_once(self):
        cfg = small_cfg("oscar")
        k, v = kv_with_sinks(5, 2, 120, 2, 64)
        c = oj.init_cache(cfg, batch=2, max_len=128, num_kv_heads=2, head_dim=64)

        @jax.jit
        @chex.assert_max_traces(n=1)
        def step(c, kt, vt):
            return oj.append(c, kt, vt)

        for i in range(120):  # crosses several flushes
            c = step(c, k[:, i], v[:, i])
        assert c.lengths.tolist() == [120, 120]

    def test_overflow_under_jit_never_overwrites(self):
        cfg = small_cfg("oscar")
        k, v = kv_with_sinks(6, 2, 128, 2, 64)
        c = oj.init_cache(cfg, batch=2, max_len=128, num_kv_heads=2, head_dim=64, dtype=jnp.float32)
        c = oj.prefill(c, k, v, jnp.array([128, 100]))
        c2 = jax.jit(oj.append)(c, k[:, 5] + 1.0, v[:, 5] + 1.0)
        assert c2.lengths.tolist() == [128, 101]
        assert c2.flags.tolist() == [oj.FLAG_OVERFLOW, 0]
        for name in ("k_codes", "k_scale", "k_norm", "v_codes", "k_res", "v_res"):
            np.testing.assert_array_equal(getattr(c2, name)[0], getattr(c, name)[0])

    def test_nonfinite_flagged_per_row(self):
        cfg = small_cfg("oscar")
        k, v = kv_with_sinks(7, 2, 40, 2, 64)
        c = oj.init_cache(cfg, batch=2, max_len=64, num_kv_heads=2, head_dim=64)
        c = oj.prefill(c, k.at[1, 3, 0, 0].set(jnp.nan), v)
        assert c.flags.tolist() == [0, oj.FLAG_NONFINITE]
        c = oj.append(c, k[:, 0], v[:, 0].at[0, 1, 1].set(jnp.inf))
        assert c.flags.tolist() == [oj.FLAG_NONFINITE, oj.FLAG_NONFINITE]

    def test_bad_lengths_are_clipped_and_flagged(self):
        cfg = small_cfg("kivi")
        k, v = kv_with_sinks(8, 2, 40, 2, 64)
        c = oj.init_cache(cfg, batch=2, max_len=64, num_kv_heads=2, head_dim=64)
        c = jax.jit(oj.prefill)(c, k, v, jnp.array([41, -3]))
        assert c.lengths.tolist() == [40, 0]
        assert c.flags.tolist() == [oj.FLAG_BAD_LENGTH, oj.FLAG_BAD_LENGTH]


class MemoryTest(parameterized.TestCase):
    def test_int2_bytes_per_token_per_head(self):
        cfg = oj.preset("oscar", bits=2)
        h, d, n = 8, 128, 4096 + 128 + 32 * 3 + 5
        c = oj.init_cache(cfg, batch=1, max_len=n, num_kv_heads=h, head_dim=d)
        k = jax.random.normal(jax.random.PRNGKey(0), (1, n, h, d), jnp.bfloat16)
        c = oj.prefill(c, k, k)
        nq = int(c.num_quantized()[0])
        assert nq == 4096 + 96
        # count from the arrays themselves: every stored element of the valid region
        g = cfg.group_size
        q_bytes = sum(
            getattr(c, f)[:, :, :stop].size * getattr(c, f).dtype.itemsize
            for f, stop in (("k_codes", nq), ("v_codes", nq), ("k_scale", nq // g),
                            ("k_zero", nq // g), ("k_norm", nq), ("v_scale", nq),
                            ("v_zero", nq))
        )  # fmt: skip
        r_bytes = 2 * (n - nq) * h * d * 2
        assert oj.cache_nbytes(c) == q_bytes + r_bytes
        per_token_head = q_bytes / (nq * h)
        assert per_token_head <= 100, per_token_head
        assert 512 / per_token_head >= 5.1

    def test_bf16_counts_residual_only(self):
        c = oj.init_cache(oj.preset("bf16"), batch=2, max_len=50, num_kv_heads=2, head_dim=64)
        k = jnp.ones((2, 30, 2, 64))
        c = oj.prefill(c, k, k, jnp.array([30, 10]))
        assert oj.cache_nbytes(c) == 40 * 2 * 2 * 64 * 2


class ErrorTest(parameterized.TestCase):
    def test_config_errors_name_the_value(self):
        with self.assertRaisesRegex(ValueError, r"bits=5 must be one of 1, 2, 3, 4 or 8"):
            oj.preset("oscar", bits=5)
        with self.assertRaisesRegex(ValueError, r"group_size=24"):
            oj.preset("kivi", group_size=24)
        with self.assertRaisesRegex(ValueError, r"residual_length=100"):
            oj.preset("kivi", residual_length=100)
        with self.assertRaisesRegex(ValueError, r"method='foo'"):
            oj.preset("foo")
        with self.assertRaisesRegex(ValueError, r"norm_granularity='x'"):
            oj.preset("oscar", norm_granularity="x")
        with self.assertRaisesRegex(ValueError, r"colour"):
            oj.preset("oscar", colour=1)

    def test_cache_errors(self):
        cfg = oj.preset("oscar")
        with self.assertRaisesRegex(ValueError, "head_dim=20"):
            oj.init_cache(cfg, batch=1, max_len=8, num_kv_heads=1, head_dim=20)
        with self.assertRaisesRegex(ValueError, "head_dim=48"):
            oj.init_cache(cfg, batch=1, max_len=8, num_kv_heads=1, head_dim=48)
        with self.assertRaisesRegex(ValueError, "batch=0"):
            oj.init_cache(cfg, batch=0, max_len=8, num_kv_heads=1, head_dim=64)
        with self.assertRaisesRegex(ValueError, "dtype"):
            oj.init_cache(cfg, batch=1, max_len=8, num_kv_heads=1, head_dim=64, dtype=jnp.int32)
        c = oj.init_cache(cfg, batch=2, max_len=16, num_kv_heads=2, head_dim=64)
        k = jnp.ones((2, 8, 2, 64))
        with self.assertRaisesRegex(ValueError, "rank 4"):
            oj.prefill(c, k[0], k[0])
        with self.assertRaisesRegex(ValueError, "max_len=16"):
            oj.prefill(c, jnp.ones((2, 17, 2, 64)), jnp.ones((2, 17, 2, 64)))
        with self.assertRaisesRegex(ValueError, "batch, num_kv_heads, head_dim"):
            oj.prefill(c, jnp.ones((3, 8, 2, 64)), jnp.ones((3, 8, 2, 64)))
        with self.assertRaisesRegex(ValueError, "dtype"):
            oj.prefill(c, k.astype(jnp.int32), k.astype(jnp.int32))
        with self.assertRaisesRegex(ValueError, "lengths"):
            oj.prefill(c, k, k, jnp.array([1, 2, 3]))
        with self.assertRaisesRegex(ValueError, "rank 3"):
            oj.append(c, k, k)
        with self.assertRaisesRegex(ValueError, "v.shape"):
            oj.append(c, k[:, 0], k[:, 0, :1])
        with self.assertRaisesRegex(ValueError, "implementation='cuda'"):
            oj.prefill(
                oj.init_cache(
                    oj.preset("kivi", residual_length=0),
                    batch=2,
                    max_len=64,
                    num_kv_heads=2,
                    head_dim=64,
                ),
                jnp.ones((2, 64, 2, 64)),
                jnp.ones((2, 64, 2, 64)),
                implementation="cuda",
            )


if __name__ == "__main__":
    pytest.main([__file__])


class JitParityTest(parameterized.TestCase):
    """Every public op gives the same result with and without jit."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters("kivi", "oscar", "bf16")
    def test_fake_quant_prefill_append_dequantize(self, method):
        cfg = small_cfg(method)
        k, v = kv_with_sinks(9, 2, 99, 2, 64)
        kh = self.variant(lambda x: oj.fake_quant_keys(x, cfg))(k)
        vh = self.variant(lambda x: oj.fake_quant_values(x, cfg))(v)
        chex.assert_trees_all_close(kh, oj.fake_quant_keys(k, cfg), rtol=1e-6, atol=1e-6)
        chex.assert_trees_all_close(vh, oj.fake_quant_values(v, cfg), rtol=1e-6, atol=1e-6)
        assert kh.shape == k.shape and kh.dtype == k.dtype
        c0 = oj.init_cache(cfg, batch=2, max_len=160, num_kv_heads=2, head_dim=64,
                           dtype=jnp.float32)  # fmt: skip
        c = self.variant(oj.prefill)(c0, k, v, jnp.array([99, 40]))
        c = self.variant(oj.append)(c, k[:, 0], v[:, 0])
        want = oj.append(oj.prefill(c0, k, v, jnp.array([99, 40])), k[:, 0], v[:, 0])
        chex.assert_trees_all_equal(c, want)
        # same stored bits; the dequantized floats may differ in the last bit (jit contracts
        # code * scale + zero into fused multiply-adds)
        chex.assert_trees_all_close(
            self.variant(oj.dequantize)(c), oj.dequantize(want), rtol=1e-6, atol=1e-7
        )
