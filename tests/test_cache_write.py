"""The one-launch cache update (``pallas_kernels.cache_write``) against XLA's scatters.

``fused_update`` must give, bit for bit, the caches of the XLA sequence
``prepare_flushes`` (ring clear) -> ``append_to_ring`` -> ``write_flush``. Caches are
random in every field (never zeros, so a missed or misplaced write shows), rows ragged:
flushing this step (one at the last group of the quantized part), ring only, full
(append dropped, FLAG_OVERFLOW), empty, and a non-finite token. ``TestCacheWriteGPU``
compiles through Triton (skipped without a GPU); ``TestCacheWriteInterpret`` runs the
same cases in Pallas interpret mode on CPU. The models tests decode a tiny model with
``Backends(encode="triton", cache_write="triton")`` (the fused writes) against the default writes.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gpu_available
from flax import nnx

import models
import oscar_jax as oj
from models.config import ModelConfig
from oscar_jax import flush as ofl
from oscar_jax.ring import append_to_ring
from pallas_kernels import cache_write as cw
from pallas_kernels.quantize import triton as pq

LENGTHS = (63, 40, 288, 0, 287, 127)  # flush; ring; full; empty; flush into the last group; flush
MAX_LEN = 288  # R = G = 32: quantized capacity 256
CASES = {
    "int2_d128_per_token_bf16": dict(bits=2, d=128, norm="per_token", dtype=jnp.bfloat16),
    "int2_d64_per_head_f32": dict(
        bits=2,
        d=64,
        norm="per_head",
        dtype=jnp.float32,
        param_dtype="float32",
        norm_dtype="float32",
    ),  # fmt: skip
    "int4_d128_per_head_bf16": dict(bits=4, d=128, norm="per_head", dtype=jnp.bfloat16),
    "int4_d64_per_token_f32": dict(bits=4, d=64, norm="per_token", dtype=jnp.float32),
    # the Mosaic kernel's layout: a group's half-record merged into its record
    "int2_d128_record_f16": dict(
        bits=2, d=128, norm="per_head", dtype=jnp.bfloat16, layout="record"
    ),  # fmt: skip
    "int2_d128_record_per_token_bf16": dict(
        bits=2, d=128, norm="per_token", dtype=jnp.float32, param_dtype="bfloat16", layout="record"
    ),  # fmt: skip
    "int4_d128_record_f16": dict(
        bits=4, d=128, norm="per_head", dtype=jnp.bfloat16, layout="record"
    ),  # fmt: skip
    "int2_d64_record_per_token_f16": dict(
        bits=2, d=64, norm="per_token", dtype=jnp.bfloat16, layout="record"
    ),  # fmt: skip
    "int4_d256_record_bf16": dict(
        bits=4, d=256, norm="per_head", dtype=jnp.bfloat16, param_dtype="bfloat16", layout="record"
    ),  # fmt: skip
}


def random_cache(bits, d, norm, dtype, h=2, seed=0, layout="planar", **cfg_kw):
    """A cache whose every field is random (codes, params, norms, ring), flags mixed; a
    record-layout one is the random planar cache converted exactly."""
    cfg = oj.preset("oscar", bits=bits, group_size=32, residual_length=32,
                    norm_granularity=norm, **cfg_kw)  # fmt: skip
    b = len(LENGTHS)
    c = oj.init_cache(cfg, batch=b, max_len=MAX_LEN, num_kv_heads=h, head_dim=d, dtype=dtype)
    keys = iter(jax.random.split(jax.random.key(seed), len(cw.CACHE_FIELDS)))
    fields = {}
    for name in cw.CACHE_FIELDS:
        a, key = getattr(c, name), next(keys)
        if a.dtype == jnp.uint8:
            fields[name] = jax.random.randint(key, a.shape, 0, 256).astype(jnp.uint8)
        else:
            fields[name] = (1.0 + jax.random.normal(key, a.shape)).astype(a.dtype)
    c = dataclasses.replace(
        c, lengths=jnp.asarray(LENGTHS, jnp.int32),
        flags=jnp.asarray(np.arange(b) % 3 == 0, jnp.int32), **fields,
    )  # fmt: skip
    return oj.convert_layout(c, layout)


def token(cache, seed):
    b, h, d = cache.batch, cache.num_kv_heads, cache.head_dim
    k = jax.random.normal(jax.random.key(seed), (b, h, d))
    v = jax.random.normal(jax.random.key(seed + 1), (b, h, d))
    return k.at[1, 0, 3].set(jnp.inf), v  # a non-finite token in a ring-only row


def xla_update(cache, k, v):
    """The default path: clear in prepare_flushes, then the ring append and group store."""
    (c,), (todo,) = ofl.prepare_flushes([cache])
    return ofl.write_flush(append_to_ring(c, k, v)[0], todo)


class TestCacheWriteGPU:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if not self.INTERPRET and not gpu_available():
            pytest.skip("no GPU: the Triton kernel needs one; TestCacheWriteInterpret runs on CPU")

    def fused(self, cache, k, v):
        (c,), (todo,) = ofl.prepare_flushes([cache], clear=False)
        return cw.fused_update(c, k, v, todo, interpret=self.INTERPRET)

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_matches_xla_scatters(self, name):
        cache = random_cache(**CASES[name])
        k, v = token(cache, 7)
        nq, flush = ofl.flush_due(cache)
        assert np.asarray(flush).tolist() == [True, False, False, False, True, True]
        assert int(nq[4]) + 32 == cache.quant_capacity  # the last group of the array
        want = jax.jit(xla_update)(cache, k, v)
        got = jax.jit(self.fused)(cache, k, v)
        chex.assert_trees_all_equal(got, want)
        flags = np.asarray(got.flags)
        assert flags[2] & oj.FLAG_OVERFLOW and flags[1] & oj.FLAG_NONFINITE
        for f in ("k_res", "k_codes", "v_scale", "k_norm"):  # the update wrote something
            if getattr(cache, f).size:  # (a record cache keeps no planar v_scale)
                assert not np.array_equal(
                    np.asarray(getattr(got, f)), np.asarray(getattr(cache, f))
                )


class TestCacheWriteInterpret(TestCacheWriteGPU):
    INTERPRET = True


def test_rejects_caches_it_does_not_cover():
    good = random_cache(2, 64, "per_head", jnp.float32)
    k, v = token(good, 0)
    (c,), (todo,) = ofl.prepare_flushes([good], clear=False)
    with pytest.raises(ValueError, match="k_t.shape"):
        cw.fused_update(c, k[:, :1], v, todo, interpret=True)
    with pytest.raises(ValueError, match="todo"):
        cw.fused_update(c, k, v, todo.ek, interpret=True)
    bad = {
        "method='bf16'": oj.preset("bf16"),
        "residual_length=0": oj.preset("oscar", bits=2, residual_length=0),
        "bits=3": oj.preset("oscar", bits=3, group_size=32, residual_length=32),
    }
    for match, cfg in bad.items():
        c = oj.init_cache(cfg, batch=2, max_len=288, num_kv_heads=2, head_dim=64)
        kk = jnp.zeros((2, 2, 64))
        assert cw.unsupported_reason(c) is not None
        with pytest.raises(ValueError, match=match):
            cw.fused_update(c, kk, kk, todo, interpret=True)


@pytest.mark.parametrize(
    "kw",
    [dict(bits=2, d=128, norm_granularity="per_head", dtype=jnp.bfloat16),  # S = 160 slots
     dict(bits=4, d=64, norm_granularity="per_token", dtype=jnp.float32),
     dict(bits=2, d=128, norm_granularity="per_head", dtype=jnp.bfloat16, layout="record")],
    ids=["int2_llama_shape", "int4_per_token", "int2_record"],
)  # fmt: skip
def test_lowers_to_triton_with_aliased_cache(kw):
    """Triton lowering (gaps interpret mode cannot see), on CPU; every cache array aliased."""
    from jax import export

    dtype, d = kw.pop("dtype"), kw.pop("d")
    cfg = oj.preset("oscar", **kw)  # R = 128, G = 32: the ring's 160 slots are no power of two
    cache = jax.eval_shape(lambda: oj.init_cache(cfg, batch=2, max_len=1152, num_kv_heads=8,
                                                 head_dim=d, dtype=dtype))  # fmt: skip
    kt = jax.ShapeDtypeStruct((2, 8, d), jnp.float32)

    def f(cache, k, v):
        (c,), (todo,) = ofl.prepare_flushes([cache], clear=False)
        return cw.fused_update(c, k, v, todo, interpret=False)

    exp = export.export(
        jax.jit(f), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(cache, kt, kt)  # fmt: skip
    text = exp.mlir_module()
    assert "xla.gpu.triton" in text
    fields = 4 if cfg.layout == "record" else len(cw.CACHE_FIELDS)  # ring K, V, records, norms
    assert text.count("output_operand_alias<") == fields


# -- models: decode steps with the fused cache write -----------------------------------
TINY = ModelConfig(
    family="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512,
)  # fmt: skip


def fused_and_xla_runs(seed, lengths, steps, max_len, mesh=None, kv=None, config=TINY,
                       encode=None):  # fmt: skip
    """Prefill, then ``steps`` greedy decode steps, with the cache writes of XLA and of the
    fused kernel: [(logits, caches)] per step for each, compared bit for bit.

    ``encode``: the encoder of both runs (None: each run's own, XLA or the Pallas one;
    compiled on a GPU the Pallas encoder rounds a few codes differently from XLA's,
    ``test_quantize_kernel``, so a GPU comparison of the writes alone names one)."""
    kv = kv or oj.preset("oscar", bits=2, group_size=16, residual_length=16)
    m = models.CausalLM(config, rngs=nnx.Rngs(seed))
    ids = np.asarray(jax.random.randint(jax.random.key(seed), (2, 40), 0, 256), np.int32)
    runs = {}
    for impl in ("xla", "pallas"):
        logits, caches, p = models.prefill(
            m, ids, kv, max_new_tokens=steps + 1, lengths=lengths, max_len=max_len, mesh=mesh,
            cache_dtype="bfloat16",
            implementation=models.Backends(encode=encode or impl, cache_write=impl),
        )  # fmt: skip
        assert models.fused_cache_write(p.st, caches[0]) == (impl == "pallas")
        if mesh is not None:  # the kernels run per device: nothing is gathered
            assert "all-gather(" not in mstep_jit_text(p, caches, lengths)
        out = [(logits, caches)]
        for i in range(steps):
            tok = jnp.argmax(out[-1][0], -1).astype(jnp.int32)
            out.append(models.decode_step(p, out[-1][1], tok, lengths + i))
        runs[impl] = out
    for i, (a, b) in enumerate(zip(runs["xla"], runs["pallas"], strict=True)):
        chex.assert_trees_all_equal(b, a, custom_message=f"step {i}")
    return runs["pallas"]


def mstep_jit_text(p, caches, lengths) -> str:
    """The compiled decode step's HLO text."""
    tok = jnp.zeros((len(lengths),), jnp.int32)
    pos = jnp.asarray(lengths, jnp.int32)
    step = models.step_program().lower(p.st, p.decode_params, tuple(caches), tok, pos)
    return step.compile().as_text()


