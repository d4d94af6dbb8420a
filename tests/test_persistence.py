"""Save / restore of caches and generation state: bit-identical, sharded, corrupt -> ValueError."""

from __future__ import annotations

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import models
import oscar_jax as oj
from oscar_jax import persistence
from oscar_jax import sharding as osh

SMALL = dict(residual_length=32, group_size=32)


def _cache(method="oscar", b=2, h=2, d=64, t=90, max_len=128, dtype=jnp.bfloat16, **kw):
    cfg = oj.preset("bf16") if method == "bf16" else oj.preset(method, **SMALL, **kw)
    k = jax.random.normal(jax.random.key(0), (b, t, h, d))
    v = jax.random.normal(jax.random.key(1), (b, t, h, d))
    c = oj.init_cache(cfg, batch=b, max_len=max_len, num_kv_heads=h, head_dim=d, dtype=dtype)
    return oj.prefill(c, k, v, jnp.arange(b, dtype=jnp.int32) * 7 + t - 7 * (b - 1))


def _assert_same(a, b):
    chex.assert_trees_all_equal(a, b)
    chex.assert_trees_all_equal_dtypes(a, b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)


@pytest.mark.parametrize(
    "method, kw, dtype",
    [
        ("oscar", dict(bits=2), jnp.bfloat16),
        ("kivi", dict(bits=4, norm_granularity="per_token", param_dtype="float16"), jnp.float16),
        ("oscar", dict(bits=3, param_dtype="float8_e4m3fn", norm_dtype="float32"), jnp.float32),
        ("bf16", {}, jnp.bfloat16),
    ],
)
def test_cache_round_trip_bit_identical(tmp_path, method, kw, dtype):
    c = _cache(method, dtype=dtype, **kw)
    c = jax.jit(oj.append)(c, c.k_res[:, :, 0] * 0 + jnp.nan, c.v_res[:, :, 0])  # flags too
    p = oj.save_state(tmp_path / "c.safetensors", c)
    r = oj.load_state(p)
    assert isinstance(r, oj.KVCache) and r.cfg == c.cfg and r.max_len == c.max_len
    _assert_same(r, c)
    meta = persistence.describe(p)["metadata"]
    assert meta["version"] == "1" and len(meta["sha256"]) == 64
    if kw.get("param_dtype") == "float8_e4m3fn":
        return  # safetensors.numpy has no float8 (the Rust reader has)
    st = pytest.importorskip("safetensors.numpy")  # any safetensors reader can read it
    raw = st.load_file(p)
    np.testing.assert_array_equal(raw["t0"], np.asarray(c.k_codes))


def test_generation_state_round_trip(tmp_path):
    caches = jax.vmap(lambda _: _cache())(jnp.arange(3))  # 3 stacked layers
    carry = (caches, jnp.array([5, 9], jnp.int32), jax.random.key(7), jnp.array([False, True]))
    state = {"carry": carry, "step": jnp.int32(11), "note": None, "hist": [jnp.ones((2, 3))]}
    p = oj.save_state(tmp_path / "g.safetensors", state)
    r = oj.load_state(p)
    _assert_same(jax.tree_util.tree_map(lambda x: x, r["carry"][:2]), carry[:2])
    np.testing.assert_array_equal(jax.random.key_data(r["carry"][2]), jax.random.key_data(carry[2]))
    assert jax.random.key_impl(r["carry"][2]) == jax.random.key_impl(carry[2])
    assert r["note"] is None and r["step"] == 11 and isinstance(r["hist"], list)
    assert jax.random.normal(r["carry"][2]) == jax.random.normal(carry[2])


