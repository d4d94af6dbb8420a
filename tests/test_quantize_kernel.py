"""The fused Pallas encoder (``pallas_kernels.quantize.triton``) against ``encode_*_xla``.

``TestQuantizeKernelGPU`` compiles through Triton (skipped without a GPU);
``TestQuantizeKernelInterpret`` runs the same cases in Pallas interpret mode.
Inputs are fresh random keys/values with massive channels and low-norm sink tokens;
token counts are not multiples of the kernel's block (groups_per_block groups).

Agreement:
* interpret mode on CPU vs XLA on CPU: codes, scales, zeros and norms bit-identical in
  every case below; the bound allows 1e-4 of codes off by one (a reduction order
  that moves a value across an exact rounding tie) and 1 ulp on scales/zeros/norms.
* compiled on the H200 vs XLA on the H200: 0.004 %-1.9 % of codes off by one, scales and
  zeros within 1 bf16/f16 ulp, norms identical. XLA there does not divide or take
  square roots IEEE-exactly (29 % / 17 % of random f32 quotients / roots differ from
  numpy), the kernel does (div.rn); low-precision inputs over a bf16 scale land
  exactly on x.5 ties often, and there the two roundings disagree.
"""

import functools
import math
import zlib
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gpu_available
from helpers import kv_with_sinks
from tolerances import QUANT_CODES_OFF_BY_ONE, QUANT_PARAM_ULPS

import oscar_jax as oj
from benchmarks.bench_quantize import ulp_dist
from pallas_kernels.quantize import rotation as qr
from pallas_kernels.quantize import triton as pq

# name: (preset, preset overrides, D, T, input dtype, kernel options)
CASES = {
    "oscar_int2_d128_g32_bf16": ("oscar", dict(bits=2, group_size=32), 128, 96, "bfloat16", {}),
    "oscar_int4_d64_g64_f16_per_token": (
        "oscar",
        dict(bits=4, group_size=64, norm_granularity="per_token"),
        64,
        192,
        "float16",
        dict(groups_per_block=2),
    ),
    "oscar_int2_d256_g128_f32": (
        "oscar",
        dict(bits=2, group_size=128),
        256,
        384,
        "float32",
        dict(groups_per_block=2, num_warps=4),
    ),
    "kivi_int2_d128_g32": (
        "kivi",
        dict(bits=2, group_size=32),
        128,
        160,
        "bfloat16",
        dict(groups_per_block=4),
    ),
    "oscar_int2_d128_g32_bf16_loop": (  # whole blocks: the unguarded, pipelined group loop
        "oscar",
        dict(bits=2, group_size=32),
        128,
        256,
        "bfloat16",
        dict(groups_per_block=4, num_stages=3),
    ),
    "rotation_only_int4_d128_f32": ("rotation_only", dict(bits=4), 128, 96, "float32", {}),
    "ots_only_int2_d64_f16_per_token": (
        "ots_only",
        dict(bits=2, norm_granularity="per_token"),
        64,
        96,
        "float16",
        dict(groups_per_block=1),
    ),
    "randomized_hadamard_int2_d64": (
        "oscar",
        dict(bits=2, rotation="randomized_hadamard"),
        64,
        96,
        "bfloat16",
        {},
    ),
    "randomized_hadamard_int4_d256_f32": (
        "oscar",
        dict(bits=4, rotation="randomized_hadamard"),
        256,
        64,
        "float32",
        {},
    ),
    "random_orthogonal_int4_d64": (
        "oscar",
        dict(bits=4, rotation="random_orthogonal"),
        64,
        64,
        "bfloat16",
        {},
    ),
    "f32_params_bf16_norms_fastdiv": (
        "oscar",
        dict(bits=2, param_dtype="float32", norm_dtype="bfloat16"),
        128,
        96,
        "bfloat16",
        dict(exact_division=False),
    ),
}


