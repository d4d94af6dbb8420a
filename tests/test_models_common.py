"""Shared tiny Hugging Face checkpoints for the models/ tests (built once per process).

Each checkpoint is a seeded random transformers model saved with
``save_pretrained`` (safetensors) to a temporary directory. Biases and norm
weights are re-drawn away from their zero / one initialisation so that the
parity tests see them, and the initializer range is large enough that greedy
decoding has clear winners.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

import numpy as np

VOCAB = 256


def _llama3_rope():
    return {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
    }  # fmt: skip


COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    initializer_range=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip

# name -> (transformers config class name, extra config kwargs, save kwargs)
SPECS = {
    "llama3": ("LlamaConfig", dict(rope_scaling=_llama3_rope(), rope_theta=500000.0), {}),
    "llama32_tied": (
        "LlamaConfig",
        dict(tie_word_embeddings=True, rope_scaling=_llama3_rope()),
        {},
    ),  # fmt: skip
    "qwen2": ("Qwen2Config", dict(use_sliding_window=False, rope_theta=1000000.0), {}),
    "qwen3": ("Qwen3Config", dict(head_dim=32, num_attention_heads=4, hidden_size=48), {}),
    "llama3_sharded": (
        "LlamaConfig",
        dict(rope_scaling=_llama3_rope()),
        dict(max_shard_size="40KB"),
    ),  # fmt: skip
    "qwen3_bf16": ("Qwen3Config", dict(head_dim=32), dict(bf16=True)),
    # milder weights (logits of order 1-2, like a trained model's) for cache-quantization error
    "llama3_q": ("LlamaConfig", dict(rope_scaling=_llama3_rope(), initializer_range=0.05), {}),
    "qwen3_q": ("Qwen3Config", dict(head_dim=32, initializer_range=0.05), {}),
}
FAMILY_OF = {"LlamaConfig": "LlamaForCausalLM", "Qwen2Config": "Qwen2ForCausalLM",
             "Qwen3Config": "Qwen3ForCausalLM"}  # fmt: skip


def _tmpdir() -> str:
    d = tempfile.mkdtemp(prefix="oscar_models_")
    atexit.register(shutil.rmtree, d, True)
    return d


@functools.cache
def checkpoint(name: str):
    """-> (path, torch float32 model with the same weights as saved on disk)."""
    import torch
    import transformers

    cls_name, extra, save = SPECS[name]
    kw = {**COMMON, **extra}
    cfg = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(sum(map(ord, name)))
    model = getattr(transformers, FAMILY_OF[cls_name])(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0.0, 0.3)
            elif "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    path = _tmpdir()
    save = dict(save)
    if save.pop("bf16", False):
        model.to(torch.bfloat16).save_pretrained(path, **save)
        # reload in float32 (casting back in place would leave RoPE buffers rounded to bf16)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
    else:
        model.save_pretrained(path, **save)
    return path, model


@functools.cache
def ours(name: str):
    import models

    return models.from_pretrained(checkpoint(name)[0])


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


def hf_greedy(model, prompt: np.ndarray, n: int) -> np.ndarray:
    """transformers greedy generate of one 1-D prompt -> its n new tokens."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor(prompt[None], dtype=torch.long), max_new_tokens=n, do_sample=False,
            attention_mask=torch.ones((1, len(prompt)), dtype=torch.long), pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].numpy()


def random_ids(b: int, t: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (b, t)).astype(np.int32)
