"""Group quantization and packing: exact packing, error bounds, no NaN on degenerate groups."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

import oscar_jax as oj
from oscar_jax import codec, quant


class PackTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(bits=(1, 2, 3, 4, 8), axis=(-1, 1))
    def test_pack_unpack_exact(self, bits, axis):
        codes = jax.random.randint(jax.random.PRNGKey(bits), (3, 64, 16), 0, 1 << bits)
        codes = codes.astype(jnp.uint8)
        packed = self.variant(lambda c: oj.pack(c, bits, axis=axis))(codes)
        assert packed.dtype == jnp.uint8
        n_axis = 1 if axis == 1 else 2
        assert packed.shape[n_axis] == codes.shape[n_axis] * bits // 8
        np.testing.assert_array_equal(
            self.variant(lambda p: oj.unpack(p, bits, axis=axis))(packed), codes
        )

    def test_planar_layout_int2(self):
        codes = jnp.arange(16, dtype=jnp.uint8) % 4  # 16 codes -> 4 bytes, P = 4
        packed = np.asarray(oj.pack(codes, 2))
        for j in range(4):
            want = sum(int(codes[j + i * 4]) << (2 * i) for i in range(4))
            assert packed[j] == want

    @given(
        bits=st.sampled_from([1, 2, 3, 4, 8]), n8=st.integers(1, 16), seed=st.integers(0, 2**31 - 1)
    )
    @settings(max_examples=30, deadline=None)
    def test_pack_roundtrip_property(self, bits, n8, seed):
        rng = np.random.default_rng(seed)
        codes = rng.integers(0, 1 << bits, size=(2, 8 * n8), dtype=np.uint8)
        np.testing.assert_array_equal(oj.unpack(oj.pack(jnp.asarray(codes), bits), bits), codes)

    def test_bad_pack_lengths(self):
        with self.assertRaisesRegex(ValueError, "n=6"):
            oj.pack(jnp.zeros((6,), jnp.uint8), 2)
        with self.assertRaisesRegex(ValueError, "bits=5"):
            oj.pack(jnp.zeros((8,), jnp.uint8), 5)


class QuantizeTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(
        bits=(1, 2, 3, 4, 8), dtype=("float32", "bfloat16", "float16"), axis=(0, 1)
    )
    def test_error_within_half_step(self, bits, dtype, axis):
        x = jax.random.normal(jax.random.PRNGKey(3), (64, 64)) * 4 + 1
        fn = self.variant(lambda x: oj.quantize_groups(x, bits, 32, axis, jnp.dtype(dtype)))
        codes, scale, zero = fn(x)
        assert int(codes.max()) <= (1 << bits) - 1
        x_hat = oj.dequantize_groups(codes, scale, zero, 32, axis)
        step = jnp.repeat(scale.astype(jnp.float32), 32, axis=axis)
        # half a step, plus the rounding of scale and zero to their dtype (relative eps * range)
        eps = float(jnp.finfo(jnp.dtype(dtype)).eps)
        slack = eps * (jnp.abs(x).max() + step * ((1 << bits) - 1)) + 1e-6
        assert bool(jnp.all(jnp.abs(x_hat - x) <= step / 2 + slack))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(2, 4)
    def test_constant_and_zero_groups_give_no_nan(self, bits):
        x = jnp.concatenate([jnp.full((32, 8), 3.25), jnp.zeros((32, 8))], axis=0)
        codes, scale, zero = self.variant(
            lambda x: oj.quantize_groups(x, bits, 32, 0, jnp.float32)
        )(x)
        x_hat = oj.dequantize_groups(codes, scale, zero, 32, 0)
        assert bool(jnp.all(jnp.isfinite(x_hat)))
        np.testing.assert_array_equal(x_hat, x)

    def test_group_layout_keys_per_channel_values_per_token(self):
        cfg = oj.preset("kivi", bits=2)
        kh = jax.random.normal(jax.random.PRNGKey(0), (1, 2, 64, 128))
        ek = oj.encode_keys_xla(kh, cfg)
        ev = oj.encode_values_xla(kh, cfg)
        assert ek.scale.shape == (1, 2, 2, 128)  # one per channel per 32 tokens
        assert ev.scale.shape == (1, 2, 64, 4)  # one per token per 32 channels
        assert ek.codes.shape == ev.codes.shape == (1, 2, 64, 32)
        # a group's scale is set by its own 32 tokens only
        kh2 = kh.at[:, :, 40].mul(100.0)
        ek2 = oj.encode_keys_xla(kh2, cfg)
        np.testing.assert_array_equal(ek2.scale[:, :, 0], ek.scale[:, :, 0])
        assert not np.array_equal(ek2.scale[:, :, 1], ek.scale[:, :, 1])

    @parameterized.parameters("bfloat16", "float32", "float8_e4m3fn")
    def test_param_dtypes(self, pdt):
        cfg = oj.preset("oscar", bits=2, param_dtype=pdt)
        k = jax.random.normal(jax.random.PRNGKey(0), (1, 64, 2, 64))
        ek = oj.encode_keys_xla(jnp.swapaxes(k, 1, 2), cfg)
        assert ek.scale.dtype == jnp.dtype(pdt)
        err = jnp.abs(oj.fake_quant_keys(k, cfg) - k).mean() / jnp.abs(k).mean()
        assert float(err) < 0.5

    def test_quant_helpers_reject_bad_group(self):
        with self.assertRaisesRegex(ValueError, "group_size=32"):
            quant.quantize_groups(jnp.ones((40,)), 2, 32, 0, jnp.float32)


class ScalingTest(parameterized.TestCase):
    """The exact scalings behind the token norm and the division by it."""

    def test_pow2_prescale_is_an_exact_power_of_two(self):
        bits = np.random.default_rng(0).integers(1, 0x7F800000, size=4096, dtype=np.int64)
        m = np.concatenate([bits.astype(np.uint32).view(np.float32), [1.0, 2.0**127, 1e-45]])
        s, inv = (np.asarray(a, np.float64) for a in quant.pow2_prescale(jnp.asarray(m)))
        np.testing.assert_array_equal(np.log2(s), np.round(np.log2(s)))  # powers of two
        np.testing.assert_array_equal(s * inv, 1.0)
        assert s.min() >= 2.0**-126 and s.max() <= 2.0**126  # normal: x * s is exact
        ms = m.astype(np.float64) * s
        normal = (m >= 2.0**-126) & (m < 2.0**127)
        assert np.all((ms[normal] >= 1) & (ms[normal] < 2)), "m s in [1, 2)"
        assert np.all(ms < 4)
        # the token norm's clamp: s >= 2^-121, so s / sqrt(1024) is still a normal float
        s, inv = (np.asarray(a, np.float64) for a in quant.pow2_prescale(jnp.asarray(m), 121))
        np.testing.assert_array_equal(s * inv, 1.0)
        assert s.min() == 2.0**-121 and s.max() <= 2.0**126
        ms = m.astype(np.float64) * s
        mid = (m >= 2.0**-126) & (m < 2.0**122)
        assert np.all((ms[mid] >= 1) & (ms[mid] < 2)) and np.all(ms < 2.0**7)
        assert float(np.float32(s.min()) * np.float32(1 / np.sqrt(1024))) >= 2.0**-126
        with self.assertRaisesRegex(ValueError, "max_exponent"):
            quant.pow2_prescale(jnp.ones(2), 127)

    @parameterized.parameters("per_head", "per_token")
    def test_token_norm_matches_float64_at_any_scale(self, gran):
        x = jax.random.normal(jax.random.PRNGKey(1), (1, 2, 12, 64), jnp.float32)
        scale = jnp.asarray(10.0 ** np.linspace(-40, 36, 12), jnp.float32)[None, None, :, None]
        x = x * scale  # tokens from subnormal-range values to 1e36 (no overflow, no NaN)
        got = np.asarray(codec.token_l2_norm(x, gran), np.float64)
        xs = np.asarray(x, np.float64)
        want = (
            np.sqrt((xs**2).sum(-1))
            if gran == "per_head"
            else np.sqrt((xs**2).sum((1, 3)))[:, None]
        )
        normal = want > 2.0**-126
        np.testing.assert_allclose(got[normal], want[normal], rtol=2e-6)
        assert np.all(np.isfinite(got)) and np.all(got[~normal] >= 0)
        assert float(codec.token_l2_norm(jnp.zeros((1, 1, 2, 8)), gran).max()) == 0.0

    @parameterized.parameters("per_head", "per_token")
    def test_scaled_reciprocal_normal_and_as_one_over_norm(self, gran):
        """r = 1 / (d s) is a normal float at every scale, and (x s) r equals x * (1 / d)
        wherever 1 / d is normal: the same bits as a multiply by the norm's reciprocal."""
        x = jax.random.normal(jax.random.PRNGKey(2), (1, 2, 16, 64), jnp.float32)
        scale = jnp.asarray(10.0 ** np.linspace(-44, 37, 16), jnp.float32)[None, None, :, None]
        x = x * scale  # tokens from subnormal values to 1e37
        n, s = codec.token_norm_and_prescale(x, gran)  # [1, Hn, 16]
        d = quant.round_to_dtype(n, jnp.bfloat16)  # a stored norm
        r = quant.scaled_reciprocal(d, s)
        r64, d64 = np.asarray(r, np.float64), np.asarray(d, np.float64)
        assert np.all(r64[d64 >= 2.0**-126] > 0)
        assert np.all(r64[r64 > 0] >= 2.0**-126) and np.all(r64 <= 2.0**126)
        ok = (d64 >= 2.0**-126) & (d64 <= 2.0**126)
        assert ok.sum() >= 10 * d.shape[1]
        got = (x * s[..., None]) * r[..., None]
        want = x * jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)[..., None]
        mask = np.broadcast_to(ok[..., None], x.shape)
        np.testing.assert_array_equal(np.asarray(got)[mask], np.asarray(want)[mask])
        for bad in (0.0, np.inf, np.nan):  # no norm, an overflowed one, a NaN key: r = 0
            np.testing.assert_array_equal(quant.scaled_reciprocal(jnp.full(2, bad), 1.0), 0.0)