def test_model_decode_fused_equals_xla_writes():
    """Steps across several flushes (and an overflow): caches and logits bit-identical.

    head_dim 32 at INT2 is outside the Pallas encoder (it falls back to XLA), so the
    "pallas" and "xla" runs differ only in how the caches are written."""
    kv = oj.preset("oscar", bits=2, group_size=16, residual_length=16)
    assert pq.kernel_unsupported_reason(kv, TINY.head_dim) is not None
    run = fused_and_xla_runs(3, np.array([40, 29], np.int32), 47, 84)
    last = run[-1][1][0]
    assert np.all(np.asarray(last.num_quantized()) >= 48)  # 3+ flushes per row
    assert np.asarray(last.flags)[0] & oj.FLAG_OVERFLOW  # row 0 ran past max_len


def test_model_decode_fused_record_writes_equal_xla():
    """A layout='record' cache (head_dim 128): the fused kernel merges each flushed group's
    half-record into its record as the XLA write does, bit for bit, across flushes."""
    kv = oj.preset("oscar", bits=2, residual_length=32, rotate_values=False, layout="record")
    config = dataclasses.replace(TINY, num_heads=2, num_kv_heads=1, head_dim=128)
    run = fused_and_xla_runs(4, np.array([40, 35], np.int32), 60, 400, kv=kv, config=config,
                             encode="xla")  # fmt: skip
    last = run[-1][1][0]
    assert last.cfg.layout == "record"
    assert np.asarray(last.num_quantized()).tolist() == [64, 32]  # both halves of a record


