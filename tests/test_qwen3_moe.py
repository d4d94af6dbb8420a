"""Qwen3-MoE: parity with transformers' Qwen3MoeForCausalLM on tiny random checkpoints,
the two expert paths (ragged_dot / gathered weights), decoding over the OScaR cache and
on a mesh whose model axis splits every expert's hidden dimension."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import models
import oscar_jax as oj
from models import moe

LOGIT_TOL = 1e-4
VOCAB = 256


@functools.cache
def checkpoint(norm_topk_prob: bool):
    """(path, float32 transformers model): 8 experts, 2 per token, hub-format tensors."""
    torch = pytest.importorskip(
        "torch", reason="parity needs torch + transformers (the [hf] extra)"
    )
    transformers = pytest.importorskip("transformers")
    from test_models_common import _tmpdir

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        max_position_embeddings=512, initializer_range=0.15, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(11 + norm_topk_prob)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # a router with clear preferences
                p.normal_(0.0, 0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    path = _tmpdir()
    model.save_pretrained(path)
    return path, model


@functools.cache
def ours(norm_topk_prob: bool = True):
    return models.from_pretrained(checkpoint(norm_topk_prob)[0])


def _random_ids(b, t, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, (b, t)).astype(np.int32)


def test_config_is_read():
    c = ours().config
    assert c.family == "qwen3_moe" and c.is_moe and c.qk_norm
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 32)
    assert c.norm_topk_prob and not ours(False).config.norm_topk_prob
    assert ours().params()["layers"]["we_gate"].shape == (2, 8, 64, 32)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_match_transformers(norm_topk_prob):
    from test_models_common import hf_logits

    _, hf = checkpoint(norm_topk_prob)
    ids = _random_ids(2, 37, seed=1)
    ref = hf_logits(hf, ids)
    got = np.asarray(ours(norm_topk_prob).logits(ids))
    diff = float(np.max(np.abs(got - ref)))
    print(f"qwen3_moe (norm_topk_prob={norm_topk_prob}): max |logit diff| = {diff:.2e}")
    assert got.shape == ref.shape and diff <= LOGIT_TOL


def test_expert_paths_agree():
    """ragged_dot over sorted pairs and gathered expert weights: the same MLP."""
    m = ours()
    lp = jax.tree.map(lambda a: a[0], m.params()["layers"])
    x = jax.random.normal(jax.random.key(0), (3, 5, 64), jnp.float32)
    a = moe.moe_mlp(m.config, lp, x, "ragged")
    b = moe.moe_mlp(m.config, lp, x, "gather")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="implementation"):
        moe.moe_mlp(m.config, lp, x, "nope")


def test_greedy_generate_matches_transformers_ragged():
    from test_models_common import hf_greedy

    _, hf = checkpoint(True)
    m = ours()
    lengths = np.array([11, 4, 16], np.int32)
    ids = _random_ids(3, 16, seed=2)
    for i, n in enumerate(lengths):
        ids[i, n:] = 0
    got = np.asarray(models.generate(m, ids, 32, kv=oj.preset("bf16"), lengths=lengths,
                                     stop_tokens=()))  # fmt: skip
    for i, n in enumerate(lengths):
        np.testing.assert_array_equal(got[i], hf_greedy(hf, ids[i, :n], 32))


def test_int2_generate_equals_stepwise():
    m = ours()
    ids = _random_ids(2, 12, seed=3)
    kv = oj.preset("oscar", bits=2, residual_length=32)
    got = np.asarray(models.generate(m, ids, 16, kv=kv, stop_tokens=()))
    ref = np.asarray(models.generate_stepwise(m, ids, 16, kv=kv, stop_tokens=()))
    np.testing.assert_array_equal(got, ref)


def test_sharded_experts_equal_unsharded():
    """model axis 2 (each expert's hidden dim split in two), data axis 2."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    m = ours()
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2, 1), ("data", "model", "sequence"))
    ids = _random_ids(2, 12, seed=4)
    kv = oj.preset("bf16")
    ref = np.asarray(models.generate(m, ids, 12, kv=kv, stop_tokens=()))
    got = np.asarray(models.generate(m, ids, 12, kv=kv, stop_tokens=(), mesh=mesh))
    np.testing.assert_array_equal(got, ref)
    sh = m.decode_params(kv, mesh)["layers"][0]["we_down"].sharding
    assert sh.spec == jax.sharding.PartitionSpec(None, "model", None)


def test_unsupported_moe_configs_are_named():
    base = {"model_type": "qwen3_moe", "vocab_size": 8, "hidden_size": 8, "head_dim": 8,
            "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 1,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4}  # fmt: skip
    with pytest.raises(ValueError, match="mlp_only_layers"):
        models.from_hf_config({**base, "mlp_only_layers": [0]})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        models.from_hf_config({**base, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="mixture of experts"):
        models.from_hf_config({**base, "model_type": "qwen3"})
