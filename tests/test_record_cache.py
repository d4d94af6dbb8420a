"""A cache of ``KVQuantConfig(layout="record")``: its writers (prefill, the decode-time
flushes) write exactly the records that ``fragment_layout`` makes of a planar cache given the
same writes, its readers go through the exact inverse or refuse it by name, and the
"mosaic" decode backend reads it (on the H200; refused by name without one)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import kv_with_sinks, query
from jax.sharding import Mesh

import models
import oscar_jax as oj
from models.model import CausalLM
from oscar_jax import backends, flush, record
from oscar_jax import sharding as osh
from pallas_kernels import cache_write
from pallas_kernels.decode import mosaic as mk

D = 128
MAX_LEN = 700  # Lq = 768: three 256-token tiles, twelve records


def _caches(seed, lengths, *, t=None, h=2, bits=2, d=D, **kw):
    """The same prompt prefilled into a planar and a record cache (head_dim d)."""
    cfg = oj.preset("oscar", bits=bits, **kw)
    b = len(lengths)
    t = t or max(max(lengths), 1)
    k, v = kv_with_sinks(seed, b, t, h, d, jnp.bfloat16, sinks=(0, 1))
    n = jnp.asarray(lengths, jnp.int32)
    out = []
    for layout in ("planar", "record"):
        c = oj.init_cache(cfg.replace(layout=layout), batch=b, max_len=MAX_LEN, num_kv_heads=h,
                          head_dim=d)  # fmt: skip
        out.append(jax.jit(oj.prefill)(c, k, v, n))
    return out


def _assert_same_writes(planar, rec_cache):
    """rec / kn equal ``fragment_layout`` of the planar cache, every other leaf equal."""
    assert rec_cache.cfg == planar.cfg.replace(layout="record")
    pdt = planar.cfg.scale_dtype
    rec, kn = mk.fragment_layout(planar.k_codes, planar.k_scale, planar.k_zero, planar.k_norm,
                                 planar.v_codes, planar.v_scale, planar.v_zero, param_dtype=pdt,
                                 block_tokens=64)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(rec_cache.rec), np.asarray(rec))
    np.testing.assert_array_equal(np.asarray(rec_cache.kn), np.asarray(kn))
    for f in ("k_res", "v_res", "lengths", "flags"):
        np.testing.assert_array_equal(
            np.asarray(getattr(rec_cache, f).astype(jnp.float32)),
            np.asarray(getattr(planar, f).astype(jnp.float32)),
            err_msg=f,
        )
    assert rec_cache.quant_capacity == planar.quant_capacity


def _step_kv(seed, b, h, d=D):
    k, v = kv_with_sinks(seed, b, 1, h, d, jnp.bfloat16, sinks=())
    return k[:, 0], v[:, 0]


def _early_step(c, k_t, v_t):
    cs, todo = flush.prepare_flushes((c,))
    return flush.write_step(cs[0], k_t, v_t, todo[0])


# rows: empty, all in the ring, quantized part ending mid-record (nq = 96), at a record
# boundary (nq = 128), long; appends flush each row several times and cross records
CASES = [
    dict(lengths=[0, 100, 229, 256, 650], param_dtype="float16", norm_granularity="per_head"),
    dict(lengths=[161, 30, 400, 517], param_dtype="bfloat16", norm_granularity="per_token"),
    dict(
        lengths=[300, 129], param_dtype="float16", norm_granularity="per_token", rotate_values=False
    ),  # fmt: skip
    dict(lengths=[0, 100, 229, 650], param_dtype="float16", norm_granularity="per_head", bits=4),
    dict(lengths=[161, 400], param_dtype="bfloat16", norm_granularity="per_token", bits=4),
    # head_dim 64 (SmolLM2, Qwen2.5) and 256 (Gemma 3)
    dict(lengths=[0, 229, 650], param_dtype="float16", norm_granularity="per_head", d=64),
    dict(lengths=[161, 517], param_dtype="bfloat16", norm_granularity="per_token", bits=4, d=64),
    dict(lengths=[100, 400], param_dtype="bfloat16", norm_granularity="per_head", d=256),
    dict(lengths=[256, 33], param_dtype="float16", norm_granularity="per_token", bits=4, d=256),
]


IDS = ["f16-per_head", "bf16-per_token", "f16-unrot", "int4-f16-per_head", "int4-bf16-per_token",
       "d64-f16", "d64-int4-bf16", "d256-bf16", "d256-int4-f16"]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_prefill_and_flushes_write_the_records_of_the_planar_cache(case):
    case = dict(case)
    lengths = case.pop("lengths")
    planar, rec = _caches(len(lengths), lengths, **case)
    _assert_same_writes(planar, rec)
    b, h, d = planar.batch, planar.num_kv_heads, planar.head_dim
    step = jax.jit(oj.append)
    for i in range(70):  # every row flushes at least twice (a group every 32 appends)
        k_t, v_t = _step_kv(100 + i, b, h, d)
        planar, rec = step(planar, k_t, v_t), step(rec, k_t, v_t)
    assert int(jnp.max(planar.num_quantized())) > 0
    _assert_same_writes(planar, rec)
    # the decode step's other writer: the flush encoded early (prepare_flushes), then stored
    early = jax.jit(_early_step)
    for i in range(40):
        k_t, v_t = _step_kv(300 + i, b, h, d)
        planar, rec = early(planar, k_t, v_t), early(rec, k_t, v_t)
    _assert_same_writes(planar, rec)
    # readers through the exact inverse: dequantize and the XLA reference attention
    for a, w in zip(oj.dequantize(rec), oj.dequantize(planar), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
    q = query(7, b, 4 * h, d)
    got = oj.decode_attention(q, rec, implementation="xla")
    want = oj.decode_attention(q, planar, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # the same stored values
    # and the conversion back is exact
    back = oj.convert_layout(rec, "planar")
    for f in record.PLANAR:
        got_f, want_f = (np.asarray(getattr(c, f)).view(np.uint8) for c in (back, planar))
        np.testing.assert_array_equal(got_f, want_f, err_msg=f)


def test_an_empty_record_cache_and_one_without_a_quantized_part():
    cfg = oj.preset("oscar", bits=2, layout="record")
    c = oj.init_cache(cfg, batch=2, max_len=MAX_LEN, num_kv_heads=2, head_dim=D)
    assert c.rec.shape == (2, 2, 768 // 64, record.WORDS) and c.rec.dtype == jnp.uint32
    assert c.kn.shape == (2, 2, 768) and c.kn.dtype == jnp.float32
    assert c.k_scale.shape[2] == c.v_codes.shape[2] == 0 and c.quant_capacity == 768
    assert int(jnp.sum(c.rec)) == 0
    per_q, _ = oj.cache.bytes_per_token(c)
    assert per_q == 2 * (1600 * 4 / 64 + 4)
    small = oj.init_cache(cfg, batch=1, max_len=100, num_kv_heads=2, head_dim=D)
    assert small.quant_capacity == 0
    k, v = kv_with_sinks(3, 1, 90, 2, D, jnp.bfloat16)
    small = oj.prefill(small, k, v)
    q = query(3, 1, 4, D)
    want = oj.decode_attention(q, oj.convert_layout(small, "planar"))
    np.testing.assert_array_equal(np.asarray(oj.decode_attention(q, small)), np.asarray(want))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(layout="records"), "layout='records' must be one of"),
        (dict(layout="record", bits=3), "bits=3"),
        (dict(layout="record", group_size=64, residual_length=128), "group_size=64"),
        (dict(layout="record", param_dtype="float32"), "param_dtype='float32'"),
    ],
)
def test_config_validation_names_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        oj.preset("oscar", **kw)


def test_bf16_method_and_head_dim_are_refused_for_records():
    with pytest.raises(ValueError, match="bits=16"):
        oj.KVQuantConfig(method="bf16", bits=16, layout="record")
    cfg = oj.preset("kivi", bits=2, layout="record")
    with pytest.raises(ValueError, match=r"head_dim=96 must be one of \(64, 128, 256\) for layout"):
        oj.init_cache(cfg, batch=1, max_len=400, num_kv_heads=1, head_dim=96)


def test_planar_readers_refuse_a_record_cache_by_name():
    planar, rec = _caches(5, [300, 200])
    q = query(5, 2, 4, D)
    with pytest.raises(ValueError, match="layout='record'"):
        oj.decode_attention(q, rec, implementation="triton")
    with pytest.raises(ValueError, match="layout='planar'"):
        _ = planar.rec
    assert cache_write.unsupported_reason(rec) is None  # the fused write merges records
    with pytest.raises(ValueError, match="layout='planar'.*convert=True"):
        mk.decode_attention_mosaic(q, planar)


def test_mosaic_backend_lookup():
    assert "mosaic" in backends.available("decode_attention")
    assert oj.Backends.of("mosaic") == oj.Backends(attention="mosaic")
    _, rec = _caches(6, [300, 200])
    if oj.gpu_available():
        pytest.skip("the refusal is for machines where the Mosaic kernel cannot run")
    with pytest.raises(ValueError, match="implementation='mosaic' .*not available here"):
        oj.decode_attention(query(6, 2, 4, D), rec, implementation="mosaic")


@pytest.mark.parametrize("bits,d", [(2, 128), (4, 128), (2, 64), (4, 256)])
def test_record_cache_saves_and_loads_bit_for_bit(tmp_path, bits, d):
    _, rec = _caches(8, [300, 517], param_dtype="bfloat16", bits=bits, d=d)
    path = oj.save_state(tmp_path / "rec.safetensors", rec)
    back = oj.load_state(path)
    assert back.cfg == rec.cfg
    for a, w in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(rec), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(w).view(np.uint8))
    node = oj.persistence.describe(path)["metadata"]["tree"]
    assert node["record_layout"] == record.RECORD_VERSION and node["cfg"]["layout"] == "record"
    planar = oj.convert_layout(rec, "planar")
    pnode = oj.persistence.describe(oj.save_state(tmp_path / "p.safetensors", planar))
    assert "layout" not in pnode["metadata"]["tree"]["cfg"]  # older readers read it


def test_a_record_file_of_another_layout_version_is_refused(tmp_path, monkeypatch):
    _, rec = _caches(9, [300])
    monkeypatch.setattr(oj.persistence, "RECORD_VERSION", record.RECORD_VERSION + 1)
    path = oj.save_state(tmp_path / "rec.safetensors", rec)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=f"record layout version {record.RECORD_VERSION + 1}; "
                       r"this reader knows \(1, 2\)"):  # fmt: skip
        oj.load_state(path)


def _v1_records(rec):
    """Records of this version -> record layout version 1 (key params in blocks of d / 8
    words a j; V code words as K's), written out from version 1's formulas, independently
    of the library's converter."""
    r = np.asarray(rec)
    bits, d = record.record_format(r.shape[-1])
    vc, kp = record.offsets(bits, d)[1:3]
    out = r.copy()
    t, u = d * bits // 64, min(4, d * bits // 64)  # V words a thread, words a load
    c, m = t * 64 // d, d // 64  # classes, 64-channel blocks
    for tid in range(128):
        for f in range(t):
            out[..., vc + 128 * u * (f // u) + u * tid + f % u] = r[
                ..., vc + 128 * m * (f % c) + m * tid + f // c]  # fmt: skip
    for blk in range(4):
        base = kp + blk * (d // 2)
        for j in range(4):
            for cb in range(d // 8):
                out[..., base + d // 8 * j + cb] = r[..., base + 16 * (cb // 4) + 4 * j + cb % 4]
    return out


@pytest.mark.parametrize("bits, d", [(2, 128), (4, 64), (2, 256)])
def test_a_record_file_of_layout_version_1_is_converted_on_load(tmp_path, monkeypatch, bits, d):
    """A file saved with record layout 1 loads into this version's records bit for bit."""
    _, rec = _caches(12, [300, 517], bits=bits, d=d)
    assert record.RECORD_VERSION == 2
    old = dataclasses.replace(rec, k_codes=jnp.asarray(_v1_records(rec.k_codes)))
    assert not np.array_equal(np.asarray(old.k_codes), np.asarray(rec.k_codes))
    monkeypatch.setattr(oj.persistence, "RECORD_VERSION", 1)
    path = oj.save_state(tmp_path / "v1.safetensors", old)
    monkeypatch.undo()
    assert oj.persistence.describe(path)["metadata"]["tree"]["record_layout"] == 1
    back = oj.load_state(path)
    for a, w in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(rec), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(w).view(np.uint8))


def test_conversion_is_exact_both_ways_and_keeps_the_pytree():
    planar, rec = _caches(10, [640, 200], norm_granularity="per_token")
    conv = oj.convert_layout(planar, "record")
    leaves = jax.tree_util.tree_leaves
    for a, w in zip(leaves(conv), leaves(rec), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(w).view(np.uint8))
    assert jax.tree_util.tree_structure(dataclasses.replace(planar, cfg=rec.cfg)) == (
        jax.tree_util.tree_structure(rec)
    )


@pytest.mark.parametrize("bits", [2, 4])
def test_sequence_sharded_record_cache_equals_unsharded(bits):
    """Records split over the sequence axis (whole records a shard): prefill, appends with
    flushes (shard-aware record writes) and the XLA attention per shard equal one device."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 2, 4), ("data", "model", "sequence"))
    b, h = 2, 2
    cfg = oj.preset("oscar", bits=bits, layout="record")
    c = oj.init_cache(cfg, batch=b, max_len=128 + 1024, num_kv_heads=h, head_dim=D)
    k, v = kv_with_sinks(11, b, 700, h, D, jnp.bfloat16)
    lengths = jnp.array([700, 229])
    ref = oj.prefill(c, k, v, lengths)
    sh = osh.cache_shardings(ref, mesh)
    cs = jax.jit(oj.prefill, out_shardings=sh)(c, k, v, lengths)
    want = (b, 1, 1024 // 64 // 4, record.record_words(bits))
    assert cs.rec.addressable_shards[0].data.shape == want
    dec = jax.jit(lambda q, c: osh.sharded_decode_attention(q, c, mesh))
    app = jax.jit(lambda c, k, v: osh.sharded_append(c, k, v, mesh), out_shardings=sh)
    ref_app = jax.jit(oj.append)
    k2, v2 = kv_with_sinks(12, b, 36, h, D, jnp.bfloat16)
    for step in range(36):  # a flush for every row
        cs = app(cs, k2[:, step], v2[:, step])
        ref = ref_app(ref, k2[:, step], v2[:, step])
    for a, w in zip(jax.tree_util.tree_leaves(cs), jax.tree_util.tree_leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(w).view(np.uint8))
    q = query(13, b, 2 * h, D)
    np.testing.assert_allclose(np.asarray(dec(q, cs)), np.asarray(oj.decode_attention(q, ref)),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_model_decode_over_a_record_cache_equals_planar():
    """A 2-layer Qwen3-shaped model (head_dim 128): prefill and 36 decode steps (flushes in
    every layer) give the same logits, bit for bit, over a record cache as over a planar one.
    Both read by XLA: on a GPU "auto" gives the two layouts different kernels (Mosaic,
    Triton), which agree only within the kernels' tolerance (test_decode_mosaic)."""
    small = dict(vocab_size=256, hidden_size=256, intermediate_size=256, num_layers=2)
    mc = dataclasses.replace(models.config.qwen3_8b(), num_heads=4, num_kv_heads=2, **small)
    m = CausalLM(mc, dtype=jnp.float32, rngs=nnx.Rngs(0))
    ids = np.asarray(jax.random.randint(jax.random.key(1), (2, 90), 0, 256), np.int32)
    runs = []
    for layout in ("planar", "record"):
        kv = oj.preset("oscar", bits=2, residual_length=32, layout=layout)
        logits, caches, p = models.prefill(m, ids, kv, max_new_tokens=40, implementation="xla")
        seq, pos = [np.asarray(logits)], np.asarray(p.lengths)
        for i in range(36):
            logits, caches = models.decode_step(p, caches, ids[:, i], pos + i)
            seq.append(np.asarray(logits))
        assert caches[0].cfg.layout == layout and int(caches[0].num_quantized().min()) == 64
        runs.append(np.stack(seq))
    np.testing.assert_array_equal(*runs)


def test_early_flush_carries_the_record_words_it_writes():
    """prepare_flushes computes a record cache's half-record words with the encoding (under
    its lax.cond, not for every layer on every step); they equal the words the write would
    compute, and writing with or without them stores the same bits."""
    _, rec = _caches(11, [159, 191, 40])  # rows 0 and 1 flush a group (halves 0 and 1)
    caches, todo = flush.prepare_flushes((rec, rec))
    for c, f in zip(caches, todo, strict=True):
        assert f.words is not None and f.words.shape == (3, 2, record.WORDS)
        assert np.asarray(f.flush).any()
        want = record.flush_words(f.ek, f.ev, f.nq, param_dtype=c.cfg.scale_dtype)
        np.testing.assert_array_equal(np.asarray(f.words)[np.asarray(f.flush)],
                                      np.asarray(want)[np.asarray(f.flush)])  # fmt: skip
        got = flush.write_flush(c, f)
        again = flush.write_flush(c, f._replace(words=None))
        jax.tree.map(np.testing.assert_array_equal, got, again)
    planar, _ = _caches(11, [159, 191, 40])
    assert flush.prepare_flushes((planar,))[1][0].words is None


def test_sharded_early_flush_of_record_caches_equals_one_device():
    """sharded_prepare_flushes (rows on data, heads on model) gives each shard its rows' record
    words; the caches and the flushing rows' groups and words equal one device's, and the
    sharded write stores the same bits with or without the words."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2, 1), ("data", "model", "sequence"))
    _, rec = _caches(11, [159, 191, 40, 100])
    want_c, want_t = flush.prepare_flushes((rec, rec))
    got_c, got_t = osh.sharded_prepare_flushes((rec, rec), mesh)
    for a, w in zip(jax.tree.leaves(got_c), jax.tree.leaves(want_c), strict=True):
        if a.size:
            np.testing.assert_array_equal(a, w)
    for tg, tw in zip(got_t, want_t, strict=True):
        fl = np.asarray(tw.flush)  # other rows' groups are not stored (a skipped shard: zeros)
        assert fl.any() and tg.words is not None
        for a, w in zip(jax.tree.leaves(tg), jax.tree.leaves(tw), strict=True):
            if a.ndim > 1 and a.size:
                np.testing.assert_array_equal(np.asarray(a)[fl], np.asarray(w)[fl])
    one = osh.sharded_write_flush(got_c[0], got_t[0], mesh)
    two = osh.sharded_write_flush(got_c[0], got_t[0]._replace(words=None), mesh)
    for a, w in zip(jax.tree.leaves(one), jax.tree.leaves(two), strict=True):
        if a.size:
            np.testing.assert_array_equal(a, w)


def test_prepare_decides_an_auto_layout_from_the_model_and_its_backends(monkeypatch):
    """models.prepare hands its caches "record" for a head_dim-128 INT2 model exactly where
    its decode attention is the Mosaic kernel (a Hopper GPU pretended here), else "planar";
    the memory planner sees the same caches."""
    small = dict(vocab_size=256, hidden_size=256, intermediate_size=256, num_layers=2)
    mc = dataclasses.replace(models.config.qwen3_8b(), num_heads=4, num_kv_heads=2, **small)
    m = CausalLM(mc, dtype=jnp.float32, rngs=nnx.Rngs(0))
    ids = np.ones((1, 8), np.int32)
    kv = oj.preset("oscar", bits=2)

    def layout(**kw):
        return models.prepare(m, ids, max_new_tokens=4, kv=kv, **kw).st.kv.layout

    monkeypatch.setattr(backends, "gpu_available", lambda: False)
    assert layout() == "planar"
    monkeypatch.setattr(backends, "gpu_available", lambda: True)
    monkeypatch.setitem(backends._RESOLVED, ("decode_attention", "mosaic"), lambda *a, **k: 0)
    assert layout() == "record" and layout(implementation="mosaic") == "record"
    assert layout(implementation="triton") == "planar"
    abstract = models.memory.abstract_cache(mc, kv, batch=1, max_len=512)
    assert abstract.cfg.layout == "record"
