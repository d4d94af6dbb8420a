"""The per-layer params form (``layers.unstack_layers``) that decoding reads in place.

Both forms give the same numbers: ``layers.forward`` (Python loop vs ``lax.scan``),
``step.layer_params``, ``CausalLM.decode_params`` (folded, sharded, cached), the
sharding specs, and ``benchmarks/e2e_fill.random_params`` (the same index-hashed values
per layer as slices of the stacked tensors). ``tests/test_inplace.py`` proves the decode
step reads the per-layer weights without copies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import models
import oscar_jax as oj
from benchmarks import e2e_common as ec  # noqa: E402
from benchmarks import e2e_fill as ef  # noqa: E402
from models import forward, layers
from models import sharding as msh
from models.config import ModelConfig

CFG = ModelConfig(
    family="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=3,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, qk_norm=True,
    qkv_bias=True,
)  # fmt: skip
KV = oj.preset("oscar", bits=2, residual_length=16, group_size=16)  # rotates values


@functools.cache
def model():
    m = models.CausalLM(CFG, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)  # non-trivial norms and biases
    m.set_params(jax.tree_util.tree_map(
        lambda a: a if a.ndim >= 2 else jnp.asarray(rng.normal(1.0, 0.2, a.shape), a.dtype),
        m.params()))  # fmt: skip
    return m


def _plain(tree):  # layers.Transposed weights back to [in, out]
    return jax.tree_util.tree_map(
        layers.plain, tree, is_leaf=lambda x: isinstance(x, layers.Transposed)
    )


def _leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(_plain(a)), jax.tree_util.tree_leaves(_plain(b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_unstack_layers_slices_each_layer():
    p = model().params()
    u = layers.unstack_layers(p)
    assert isinstance(u["layers"], tuple) and len(u["layers"]) == CFG.num_layers
    assert layers.is_per_layer(u) and not layers.is_per_layer(p)
    assert layers.num_layers(u) == layers.num_layers(p) == CFG.num_layers
    assert layers.unstack_layers(u) is u
    for i, lp in enumerate(u["layers"]):
        assert set(lp) == set(p["layers"])
        for k, a in lp.items():  # projections [out, in] (layers.Transposed), the rest as is
            assert isinstance(a, layers.Transposed) == (k in layers.PROJECTIONS), k
            if k in layers.PROJECTIONS:
                assert a.w.shape == p["layers"][k].shape[:0:-1], k
            np.testing.assert_array_equal(
                np.asarray(layers.plain(a)), np.asarray(p["layers"][k][i])
            )
    assert u["embed"] is p["embed"]  # the rest is shared, not copied
    _leaves_equal(layers.stack_layers(u), p)
    assert layers.stack_layers(p) is p
    assert forward.layer_params(u, 1) is u["layers"][1]
    _leaves_equal(forward.layer_params(p, 1), u["layers"][1])


def _leaves_close(a, b):  # [out, in] weights sum the dot in another order: not bit-equal
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_forward_per_layer_equals_scan():
    p = model().params()
    u = layers.unstack_layers(p)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 20)), jnp.int32)
    valid = jnp.arange(20)[None, :] < jnp.asarray([[20], [13]])
    fwd = jax.jit(functools.partial(layers.forward, CFG, keep_kv=True),
                  static_argnames="stack_kv")  # fmt: skip
    x0, (k0, v0) = fwd(p, ids, valid=valid)
    x1, (k1, v1) = fwd(u, ids, valid=valid)
    _leaves_close((x0, k0, v0), (x1, k1, v1))
    x2, (k2, v2) = fwd(u, ids, valid=valid, stack_kv=False)
    assert isinstance(k2, tuple) and len(k2) == CFG.num_layers
    _leaves_equal((x1, k1, v1), (x2, jnp.stack(k2), jnp.stack(v2)))
    x3, kv3 = layers.forward(CFG, u, ids)  # eager, no K/V
    assert kv3 is None
    np.testing.assert_allclose(np.asarray(x3), np.asarray(layers.forward(CFG, p, ids)[0]),
                               rtol=1e-6, atol=1e-6)  # fmt: skip


def test_decode_params_folded_cached_and_cleared():
    m = models.CausalLM(CFG, rngs=nnx.Rngs(2))
    d = m.decode_params(KV)
    assert m.decode_params(KV) is d  # cached
    assert (KV.rotation, KV.rotation_seed) not in m._folded  # the stacked fold is not kept
    ref = layers.unstack_layers(m.folded_params(KV))
    _leaves_equal(d, ref)  # the same values as the stacked fold's slices
    plain = m.decode_params(None)
    _leaves_equal(plain, layers.unstack_layers(m.params()))
    assert not np.allclose(
        np.asarray(plain["layers"][0]["wv"].w), np.asarray(d["layers"][0]["wv"].w)
    )
    m.set_params(m.params())
    assert m.decode_params(KV) is not d  # set_params drops the cached forms


def test_generate_runs_on_decode_params():
    """prepare / generate / the step API use the per-layer form; the stacked ``params`` are
    built only on request and give the same step."""
    m = models.CausalLM(CFG, rngs=nnx.Rngs(3))
    ids = np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 12))
    out = np.asarray(models.generate(m, ids, 6, kv=KV, stop_tokens=()))
    assert all(isinstance(v, dict) and isinstance(v["layers"], tuple)
               for k, v in m._folded.items() if k[0] == "layers")  # fmt: skip
    assert (KV.rotation, KV.rotation_seed) not in m._folded
    logits, caches, p = models.prefill(m, ids, KV, max_new_tokens=6, stop_tokens=())
    assert p.decode_params is m.decode_params(KV)
    tok = jnp.asarray(out[:, 0])
    a = models.step_program()(p.st, p.decode_params, caches, tok, p.lengths)[0]
    b = models.step_program()(p.st, p.params, caches, tok, p.lengths)[0]  # stacked: slices
    _leaves_close(a, b)
    assert not isinstance(p.params["layers"], tuple)


def test_param_specs_per_layer_drop_the_layer_axis():
    stacked = msh.param_specs(CFG)
    per = msh.param_specs(CFG, per_layer=True)
    assert len(per["layers"]) == CFG.num_layers
    for lp in per["layers"]:
        for k, s in lp.items():
            want = stacked["layers"][k]
            if k in layers.PROJECTIONS:  # [out, in]: the spec reversed
                s = P(*s.w[::-1])
            assert (P(None, *s) if s else P()) == want, (k, s, want)
    assert {k: v for k, v in per.items() if k != "layers"} == {
        k: v for k, v in stacked.items() if k != "layers"
    }


def test_decode_params_on_a_mesh():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2, 1), ("data", "model", "sequence"))
    m = models.CausalLM(CFG, rngs=nnx.Rngs(4))
    d = m.decode_params(KV, mesh)
    assert m.decode_params(KV, mesh) is d
    _leaves_equal(d, layers.unstack_layers(m.folded_params(KV)))
    for lp in d["layers"]:
        assert lp["wq"].w.addressable_shards[0].data.shape == (4 * 16 // 2, 64)  # [out, in]
        assert lp["wo"].w.addressable_shards[0].data.shape == (64, 4 * 16 // 2)
        assert lp["bk"].addressable_shards[0].data.shape == (2 * 16 // 2,)
        assert lp["w_down"].w.sharding.spec == P(None, "model")
    placed = msh.shard_params(CFG, layers.unstack_layers(m.params()), mesh)
    assert placed["layers"][2]["w_up"].w.sharding.spec == P("model", None)


@pytest.mark.parametrize("name", ["llama31_8b", "qwen3_8b"])
def test_random_params_per_layer_keep_the_stacked_values(name):
    """Layer l's tensor = slice l of the stacked tensor hashed from its stacked indices."""
    cfg = ec.model_config(name, tiny=True).replace(num_layers=3)
    seed = 5
    got = ef.random_params(cfg, ec.param_shardings(cfg), seed)
    shapes = layers.param_shapes(cfg)
    flat, _ = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=layers.is_shape)
    half, checked = 0.02 * np.sqrt(3.0), 0
    for i, (path, shape) in enumerate(flat):
        keys = [str(getattr(k, "key", k)) for k in path]
        if "norm" in keys[-1] or keys[-1].startswith("b"):
            continue
        u = ef.hash_uniform(shape, 1000 * seed + i)  # the stacked tensor's values
        want = np.asarray((half * (2.0 * u - 1.0)).astype(jnp.bfloat16))
        if keys[0] == "layers":
            for layer in range(cfg.num_layers):
                np.testing.assert_array_equal(np.asarray(layers.plain(got["layers"][layer][keys[1]])),
                                              want[layer], err_msg=f"{keys} {layer}")  # fmt: skip
                checked += 1
        else:
            np.testing.assert_array_equal(np.asarray(got[keys[0]]), want, err_msg=str(keys))
            checked += 1
    assert checked >= 7 * cfg.num_layers + 2
    assert np.all(np.asarray(got["layers"][1]["attn_norm"]) == 1)
