"""Write a ``ModelConfig`` + params dict as a Hugging Face Llama checkpoint directory.

The directory holds ``config.json`` (LlamaForCausalLM), bfloat16 weights in
safetensors shards (each below ``max_shard_bytes``) with
``model.safetensors.index.json``, and, when given, ``tokenizer.json`` with a
``tokenizer_config.json`` for ``PreTrainedTokenizerFast``. Both
``models.from_pretrained`` and ``transformers`` load it. The safetensors files
are written here directly (8-byte header length, JSON header, raw data).
"""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np

from models.config import ModelConfig
from models.loading import HF_LAYER_NAMES, HF_TOP_NAMES

_ST_NAME = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16",
            np.dtype(np.float16): "F16"}  # fmt: skip


def hf_config(cfg: ModelConfig, dtype: str = "bfloat16") -> dict:
    """config.json of a Llama checkpoint (transformers 4.x and 5.x keys)."""
    if cfg.family != "llama" or cfg.qkv_bias or cfg.o_bias or cfg.qk_norm:
        raise ValueError(f"cfg must be a plain Llama config, got {cfg}")
    if cfg.rope_type != "default":
        raise ValueError(f"cfg.rope_type={cfg.rope_type!r} must be 'default' for this export")
    eos = list(cfg.eos_token_ids)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "mlp_bias": False, "initializer_range": 0.02,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": cfg.pad_token_id, "use_cache": True, "dtype": dtype,
        "torch_dtype": dtype,
    }  # fmt: skip


def hf_tensors(cfg: ModelConfig, params: dict, dtype=ml_dtypes.bfloat16) -> dict[str, np.ndarray]:
    """HF tensor name -> numpy array ([out, in] layout) in ``dtype``, in a fixed order."""
    out = {}
    for key in ("embed", "norm", "lm_head"):
        if key in params:
            hf, tr = HF_TOP_NAMES[key]
            a = np.asarray(params[key], np.float32)
            out[hf] = np.ascontiguousarray(a.T if tr else a).astype(dtype)
    lay = params["layers"]
    for i in range(cfg.num_layers):
        for key in sorted(lay):
            suffix, tr = HF_LAYER_NAMES[key]
            a = np.asarray(lay[key][i], np.float32)
            out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(a.T if tr else a).astype(dtype)
    return out


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    header, off = {}, 0
    for name, a in tensors.items():
        header[name] = {"dtype": _ST_NAME[a.dtype], "shape": list(a.shape),
                        "data_offsets": [off, off + a.nbytes]}  # fmt: skip
        off += a.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for a in tensors.values():
            f.write(a.tobytes())


def save_hf(
    path: str, cfg: ModelConfig, params: dict, tokenizer_json: str | None = None,
    max_shard_bytes: int = 15 * 2**20, model_max_length: int | None = None,
) -> list[str]:  # fmt: skip
    """Write the checkpoint directory; returns the file names written."""
    if max_shard_bytes < 1:
        raise ValueError(f"{max_shard_bytes=} must be positive")
    os.makedirs(path, exist_ok=True)
    tensors = hf_tensors(cfg, params)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, a in tensors.items():
        if a.nbytes > max_shard_bytes:
            raise ValueError(f"tensor {name} has {a.nbytes} bytes > {max_shard_bytes=}")
        if size + a.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += a.nbytes
    n = len(shards)
    files = []
    wmap = {}
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        write_safetensors(os.path.join(path, fn), sh)
        files.append(fn)
        wmap.update({k: fn for k in sh})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": wmap}  # fmt: skip
    _dump(os.path.join(path, "model.safetensors.index.json"), index)
    _dump(os.path.join(path, "config.json"), hf_config(cfg))
    files += ["model.safetensors.index.json", "config.json"]
    if tokenizer_json:
        shutil.copyfile(tokenizer_json, os.path.join(path, "tokenizer.json"))
        tc = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "clean_up_tokenization_spaces": False,
              "model_max_length": model_max_length or cfg.max_position_embeddings}  # fmt: skip
        _dump(os.path.join(path, "tokenizer_config.json"), tc)
        files += ["tokenizer.json", "tokenizer_config.json"]
    return files


def _dump(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
