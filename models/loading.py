"""``from_pretrained``: a Hugging Face checkpoint directory or a GGUF file -> ``CausalLM``.

A ``.gguf`` file (or any file starting with GGUF's magic) is read by ``models.gguf``:
config and tokenizer from its metadata, tensors dequantized into the model dtype.

Reads ``config.json`` and ``model.safetensors`` or sharded safetensors with
``model.safetensors.index.json``. The safetensors files are memory-mapped and
parsed here (8-byte header length, JSON header, raw little-endian data), so
BF16/F16/F32 on disk are cast to the target dtype one tensor at a time, each
layer's slice written into a preallocated stacked host array that is moved to
the device before the next parameter kind is read: the host never holds two
full copies of the weights.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import tokenizers
from flax import nnx

from models import gguf, layers
from models.config import ModelConfig, from_hf_config
from models.model import CausalLM

_ST_DTYPES = {
    "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
}  # fmt: skip

# our layer param name -> (HF suffix under model.layers.{i}., transpose)
HF_LAYER_NAMES = {
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "bo": ("self_attn.o_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
    "attn_norm": ("input_layernorm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
}
# Gemma 3's four norms per layer (its post_attention_layernorm is the norm *after* attention)
HF_GEMMA3_NAMES = {
    **HF_LAYER_NAMES,
    "post_attn_norm": ("post_attention_layernorm.weight", False),
    "mlp_norm": ("pre_feedforward_layernorm.weight", False),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", False),
}
# Qwen3-MoE: the router, and each expert's projections (the hub's per-expert tensors)
HF_MOE_NAMES = {**HF_LAYER_NAMES, "router": ("mlp.gate.weight", True)}
HF_EXPERT_NAMES = {
    "we_gate": ("gate_proj.weight", True), "we_up": ("up_proj.weight", True),
    "we_down": ("down_proj.weight", True),
}  # fmt: skip
HF_TOP_NAMES = {"embed": ("model.embed_tokens.weight", False), "norm": ("model.norm.weight", False),
              "lm_head": ("lm_head.weight", True)}  # fmt: skip
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class SafetensorsFile:
    """Lazy, memory-mapped view of one .safetensors file: ``names``, ``shape(n)``, ``get(n)``."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or 8 + n > size:
                raise ValueError(
                    f"{path}: truncated safetensors file ({size} bytes; header length "
                    f"{n if n >= 0 else 'missing'})"
                )
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise ValueError(f"{path}: corrupted safetensors header ({e})") from e
        header.pop("__metadata__", None)
        self.header = header
        self.offset = 8 + n
        self._mm = None
        data = size - self.offset
        for name, info in header.items():
            try:
                a, b = (int(x) for x in info["data_offsets"])
                shape = tuple(int(x) for x in info["shape"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}: tensor {name!r} has a bad header entry") from e
            if b > data:
                raise ValueError(
                    f"{path}: truncated: tensor {name!r} needs bytes {a}..{b} of the data "
                    f"section, the file has {data}"
                )
            dt = _ST_DTYPES.get(info.get("dtype"))
            if dt is not None and b - a != np.dtype(dt).itemsize * int(np.prod(shape)):
                raise ValueError(
                    f"{path}: tensor {name!r} has {b - a} bytes, {info['dtype']} {list(shape)} "
                    "needs " + str(np.dtype(dt).itemsize * int(np.prod(shape)))
                )

    @property
    def names(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        """A read-only memory-mapped numpy view of the tensor (no copy)."""
        info = self.header[name]
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(
                f"tensor {name!r} in {self.path} has unsupported dtype {info['dtype']} "
                f"(expected one of {sorted(_ST_DTYPES)})"
            )
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        a, b = info["data_offsets"]
        raw = self._mm[self.offset + a : self.offset + b]
        return raw.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def _open_weights(path: str) -> dict[str, SafetensorsFile]:
    """Tensor name -> the file holding it."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            wmap = json.load(f)["weight_map"]
        absent = sorted(
            fn for fn in set(wmap.values()) if not os.path.isfile(os.path.join(path, fn))
        )
        if absent:
            raise ValueError(f"{index} lists shard files that do not exist: {absent}")
        files = {fn: SafetensorsFile(os.path.join(path, fn)) for fn in sorted(set(wmap.values()))}
        out = {}
        for sf in files.values():
            for n in sf.names:
                out[n] = sf
        missing = sorted(n for n, fn in wmap.items() if n not in files[fn].header)
        if missing:
            raise ValueError(f"index lists tensors absent from their shard: {missing[:8]}")
        return out
    if os.path.isfile(single):
        sf = SafetensorsFile(single)
        return {n: sf for n in sf.names}
    found = sorted(os.listdir(path))
    raise ValueError(
        f"no weights in {path!r}: expected model.safetensors or model.safetensors.index.json "
        f"(found {found[:20]})"
    )


def load_config(path: str) -> ModelConfig:
    """The ModelConfig of a checkpoint directory's config.json or of a GGUF file's metadata."""
    if gguf.is_gguf(path):
        return gguf.load_config(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a directory")
    cpath = os.path.join(path, "config.json")
    if not os.path.isfile(cpath):
        raise ValueError(f"no config.json in {path!r}")
    with open(cpath) as f:
        return from_hf_config(json.load(f))


def expected_hf_names(cfg: ModelConfig) -> dict[str, tuple[str, int | tuple | None, bool]]:
    """HF name -> (our param key, layer index, (layer, expert) or None, transpose)."""
    shapes = layers.param_shapes(cfg)
    names = {"gemma3": HF_GEMMA3_NAMES, "qwen3_moe": HF_MOE_NAMES}.get(cfg.family, HF_LAYER_NAMES)
    out = {}
    for key in shapes:
        if key != "layers":
            hf, tr = HF_TOP_NAMES[key]
            out[hf] = (key, None, tr)
    for key in shapes["layers"]:
        for i in range(cfg.num_layers):
            if key in HF_EXPERT_NAMES:
                suffix, tr = HF_EXPERT_NAMES[key]
                for j in range(cfg.num_experts):
                    out[f"model.layers.{i}.mlp.experts.{j}.{suffix}"] = (key, (i, j), tr)
            else:
                suffix, tr = names[key]
                out[f"model.layers.{i}.{suffix}"] = (key, i, tr)
    return out


def from_pretrained(path: str, dtype=jnp.float32) -> CausalLM:
    """Load a Llama / Qwen2 / Qwen3 / Gemma 3 (text) / Qwen3-MoE checkpoint directory into a
    ``CausalLM`` of ``dtype`` (Qwen3-MoE: the hub's per-expert tensors).

    ``path`` may also be a GGUF file (llama, qwen2, qwen3, gemma3; ``models.gguf``),
    whose tokenizer metadata gives ``model.tokenizer``.

    Raises ValueError for a missing directory / config / weights, unsupported config
    attributes, and missing or unexpected tensors (all named) or wrong shapes; for a GGUF
    file also for an unsupported architecture or tensor type, a truncated file or a bad
    header (naming the file and the field or tensor).
    """
    path = os.fspath(path)
    if gguf.is_gguf(path):
        return gguf.load(path, dtype)
    cfg = load_config(path)
    tensors = _open_weights(path)
    want = expected_hf_names(cfg)
    have = set(tensors)
    missing = sorted(set(want) - have)
    unexpected = sorted(
        n for n in have - set(want)
        if not _IGNORED.match(n) and not (cfg.tie_word_embeddings and n == "lm_head.weight")
    )  # fmt: skip
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path!r} does not match its {cfg.family} config: "
            f"missing tensors {missing[:12]}{' ...' if len(missing) > 12 else ''}, "
            f"unexpected tensors {unexpected[:12]}{' ...' if len(unexpected) > 12 else ''}"
        )
    shapes = layers.param_shapes(cfg)
    model = nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    np_dtype = jnp.dtype(dtype)
    by_key: dict[str, list[str]] = {}
    for hf, (key, _, _) in want.items():
        by_key.setdefault(key, []).append(hf)
    for key, names in by_key.items():
        top = key in shapes and key != "layers"
        shape = shapes[key] if top else shapes["layers"][key]
        host = np.empty(shape, np_dtype)
        for hf in names:
            _, i, tr = want[hf]
            src = tensors[hf].get(hf)
            src = src.T if tr else src
            dst_shape = shape if i is None else shape[1 if isinstance(i, int) else len(i) :]
            if src.shape != tuple(dst_shape):
                raise ValueError(
                    f"tensor {hf!r} in {tensors[hf].path} has shape {tensors[hf].shape(hf)}, "
                    f"expected {tuple(dst_shape[::-1]) if tr else tuple(dst_shape)} from "
                    f"{os.path.join(path, 'config.json')} ({cfg.family}: hidden_size="
                    f"{cfg.hidden_size}, num_heads={cfg.num_heads}, num_kv_heads="
                    f"{cfg.num_kv_heads}, head_dim={cfg.head_dim}, vocab_size={cfg.vocab_size})"
                )
            if i is None:
                host[...] = src.astype(np_dtype)
            else:
                host[i] = src.astype(np_dtype)
        arr = jax.device_put(host)
        del host
        var = getattr(model, key) if top else getattr(model.layers, key)
        var.set_value(arr)
    model.config = cfg
    model.dtype = np_dtype
    model._folded = {}
    tok = os.path.join(path, "tokenizer.json")
    model.tokenizer = None
    if os.path.isfile(tok):
        model.tokenizer = tokenizers.Tokenizer.from_file(tok)
    return model
