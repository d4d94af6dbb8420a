"""The Pallas decode kernels against the pure-JAX reference (``decode_attention_xla``).

``TestDecodeKernelGPU`` compiles through Triton (skipped without a GPU);
``TestDecodeKernelInterpret`` runs the same cases in Pallas interpret mode on CPU
with small shapes. Inputs are random (never zeros) with planted low-norm sink
tokens; lengths are not multiples of any block; batches mix long rows, rows wholly
in the residual (nq = 0) and empty rows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gpu_available
from tolerances import tol

import oscar_jax as oj
from pallas_kernels.decode import config as pcfg
from pallas_kernels.decode import partials as ppart


def make_case(
    method,
    *,
    bits=2,
    d=128,
    gqa=4,
    h=2,
    lens=(700, 100, 0, 301),
    max_len=1024,
    seed=0,
    dtype=jnp.bfloat16,
    **cfg_kw,
):
    if method != "bf16":
        cfg_kw["bits"] = bits
    cfg = oj.preset(method, **cfg_kw)
    b, t = len(lens), max(max(lens), 1)
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    k = 2.0 * jax.random.normal(k1, (b, t, h, d)) + jax.random.normal(k4, (1, 1, h, d))
    v = jax.random.normal(k2, (b, t, h, d))
    k = k.at[:, :3].multiply(0.03)  # low-norm attention-sink keys (token norm imbalance)
    cache = oj.init_cache(cfg, batch=b, max_len=max_len, num_kv_heads=h, head_dim=d, dtype=dtype)
    cache = oj.prefill(cache, k.astype(dtype), v.astype(dtype), jnp.asarray(lens, jnp.int32))
    q = (2.0 * jax.random.normal(k3, (b, h * gqa, d))).astype(dtype)
    return q, cache


CASES = {
    # name: (make_case kwargs, kernel options)
    "int2_d128_gqa4_ragged": (
        dict(method="oscar", max_len=768),
        dict(block_tokens=64, blocks_per_split=3),
    ),
    "int4_d64_gqa1": (
        dict(method="oscar", bits=4, d=64, gqa=1, lens=(613, 200)),
        dict(num_stages=2),
    ),
    "int2_d256_gqa8_per_token": (
        dict(method="oscar", d=256, gqa=8, h=1, lens=(905, 131), norm_granularity="per_token"),
        dict(block_tokens=128, blocks_per_split=2),
    ),
    "kivi_int2_d64_gqa8": (
        dict(method="kivi", d=64, gqa=8, h=1, lens=(517,)),
        dict(fuse_ring=False),
    ),
    # value scales / zeros as 2-byte columns (the default reads uint32 pairs)
    "int2_d128_gqa4_vcol": (
        dict(method="oscar", max_len=768),
        dict(block_tokens=64, blocks_per_split=3, vparams="col"),
    ),
    "int2_d64_gqa8_vpair_f32norms": (  # float32 norms: token_split auto -> 1
        dict(method="oscar", d=64, gqa=8, h=1, lens=(517, 40), norm_dtype="float32"),
        dict(vparams="pair", num_warps=4),
    ),
    # float32 scales / zeros: values in float32, two bfloat16 value dots (hi + lo); one
    # bfloat16 rounding of the parameters gave 2.1e-2 / 1.2e-2 on these two cases
    "int2_d128_gqa2_f32params": (
        dict(method="oscar", gqa=2, h=1, lens=(300, 7), param_dtype="float32"),
        dict(token_split=2, rotate_in_kernel=True),
    ),
    "int4_d64_gqa4_f32params": (
        dict(method="oscar", bits=4, d=64, h=1, lens=(613, 200), param_dtype="float32"),
        dict(),
    ),
    # float16 scales / zeros: float16 value MMA, no parameter conversions in the kernel
    "int2_d128_gqa4_f16params": (
        dict(method="oscar", param_dtype="float16", max_len=768),
        dict(block_tokens=64, blocks_per_split=4),
    ),
    "int4_d64_gqa4_f16params_f16cache_vcol": (
        dict(
            method="oscar", bits=4, d=64, lens=(613, 200), param_dtype="float16", dtype=jnp.float16
        ),
        dict(vparams="col"),
    ),  # fmt: skip
    # token_split: auto (0) takes 2 sub-blocks where it applies and a split walks >= 4
    # blocks (int2_d128_gqa4_f16params), else 1 (most cases above); 2 explicitly
    "int2_d128_gqa4_split2_ragged": (
        dict(method="oscar", lens=(700, 33, 0, 161), max_len=768),
        dict(block_tokens=64, blocks_per_split=3, token_split=2, rotate_in_kernel=True),
    ),
    "int2_d128_gqa8_split2_per_token_noring": (
        dict(method="oscar", gqa=8, h=1, lens=(517, 40), norm_granularity="per_token"),
        dict(token_split=2, fuse_ring=False),
    ),
    "int4_d64_gqa1_split2_g64": (
        dict(method="oscar", bits=4, d=64, gqa=1, lens=(613, 200), group_size=64),
        dict(token_split=2),
    ),
    "kivi_int2_d64_gqa4_split2_vcol": (  # no rotation, unit norms; 2-byte value columns
        dict(method="kivi", d=64, h=1, lens=(517, 90)),
        dict(token_split=2, vparams="col"),
    ),
    "int2_d256_gqa4_split2_f16params": (
        dict(method="oscar", d=256, h=1, lens=(905, 131), param_dtype="float16"),
        dict(block_tokens=128, blocks_per_split=2, token_split=2, rotate_in_kernel=True),
    ),
    # the query rotation and the output un-rotation in the kernel (Kronecker factors; the
    # heuristic takes it from B x H = 192, so these small cases ask for it; also above)
    "int4_d128_gqa4_randomized_hadamard": (  # query planes 64 wide, output chunks 32
        dict(method="oscar", bits=4, rotation="randomized_hadamard", lens=(613, 200, 0)),
        dict(rotate_in_kernel=True),
    ),
    "int2_d64_gqa4_keys_rotated_split2": (  # rotate_values=False: the query only
        dict(
            method="oscar",
            d=64,
            h=1,
            lens=(517, 90),
            rotation="randomized_hadamard",
            rotate_values=False,
        ),
        dict(token_split=2, rotate_in_kernel=True),
    ),
    "int4_d64_gqa4_f32params_rotate_in_kernel": (  # bfloat16 hi + lo un-rotation dots
        dict(method="oscar", bits=4, d=64, h=1, lens=(613, 200), param_dtype="float32"),
        dict(rotate_in_kernel=True),
    ),
    "int2_d128_gqa4_random_orthogonal": (  # no Kronecker form: XLA GEMMs whatever asked
        dict(method="oscar", rotation="random_orthogonal", lens=(300, 77)),
        dict(rotate_in_kernel=True),
    ),
    # the split merge: one Pallas launch where every partial is in the original basis
    # (the cases above with rotate_in_kernel or no value rotation take it by default)
    "int2_d128_gqa6_split2_merge_pallas": (  # 6 query rows: merge tiles of 8, sliced
        dict(method="oscar", gqa=6, h=1, lens=(517, 90, 0)),
        dict(token_split=2, rotate_in_kernel=True, merge="pallas", merge_cols=64),
    ),
    "int2_d128_gqa4_xla_rotation": (  # the query rotation, un-rotation and merge in XLA
        dict(method="oscar", lens=(700, 33, 0, 161), max_len=768),
        dict(block_tokens=64, blocks_per_split=3, rotate_in_kernel=False),
    ),
    "int2_d128_gqa4_split2_merge_xla": (
        dict(method="oscar", lens=(700, 33, 0, 161), max_len=768),
        dict(
            block_tokens=64, blocks_per_split=3, token_split=2, rotate_in_kernel=True, merge="xla"
        ),
    ),  # fmt: skip
    "bf16_d128_gqa4": (
        dict(method="bf16", lens=(300, 77, 0), max_len=500),
        dict(block_tokens=64, blocks_per_split=2),
    ),
}


class TestDecodeKernelGPU:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if not self.INTERPRET and not gpu_available():
            pytest.skip(
                "no GPU: the compiled (Triton) kernels need one; "
                "TestDecodeKernelInterpret runs the same cases on CPU"
            )

    def decode(self, q, cache, **opts):
        return oj.decode_attention(
            q, cache, implementation="pallas", interpret=self.INTERPRET, **opts
        )

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_matches_reference(self, name):
        kw, opts = CASES[name]
        q, cache = make_case(**kw)
        ref = oj.decode_attention_xla(q, cache).astype(jnp.float32)
        out = self.decode(q, cache, **opts)
        assert out.shape == q.shape and out.dtype == q.dtype
        out = out.astype(jnp.float32)
        assert bool(jnp.all(jnp.isfinite(out)))
        err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
        assert err <= tol(q.dtype)["max_rel"], f"{name}: max rel error {err:.3e}"
        empty = np.asarray(cache.lengths) == 0
        if empty.any():  # a row with no tokens returns zeros
            assert float(jnp.max(jnp.abs(out[empty]))) == 0.0

    def test_bad_inputs(self):
        def empty(bits=2, d=128):  # only static checks run: no kernel launch
            c = oj.init_cache(
                oj.preset("oscar", bits=bits), batch=1, max_len=512, num_kv_heads=1, head_dim=d
            )
            return jax.random.normal(jax.random.PRNGKey(1), (1, 2, d), jnp.bfloat16), c

        q, cache = empty()
        with pytest.raises(ValueError, match="block_tokens"):
            self.decode(q, cache, block_tokens=48)
        with pytest.raises(ValueError, match="block_tokens"):
            self.decode(q, cache, block_tokens=16)  # not a multiple of G=32
        with pytest.raises(ValueError, match="unknown options"):
            self.decode(q, cache, splits=3)
        with pytest.raises(ValueError, match="num_warps"):
            self.decode(q, cache, num_warps=3)
        with pytest.raises(ValueError, match="fuse_ring"):
            self.decode(q, cache, fuse_ring=1)
        c64 = oj.init_cache(
            oj.preset("oscar", bits=2, group_size=64),
            batch=1,
            max_len=512,
            num_kv_heads=1,
            head_dim=64,
        )  # one value group per head: nothing to pair
        with pytest.raises(ValueError, match="vparams"):
            self.decode(q[..., :64], c64, vparams="pair")
        self.decode(q[..., :64], c64)  # "auto" falls back to 2-byte columns
        with pytest.raises(ValueError, match="GQA ratio"):
            self.decode(jnp.repeat(q[:, :1], 32, axis=1), cache)
        with pytest.raises(ValueError, match="token_split"):
            self.decode(q, cache, token_split=4)
        with pytest.raises(ValueError, match="token_split"):
            self.decode(jnp.repeat(q, 8, axis=1), cache, token_split=2)  # 2 x 16 rows
        c32 = oj.init_cache(
            oj.preset("oscar", norm_dtype="float32"), batch=1, max_len=512, num_kv_heads=1,
            head_dim=128,
        )  # fmt: skip
        with pytest.raises(ValueError, match="16-bit norms"):
            self.decode(q, c32, token_split=2)
        with pytest.raises(ValueError, match="merge='pallas'"):  # partials rotated
            self.decode(q, cache, merge="pallas", rotate_in_kernel=False)
        with pytest.raises(ValueError, match="merge='pallas'"):
            self.decode(q, cache, merge="pallas", rotate_in_kernel=True, fuse_ring=False)
        with pytest.raises(ValueError, match="bits"):
            self.decode(*empty(bits=3, d=64))
        with pytest.raises(ValueError, match="head_dim"):
            self.decode(*empty(d=96))


class TestDecodeKernelInterpret(TestDecodeKernelGPU):
    INTERPRET = True


def test_heuristic_config():
    c = pcfg.choose_config(1, 8, 131072, 32, interpret=True)
    assert c.block_tokens % 32 == 0 and c.blocks_per_split >= 4
    c = pcfg.choose_config(1, 8, 131072, 32, block_tokens=256, interpret=True)
    assert c.block_tokens == 256
    with pytest.raises(ValueError, match="unpack"):
        pcfg.DecodeConfig(unpack="nope")
    for bad in (
        dict(vparams="nope"),
        dict(vparams="tile"),
        dict(token_split=3),
        dict(token_split=4),
        dict(token_split=-1),
        dict(rotate_in_kernel=1),
        dict(merge="nope"),
        dict(merge_cols=24),
        dict(merge_cols=8),
        dict(merge_cols=True),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            pcfg.DecodeConfig(**bad)
    assert pcfg.DecodeConfig().vparams == "auto"
    assert pcfg.DecodeConfig().token_split == 0  # auto

    def split(bps=8, gqa=4, lq=1024, **kw):
        c = oj.init_cache(oj.preset("oscar", **kw), batch=1, max_len=lq, num_kv_heads=1,
                          head_dim=128)  # fmt: skip
        cfg = pcfg.DecodeConfig(block_tokens=64, blocks_per_split=bps, interpret=True)
        return ppart.token_split(cfg, c, gqa)

    assert split() == 2 and split(gqa=8) == 2 and split(gqa=1) == 2
    assert split(bps=3) == 1 and split(lq=128) == 1  # short splits: 3 blocks, none
    assert split(gqa=16) == 1 and split(group_size=16) == 1
    assert split(norm_dtype="float32") == 1 and split(norm_dtype="float16") == 2
    assert pcfg.choose_config(1, 8, 131072, 32, interpret=True).num_warps == 2  # INT kernel
    # INT blocks per split (the decode.config docstring): one wave of 32 at 1 x 128K, 1 at
    # 1 x 4K, 32 where full programs fill their last wave (8 x 32K, 8 x 33024), the
    # list-scheduling choice where they leave it ragged (48 x 4K, 24 x 8K); all timed
    shapes = ((1, 131072), (8, 32768), (8, 33024), (48, 4096), (24, 8192), (1, 4096))
    bps = [pcfg.choose_config(b, 8, n, 32, interpret=True).blocks_per_split for b, n in shapes]
    assert bps == [32, 32, 32, 16, 26, 1]
    rik = [pcfg.choose_config(b, 8, n, 32, interpret=True).rotate_in_kernel for b, n in shapes]
    assert all(rik)  # with the Pallas merge: faster at every shape timed
    from pallas_kernels.decode import merge as dm

    assert [dm.auto_cols(b, 8, 128) for b in (1, 4, 8, 48)] == [16, 16, 32, 32]
    assert dm.auto_cols(1, 1, 16 * 2) == 16  # never more than head_dim
    assert dm.step_splits(65, 4, 1, 16) == 128 and dm.step_splits(65, 4, 2, 16) == 128
    assert dm.step_splits(65, 8, 2, 16) == 64 and dm.step_splits(5, 4, 2, 32) == 8
    assert dm.step_splits(65, 4, 1, 16, chunk=16) == 16
    assert pcfg.choose_config(1, 8, 131072, interpret=True).num_warps == 4  # BF16 kernel


@pytest.mark.parametrize(
    "method,opts",
    [
        ("oscar", {}),
        ("oscar", {"fuse_ring": False}),
        ("oscar", {"vparams": "col"}),
        ("oscar", {"token_split": 1}),
        ("oscar", {"rotate_in_kernel": True}),
        ("oscar", {"rotate_in_kernel": True, "merge": "xla"}),
        ("kivi", {}),
        ("bf16", {}),
    ],
)
def test_lowers_to_triton(method, opts):
    """Lowering gaps (e.g. slicing a loaded value) that interpret mode cannot see, on CPU."""
    from jax import export

    q, cache = make_case(method, lens=(300, 40), max_len=512, d=64)
    f = jax.jit(
        lambda q, c: oj.decode_attention(q, c, implementation="pallas", interpret=False, **opts)
    )
    exp = export.export(
        f,
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(q, cache)
    assert "xla.gpu.triton" in exp.mlir_module()


def test_pow2_scale():
    """The in-kernel un-rotation's row scaling: exact powers of two, rows moved to [1, 2)."""
    from pallas_kernels.decode.tiles import pow2_scale

    x = np.asarray([1e-7, 6e-5, 0.75, 1.0, 3.0, 1e30, 2.0**126], np.float32)
    up, down = (np.asarray(v) for v in pow2_scale(jnp.asarray(x)))
    assert np.all((x * up >= 1) & (x * up < 2)) and np.all(up * down == 1)
    assert np.all(np.log2(up) == np.round(np.log2(up)))  # powers of two: exact scaling
    up, down = pow2_scale(jnp.asarray([0.0, 2.0**127, np.inf], jnp.float32))
    assert np.all(np.asarray(up) == 1) and np.all(np.asarray(down) == 1)