def test_config_errors_speak_to_users():
    """A bad bit width names what each method takes; bf16 takes no bits; no ``self.``."""
    with pytest.raises(
        ValueError, match=r"bits=5 must be one of 1, 2, 3, 4 or 8 for method 'oscar'"
    ):
        oj.preset("oscar", bits=5)
    with pytest.raises(
        ValueError, match=r"bits=2 must not be given for method 'bf16'.*unquantized"
    ):
        oj.preset("bf16", bits=2)
    with pytest.raises(ValueError, match=r"bits=2 must not be given for method 'bf16'"):
        oj.KVQuantConfig(method="bf16", bits=2)
    assert oj.preset("bf16", bits=16) == oj.preset("bf16")
    for bad in (dict(bits=5), dict(group_size=24), dict(residual_length=100), dict(rotation="x")):
        with pytest.raises(ValueError) as e:
            oj.preset("kivi", **bad)
        assert "self." not in str(e.value) and f"{next(iter(bad))}=" in str(e.value)
    c = oj.init_cache(oj.preset("oscar"), batch=1, max_len=256, num_kv_heads=1, head_dim=128)
    with pytest.raises(ValueError, match=r"implementation='cuda' must be one of .*'pallas'.*'xla'"):
        oj.decode_attention(jnp.zeros((1, 1, 128)), c, implementation="cuda")
