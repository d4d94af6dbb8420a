"""Reference decode attention: exact for bf16, consistent with dequantize, GQA, ragged rows."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from helpers import kv_with_sinks, query, small_cfg

import oscar_jax as oj


def exact_attention_f64(q, k, v, lengths):
    """float64 numpy softmax attention over the first lengths[i] tokens of each row."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, hq, d = q.shape
    h = k.shape[2]
    out = np.zeros((b, hq, d))
    for i in range(b):
        n = int(lengths[i])
        if n == 0:
            continue
        for j in range(hq):
            s = k[i, :n, j // (hq // h)] @ q[i, j] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, j] = (p / p.sum()) @ v[i, :n, j // (hq // h)]
    return out


def filled(cfg, k, v, lengths, max_len):
    b, _, h, d = k.shape
    c = oj.init_cache(cfg, batch=b, max_len=max_len, num_kv_heads=h, head_dim=d, dtype=k.dtype)
    return oj.prefill(c, k, v, lengths)


class DecodeAttentionTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((1, 64), (4, 128), (8, 64))
    def test_bf16_preset_is_exact_softmax(self, gqa, d):
        b, t, h = 3, 90, 2
        k, v = kv_with_sinks(10 + gqa, b, t, h, d)
        q = query(10 + gqa, b, h * gqa, d)
        lengths = jnp.array([90, 1, 0])
        c = filled(oj.preset("bf16"), k, v, lengths, 100)
        out = self.variant(oj.decode_attention)(q, c)
        ref = exact_attention_f64(q, k, v, lengths)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out[2], 0)  # empty row: zeros, no NaN

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters("kivi", "ots_only", "rotation_only", "oscar")
    def test_matches_attention_over_dequantized_cache(self, method):
        b, t, h, d, gqa = 3, 250, 2, 64, 4
        k, v = kv_with_sinks(20, b, t, h, d)
        q = query(20, b, h * gqa, d)
        lengths = jnp.array([250, 100, 30])
        c = filled(small_cfg(method, bits=2), k, v, lengths, 260)
        assert c.num_quantized().tolist() == [160, 32, 0]
        out = self.variant(oj.decode_attention)(q, c)
        kd, vd = oj.dequantize(c)
        ref = exact_attention_f64(q, kd, vd, lengths)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-5, atol=2e-5)

    @parameterized.parameters("kivi", "oscar")
    def test_int8_close_to_exact(self, method):
        b, t, h, d, gqa = 2, 300, 2, 128, 4
        k, v = kv_with_sinks(30, b, t, h, d)
        q = query(30, b, h * gqa, d)
        lengths = jnp.array([300, 170])
        c = filled(small_cfg(method, bits=8), k, v, lengths, 300)
        out = oj.decode_attention(q, c)
        ref = exact_attention_f64(q, k, v, lengths)
        rel = np.abs(np.asarray(out) - ref).max() / np.abs(ref).max()
        assert rel < 2e-2, rel

    def test_bf16_cache_dtype_and_softmax_scale(self):
        k, v = kv_with_sinks(40, 1, 20, 1, 64, dtype=jnp.bfloat16)
        q = query(40, 1, 2, 64, jnp.bfloat16)
        c = filled(oj.preset("bf16"), k, v, None, 20)
        out = oj.decode_attention(q, c, softmax_scale=0.05)
        assert out.dtype == jnp.bfloat16
        s = jnp.einsum("hd,td->ht", q[0].astype(jnp.float32), k[0, :, 0].astype(jnp.float32))
        ref = jax.nn.softmax(s * 0.05, -1) @ v[0, :, 0].astype(jnp.float32)
        np.testing.assert_allclose(np.asarray(out[0], np.float32), ref, rtol=1e-2, atol=1e-2)

    def test_query_errors(self):
        c = oj.init_cache(oj.preset("oscar"), batch=2, max_len=8, num_kv_heads=2, head_dim=64)
        with self.assertRaisesRegex(ValueError, "q.shape"):
            oj.decode_attention(jnp.ones((2, 64)), c)
        with self.assertRaisesRegex(ValueError, "num_q_heads=3"):
            oj.decode_attention(jnp.ones((2, 3, 64)), c)
        with self.assertRaisesRegex(ValueError, "batch=2"):
            oj.decode_attention(jnp.ones((1, 4, 64)), c)
        with self.assertRaisesRegex(ValueError, r"implementation='cuda' must be one of .*'triton'"):
            oj.decode_attention(jnp.ones((2, 4, 64)), c, implementation="cuda")


if __name__ == "__main__":
    pytest.main([__file__])
