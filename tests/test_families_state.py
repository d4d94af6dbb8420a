"""Gemma 3 (sliding-window rings) and Qwen3-MoE beyond parity: cache memory figures against
the decode state's real arrays, a decode state saved mid-generation and resumed, and the
evaluation harness's cache-exact logits against token-by-token decoding."""

from __future__ import annotations

import functools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
import oscar_jax as oj
from models import window as mwin
from oscar_eval import ppl as eval_ppl
from oscar_jax import persistence

VOCAB, WINDOW = 128, 8
KV = dict(residual_length=16, group_size=16)


def _config(family: str) -> models.ModelConfig:
    if family == "gemma3":  # local, global, local, global
        return models.gemma3_270m().replace(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
            num_kv_heads=2, head_dim=32, query_pre_attn_scalar=32.0, sliding_window=WINDOW,
            local_layers=(0, 2), max_position_embeddings=512,
        )  # fmt: skip
    return models.qwen3_30b_a3b().replace(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32,
    )  # fmt: skip


@functools.cache
def _model(family: str) -> models.CausalLM:
    """Random weights scaled up so that the logits are confident (the cache matters)."""
    m = models.CausalLM(_config(family), rngs=nnx.Rngs(0))
    p = m.params()
    p["embed"] = p["embed"] * 4.0
    p["layers"] = {k: (v * 4.0 if k.startswith("w") else v) for k, v in p["layers"].items()}
    m.set_params(p)
    return m


def _ids(b, t, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, (b, t)).astype(np.int32)


def _host(tree):
    """numpy copies of a pytree's arrays (typed PRNG keys as their key data)."""

    def one(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree_util.tree_map(one, tree)


def _leaf_bytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(tree)))


# -- memory ------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["bf16", "oscar2"])
@pytest.mark.parametrize("max_len", [48, 6])  # ring = the window; ring = max_len < window
def test_gemma3_cache_bytes_are_the_decode_states(preset, max_len):
    m = _model("gemma3")
    cfg = m.config
    kv = oj.preset("bf16") if preset == "bf16" else oj.preset("oscar", bits=2, **KV)
    b = 2
    logits, caches, p = models.prefill(m, _ids(b, 5, 1), kv, max_new_tokens=1, max_len=max_len,
                                       cache_dtype=jnp.bfloat16)  # fmt: skip
    state = models.first_state(p.st, logits, caches, p.lengths, jax.random.key(0),
                               jnp.float32(1e-6), jnp.float32(1.0))  # fmt: skip
    assert [isinstance(c, mwin.WindowCache) for c in state.caches] == [True, False, True, False]
    want = models.cache_nbytes(cfg, kv, batch=b, max_len=max_len, dtype=jnp.bfloat16)
    assert _leaf_bytes(state.caches) == want
    rest = _leaf_bytes((state.tok, state.pos, state.key, state.stop))
    assert _leaf_bytes(state) == want + rest
    # the rings: window (or max_len) x KV heads x head_dim x 2 (K, V) x 2 bytes per row,
    # plus int32 lengths and flags; the global layers: the OScaR cache as for other families
    ring = b * min(WINDOW, max_len) * cfg.num_kv_heads * cfg.head_dim * 2 * 2 + 2 * 4 * b
    one = models.abstract_nbytes(models.abstract_cache(cfg, kv, batch=b, max_len=max_len))
    assert want == 2 * ring + 2 * one
    assert models.abstract_nbytes(models.abstract_window(cfg, batch=b, max_len=max_len)) == ring
    rows = dict(((r[0], r[1]), r) for r in models.memory_table({"g": cfg}, contexts=(max_len,)))
    assert rows["g", max_len][2] == models.cache_nbytes(cfg, oj.preset("bf16"), batch=1,
                                                        max_len=max_len)  # fmt: skip


def test_batch_that_fits_and_other_families_unchanged():
    g, moe = _config("gemma3"), _config("qwen3_moe")
    kv = oj.preset("oscar", bits=2, **KV)
    row = models.cache_nbytes(g, kv, batch=1, max_len=64)
    assert models.cache_nbytes(g, kv, batch=7, max_len=64) == 7 * row
    assert models.max_batch(g, kv, 5 * row + row - 1, max_len=64) == 5
    assert models.max_batch(g, kv, 5 * row, max_len=64, multiple=2) == 4
    assert models.max_batch(g, kv, row - 1, max_len=64) == 0
    for bad in (-1, float("nan"), "1", True):
        with pytest.raises(ValueError, match="budget_bytes"):
            models.max_batch(g, kv, bad, max_len=64)
    with pytest.raises(ValueError, match="multiple"):
        models.max_batch(g, kv, row, max_len=64, multiple=0)
    with pytest.raises(ValueError, match="local_layers"):
        models.abstract_caches(g, kv, batch=1, max_len=64)  # no [L, ...] stack of rings
    with pytest.raises(ValueError, match="local_layers"):
        models.abstract_window(moe, batch=1, max_len=64)
    # families without rings: the same bytes as the stacked caches (L x one layer's)
    for cfg in (moe, models.llama31_8b()):
        stacked = models.abstract_nbytes(models.abstract_caches(cfg, kv, batch=3, max_len=4096))
        assert models.cache_nbytes(cfg, kv, batch=3, max_len=4096) == stacked