@pytest.mark.parametrize("shape", [(2, 1, 1), (1, 2, 1)], ids=["data", "model"])
def test_model_decode_fused_on_a_mesh(shape):
    """Rows or KV heads split over 2 devices: the fused writes and the flush encoder run per
    device (shard_map) and give the sharded XLA writes' caches and logits, bit for bit."""
    from jax.sharding import Mesh

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices: XLA_FLAGS=--xla_force_host_platform_device_count=2")
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(shape), ("data", "model", "sequence"))
    run = fused_and_xla_runs(4, np.array([40, 23], np.int32), 20, 64, mesh)
    nq0, nq = (np.asarray(r[1][0].num_quantized()) for r in (run[0], run[-1]))
    assert np.all(nq > nq0)  # every row flushed while decoding


@pytest.mark.parametrize("shape", [(2, 1, 1), (1, 2, 1)], ids=["data", "model"])
def test_sharded_prepare_flushes_equals_unsharded(shape):
    """Per-device encoding gives the unsharded flushes exactly, flags included: an encoding
    overflow planted in KV head 1 (model shard 1) flags its row on every shard."""
    from jax.sharding import Mesh

    from oscar_jax import sharding as osh

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(shape), ("data", "model", "sequence"))
    c = random_cache(**CASES["int2_d64_per_head_f32"])
    nq, due = ofl.flush_due(c)
    assert bool(due[5]) and int(c.flags[5]) == 0  # row 5 (127 tokens) flushes tokens 64..95
    slot = int(nq[5]) % c.slots_total
    big = jnp.array([3e38, -3e38])  # a value group's range overflows float32
    c = dataclasses.replace(c, v_res=c.v_res.at[5, 1, slot, :2].set(big))
    ref_c, ref_t = ofl.prepare_flushes([c], clear=False)
    assert int(ref_c[0].flags[5]) & oj.FLAG_NONFINITE  # the encoding overflowed
    out_c, out_t = jax.jit(lambda cs: osh.sharded_prepare_flushes(cs, mesh, clear=False))(
        (osh.shard_cache(c, mesh),)
    )
    chex.assert_trees_all_equal((out_c, out_t), (ref_c, ref_t))
    per_token = random_cache(**CASES["int2_d128_per_token_bf16"])
    reason = osh.local_flush_reason(per_token, mesh)
    assert (reason is None) == (shape[1] == 1)
    if reason:
        with pytest.raises(ValueError, match="per-token key norms"):
            osh.sharded_prepare_flushes([per_token], mesh)


