"""Loading and input errors of models/, and full-size shapes via eval_shape."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

import models
import oscar_jax as oj


def _write_config(d, **kw):
    base = dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    base.update(kw)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(base, f)


def test_missing_dir_config_and_weights(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        models.from_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match="no config.json"):
        models.from_pretrained(tmp_path)
    _write_config(tmp_path)
    with pytest.raises(ValueError, match="no weights"):
        models.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(model_type="mistral"), "model_type='mistral'"),
        (dict(model_type="mixtral"), "model_type='mixtral'"),
        (dict(architectures=["LlamaForSequenceClassification"]), "LlamaForSequenceClassification"),
        (
            dict(
                model_type="qwen2",
                architectures=["Qwen2ForCausalLM"],
                use_sliding_window=True,
                sliding_window=4096,
            ),
            "use_sliding_window",
        ),  # fmt: skip
        (
            dict(
                model_type="qwen3",
                architectures=["Qwen3ForCausalLM"],
                layer_types=["sliding_attention"],
            ),
            "layer_types",
        ),  # fmt: skip
        (dict(num_local_experts=8), "num_local_experts"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn'"),
        (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), "lacks"),
    ],
)
def test_unsupported_config(tmp_path, kw, match):
    _write_config(tmp_path, **kw)
    with pytest.raises(ValueError, match=match):
        models.from_pretrained(tmp_path)


def test_config_variants_read():
    cfg = models.from_hf_config(dict(
        model_type="llama", vocab_size=10, hidden_size=32, intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=2, rope_theta=5e5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        eos_token_id=[1, 2],
    ))  # fmt: skip
    assert cfg.rope_theta == 5e5 and cfg.rope_type == "llama3" and cfg.eos_token_ids == (1, 2)
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 16
    inv = models.rope_inv_freq(cfg)
    base = 1.0 / (5e5 ** (np.arange(0, 16, 2) / 16))
    assert inv[0] == pytest.approx(base[0]) and inv[-1] == pytest.approx(base[-1] / 8, rel=1e-5)


def _tensor_checkpoint_or_skip():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_models_common import checkpoint

    return checkpoint("qwen2")[0]


@pytest.mark.parametrize("change", ["missing", "unexpected", "shape"])
def test_missing_unexpected_and_misshaped_tensors(tmp_path, change):
    from safetensors.numpy import load_file, save_file

    src = _tensor_checkpoint_or_skip()
    shutil.copy(os.path.join(src, "config.json"), tmp_path)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    if change == "missing":
        del tensors["model.layers.1.self_attn.k_proj.bias"]
        match = r"missing tensors \['model.layers.1.self_attn.k_proj.bias'\]"
    elif change == "unexpected":
        tensors["model.layers.0.mlp.extra.weight"] = np.zeros((2, 2), np.float32)
        match = r"unexpected tensors \['model.layers.0.mlp.extra.weight'\]"
    else:
        tensors["model.norm.weight"] = np.zeros((3,), np.float32)
        match = "model.norm.weight"
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        models.from_pretrained(tmp_path)


def _tiny_model():
    cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                             num_heads=2, num_kv_heads=1, head_dim=16)  # fmt: skip
    return models.CausalLM(cfg)


def test_ids_out_of_range_and_prompt_too_long():
    m = _tiny_model()
    with pytest.raises(ValueError, match="vocab_size=64"):
        m.logits(np.array([[1, 64]], np.int32))
    with pytest.raises(ValueError, match="vocab_size=64"):
        models.generate(m, np.array([[-1, 3]], np.int32), 4)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        m.logits(np.array([1, 2], np.int32))
    ids = np.ones((2, 12), np.int32)
    with pytest.raises(ValueError, match="longer than the cache"):
        models.generate(m, ids, 4, kv=oj.preset("bf16"), max_len=8)
    with pytest.raises(ValueError, match="lengths"):
        models.generate(m, ids, 4, lengths=np.array([0, 12]))
    with pytest.raises(ValueError, match="max_new_tokens"):
        models.generate(m, ids, 0)


def test_full_size_shapes_and_memory_without_allocation():
    llama, qwen = models.llama31_8b(), models.qwen3_8b()
    am = models.abstract_model(llama)
    from flax import nnx

    leaves = jax.tree_util.tree_leaves(nnx.state(am, nnx.Param))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    n = sum(int(np.prod(x.shape)) for x in leaves)
    assert n == llama.num_params() and 8.0e9 < n < 8.1e9  # Llama-3.1-8B: 8.03B
    assert 8.1e9 < qwen.num_params() < 8.3e9  # Qwen3-8B: 8.19B
    caches = models.abstract_caches(qwen, oj.preset("oscar", bits=2), batch=1, max_len=131072)
    assert caches.k_codes.shape[:2] == (36, 1)
    rows = models.memory_table({"Llama-3.1-8B": llama, "Qwen3-8B": qwen})
    gib = 1024**3
    by = {(r[0], r[1]): r for r in rows}
    # BF16: 2 (K, V) * layers * 8 KV heads * 128 * 2 bytes per token (+ int32 lengths, flags)
    assert by["Llama-3.1-8B", 32768][2] == 2 * 32 * 8 * 128 * 2 * 32768 + 32 * 8 == 4 * gib + 256
    assert by["Qwen3-8B", 131072][2] == 18 * gib + 36 * 8
    for r in rows:
        assert 5.0 < r[4] < 5.25  # ~100 B / token / head (norms f32) + the residual ring


def test_tokenizer_is_loaded_when_present(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    src = _tensor_checkpoint_or_skip()
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), tmp_path)
    assert models.from_pretrained(tmp_path).tokenizer is None
    vocab = {f"w{i}": i for i in range(256)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    m = models.from_pretrained(tmp_path)
    ids = m.tokenizer.encode("w3 w200 w7").ids
    assert ids == [3, 200, 7]
    assert m.logits(np.array([ids], np.int32)).shape == (1, 3, 256)


# -- damaged checkpoints: errors name the file and the tensor (no torch needed) ---------
def _numpy_checkpoint(d, sharded=False, **cfg_kw):
    """A tiny Llama checkpoint written with numpy: config.json + (sharded) safetensors."""
    from safetensors.numpy import save_file

    from models import layers
    from models.loading import expected_hf_names

    _write_config(d, **cfg_kw)
    cfg = models.load_config(str(d))
    shapes = layers.param_shapes(cfg)
    tensors = {}
    for hf, (key, i, tr) in expected_hf_names(cfg).items():
        shape = shapes[key] if i is None else shapes["layers"][key][1:]
        shape = tuple(shape[::-1]) if tr else tuple(shape)
        tensors[hf] = np.full(shape, 0.01, np.float32)
    if not sharded:
        save_file(tensors, os.path.join(d, "model.safetensors"))
        return tensors
    names = sorted(tensors)
    half = len(names) // 2
    wmap = {}
    for fn, part in (("model-00001-of-00002.safetensors", names[:half]),
                     ("model-00002-of-00002.safetensors", names[half:])):  # fmt: skip
        save_file({n: tensors[n] for n in part}, os.path.join(d, fn))
        wmap.update({n: fn for n in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": wmap}, f)
    return tensors


def test_numpy_checkpoint_loads(tmp_path):
    _numpy_checkpoint(tmp_path, sharded=True)
    m = models.from_pretrained(tmp_path)
    assert m.logits(np.array([[1, 2]], np.int32)).shape == (1, 2, 64)


@pytest.mark.parametrize("cut", [1, 100, 10_000])
def test_truncated_shard_names_file_and_tensor(tmp_path, cut):
    _numpy_checkpoint(tmp_path, sharded=True)
    shard = os.path.join(tmp_path, "model-00002-of-00002.safetensors")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(max(0, size - cut))
    with pytest.raises(ValueError, match="truncated") as e:
        models.from_pretrained(tmp_path)
    assert shard in str(e.value)
    if size - cut > 8 + 100:  # header intact: the first tensor that does not fit is named
        assert "tensor 'model." in str(e.value)


def test_missing_shard_file(tmp_path):
    _numpy_checkpoint(tmp_path, sharded=True)
    os.remove(os.path.join(tmp_path, "model-00001-of-00002.safetensors"))
    with pytest.raises(ValueError, match="model-00001-of-00002.safetensors"):
        models.from_pretrained(tmp_path)


def test_wrong_dtype_names_file_and_tensor(tmp_path):
    from safetensors.numpy import save_file

    tensors = _numpy_checkpoint(tmp_path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    path = os.path.join(tmp_path, "model.safetensors")
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"'model.norm.weight'.*unsupported dtype I32") as e:
        models.from_pretrained(tmp_path)
    assert path in str(e.value)


def test_wrong_shape_names_file_and_tensor(tmp_path):
    from safetensors.numpy import save_file

    tensors = _numpy_checkpoint(tmp_path)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
    path = os.path.join(tmp_path, "model.safetensors")
    save_file(tensors, path)
    with pytest.raises(
        ValueError, match=r"'model.layers.0.self_attn.k_proj.weight'.*\(8, 32\)"
    ) as e:
        models.from_pretrained(tmp_path)
    assert path in str(e.value) and "config.json" in str(e.value)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(hidden_size=64), r"'model.embed_tokens.weight'.*hidden_size=64"),
        (dict(num_key_value_heads=2), r"k_proj.weight'.*num_kv_heads=2"),
        (dict(vocab_size=80), r"'model.embed_tokens.weight'.*vocab_size=80"),
        (dict(num_hidden_layers=2), r"missing tensors \['model.layers.1."),
    ],
)
def test_config_disagrees_with_weights(tmp_path, kw, match):
    _numpy_checkpoint(tmp_path)
    _write_config(tmp_path, **kw)  # the config changes, the weights stay
    with pytest.raises(ValueError, match=match):
        models.from_pretrained(tmp_path)


def test_corrupted_header(tmp_path):
    _numpy_checkpoint(tmp_path)
    path = os.path.join(tmp_path, "model.safetensors")
    blob = bytearray(open(path, "rb").read())
    blob[8] = ord("x")  # the header's opening brace
    open(path, "wb").write(bytes(blob))
    with pytest.raises(ValueError, match="corrupted safetensors header") as e:
        models.from_pretrained(tmp_path)
    assert path in str(e.value)


def test_rotated_int2_keys_on_a_model_with_k_biases_warn():
    """Qwen2-style k biases break the key rotation at INT2 (ACCURACY.md): prepare says so,
    once per call, and stays silent for the presets that do not rotate keys."""
    import warnings

    from flax import nnx

    cfg = models.ModelConfig(family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                             num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                             qkv_bias=True)  # fmt: skip
    m = models.CausalLM(cfg, rngs=nnx.Rngs(0))
    ids = np.ones((1, 4), np.int32)
    with pytest.warns(models.KeyBiasWarning, match="ots_only"):
        models.prepare(m, ids, max_new_tokens=2, kv=oj.preset("oscar", bits=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", models.KeyBiasWarning)
        for kv in (oj.preset("ots_only", bits=2), oj.preset("kivi", bits=2),
                   oj.preset("oscar", bits=4), oj.preset("bf16")):  # fmt: skip
            models.prepare(m, ids, max_new_tokens=2, kv=kv)
        plain = models.CausalLM(cfg.replace(qkv_bias=False), rngs=nnx.Rngs(0))
        models.prepare(plain, ids, max_new_tokens=2, kv=oj.preset("oscar", bits=2))