# -- persistence ---------------------------------------------------------------------------
_step = jax.jit(models.step, static_argnums=0)


def _resume_run(tmp_path, family, mesh=None, n=20, at=9):
    """Greedy decode states stepped by ``models.step``; at step ``at`` the state is saved,
    dropped and loaded (onto ``mesh`` with its saved layout). -> (tokens, loaded, path)."""
    m = _model(family)
    kv = oj.preset("oscar", bits=2, **KV)
    ids, lengths = _ids(2, 24, 3), np.array([24, 6], np.int32)
    ids[1, 6:] = 0
    kw = dict(max_new_tokens=n, lengths=lengths, stop_tokens=(), mesh=mesh)
    logits, caches, p = models.prefill(m, ids, kv, **kw)
    t, top_p = jnp.float32(1e-6), jnp.float32(1.0)  # greedy, as generate passes them
    state = models.first_state(p.st, logits, caches, p.lengths, jax.random.key(0), t, top_p)
    toks, saved, loaded = [np.asarray(state.tok)], None, None
    path = tmp_path / f"{family}.safetensors"
    for i in range(1, n):
        if i == at:
            saved = _host(state)
            oj.save_state(path, state)
            del state
            state = loaded = oj.load_state(path, mesh=mesh)
        state = _step(p.st, p.decode_params, state, t, top_p)
        toks.append(np.asarray(state.tok))
    chex.assert_trees_all_equal(_host(loaded), saved)
    return np.stack(toks, axis=1), loaded, path


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_decode_state_saved_mid_generation_resumes_exactly(tmp_path, family):
    """Ragged rows, the rings wrapped and groups flushed before and after the save."""
    m = _model(family)
    kv = oj.preset("oscar", bits=2, **KV)
    got, loaded, path = _resume_run(tmp_path, family)
    ids, lengths = _ids(2, 24, 3), np.array([24, 6], np.int32)  # as _resume_run
    ids[1, 6:] = 0
    want = np.asarray(models.generate(m, ids, 20, kv=kv, lengths=lengths, stop_tokens=()))
    np.testing.assert_array_equal(got, want)
    assert isinstance(loaded, models.DecodeState) and isinstance(loaded.key, jax.Array)
    kinds = [type(c).__name__ for c in loaded.caches]
    if family == "gemma3":
        assert kinds == ["WindowCache", "KVCache"] * 2
        assert int(np.asarray(loaded.caches[0].lengths).min()) > WINDOW  # wrapped before the save
    else:
        assert kinds == ["KVCache"] * 2
    assert int(np.asarray(loaded.caches[-1].num_quantized()).max()) > 0
    assert persistence.describe(path)["metadata"]["version"] == "2"


def test_sharded_gemma3_state_restores_onto_the_mesh(tmp_path):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "model", "sequence"))
    got, loaded, _ = _resume_run(tmp_path, "gemma3", mesh=mesh)
    ref, _, _ = _resume_run(tmp_path, "gemma3")
    np.testing.assert_array_equal(got, ref)
    ring = loaded.caches[0].k.sharding  # saved PartitionSpec re-applied: rows x KV heads
    want = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
    assert ring.is_equivalent_to(want, 4), ring


def test_unknown_or_changed_nodes_are_clear_errors(tmp_path):
    ring = mwin.init(1, 1, 4, 2, jnp.float32)
    p = oj.save_state(tmp_path / "ring.safetensors", {"ring": ring})
    assert isinstance(oj.load_state(p)["ring"], mwin.WindowCache)
    blob = open(p, "rb").read()
    n = int.from_bytes(blob[:8], "little")

    def rewrite(edit):
        head = json.loads(blob[8 : 8 + n])
        tree = json.loads(head["__metadata__"]["tree"])
        edit(tree["items"][0][1])
        head["__metadata__"]["tree"] = json.dumps(tree)
        hb = json.dumps(head).encode()
        f = tmp_path / "bad.safetensors"
        f.write_bytes(len(hb).to_bytes(8, "little") + hb + blob[8 + n :])
        return f

    with pytest.raises(ValueError, match="'Nope' is not registered"):
        oj.load_state(rewrite(lambda node: node.update(name="Nope")))
    with pytest.raises(ValueError, match="WindowCache fields"):
        oj.load_state(rewrite(lambda node: node["fields"].pop("flags")))
    with pytest.raises(ValueError, match="cls="):
        persistence.register_node(dict)
    with pytest.raises(ValueError, match="name="):
        persistence.register_node(models.DecodeState, name="WindowCache")


