"""One config dataclass for the Llama / Qwen2 / Qwen3 decoder family.

The three families share one decoder; they differ only in a few switches:

* ``qkv_bias`` (Qwen2/2.5: q/k/v projections carry biases; Llama with
  ``attention_bias`` too, plus an o_proj bias, ``o_bias``),
* ``qk_norm`` (Qwen3: a per-head RMSNorm over head_dim on q and k before RoPE),
* ``tie_word_embeddings`` (Llama 3.2 1B/3B, small Qwens),
* the RoPE variant (``default``, ``linear`` or ``llama3`` frequency scaling).

``from_hf_config`` reads a Hugging Face ``config.json`` dict (transformers 4.x
``rope_theta``/``rope_scaling`` or 5.x ``rope_parameters``) and raises
ValueError naming every attribute it cannot honour (sliding window enabled,
MoE, unknown model_type / architecture, non-SiLU MLP, unknown RoPE type).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

FAMILIES = ("llama", "qwen2", "qwen3")
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
}
ROPE_TYPES = ("default", "linear", "llama3")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shape and switch description of one decoder (hashable: a jit static arg)."""

    family: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    # rope scaling parameters as a sorted tuple of (name, value) so the config stays hashable
    rope_scaling: tuple[tuple[str, float], ...] = ()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} must be one of {FAMILIES}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r} must be one of {ROPE_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):  # fmt: skip
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int | np.integer) or val < 1:
                raise ValueError(f"{name}={val!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE)")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_params(self) -> dict[str, float]:
        return dict(self.rope_scaling)

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    def num_params(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        per = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        per += (self.q_size + 2 * self.kv_size) * self.qkv_bias + h * self.o_bias
        per += 2 * self.head_dim * self.qk_norm
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * per + emb + h


def _as_tuple_ids(x) -> tuple[int, ...]:
    if x is None:
        return ()
    if isinstance(x, int | np.integer):
        return (int(x),)
    return tuple(int(i) for i in x)


def from_hf_config(d: dict[str, Any]) -> ModelConfig:
    """Translate a Hugging Face config.json dict; ValueError names what is unsupported."""
    problems: list[str] = []
    model_type = d.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"unsupported model_type={model_type!r}: supported are {FAMILIES} "
            "(Llama 2/3/3.1/3.2, Qwen2/2.5, Qwen3)"
        )
    archs = d.get("architectures") or list(ARCHITECTURES[model_type])
    bad_arch = [a for a in archs if a not in ARCHITECTURES[model_type]]
    if bad_arch:
        problems.append(f"architectures={bad_arch} (supported: {ARCHITECTURES[model_type]})")
    if d.get("use_sliding_window"):
        problems.append(f"use_sliding_window=True (sliding_window={d.get('sliding_window')})")
    layer_types = d.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        problems.append(f"layer_types={sorted(set(layer_types))} (only full_attention)")
    if model_type == "llama" and d.get("sliding_window"):
        problems.append(f"sliding_window={d['sliding_window']}")
    for k in _MOE_KEYS:
        if d.get(k):
            problems.append(f"{k}={d[k]} (mixture of experts)")
    if d.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={d['hidden_act']!r} (only 'silu')")
    if d.get("mlp_bias"):
        problems.append("mlp_bias=True")
    if d.get("pretraining_tp", 1) not in (1, None):
        problems.append(f"pretraining_tp={d['pretraining_tp']}")
    # RoPE: transformers 5 keeps everything in rope_parameters; 4.x in rope_theta / rope_scaling.
    rp = dict(d.get("rope_parameters") or {})
    rs = d.get("rope_scaling") or {}
    rp = {**rs, **rp}
    theta = float(rp.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = rp.pop("rope_type", rp.pop("type", "default")) or "default"
    if rp.get("partial_rotary_factor", 1.0) != 1.0 or d.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append("partial_rotary_factor != 1")
    rp.pop("partial_rotary_factor", None)
    if rope_type not in ROPE_TYPES:
        problems.append(f"rope_type={rope_type!r} (supported: {ROPE_TYPES})")
    needed = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings")}.get(rope_type, ())  # fmt: skip
    missing = [k for k in needed if k not in rp]
    if missing:
        problems.append(f"rope scaling of type {rope_type!r} lacks {missing}")
    if problems:
        raise ValueError(f"unsupported {model_type} config attributes: " + "; ".join(problems))
    h = int(d["hidden_size"])
    nh = int(d["num_attention_heads"])
    head_dim = d.get("head_dim") or h // nh
    attn_bias = bool(d.get("attention_bias", False))
    eos = _as_tuple_ids(d.get("eos_token_id"))
    return ModelConfig(
        family=model_type,
        vocab_size=int(d["vocab_size"]),
        hidden_size=h,
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=nh,
        num_kv_heads=int(d.get("num_key_value_heads") or nh),
        head_dim=int(head_dim),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_type=rope_type,
        rope_scaling=tuple(sorted((k, float(rp[k])) for k in needed)),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or attn_bias,
        o_bias=model_type == "llama" and attn_bias,
        qk_norm=model_type == "qwen3",
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos,
        pad_token_id=d.get("pad_token_id"),
    )


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2] (float32) of the config's RoPE variant."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    p = cfg.rope_params
    if cfg.rope_type == "linear":
        inv = inv / p["factor"]
    elif cfg.rope_type == "llama3":
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        lo_wavelen, hi_wavelen = old / lo, old / hi
        scaled = np.where(wavelen > lo_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= hi_wavelen) & (wavelen <= lo_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


# -- full-size configs (shapes only; used with jax.eval_shape) ---------------------
def llama31_8b() -> ModelConfig:
    return ModelConfig(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_type="llama3",
        rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                      ("original_max_position_embeddings", 8192.0)),
        max_position_embeddings=131072, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    )  # fmt: skip


def qwen3_8b() -> ModelConfig:
    return ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, qk_norm=True,
        bos_token_id=151643, eos_token_ids=(151645,),
    )  # fmt: skip
