"""A tiny random Llama as a Hugging Face directory, for the evaluation and CLI tests.

config.json + model.safetensors (numpy-written, HF tensor names) + tokenizer.json
(a byte-level BPE trained with ``tokenizers`` on the passkey filler text, with
<bos> = 0 and <eos> = 1) + heldout_sample.npy (uint16 ids, documents starting
with BOS), the layout of the bundled ``oscar_proxy/bundled/``. No torch needed.
"""

from __future__ import annotations

import json
import os

import numpy as np


def _corpus(rng: np.random.Generator, n_docs: int) -> list[str]:
    from oscar_eval.passkey import FILLER, PREAMBLE, QUESTION

    docs = []
    for i in range(n_docs):
        s = [FILLER[j] for j in rng.integers(0, len(FILLER), 40)]
        docs.append(" ".join([PREAMBLE if i % 2 else "", *s, QUESTION, str(10000 + i)]).strip())
    return docs


def make_tiny_hf_dir(path, *, seed: int = 0, scale: float = 4.0, head_dim: int = 32) -> str:
    """Write the tiny checkpoint to ``path`` and return it (as str)."""
    import tokenizers
    from safetensors.numpy import save_file

    import models
    from models import layers
    from models.loading import expected_hf_names

    path = str(path)
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    docs = _corpus(rng, 60)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<bos>", "<eos>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(docs, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    mc = models.load_config(path)
    shapes = layers.param_shapes(mc)
    tensors = {}
    for hf, (key, i, tr) in sorted(expected_hf_names(mc).items()):
        shape = shapes[key] if i is None else shapes["layers"][key][1:]
        shape = tuple(shape[::-1]) if tr else tuple(shape)
        if "norm" in key:
            tensors[hf] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            w = rng.standard_normal(shape) * scale / np.sqrt(shape[-1] if tr else shape[0])
            tensors[hf] = w.astype(np.float32)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    ids: list[int] = []
    for d in _corpus(np.random.default_rng(seed + 1), 80):
        ids += [0, *tok.encode(d).ids]
    np.save(os.path.join(path, "heldout_sample.npy"), np.asarray(ids, np.uint16))
    return path