# -- evaluation harness ---------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_eval_cache_exact_logits_equal_decoding(family):
    """``oscar_eval.ppl``'s parallel form (perplexity's path): bf16 is the model's causal
    attention (windowed on Gemma 3's local layers); INT2 agrees with prefill + decode_step
    token by token up to float32 ulps moving a code (bounds of tests/test_eval.py)."""
    m = _model(family)
    b, t = 2, 40  # five windows; two flushes of G = 16 after R = 16
    ids = _ids(b, t, 5)
    bf = np.asarray(eval_ppl.cached_logits(m, ids, oj.preset("bf16")))
    np.testing.assert_allclose(bf, np.asarray(m.logits(ids)), rtol=0, atol=2e-5)
    kv = oj.preset("oscar", bits=2, **KV)
    logits, caches, p = models.prefill(m, ids[:, :1], kv, max_new_tokens=t, max_len=t + 16)
    ref = [np.asarray(logits)]
    for i in range(1, t):
        logits, caches = models.decode_step(p, caches, ids[:, i], np.full(b, i, np.int32))
        ref.append(np.asarray(logits))
    ref = np.stack(ref, axis=1)
    par = np.asarray(eval_ppl.cached_logits(m, ids, kv))
    err, effect = float(np.max(np.abs(par - ref))), float(np.max(np.abs(bf - ref)))
    print(f"{family}: parallel vs decoding {err:.1e}; INT2 moves logits by {effect:.2f}")
    assert effect > 0.1  # the quantized cache matters: the agreement is not vacuous
    assert err <= 3e-3 and np.median(np.abs(par - ref)) <= 1e-5
    nll, _ = eval_ppl.window_nll(m, ids, kv, batch=b)
    lp = jax.nn.log_softmax(ref[:, :-1], axis=-1)
    want = -np.take_along_axis(np.asarray(lp), ids[:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(nll, want, rtol=0, atol=3e-3)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_eval_needle_loglikelihood_equals_decoding(family):
    """``oscar_eval.niah.answer_logprob`` (the needle test's path): the prompt prefilled, the
    answer teacher-forced through the INT2 cache (rings on Gemma 3) as decode_step does."""
    from oscar_eval import niah as eval_niah

    m = _model(family)
    kv = oj.preset("oscar", bits=2, **KV)
    ids, ans = _ids(1, 36, 7)[0], _ids(1, 6, 8)[0]
    got = eval_niah.answer_logprob(m, [{"ids": ids.tolist(), "answer_ids": ans.tolist()}], kv)
    # a prompt bucket of 64 (max_len 80): with max_len 48 the prefill runs on 48 columns and
    # Gemma 3's windowed prompt attention differs by float32 ulps, which flip INT2 codes
    # here and move a token's log-probability by up to 1.2e-2 (bf16: 1e-6; Llama: 1e-6)
    logits, caches, p = models.prefill(m, ids[None], kv, max_new_tokens=8, max_len=80)
    assert p.ids.shape == (1, 64)
    want = 0.0
    for i, a in enumerate(ans):
        want += float(jax.nn.log_softmax(logits[0])[a])
        logits, caches = models.decode_step(p, caches, [a], [len(ids) + i])
    assert abs(got[0] - want) <= 1e-4, (got, want)


# -- sharded meshes (generation: tests/test_gemma3.py, tests/test_qwen3_moe.py) -------------
def _mesh():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "model", "sequence"))


def test_moe_int2_generation_on_a_sequence_split_mesh():
    """The INT2 cache split by rows, KV heads and sequence, the experts' hidden dim by model
    (test_qwen3_moe covers a bf16 cache on a mesh without a sequence axis)."""
    m = _model("qwen3_moe")
    kv = oj.preset("oscar", bits=2, **KV)
    ids = _ids(2, 24, 6)
    ref = np.asarray(models.generate(m, ids, 12, kv=kv, stop_tokens=(), max_len=64))
    got = np.asarray(models.generate(m, ids, 12, kv=kv, stop_tokens=(), max_len=64, mesh=_mesh()))
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_sharded_decode_step_hlo(family):
    """``decode_step_hlo`` lowers from shapes: rings on Gemma 3's local layers."""
    kv = oj.preset("oscar", bits=2, **KV)
    hlo = models.decode_step_hlo(_config(family), kv, _mesh(), batch=2, max_len=128)
    assert "all-reduce" in hlo or "all-gather" in hlo
