"""Parity of the Flax ports with transformers' PyTorch models on tiny random checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="parity needs torch + transformers (the [hf] extra)")
pytest.importorskip("transformers")

from test_models_common import checkpoint, hf_greedy, hf_logits, ours, random_ids  # noqa: E402

import models  # noqa: E402
import oscar_jax as oj  # noqa: E402

LOGIT_TOL = 1e-4
FAMILIES = ["llama3", "llama32_tied", "qwen2", "qwen3"]


@pytest.mark.parametrize("name", FAMILIES + ["llama3_sharded", "qwen3_bf16"])
def test_logits_match_transformers(name):
    _, hf = checkpoint(name)
    m = ours(name)
    ids = random_ids(2, 37, seed=1)
    got = np.asarray(m.logits(ids))
    ref = hf_logits(hf, ids)
    assert got.shape == ref.shape == (2, 37, m.config.vocab_size)
    diff = float(np.max(np.abs(got - ref)))
    print(f"{name}: max |logit diff| = {diff:.2e} (max |logit| {np.abs(ref).max():.2f})")
    assert diff <= LOGIT_TOL


def test_family_switches_were_read():
    assert ours("llama3").config.rope_type == "llama3"
    assert ours("llama32_tied").config.tie_word_embeddings
    assert not hasattr(ours("llama32_tied"), "lm_head")
    assert ours("qwen2").config.qkv_bias and not ours("qwen2").config.o_bias
    q3 = ours("qwen3").config
    assert q3.qk_norm and q3.head_dim * q3.num_heads != q3.hidden_size
    import os

    assert (
        len([f for f in os.listdir(checkpoint("llama3_sharded")[0]) if f.endswith(".safetensors")])
        > 1
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_generate_matches_transformers_ragged(name):
    """bf16-preset cache: 32 greedy tokens equal transformers' on each row's own prompt."""
    _, hf = checkpoint(name)
    m = ours(name)
    lengths = np.array([11, 4, 16], np.int32)
    ids = random_ids(3, 16, seed=2)
    for i, n in enumerate(lengths):
        ids[i, n:] = 0  # right padding
    got = np.asarray(models.generate(m, ids, 32, kv=oj.preset("bf16"), lengths=lengths,
                                     stop_tokens=()))  # fmt: skip
    assert got.shape == (3, 32) and got.dtype == np.int32
    for i, n in enumerate(lengths):
        ref = hf_greedy(hf, ids[i, :n], 32)
        agree = float(np.mean(got[i] == ref))
        print(f"{name} row {i} (prompt {n}): token agreement {agree:.3f}")
        np.testing.assert_array_equal(got[i], ref)