def test_sharded_fused_update_needs_no_sequence_axis():
    from jax.sharding import Mesh

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 1, 2), ("data", "model", "sequence"))
    c = oj.init_cache(oj.preset("oscar", bits=2, group_size=16, residual_length=16), batch=2,
                      max_len=64, num_kv_heads=2, head_dim=32)  # fmt: skip
    k = jnp.ones((2, 2, 32))
    with pytest.raises(ValueError, match="'sequence' has size 2"):
        cw.sharded_fused_update(c, k, k, None, mesh)


def test_fused_step_updates_caches_in_place():
    """The decode step with the fused writes copies no whole cache and aliases every cache
    buffer (compiled on the CPU, interpret mode; ``test_inplace``'s check of the default)."""
    import test_inplace as ti

    kv = ti.KV["oscar"]
    st = ti._static(kv)._replace(
        backends=models.Backends.of("triton").replace(attention="xla", prompt_attention="reference")
    )
    params, caches = ti._abstract(kv)
    assert models.fused_cache_write(st, caches[0])
    tok = jax.ShapeDtypeStruct((ti.B,), jnp.int32)
    step = models.step_program(donate=True).lower(st, params, caches, tok, tok).compile()
    found = ti.hc.whole_cache_copies(step.as_text(), ti.hc.cache_shapes(caches))
    assert not found, ti.hc.format_copies(found)
    assert step.memory_analysis().alias_size_in_bytes >= ti.memory.abstract_nbytes(caches)
