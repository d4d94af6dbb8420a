"""GGUF checkpoints (llama.cpp's one-file format) -> ``CausalLM``: llama, qwen2, qwen3.

A GGUF file holds the config as metadata (``llama.block_count``, ...), the tokenizer
as metadata (``tokenizer.ggml.*``, built by ``models.gguf_tokenizer``) and the weights
as tensors that may be block-quantized (Q4_0, Q4_K, Q8_0, ...). ``load(path, dtype)``
parses the header here and checks all of it before anything is allocated: magic and
version, every metadata value and tensor entry against the file's size, the config
fields, every tensor's name, type and shape against the config, and that the ``gguf``
package can dequantize each tensor type. Any problem is a ValueError naming the file
and the field or tensor; no model is returned half-loaded. Then each tensor is
dequantized to float32 with ``gguf.quants.dequantize`` and cast to the model dtype,
one at a time, into a preallocated stacked host array (as ``models.loading`` does).

Layouts: a GGUF tensor's dims are listed innermost first, so a projection read as
numpy is ``[out, in]`` (PyTorch's layout) and is transposed to ours (``[in, out]``).
llama.cpp's converter stores a *llama* model's q and k projection rows (and biases)
permuted per head from the rotate-half order to interleaved pairs (llama.cpp's llama
RoPE rotates adjacent pairs); ``unpermute_rows`` undoes it. qwen2 / qwen3 files keep
rotate-half order (llama.cpp's NEOX RoPE) and are not permuted.

``read_header(path)`` gives the parsed header (``GGUFHeader``: metadata dict, tensor
table) without reading any weights, e.g. for ``tokenizer.chat_template``.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from models import layers
from models.config import ModelConfig
from models.gguf_tokenizer import tokenizer_from_header
from models.model import CausalLM

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
_REQUIRED = object()
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")

# our param key -> the GGUF tensor name under ``blk.{i}.`` (layers) or at the top
LAYER_NAMES = {
    "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "bo": "attn_output.bias", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
    "attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight",
}  # fmt: skip
# Gemma 3: four norms per layer (llama.cpp's converter stores every Gemma norm weight as
# 1 + w: the loader subtracts the 1 again, as transformers' GGUF loading does)
GEMMA3_NAMES = {
    **LAYER_NAMES, "post_attn_norm": "post_attention_norm.weight",
    "mlp_norm": "ffn_norm.weight", "post_mlp_norm": "post_ffw_norm.weight",
}  # fmt: skip
# llama.cpp's Gemma 3: every 6th layer global, local RoPE base 10000
GEMMA3_PATTERN, GEMMA3_LOCAL_THETA = 6, 10000.0
TOP_NAMES = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
_TRANSPOSED = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"}


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first): the GGUF dims reversed
    qtype: int  # ggml type id
    type_name: str
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFHeader(NamedTuple):
    path: str
    version: int
    metadata: dict[str, Any]  # numeric arrays as numpy arrays, string arrays as lists
    tensors: dict[str, TensorInfo]
    size: int  # the file's size in bytes

    def get(self, key: str, kind: type, default: Any = _REQUIRED) -> Any:
        """Metadata ``key`` checked to be a ``kind`` (int, float, str, bool); ``default``
        when absent, a ValueError naming the file and the key when required."""
        if key not in self.metadata:
            if default is _REQUIRED:
                raise ValueError(f"{self.path}: metadata {key} is missing (it must be set)")
            return default
        val = self.metadata[key]
        ok = {
            int: isinstance(val, int) and not isinstance(val, bool),
            float: isinstance(val, int | float) and not isinstance(val, bool),
            bool: isinstance(val, bool),
            str: isinstance(val, str),
        }[kind]
        if not ok:
            shown = val if not isinstance(val, list | np.ndarray) else f"<array of {len(val)}>"
            raise ValueError(f"{self.path}: {key}={shown!r} must be a single {kind.__name__}")
        return float(val) if kind is float else val


class _Cursor:
    """Bounds-checked little-endian reads from the header bytes."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def take(self, n: int, what: str):
        end = self.pos + n
        if end > self.size:
            raise ValueError(
                f"{self.path}: truncated GGUF header: {what} needs bytes {self.pos}..{end}, "
                f"the file has {self.size}"
            )
        out, self.pos = self.buf[self.pos : end], end
        return out

    def unpack(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def strings(self, n: int, what: str) -> list[str]:
        buf, pos, size, out = self.buf, self.pos, self.size, []
        for i in range(n):
            item = what if n == 1 else f"{what}[{i}]"
            if pos + 8 > size:
                self.pos = pos
                self.take(8, f"the length of {item}")  # raises: truncated
            k = _U64.unpack_from(buf, pos)[0]
            if pos + 8 + k > size:
                self.pos = pos + 8
                self.take(k, item)  # raises: truncated
            try:
                out.append(buf[pos + 8 : pos + 8 + k].decode("utf-8"))
            except UnicodeDecodeError as e:
                msg = f"{self.path}: bad GGUF header: {item} is not UTF-8 ({e})"
                raise ValueError(msg) from None
            pos += 8 + k
        self.pos = pos
        return out

    def value(self, vtype: int, what: str):
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype], what)
        if vtype == _STRING:
            return self.strings(1, what)[0]
        if vtype == _ARRAY:
            etype, n = self.unpack("<I", what), self.unpack("<Q", what)
            if n > self.size:
                raise ValueError(f"{self.path}: bad GGUF header: {what} claims {n} elements")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                return np.frombuffer(self.take(n * dt.itemsize, what), dt).copy()
            if etype == _STRING:
                return self.strings(n, what)
            return [self.value(etype, f"{what}[{i}]") for i in range(n)]
        raise ValueError(f"{self.path}: bad GGUF header: {what} has value type={vtype}, "
                         "which must be one of GGUF's 0..12")  # fmt: skip