def _corruptions(blob: bytes):
    n = int.from_bytes(blob[:8], "little")
    yield "empty", b"", "truncated"
    yield "4 bytes", blob[:4], "truncated"
    yield "mid header", blob[: 8 + n // 2], "truncated"
    yield "no data", blob[: 8 + n], "truncated"
    yield "mid data", blob[: 8 + n + (len(blob) - 8 - n) // 2], "truncated"
    yield "last byte cut", blob[:-1], "truncated"
    yield "extra byte", blob + b"\0", "header says"
    flipped = bytearray(blob)
    flipped[-3] ^= 0x10
    yield "bit flip in data", bytes(flipped), "sha256"
    hdr = bytearray(blob)
    hdr[8 + n // 3] = ord("}")
    yield "broken header", bytes(hdr), "header"
    head = json.loads(blob[8 : 8 + n])
    head["__metadata__"]["version"] = "99"
    hb = json.dumps(head).encode()
    yield "future version", len(hb).to_bytes(8, "little") + hb + blob[8 + n :], "version"
    head = json.loads(blob[8 : 8 + n])
    head["t1"]["shape"] = [int(s) + 1 for s in head["t1"]["shape"]]
    hb = json.dumps(head).encode()
    yield "shape lies", len(hb).to_bytes(8, "little") + hb + blob[8 + n :], "t1"


def test_truncated_or_corrupted_file_is_a_clear_error(tmp_path):
    c = _cache()
    p = oj.save_state(tmp_path / "good.safetensors", c)
    blob = open(p, "rb").read()
    for name, bad, match in _corruptions(blob):
        f = tmp_path / f"bad_{name.replace(' ', '_')}.safetensors"
        f.write_bytes(bad)
        with pytest.raises(ValueError, match=match) as e:
            oj.load_state(f)
        assert str(f) in str(e.value), name  # names the file
    with pytest.raises(ValueError, match="missing"):
        oj.load_state(tmp_path / "missing.safetensors")
    # a save that fails midway leaves the old file intact
    with pytest.raises(ValueError, match="cannot save"):
        oj.save_state(p, {"x": object()})
    _assert_same(oj.load_state(p), c)
    assert [f for f in os.listdir(tmp_path) if f.startswith(".tmp_")] == []


def test_restore_onto_a_mesh_keeps_shardings(tmp_path):
    devs = np.array(jax.devices()[:8]).reshape(2, 2, 2)
    mesh = Mesh(devs, ("data", "model", "sequence"))
    c = _cache(max_len=32 + 2 * 256)  # quantized capacity divisible by sequence x G
    sh = osh.cache_shardings(c, mesh)
    placed = jax.device_put(c, sh)
    p = oj.save_state(tmp_path / "s.safetensors", placed)
    for r in (oj.load_state(p, shardings=sh), oj.load_state(p, mesh=mesh)):
        _assert_same(r, c)
        for got, want in zip(jax.tree_util.tree_leaves(r), jax.tree_util.tree_leaves(sh),
                             strict=True):  # fmt: skip
            assert got.sharding.is_equivalent_to(want, got.ndim), (got.sharding, want)
    one = oj.load_state(p, shardings=jax.sharding.SingleDeviceSharding(jax.devices()[3]))
    assert all(x.devices() == {jax.devices()[3]} for x in jax.tree_util.tree_leaves(one))
    with pytest.raises(ValueError, match="structure"):
        oj.load_state(p, shardings=[sh])


def test_resumed_decoding_equals_uninterrupted(tmp_path):
    """append + decode loop; save at step 20, restore, continue: identical outputs and cache."""
    cfg = oj.preset("oscar", bits=2, **SMALL)
    b, h, d, steps = 2, 2, 64, 60
    k = jax.random.normal(jax.random.key(3), (b, steps, h, d), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(4), (b, steps, h, d), jnp.bfloat16)
    q = jax.random.normal(jax.random.key(5), (b, 4, d), jnp.bfloat16)
    c0 = oj.init_cache(cfg, batch=b, max_len=128, num_kv_heads=h, head_dim=d)
    c0 = oj.prefill(c0, k[:, :10], v[:, :10], jnp.array([10, 3]))

    @jax.jit
    def step(c, kt, vt):
        c = oj.append(c, kt, vt)
        return c, oj.decode_attention(q, c)

    def loop(c, lo, hi):
        outs = []
        for t in range(lo, hi):
            c, o = step(c, k[:, t], v[:, t])
            outs.append(o)
        return c, outs

    c_full, o_full = loop(c0, 10, steps)
    c_mid, o_a = loop(c0, 10, 30)
    oj.save_state(tmp_path / "mid.safetensors", c_mid)
    del c_mid
    c_res, o_b = loop(oj.load_state(tmp_path / "mid.safetensors"), 30, steps)
    np.testing.assert_array_equal(np.stack(o_a + o_b), np.stack(o_full))
    _assert_same(c_res, c_full)


def test_model_generation_resumed_from_restored_caches(tmp_path):
    """models.prefill / decode_step (public API): caches saved mid-way and restored give the
    same greedy tokens as generate_stepwise and as the uninterrupted loop."""
    cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                             num_heads=2, num_kv_heads=1, head_dim=16)  # fmt: skip
    m = models.CausalLM(cfg)
    kv = oj.preset("oscar", bits=2, residual_length=16, group_size=16)
    ids = (np.arange(2 * 20, dtype=np.int32).reshape(2, 20) * 7) % 64
    lengths = np.array([20, 13])
    n = 24
    want = models.generate_stepwise(m, ids, n, kv=kv, lengths=lengths, stop_tokens=())
    logits, caches, p = models.prefill(m, ids, kv, max_new_tokens=n, lengths=lengths,
                                       stop_tokens=())  # fmt: skip
    toks = [np.asarray(jnp.argmax(logits, -1), np.int32)]
    for i in range(1, n):
        if i == 10:  # put the state aside and resume from disk
            oj.save_state(tmp_path / "state.safetensors", {"caches": caches, "tok": toks[-1]})
            del caches
            state = oj.load_state(tmp_path / "state.safetensors")
            caches = state["caches"]
            np.testing.assert_array_equal(state["tok"], toks[-1])
        logits, caches = models.decode_step(p, caches, toks[-1], np.asarray(p.lengths) + i - 1)
        toks.append(np.asarray(jnp.argmax(logits, -1), np.int32))
    np.testing.assert_array_equal(np.stack(toks, 1), want)