def head_major_kv(seed, b, t, h, d, dtype):
    k, v = kv_with_sinks(seed, b, t, h, d, sinks=(0, t // 2))
    return jnp.swapaxes(k, 1, 2).astype(dtype), jnp.swapaxes(v, 1, 2).astype(dtype)


class TestQuantizeKernelGPU:
    INTERPRET = False
    MAX_CODE_MISMATCH = QUANT_CODES_OFF_BY_ONE["gpu"]
    MAX_ULP = QUANT_PARAM_ULPS

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if not self.INTERPRET and not gpu_available():
            pytest.skip(
                "no GPU: the compiled (Triton) kernel needs one; "
                "TestQuantizeKernelInterpret runs the same cases on CPU"
            )

    def encode(self, k, v, cfg, **opts):
        return pq.encode(k, v, cfg, interpret=self.INTERPRET, **opts)

    def assert_codes_close(self, got, want, bits):
        a = np.asarray(oj.unpack(got, bits)).astype(int)
        b = np.asarray(oj.unpack(want, bits)).astype(int)
        assert got.shape == want.shape and got.dtype == want.dtype == jnp.uint8
        assert np.max(np.abs(a - b)) <= 1
        assert np.mean(a != b) <= self.MAX_CODE_MISMATCH, np.mean(a != b)

    def assert_params_close(self, got, want):
        assert got.shape == want.shape and got.dtype == want.dtype
        if got.dtype == jnp.float32:  # f32 values near 0 are many ulps apart: use a scale
            g, w = np.asarray(got), np.asarray(want)
            assert np.max(np.abs(g - w)) <= 2e-6 * max(float(np.max(np.abs(w))), 1e-30)
        else:
            assert ulp_dist(got, want) <= self.MAX_ULP

    def check(self, got, ref, cfg):
        (ek, ev), (rk, rv) = got, ref
        self.assert_codes_close(ek.codes, rk.codes, cfg.bits)
        self.assert_codes_close(ev.codes, rv.codes, cfg.bits)
        for a, b in ((ek.scale, rk.scale), (ek.zero, rk.zero), (ek.norm, rk.norm),
                     (ev.scale, rv.scale), (ev.zero, rv.zero)):  # fmt: skip
            self.assert_params_close(a, b)

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_matches_xla(self, name):
        method, over, d, t, dtype, opts = CASES[name]
        cfg = oj.preset(method, **over)
        k, v = head_major_kv(zlib.crc32(name.encode()) % 1000, 2, t, 3, d, jnp.dtype(dtype))
        got = self.encode(k, v, cfg, **opts)
        ref = (oj.encode_keys_xla(k, cfg), oj.encode_values_xla(v, cfg))
        self.check(got, ref, cfg)
        assert np.all(np.isfinite(np.asarray(got[0].norm, np.float32)))

    def test_level_division_matches_div_rn(self):
        """The compiled Markstein division by the level count equals div.rn.f32 bit for bit
        on 4M patterns each of subnormals, [0.5, 0.75), values near 1.7e38 and inf / NaN
        (benchmarks/check_division.py checks all 2^31 non-negative float32)."""
        if self.INTERPRET:
            pytest.skip("inline PTX runs on a GPU only; interpret mode divides with jnp")
        from benchmarks.check_division import BLOCK, mismatches

        for levels in (3, 15):
            for base in (0, 0x3F000000, 0x7E000000, 0x7F800000 - 32 * BLOCK):
                assert int(jnp.sum(mismatches(levels, base, 64))) == 0, (levels, hex(base))

    def test_16bit_reciprocal_matches_div_rn(self):
        """The compiled Newton reciprocal equals div.rn.f32 of 1 by x for every positive
        finite float16 (the scales: 31,743 values) and every bfloat16 in [2^-100, 2^124)
        (the prescaled norms: 28,672 values)."""
        if self.INTERPRET:
            pytest.skip("inline PTX runs on a GPU only; interpret mode divides with jnp")
        from benchmarks import check_division as cd

        assert cd.rcp_mismatches(cd.float16s())[0] == 0
        assert cd.rcp_mismatches(cd.prescaled_bfloat16s())[0] == 0

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_extreme_token_norms_match_xla(self, dtype):
        """Tokens whose squares overflow (|k| ~ 1e25) or underflow (~1e-25) float32 take
        the kernel's prescaled branch (its direct sum of squares would give an inf or 0
        norm), so does a zero token's tile; the ordinary tiles take the direct path."""
        cfg = oj.preset("oscar", bits=2, group_size=32)
        k, v = head_major_kv(17, 2, 128, 2, 128, jnp.float32)
        k = k.at[0, 0, 3].multiply(1e25).at[0, 1, 40].multiply(1e-25).at[1, 0, 70].set(0.0)
        k = k.at[1, 1, 100].multiply(2e8)  # a sum of squares above 2^60, still finite
        k, v = k.astype(dtype), v.astype(dtype)
        got = self.encode(k, v, cfg)
        ref = (oj.encode_keys_xla(k, cfg), oj.encode_values_xla(v, cfg))
        self.check(got, ref, cfg)
        norms = np.asarray(got[0].norm, np.float32)
        assert np.all(np.isfinite(norms)) and norms[1, 0, 70] == 0 and norms[0, 1, 40] > 0

    def test_degenerate_groups_no_nan(self):
        cfg = oj.preset("oscar", bits=2)
        k, v = head_major_kv(5, 1, 64, 2, 64, jnp.bfloat16)
        k = k.at[:, 0, :32].set(0.0)  # a zero-norm group of keys
        v = v.at[:, 1, 3].set(1.5)  # a constant value row
        got = self.encode(k, v, cfg)
        for x in (*got[0], *got[1]):
            assert np.all(np.isfinite(np.asarray(x, np.float32)))
        self.check(got, (oj.encode_keys_xla(k, cfg), oj.encode_values_xla(v, cfg)), cfg)

    def test_nonfinite_input_flags_its_row_like_xla(self):
        """inf / NaN in the input (garbage in): the kernel flags the same rows as the XLA
        path, and the other rows' encodings match it."""
        cfg = oj.preset("oscar", bits=2, group_size=32, residual_length=32)
        b, t, h, d = 3, 96, 2, 64
        k, v = kv_with_sinks(13, b, t, h, d, dtype=jnp.float32)
        k = k.at[1, 5, 0, 7].set(jnp.inf)  # quantized group 0 of row 1
        v = v.at[2, 40, 1, 3].set(jnp.nan)  # quantized group 1 of row 2
        caches = {}
        for impl, kw in (("xla", {}), ("pallas", dict(interpret=self.INTERPRET))):
            c = oj.init_cache(cfg, batch=b, max_len=128, num_kv_heads=h, head_dim=d,
                              dtype=jnp.float32)  # fmt: skip
            caches[impl] = oj.prefill(c, k, v, implementation=impl, **kw)
        x, p = caches["xla"], caches["pallas"]
        assert x.flags.tolist() == [0, oj.FLAG_NONFINITE, oj.FLAG_NONFINITE]
        assert p.flags.tolist() == x.flags.tolist()
        self.assert_codes_close(p.k_codes[:1], x.k_codes[:1], cfg.bits)
        self.assert_codes_close(p.v_codes[:1], x.v_codes[:1], cfg.bits)
        for f in ("k_scale", "k_zero", "k_norm", "v_scale", "v_zero"):
            self.assert_params_close(getattr(p, f)[:1], getattr(x, f)[:1])

    @pytest.mark.parametrize("method", ["oscar", "kivi"])
    def test_prefill_and_append_match_xla_path(self, method):
        cfg = oj.preset(method, bits=2, group_size=32, residual_length=32)
        b, t, h, d = 2, 120, 2, 64
        k, v = kv_with_sinks(11, b, t + 8, h, d, dtype=jnp.bfloat16)
        lengths = jnp.asarray([t, 90], jnp.int32)  # flushes at 128 and 96 tokens
        opts = dict(interpret=self.INTERPRET, groups_per_block=2)
        caches = {}
        for impl, kw in (("xla", {}), ("pallas", opts)):
            c = oj.init_cache(cfg, batch=b, max_len=256, num_kv_heads=h, head_dim=d)
            pre = jax.jit(functools.partial(oj.prefill, implementation=impl, **kw))
            app = jax.jit(functools.partial(oj.append, implementation=impl, **kw))
            c = pre(c, k[:, :t], v[:, :t], lengths)
            nq0 = c.num_quantized()
            for i in range(t, t + 8):  # crosses one flush of G tokens in each row
                c = app(c, k[:, i], v[:, i])
            assert np.all(np.asarray(c.num_quantized() > nq0))
            caches[impl] = c
        x, p = caches["xla"], caches["pallas"]
        np.testing.assert_array_equal(x.lengths, p.lengths)
        assert int(jnp.max(x.num_quantized())) > 0
        self.assert_codes_close(p.k_codes, x.k_codes, cfg.bits)
        self.assert_codes_close(p.v_codes, x.v_codes, cfg.bits)
        for f in ("k_scale", "k_zero", "k_norm", "v_scale", "v_zero"):
            self.assert_params_close(getattr(p, f), getattr(x, f))
        np.testing.assert_array_equal(p.k_res, x.k_res)


class TestQuantizeKernelInterpret(TestQuantizeKernelGPU):
    INTERPRET = True
    MAX_CODE_MISMATCH = QUANT_CODES_OFF_BY_ONE["interpret"]


class TestQuantizeKernelAPI:
    def test_fallback_to_xla_where_the_kernel_does_not_apply(self):
        k, v = head_major_kv(3, 1, 64, 2, 96, jnp.bfloat16)
        for cfg, d in ((oj.preset("oscar", bits=3), 64), (oj.preset("oscar", bits=2), 96),
                       (oj.preset("oscar", bits=8), 64)):  # fmt: skip
            assert pq.kernel_unsupported_reason(cfg, d) is not None
            kk, vv = k[..., :d], v[..., :d]
            got = pq.encode(kk, vv, cfg, interpret=True)
            want = (oj.encode_keys_xla(kk, cfg), oj.encode_values_xla(vv, cfg))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_array_equal(a, b)
        assert pq.kernel_unsupported_reason(oj.preset("oscar", bits=2), 128) is None

    def test_default_warps_grow_with_the_tile(self):
        assert pq.default_num_warps(32, 128) == 2  # the timed default
        assert pq.default_num_warps(32, 64) == 2 and pq.default_num_warps(64, 128) == 4
        assert pq.default_num_warps(128, 128) == 8 and pq.default_num_warps(128, 256) == 8

    def test_errors(self):
        cfg = oj.preset("oscar", bits=2)
        k, v = head_major_kv(4, 1, 64, 2, 64, jnp.bfloat16)
        with pytest.raises(ValueError, match="multiple of group_size"):
            pq.encode(k[:, :, :40], v[:, :, :40], cfg, interpret=True)
        with pytest.raises(ValueError, match="must match"):
            pq.encode(k, v[:, :1], cfg, interpret=True)
        with pytest.raises(ValueError, match=r"\[B, H, T, D\]"):
            pq.encode(k[0], v[0], cfg, interpret=True)
        with pytest.raises(ValueError, match="quantized"):
            pq.encode(k, v, oj.preset("bf16"), interpret=True)
        for bad in (dict(groups_per_block=0), dict(num_warps=3), dict(num_stages=0),
                    dict(exact_division=1), dict(groups_per_block=2.0),
                    dict(max_registers=300), dict(max_registers=True)):  # fmt: skip
            with pytest.raises(ValueError):
                pq.QuantizeTuning(**bad)
        with pytest.raises(ValueError, match="num_warps"):
            pq.encode(k, v, cfg, interpret=True, num_warps=5)

    def test_register_cap_reaches_the_triton_ir(self):
        """max_registers names the kernel ``*_maxnregN`` and puts ``nvvm.maxnreg = N`` on
        its tt.func when lowered for CUDA (here on the CPU; the PTX gets ``.maxnreg``);
        without a cap neither appears. Numerics do not depend on the cap."""
        from benchmarks.sass_offline import capture_triton_ir

        assert pq.default_max_registers(32, 128, 2) == 128
        assert pq.default_max_registers(128, 128, 8) is None
        cfg = oj.preset("oscar", bits=2)
        k = jax.ShapeDtypeStruct((1, 2, 64, 128), jnp.bfloat16)
        for cap, want in ((128, "nvvm.maxnreg = 128 : i32"), (None, None)):
            f = jax.jit(lambda k, v, c=cap: pq.encode(k, v, cfg, interpret=False, max_registers=c))
            irs = capture_triton_ir(lambda f=f: f.trace(k, k).lower(lowering_platforms=("cuda",)))
            ((ir, _, _),) = irs
            if want:
                assert want in ir and "@oscar_quantize_int2_maxnreg128" in ir
            else:
                assert "maxnreg" not in ir
        kk, vv = head_major_kv(6, 1, 64, 2, 128, jnp.bfloat16)
        got = pq.encode(kk, vv, cfg, interpret=True, max_registers=96)
        want = pq.encode(kk, vv, cfg, interpret=True, max_registers=None)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)

    def test_table_names_the_kernel(self):
        assert oj.backends.resolve("encode", "triton") is pq.encode
        assert oj.backends.resolve("encode", "pallas") is pq.encode  # the alias


@pytest.mark.parametrize("rotation", ["hadamard", "randomized_hadamard"])
@pytest.mark.parametrize("d,bits,g", [(64, 2, 32), (128, 2, 128), (256, 4, 32), (512, 2, 64)])
def test_kronecker_factors_equal_the_dense_rotation(rotation, d, bits, g):
    """The [W, W] factors and butterflies the kernel uses give exactly x @ R^T."""
    cfg = oj.preset("oscar", bits=bits, group_size=g, rotation=rotation)
    spec = pq._Spec(cfg, g, 1, d, "bfloat16", pq.QuantizeTuning(), True)
    w = spec.w
    both = np.asarray(qr.rotation_operand(spec), np.float64)  # [2D, W]: F_a, then F_a^T
    block, block_t = both[:d], both[d:]
    x = np.random.default_rng(d + g).integers(-8, 9, size=(g, d)).astype(np.float64)
    zs = [x[:, a * w : (a + 1) * w] @ block[a * w : (a + 1) * w] for a in range(d // w)]
    got = np.concatenate(qr.butterflies(zs), axis=1)  # integers: exact in float64
    want = np.round(x @ oj.rotation_matrix(cfg, d).T * np.sqrt(d))
    np.testing.assert_array_equal(got, want)
    # the transposed key tiles: F_a^T x_a^T, chunk by chunk
    zt = [block_t[a * w : (a + 1) * w] @ x[:, a * w : (a + 1) * w].T for a in range(d // w)]
    np.testing.assert_array_equal(np.concatenate(qr.butterflies(zt), axis=0), want.T)


def _round_f32(x: Fraction) -> Fraction:
    """x rounded to the nearest float32, ties to even (normal range)."""
    e = math.floor(math.log2(x))
    if Fraction(2) ** e > x:
        e -= 1
    elif Fraction(2) ** (e + 1) <= x:
        e += 1
    ulp = Fraction(2) ** (e - 23)
    q, r = divmod(x, ulp)
    if r * 2 > ulp or (r * 2 == ulp and q % 2):
        q += 1
    return q * ulp


def test_newton_reciprocal_rounds_every_float16_like_ieee():
    """The arithmetic of ``numerics.newton_rcp_asm``, exactly: from an approximate
    reciprocal up to 1 float32 ulp off either way (rcp.approx's bound), e = RN(1 - x y) and
    RN(y + y e) give the correctly rounded 1 / x for every positive finite float16 x. That
    covers every significand of at most 11 bits, and the arithmetic is scale-invariant
    while 1 / x is normal: so also the bfloat16 norms that ``numerics._recip``
    inverts (prescaled into [2^-100, 2^124))."""
    h = np.arange(1, 0x7C00, dtype=np.uint16)
    xs = h.view(np.float16).astype(np.float64)
    for x in map(Fraction, xs.tolist()):
        want = _round_f32(1 / x)
        ulp = Fraction(2) ** (math.floor(math.log2(want)) - 23)
        for y in (want - ulp, want, want + ulp):
            one_minus = 1 - x * y
            e = _round_f32(abs(one_minus)) * (1 if one_minus >= 0 else -1) if one_minus else 0
            assert _round_f32(y + y * e) == want, (float(x), float(y))