def read_header(path) -> GGUFHeader:
    """Parse and check a GGUF file's header and tensor table (no tensor data is read)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} is not a file")
    size = os.path.getsize(path)
    if size < 24:
        raise ValueError(f"{path}: truncated GGUF file: {size} bytes, the header alone needs 24")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        cur = _Cursor(mm, path)
        magic = bytes(cur.take(4, "the magic"))
        if magic != b"GGUF":
            raise ValueError(f"{path}: magic={magic!r} must be b'GGUF' (not a GGUF file)")
        version = cur.unpack("<I", "the version")
        if version not in (2, 3):
            raise ValueError(f"{path}: version={version} must be 2 or 3 (a big-endian file "
                             "reads as a huge version)")  # fmt: skip
        n_tensors, n_kv = cur.unpack("<Q", "tensor_count"), cur.unpack("<Q", "metadata_kv_count")
        if n_tensors > size // 24 or n_kv > size // 12:
            raise ValueError(f"{path}: bad GGUF header: tensor_count={n_tensors}, "
                             f"metadata_kv_count={n_kv} must fit in {size} bytes")  # fmt: skip
        meta: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.strings(1, f"metadata key #{i}")[0]
            if key in meta:
                raise ValueError(f"{path}: bad GGUF header: metadata {key} appears twice")
            meta[key] = cur.value(cur.unpack("<I", f"the type of {key}"), f"metadata {key}")
        table = []
        for i in range(n_tensors):
            name = cur.strings(1, f"tensor name #{i}")[0]
            nd = cur.unpack("<I", f"tensor {name!r} n_dims")
            if not 1 <= nd <= 4:
                raise ValueError(f"{path}: tensor {name!r} has n_dims={nd}, which must be 1..4")
            dims = struct.unpack(f"<{nd}Q", cur.take(8 * nd, f"tensor {name!r} dims"))
            ttype, off = (
                cur.unpack("<I", f"tensor {name!r} type"),
                cur.unpack("<Q", f"tensor {name!r} offset"),
            )
            table.append((name, dims, ttype, off))
        header_end = cur.pos
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or isinstance(align, bool) or align < 1 or align & (align - 1):
        raise ValueError(f"{path}: general.alignment={align!r} must be a power of two")
    data_start = -(-header_end // align) * align
    tensors: dict[str, TensorInfo] = {}
    for name, dims, ttype, off in table:
        try:
            qt = GGMLQuantizationType(ttype)
        except ValueError:
            raise ValueError(f"{path}: tensor {name!r} has type={ttype}, which is no ggml "
                             "tensor type this gguf package knows") from None  # fmt: skip
        block, type_size = GGML_QUANT_SIZES[qt]
        if name in tensors or dims[0] % block or 0 in dims:
            why = "appears twice" if name in tensors else f"has dims {list(dims)}"
            raise ValueError(f"{path}: bad tensor table: tensor {name!r} {why} "
                             f"({qt.name} blocks of {block})")  # fmt: skip
        nbytes = int(np.prod(dims, dtype=np.int64)) // block * type_size
        start = data_start + off
        if start + nbytes > size:
            raise ValueError(
                f"{path}: truncated: tensor {name!r} ({qt.name} {list(dims[::-1])}) needs bytes "
                f"{start}..{start + nbytes}, the file has {size}"
            )
        tensors[name] = TensorInfo(name, tuple(int(d) for d in dims[::-1]), int(qt), qt.name,
                                   start, nbytes)  # fmt: skip
    return GGUFHeader(path, version, meta, tensors, size)


def dequantize(h: GGUFHeader, name: str, mm=None) -> np.ndarray:
    """Tensor ``name`` as float32 in numpy order (``TensorInfo.shape``)."""
    t = h.tensors[name]
    mm = np.memmap(h.path, np.uint8, "r") if mm is None else mm
    raw = mm[t.offset : t.offset + t.nbytes].reshape(*t.shape[:-1], -1)
    return np.asarray(quants.dequantize(raw, t.qtype), np.float32).reshape(t.shape)


def check_types(h: GGUFHeader, names) -> None:
    """ValueError unless ``gguf`` can dequantize every tensor type among ``names``."""
    bad = {}
    for qt in sorted({h.tensors[n].qtype for n in names}):
        try:
            quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[GGMLQuantizationType(qt)][1]),
                                       np.uint8), GGMLQuantizationType(qt))  # fmt: skip
        except (NotImplementedError, KeyError, ValueError, TypeError):
            bad[qt] = next(n for n in names if h.tensors[n].qtype == qt)
    if bad:
        qt, n = next(iter(bad.items()))
        raise ValueError(f"{h.path}: tensor {n!r} has tensor_type={h.tensors[n].type_name}, "
                         f"which must be a type the gguf package dequantizes (failed: "
                         f"{sorted(h.tensors[m].type_name for m in bad.values())})")  # fmt: skip


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's llama q/k permutation: in each head's ``d`` rows the file has
    pairs ``(x_j, x_{j+d/2})`` adjacent (row ``2j + h``); we want rotate-half order
    (row ``h * d/2 + j``). ``w`` is ``[n_head * d, ...]`` (a weight or a bias)."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_header(h: GGUFHeader) -> ModelConfig:
    """The ModelConfig the metadata describes; ValueError naming the first unsupported field."""
    arch = h.get("general.architecture", str)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{h.path}: general.architecture={arch!r} must be one of {ARCHITECTURES}")
    a = lambda key, kind, default=_REQUIRED: h.get(f"{arch}.{key}", kind, default)  # noqa: E731
    sw_ok = arch == "gemma3"
    for key, bad in (("expert_count", lambda v: v > 0),
                     ("attention.sliding_window", lambda v: bool(v) and not sw_ok),
                     ("rope.scaling.type", lambda v: v not in ("none", "linear"))):  # fmt: skip
        v = h.metadata.get(f"{arch}.{key}")
        if v is not None and bad(v):
            raise ValueError(f"{h.path}: {arch}.{key}={v!r} is not supported (must be absent"
                             + (" or 'none' / 'linear')" if "rope" in key else ")"))  # fmt: skip
    if "rope_freqs.weight" in h.tensors:
        raise ValueError(f"{h.path}: tensor 'rope_freqs.weight' (RoPE frequency factors, e.g. "
                         "Llama-3.1 scaling) is not supported: must be absent")  # fmt: skip
    if "token_embd.weight" not in h.tensors:
        raise ValueError(f"{h.path}: tensor 'token_embd.weight' is missing")
    vocab, hidden = h.tensors["token_embd.weight"].shape
    heads = a("attention.head_count", int)
    for key, want in (("embedding_length", hidden), ("vocab_size", vocab)):
        if a(key, int, want) != want:
            raise ValueError(f"{h.path}: {arch}.{key}={a(key, int)} must equal "
                             f"token_embd.weight's {want}")  # fmt: skip
    rope_dim = a("rope.dimension_count", int, None)
    head_dim = a("attention.key_length", int, None) or rope_dim or hidden // max(heads, 1)
    for key, val in (
        ("rope.dimension_count", rope_dim),
        ("attention.value_length", a("attention.value_length", int, None)),
    ):
        if val is not None and val != head_dim:
            raise ValueError(f"{h.path}: {arch}.{key}={val} must equal the head dim {head_dim} "
                             "(partial RoPE / distinct value heads are not supported)")  # fmt: skip
    tokens = h.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) > vocab:
        raise ValueError(f"{h.path}: tokenizer.ggml.tokens has {len(tokens)} entries, must be "
                         f"at most token_embd.weight's {vocab} rows")  # fmt: skip
    names, n_layers = set(h.tensors), a("block_count", int)
    has = lambda suffix: any(f"blk.{i}.{suffix}" in names for i in range(n_layers))  # noqa: E731
    qkv = [has(f"attn_{x}.bias") for x in "qkv"]
    if any(qkv) and not all(qkv):
        present = [x for x, p in zip("qkv", qkv, strict=True) if p]
        raise ValueError(f"{h.path}: attn_q/k/v biases must be all present or all absent "
                         f"(present: {present})")  # fmt: skip
    rs = a("rope.scaling.type", str, "none")
    tok = lambda key: h.get(f"tokenizer.ggml.{key}", int, None)  # noqa: E731
    eos = tuple(
        dict.fromkeys(i for i in (tok("eos_token_id"), tok("eot_token_id")) if i is not None)
    )
    kw = dict(
        family=arch, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=a("feed_forward_length", int), num_layers=n_layers,
        num_heads=heads, num_kv_heads=a("attention.head_count_kv", int, heads),
        head_dim=head_dim, rms_norm_eps=a("attention.layer_norm_rms_epsilon", float),
        rope_theta=a("rope.freq_base", float, 10000.0),
        rope_type="linear" if rs == "linear" else "default",
        rope_scaling=(("factor", a("rope.scaling.factor", float)),) if rs == "linear" else (),
        max_position_embeddings=a("context_length", int, 4096),
        tie_word_embeddings="output.weight" not in names, qkv_bias=all(qkv),
        o_bias=has("attn_output.bias"), qk_norm=arch == "qwen3",
        bos_token_id=tok("bos_token_id"), eos_token_ids=eos, pad_token_id=tok("padding_token_id"),
    )  # fmt: skip
    if arch == "gemma3":
        pattern = h.metadata.get(f"{arch}.attention.sliding_window_pattern")
        if pattern is not None and not isinstance(pattern, int | np.integer):
            local = tuple(i for i, p in enumerate(np.asarray(pattern).tolist()) if p)
        else:
            every = int(pattern or GEMMA3_PATTERN)
            local = tuple(i for i in range(n_layers) if (i + 1) % every)
        # llama.cpp: 1/sqrt(head_dim), except 27B (hidden 5376): 1/sqrt(hidden / heads)
        qpas = hidden / heads if hidden == 5376 else head_dim
        kw.update(
            norm_offset=1.0, sandwich_norm=True, hidden_act="gelu_tanh", embed_scale=True,
            qk_norm=True, query_pre_attn_scalar=float(qpas), local_layers=local,
            sliding_window=a("attention.sliding_window", int) if local else None,
            rope_local_theta=GEMMA3_LOCAL_THETA,
            final_logit_softcapping=a("final_logit_softcapping", float, None),
        )  # fmt: skip
        if a("attn_logit_softcapping", float, None):
            raise ValueError(f"{h.path}: {arch}.attn_logit_softcapping is not supported")
    try:
        return ModelConfig(**kw)
    except ValueError as e:
        raise ValueError(f"{h.path}: the metadata of this {arch} model: {e}") from None


def _plan(h: GGUFHeader, cfg: ModelConfig) -> dict[str, list[tuple[str, int | None]]]:
    """Our param key -> [(GGUF tensor name, layer or None)], checked against the file."""
    shapes = layers.param_shapes(cfg)
    plan, want = {}, {}
    for key, shape in [(k, s) for k, s in shapes.items() if k != "layers"] + [
        (k, s[1:]) for k, s in shapes["layers"].items()
    ]:
        top = key in TOP_NAMES
        ln = GEMMA3_NAMES if cfg.family == "gemma3" else LAYER_NAMES
        names = [(TOP_NAMES[key], None)] if top else [
            (f"blk.{i}.{ln[key]}", i) for i in range(cfg.num_layers)]  # fmt: skip
        plan[key] = names
        for n, _ in names:
            want[n] = tuple(shape[::-1]) if key in _TRANSPOSED else tuple(shape)
    missing = sorted(set(want) - set(h.tensors))
    unexpected = sorted(set(h.tensors) - set(want))
    if missing or unexpected:
        raise ValueError(
            f"{h.path}: tensors do not match the {cfg.family} config in its metadata: "
            f"missing {missing[:12]}, unexpected {unexpected[:12]}"
        )
    for n, shape in want.items():
        if h.tensors[n].shape != shape:
            raise ValueError(
                f"{h.path}: tensor {n!r} has shape {list(h.tensors[n].shape)}, must be "
                f"{list(shape)} from the metadata ({cfg.family}: hidden_size={cfg.hidden_size}, "
                f"num_heads={cfg.num_heads}, num_kv_heads={cfg.num_kv_heads}, head_dim="
                f"{cfg.head_dim}, intermediate_size={cfg.intermediate_size})"
            )
    check_types(h, want)
    return plan


def load_config(path) -> ModelConfig:
    return config_from_header(read_header(path))


def load(path, dtype=None):
    """A ``CausalLM`` of ``dtype`` (default float32) with ``tokenizer`` from the GGUF file."""
    h = read_header(path)
    cfg = config_from_header(h)
    plan = _plan(h, cfg)
    tokenizer = tokenizer_from_header(h)  # before the weights: its errors cost nothing
    np_dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
    model = nnx.eval_shape(lambda: CausalLM(cfg, dtype=np_dtype, rngs=nnx.Rngs(0)))
    shapes = layers.param_shapes(cfg)
    mm = np.memmap(h.path, np.uint8, "r")
    for key, names in plan.items():
        top = key in TOP_NAMES
        host = np.empty(shapes[key] if top else shapes["layers"][key], np_dtype)
        for name, i in names:
            w = dequantize(h, name, mm)
            if cfg.family == "llama" and key in ("wq", "bq", "wk", "bk"):
                w = unpermute_rows(w, cfg.num_heads if key in ("wq", "bq") else cfg.num_kv_heads)
            if cfg.norm_offset and "norm" in key:  # the file holds offset + w
                w = w - np.float32(cfg.norm_offset)
            w = w.T if key in _TRANSPOSED else w
            if i is None:
                host[...] = w
            else:
                host[i] = w
        var = getattr(model, key) if top else getattr(model.layers, key)
        var.set_value(jax.device_put(host))
        del host
    del mm
    model.config, model.dtype, model._folded, model.tokenizer = cfg, np_dtype, {}, tokenizer
    return model


def is_gguf(path) -> bool:
    """Whether ``path`` names a GGUF file: ``*.gguf`` (existing or not, so that a missing
    one is reported as a missing file) or a file starting with GGUF's magic."""
    path = os.fspath(path)
    if path.lower().endswith(".gguf"):
        return not os.path.isdir(path)
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
