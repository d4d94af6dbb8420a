"""Sharded decode attention with the Pallas INT kernel per sequence shard (interpret mode on CPU).

On 8 simulated CPU devices (tests/conftest.py): ``sharded_decode_attention(...,
implementation="pallas")`` against the unsharded XLA reference and the unsharded kernel, on
fresh random caches with ragged rows (one with no quantized token, one whose quantized part
ends inside the second sequence shard), and ``models.generate`` with a mesh and the kernel.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import kv_with_sinks, query, small_cfg
from jax.sharding import Mesh
from tolerances import tol

import models
import oscar_jax as oj
from benchmarks.sharded_check import aligned_impl
from models.config import ModelConfig
from oscar_jax import sharding as osh
from pallas_kernels.decode import config as pcfg
from pallas_kernels.decode import partials as ppart

B, H, GQA = 4, 4, 4
MAX_LEN = 64 + 256  # R = 64: quantized capacity 256 = 2 sequence shards x 128 tokens
# nq = 256 (both shards), 0 (ring only), 160 (ends inside shard 1), 64 (shard 0 only)
LENGTHS = (320, 40, 234, 150)
OPTS = dict(block_tokens=64)


def make_mesh(shape):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), ("data", "model", "sequence"))


def make_cache(seed, d, **cfg_kw):
    cfg = small_cfg("oscar", **cfg_kw)
    k, v = kv_with_sinks(seed, B, max(LENGTHS), H, d)
    c = oj.init_cache(cfg, batch=B, max_len=MAX_LEN, num_kv_heads=H, head_dim=d,
                      dtype=jnp.float32)  # fmt: skip
    return oj.prefill(c, k, v, jnp.asarray(LENGTHS, jnp.int32)), query(seed, B, H * GQA, d)


def max_rel(out, ref):
    return float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))


@pytest.mark.parametrize(
    "mesh_shape,d,bits,split",
    [((1, 1, 2), 64, 2, 0), ((1, 2, 2), 64, 2, 0), ((2, 1, 2), 64, 2, 0), ((1, 2, 2), 128, 2, 0),
     ((2, 1, 2), 64, 4, 0), ((1, 2, 2), 64, 2, 2)],
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x),
)  # fmt: skip
def test_sharded_pallas_equals_unsharded(mesh_shape, d, bits, split):
    """split: the INT kernel's token sub-blocks (0: auto, which takes 1 at 2 blocks per
    shard; 2: forced)."""
    OPTS = dict(block_tokens=64, token_split=split)  # noqa: N806
    mesh = make_mesh(mesh_shape)
    cache, q = make_cache(bits * 10 + d, d, bits=bits)
    nq = np.asarray(cache.num_quantized())
    local = cache.quant_capacity // mesh_shape[2]
    assert nq.min() == 0 and np.any((nq > local) & (nq < 2 * local)), nq  # the ragged cases
    sharded = osh.shard_cache(cache, mesh)
    fn = jax.jit(lambda q, c: osh.sharded_decode_attention(
        q, c, mesh, implementation="pallas", **OPTS))  # fmt: skip
    if mesh_shape == (1, 2, 2) and d == 64:  # each shard reads its own tokens: no all-gather
        hlo = fn.lower(q, sharded).compile().as_text()
        assert "all-reduce(" in hlo and "all-gather(" not in hlo
    out = fn(q, sharded)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert bool(jnp.all(jnp.isfinite(out)))
    ref = oj.decode_attention(q, cache)  # unsharded XLA reference
    # the kernel's key MMA is float16 (pallas_kernels/decode/int_kernel.py): float16 tolerance
    assert max_rel(out, ref) <= tol(jnp.float16)["max_rel"]
    # the same kernel unsharded (ring in XLA, as here): a row within shard 0 walks the same
    # blocks in one split, so only float32 merge order differs; a row over both shards also
    # rounds its probabilities (bfloat16 value MMA operand) against another running max
    same = oj.decode_attention(q, cache, implementation="pallas", fuse_ring=False, **OPTS)
    assert max_rel(out, same) <= tol(jnp.float16)["max_rel"]
    one = nq <= local
    assert max_rel(out[one], same[one]) <= tol(jnp.float32)["max_rel"]
    xla = jax.jit(lambda q, c: osh.sharded_decode_attention(q, c, mesh))(q, sharded)
    assert max_rel(xla, ref) <= tol(jnp.float32)["max_rel"]  # the default path is unchanged


def test_bad_implementation_and_bf16_cache():
    mesh = make_mesh((1, 2, 2))
    cache, q = make_cache(0, 64)
    with pytest.raises(ValueError, match="implementation='nope'"):
        osh.sharded_decode_attention(q, cache, mesh, implementation="nope")
    with pytest.raises(ValueError, match="block_tokens"):
        osh.sharded_decode_attention(q, cache, mesh, block_tokens=64)  # options need pallas
    with pytest.raises(ValueError, match="nq.shape"):
        qs = ppart.stack_queries(1.0, q.reshape(B, H, GQA, 64))
        ppart.quantized_partials(qs, cache, pcfg.choose_config(B, H, 256, 32), nq=jnp.zeros(3))
    with pytest.raises(ValueError, match="qs.shape"):
        ppart.quantized_partials(q, cache, pcfg.choose_config(B, H, 256, 32))
    # a bf16 cache (its ring split along slots): the BF16 kernel on each slice under "pallas"
    # (rows ending in shard 0, in shard 1, and one of 7 tokens); it takes 16-bit caches only
    k, v = kv_with_sinks(3, B, 200, H, 64)
    lens = jnp.asarray([200, 7, 130, 64], jnp.int32)
    for dt in (jnp.bfloat16, jnp.float32):
        bf = oj.init_cache(oj.preset("bf16"), batch=B, max_len=256, num_kv_heads=H, head_dim=64,
                           dtype=dt)  # fmt: skip
        bf = oj.prefill(bf, k, v, lens)
        sh = osh.shard_cache(bf, mesh)
        if dt == jnp.float32:
            with pytest.raises(ValueError, match="bfloat16 or float16"):
                osh.sharded_decode_attention(q, sh, mesh, implementation="pallas")
            continue
        out = osh.sharded_decode_attention(q, sh, mesh, implementation="pallas", block_tokens=16)
        ref = oj.decode_attention(q, bf)
        assert max_rel(out, ref) <= tol(jnp.bfloat16)["max_rel"]
        one = oj.decode_attention(q, bf, implementation="pallas", block_tokens=16)
        assert max_rel(out, one) <= tol(jnp.bfloat16)["max_rel"]
        xla = osh.sharded_decode_attention(q, sh, mesh)  # float32 math: not what ran above
        assert max_rel(out, xla) > tol(jnp.float32)["max_rel"]


# -- models.generate with a mesh and the kernel ------------------------------------------
CFG = ModelConfig(
    family="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=8, num_kv_heads=2, head_dim=64, max_position_embeddings=1024,
)  # fmt: skip
GEN_LENGTHS = np.array([200, 60, 150, 20], np.int32)  # nq after prefill: 160, 0, 96, 0
GEN_MAX_LEN, N_NEW = 288, 12  # R = 32: capacity 256 = 2 x 128; rows flush while decoding


@functools.cache
def tiny_model():
    m = models.CausalLM(CFG, rngs=nnx.Rngs(0))
    # weights 3.5x the default init: logits of order 1, so greedy choices are clear
    m.set_params(jax.tree_util.tree_map(lambda a: a * 3.5 if a.ndim >= 2 else a, m.params()))
    return m


def test_generate_with_mesh_and_pallas():
    traced = []  # the sharded step really calls the kernel's partial (counted while tracing)
    kernel = oj.backends.resolve("quantized_partial", "triton")
    spy = lambda *a, **k: traced.append(1) or kernel(*a, **k)  # noqa: E731
    kv = oj.preset("oscar", bits=2, residual_length=32, group_size=32)
    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, (4, 200)).astype(np.int32)
    kw = dict(kv=kv, lengths=GEN_LENGTHS, max_len=GEN_MAX_LEN, stop_tokens=())
    # the unsharded run of the same kernel: its logits differ from the XLA path's by ~1e-2
    # (16-bit MMA operands), enough to flip this random model's near ties (top-2 gaps of
    # ~1e-3), while sharded and unsharded kernel runs differ by ~1e-3 (measured)
    ref = np.asarray(models.generate(tiny_model(), ids, N_NEW, implementation="pallas", **kw))
    mesh = make_mesh((1, 2, 2))
    be = models.Backends.of("triton").replace(attention=spy)  # the partial, called per shard
    out = models.generate(tiny_model(), ids, N_NEW, implementation=be, mesh=mesh, **kw)
    np.testing.assert_array_equal(np.asarray(out), ref)
    assert traced
    with pytest.raises(ValueError, match="implementation='nope'"):
        models.generate(tiny_model(), ids, 2, implementation="nope", mesh=mesh, **kw)


def test_aligned_splits_match_one_device():
    """bench_sharded's greedy check: with one block per split (``aligned_impl``) every split
    of the one-device kernel reads the tokens of one shard's split, so sharded and one-device
    outputs differ only by the float32 merge order (rows over both shards included)."""

    mesh = make_mesh((1, 1, 2))
    cache, q = make_cache(7, 64)
    name = aligned_impl("pallas", 1)
    out = jax.jit(lambda q, c: osh.sharded_decode_attention(
        q, c, mesh, implementation=name, **OPTS))(q, osh.shard_cache(cache, mesh))  # fmt: skip
    one = oj.decode_attention(q, cache, implementation=name, **OPTS)  # the fused ring
    aligned = max_rel(out, one)
    assert aligned <= tol(jnp.float32)["max_rel"]
    whole = oj.decode_attention(q, cache, implementation="pallas", blocks_per_split=4, **OPTS)
    assert max_rel(out, whole) > 10 * aligned  # one split over both shards: 16-bit p differs
    with pytest.raises(ValueError, match="aligned splits"):
        osh.sharded_decode_attention(q, osh.shard_cache(cache, mesh), mesh,
                                     implementation=aligned_impl("pallas", 3), **OPTS)  # fmt: skip
    with pytest.raises(ValueError, match="must be 'triton'"):
        aligned_impl("xla", 1)
