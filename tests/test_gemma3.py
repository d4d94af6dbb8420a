"""Gemma 3: parity with transformers' Gemma3ForCausalLM on tiny random checkpoints (HF
safetensors and a GGUF file written as llama.cpp's converter writes one), decoding over
the sliding-window rings and the OScaR cache, and the ring itself."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

import models
import oscar_jax as oj
from models import window as mwin

LOGIT_TOL = 1e-4
WINDOW = 8  # shorter than every prompt below but one: prompts and decoding cross the window
VOCAB = 256


def _hf_checkpoint(layer_types, qpas: int, seed: int):
    """(path, float32 transformers model) of a tiny random Gemma 3 saved with save_pretrained."""
    torch = pytest.importorskip(
        "torch", reason="parity needs torch + transformers (the [hf] extra)"
    )
    transformers = pytest.importorskip("transformers")
    from test_models_common import _tmpdir

    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=512, sliding_window=WINDOW,
        layer_types=list(layer_types), query_pre_attn_scalar=qpas, initializer_range=0.15,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # Gemma norms start at 0 (scale 1 + w): draw them away from it
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    path = _tmpdir()
    model.save_pretrained(path)
    return path, model


@functools.cache
def checkpoint():
    # local, global, local, global; query_pre_attn_scalar != head_dim (32)
    types = ["sliding_attention", "full_attention"] * 2
    return _hf_checkpoint(types, qpas=24, seed=3)


@functools.cache
def ours():
    return models.from_pretrained(checkpoint()[0])


def _random_ids(b, t, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, (b, t)).astype(np.int32)


def test_config_is_read():
    c = ours().config
    assert c.family == "gemma3" and c.local_layers == (0, 2) and c.global_layers == (1, 3)
    assert (c.sliding_window, c.rope_theta, c.rope_local_theta) == (WINDOW, 1e6, 1e4)
    assert c.norm_offset == 1.0 and c.sandwich_norm and c.embed_scale and c.qk_norm
    assert c.hidden_act == "gelu_tanh" and c.tie_word_embeddings
    assert c.query_pre_attn_scalar == 24.0 and c.query_scale == pytest.approx(np.sqrt(32 / 24))


def test_logits_match_transformers():
    """float32, prompts of 37 tokens (over four windows), stacked and per-layer params."""
    from test_models_common import hf_logits

    _, hf = checkpoint()
    m = ours()
    ids = _random_ids(2, 37, seed=1)
    ref = hf_logits(hf, ids)
    got = np.asarray(m.logits(ids))
    diff = float(np.max(np.abs(got - ref)))
    print(f"gemma3: max |logit diff| = {diff:.2e} (max |logit| {np.abs(ref).max():.2f})")
    assert got.shape == ref.shape and diff <= LOGIT_TOL
    from models import layers

    per = layers.forward(m.config, m.decode_params(None), ids)[0]  # the per-layer loop
    got2 = np.asarray(layers.lm_head(m.config, m.decode_params(None), per))
    assert float(np.max(np.abs(got2 - ref))) <= LOGIT_TOL


def test_greedy_generate_matches_transformers_ragged():
    """bf16-preset cache, ragged prompts (one within the window, two past it), 32 tokens:
    the rings wrap several times."""
    from test_models_common import hf_greedy

    _, hf = checkpoint()
    m = ours()
    lengths = np.array([11, 4, 16], np.int32)
    ids = _random_ids(3, 16, seed=2)
    for i, n in enumerate(lengths):
        ids[i, n:] = 0
    got = np.asarray(models.generate(m, ids, 32, kv=oj.preset("bf16"), lengths=lengths,
                                     stop_tokens=()))  # fmt: skip
    assert got.shape == (3, 32)
    for i, n in enumerate(lengths):
        np.testing.assert_array_equal(got[i], hf_greedy(hf, ids[i, :n], 32))


def test_int2_generate_equals_stepwise_and_rows_are_independent():
    """OScaR INT2 on the global layers: the scan equals the Python-loop reference, and a
    row of a ragged batch decodes as it does alone."""
    m = ours()
    lengths = np.array([13, 5], np.int32)
    ids = _random_ids(2, 13, seed=4)
    ids[1, 5:] = 0
    kv = oj.preset("oscar", bits=2, residual_length=32)
    got = np.asarray(models.generate(m, ids, 24, kv=kv, lengths=lengths, stop_tokens=()))
    ref = np.asarray(models.generate_stepwise(m, ids, 24, kv=kv, lengths=lengths,
                                              stop_tokens=()))  # fmt: skip
    np.testing.assert_array_equal(got, ref)
    alone = np.asarray(models.generate(m, ids[1:, :5], 24, kv=kv, stop_tokens=()))
    np.testing.assert_array_equal(got[1], alone[0])


def test_caches_are_rings_on_local_layers():
    m = ours()
    logits, caches, p = models.prefill(m, _random_ids(1, 12, 5), oj.preset("oscar", bits=2),
                                       max_new_tokens=4)  # fmt: skip
    assert isinstance(caches[0], mwin.WindowCache) and isinstance(caches[1], oj.KVCache)
    assert caches[0].k.shape == (1, 2, WINDOW, 32)


def test_ring_prefill_then_append_equals_appends():
    import jax

    rng = np.random.default_rng(0)
    b, t, h, d, size = 3, 21, 2, 8, 8
    k = rng.standard_normal((b, t, h, d)).astype(np.float32)
    v = rng.standard_normal((b, t, h, d)).astype(np.float32)
    lengths = np.array([21, 3, 9], np.int32)
    step = jax.jit(mwin.append)
    one = mwin.prefill(mwin.init(b, h, d, size, np.float32), k, v, lengths - 2)
    for j in (2, 1):
        idx = lengths - j
        one = step(one, k[np.arange(b), idx], v[np.arange(b), idx])
    full = mwin.prefill(mwin.init(b, h, d, size, np.float32), k, v, lengths)
    for a, c in zip(jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(full), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    # slot s holds the newest token t < n with t = s mod S
    np.testing.assert_array_equal(np.asarray(full.k)[0, :, 20 % size], k[0, 20])
    assert not np.asarray(full.k)[1, :, 3:].any()


def test_unsupported_configs_are_named():
    base = {"model_type": "gemma3_text", "vocab_size": 8, "hidden_size": 8, "head_dim": 8,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
            "sliding_window": 4}  # fmt: skip
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        models.from_hf_config({**base, "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="sliding_window"):
        models.ModelConfig(family="gemma3", local_layers=(0,), num_layers=1)
    c = models.from_hf_config({**base, "final_logit_softcapping": 30.0})
    assert c.final_logit_softcapping == 30.0 and c.local_layers == (0,)  # pattern 6: local


# -- GGUF ------------------------------------------------------------------------------
def _write_gguf(path, hf) -> str:
    """The HF model's weights as llama.cpp's converter writes a gemma3 file (F32; every
    norm weight stored as 1 + w; no tokenizer)."""
    gguf = pytest.importorskip("gguf")
    c = hf.config
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm",
             "post_feedforward_layernorm": "post_ffw_norm"}  # fmt: skip
    wr = gguf.GGUFWriter(str(path), "gemma3")
    wr.add_block_count(c.num_hidden_layers)
    wr.add_context_length(512)
    wr.add_embedding_length(c.hidden_size)
    wr.add_feed_forward_length(c.intermediate_size)
    wr.add_head_count(c.num_attention_heads)
    wr.add_head_count_kv(c.num_key_value_heads)
    wr.add_key_length(c.head_dim)
    wr.add_value_length(c.head_dim)
    wr.add_rope_freq_base(1e6)
    wr.add_layer_norm_rms_eps(c.rms_norm_eps)
    wr.add_sliding_window(c.sliding_window)
    out = {"token_embd.weight": sd["model.embed_tokens.weight"],
           "output_norm.weight": sd["model.norm.weight"] + 1}  # fmt: skip
    for i in range(c.num_hidden_layers):
        for hfn, gn in names.items():
            w = sd[f"model.layers.{i}.{hfn}.weight"]
            out[f"blk.{i}.{gn}.weight"] = w + 1 if "norm" in gn else w
    for name, w in out.items():
        wr.add_tensor(name, np.ascontiguousarray(w, np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return str(path)


def test_gguf_logits_match_transformers():
    """A 6-layer file (llama.cpp's pattern: layers 0-4 local, 5 global; its softmax scale
    1/sqrt(head_dim)) against the same weights in transformers."""
    from test_models_common import hf_logits

    path, hf = _hf_checkpoint(["sliding_attention"] * 5 + ["full_attention"], 32, seed=7)
    g = models.from_pretrained(_write_gguf(os.path.join(path, "tiny.gguf"), hf))
    assert g.config.local_layers == (0, 1, 2, 3, 4) and g.config.sliding_window == WINDOW
    ids = _random_ids(2, 29, seed=8)
    ref = hf_logits(hf, ids)
    diff = float(np.max(np.abs(np.asarray(g.logits(ids)) - ref)))
    print(f"gemma3 gguf: max |logit diff| = {diff:.2e}")
    assert diff <= LOGIT_TOL
    ref_hf = models.from_pretrained(path)
    kn = [np.asarray(x.params()["layers"]["k_norm"]) for x in (g, ref_hf)]
    np.testing.assert_allclose(kn[0], kn[1], atol=1e-6)  # the file's 1 + w, back to w


@pytest.mark.parametrize("method", ["bf16", "oscar"])
def test_sharded_generation_equals_unsharded(method):
    """A (data 2, model 2, sequence 2) mesh: rings split by rows and KV heads, the global
    layers' caches as the other families'."""
    import jax
    from jax.sharding import Mesh

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    m = ours()
    ids = _random_ids(2, 13, seed=4)
    kv = oj.preset("bf16") if method == "bf16" else oj.preset("oscar", bits=2, residual_length=32)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "model", "sequence"))
    ref = np.asarray(models.generate(m, ids, 12, kv=kv, stop_tokens=(), max_len=64))
    got = np.asarray(models.generate(m, ids, 12, kv=kv, stop_tokens=(), mesh=mesh, max_len=64))
    np.testing.assert_array_equal(got, ref)
