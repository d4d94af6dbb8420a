"""One config dataclass for the Llama / Qwen2 / Qwen3 / Gemma 3 / Qwen3-MoE decoders.

The families share one decoder; they differ only in a few switches:

* ``qkv_bias`` (Qwen2/2.5: q/k/v projections carry biases; Llama with
  ``attention_bias`` too, plus an o_proj bias, ``o_bias``),
* ``qk_norm`` (Qwen3: a per-head RMSNorm over head_dim on q and k before RoPE),
* ``tie_word_embeddings`` (Llama 3.2 1B/3B, small Qwens),
* the RoPE variant (``default``, ``linear`` or ``llama3`` frequency scaling),
* Gemma 3 (``family="gemma3"``): ``norm_offset`` 1 (RMSNorm weights used as ``1 + w``),
  ``sandwich_norm`` (a norm after attention and after the MLP too), ``hidden_act``
  ``gelu_tanh``, ``embed_scale`` (embeddings times sqrt(hidden)),
  ``query_pre_attn_scalar`` (softmax scale ``1/sqrt(query_pre_attn_scalar)``),
  ``sliding_window`` with ``local_layers`` (the sliding-window layers, RoPE base
  ``rope_local_theta``), ``final_logit_softcapping``,
* Qwen3-MoE (``family="qwen3_moe"``): ``num_experts`` experts of
  ``moe_intermediate_size``, ``num_experts_per_tok`` routed per token,
  ``norm_topk_prob``.

``from_hf_config`` reads a Hugging Face ``config.json`` dict (transformers 4.x
``rope_theta``/``rope_scaling`` or 5.x ``rope_parameters``) and raises
ValueError naming every attribute it cannot honour (sliding window enabled,
MoE outside qwen3_moe, unknown model_type / architecture, non-SiLU MLP outside Gemma,
unknown RoPE type, attention logit softcapping).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "qwen3_moe")
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
    "gemma3": ("Gemma3ForCausalLM",),
    "qwen3_moe": ("Qwen3MoeForCausalLM",),
}
# Hugging Face model_type -> family (Gemma 3's text-only config is "gemma3_text")
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
               "gemma3_text": "gemma3", "qwen3_moe": "qwen3_moe"}  # fmt: skip
ACTIVATIONS = ("silu", "gelu_tanh")
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
    # Gemma 3
    norm_offset: float = 0.0
    sandwich_norm: bool = False
    hidden_act: str = "silu"
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    local_layers: tuple[int, ...] = ()
    rope_local_theta: float = 10000.0
    final_logit_softcapping: float | None = None
    # mixture of experts (Qwen3-MoE)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

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
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} must be one of {ACTIVATIONS}")
        if self.local_layers:
            if self.sliding_window is None or self.sliding_window < 1:
                raise ValueError(
                    f"sliding_window={self.sliding_window!r} must be a positive int when "
                    f"local_layers={self.local_layers} is set"
                )
            bad = [i for i in self.local_layers if not 0 <= i < self.num_layers]
            if bad or tuple(sorted(set(self.local_layers))) != self.local_layers:
                raise ValueError(
                    f"local_layers={self.local_layers} must be sorted distinct layer indices "
                    f"in [0, num_layers={self.num_layers})"
                )
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ValueError(f"query_pre_attn_scalar={self.query_pre_attn_scalar} must be > 0")
        if self.num_experts:
            k, e, i = self.num_experts_per_tok, self.num_experts, self.moe_intermediate_size
            if not (1 <= k <= e and i >= 1):
                raise ValueError(
                    f"num_experts_per_tok={k} must be in [1, num_experts={e}] and "
                    f"moe_intermediate_size={i} must be >= 1"
                )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_local(self, layer: int) -> bool:
        """Whether ``layer`` is a sliding-window (local) attention layer."""
        return layer in self.local_layers

    @property
    def global_layers(self) -> tuple[int, ...]:
        """The full-attention layers (those whose cache is the OScaR cache)."""
        return tuple(i for i in range(self.num_layers) if i not in self.local_layers)

    @property
    def query_scale(self) -> float:
        """Factor on the queries so that the attention's 1/sqrt(head_dim) scale becomes
        1/sqrt(query_pre_attn_scalar) (1.0 when that is unset)."""
        if self.query_pre_attn_scalar is None:
            return 1.0
        return math.sqrt(self.head_dim / self.query_pre_attn_scalar)

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
        mlp = 3 * h * i
        if self.is_moe:
            mlp = self.num_experts * (3 * h * self.moe_intermediate_size + h)
        per = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + mlp + 2 * h
        per += 2 * h * self.sandwich_norm
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


def _rope(rp: dict, d: dict, problems: list[str], where: str = ""):
    """(theta, rope_type, scaling params) of one RoPE parameter dict."""
    rp = dict(rp)
    theta = float(rp.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = rp.pop("rope_type", rp.pop("type", "default")) or "default"
    if rp.get("partial_rotary_factor", 1.0) != 1.0 or d.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append("partial_rotary_factor != 1")
    rp.pop("partial_rotary_factor", None)
    if rope_type not in ROPE_TYPES:
        problems.append(f"{where}rope_type={rope_type!r} (supported: {ROPE_TYPES})")
    needed = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings")}.get(rope_type, ())  # fmt: skip
    missing = [k for k in needed if k not in rp]
    if missing:
        problems.append(f"{where}rope scaling of type {rope_type!r} lacks {missing}")
    return theta, rope_type, tuple(sorted((k, float(rp[k])) for k in needed if k in rp))


def from_hf_config(d: dict[str, Any]) -> ModelConfig:
    """Translate a Hugging Face config.json dict; ValueError names what is unsupported."""
    problems: list[str] = []
    model_type = d.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type={model_type!r}: supported are {tuple(MODEL_TYPES)} "
            "(Llama 2/3/3.1/3.2, Qwen2/2.5, Qwen3, Gemma 3 text, Qwen3-MoE)"
        )
    family = MODEL_TYPES[model_type]
    archs = d.get("architectures") or list(ARCHITECTURES[family])
    bad_arch = [a for a in archs if a not in ARCHITECTURES[family]]
    if bad_arch:
        problems.append(f"architectures={bad_arch} (supported: {ARCHITECTURES[family]})")
    gemma, moe = family == "gemma3", family == "qwen3_moe"
    if d.get("use_sliding_window"):
        problems.append(f"use_sliding_window=True (sliding_window={d.get('sliding_window')})")
    layer_types = list(d.get("layer_types") or [])
    allowed = ("full_attention", "sliding_attention") if gemma else ("full_attention",)
    if any(t not in allowed for t in layer_types):
        problems.append(f"layer_types={sorted(set(layer_types))} (only {allowed})")
    if family == "llama" and d.get("sliding_window"):
        problems.append(f"sliding_window={d['sliding_window']}")
    if not moe:
        for k in _MOE_KEYS:
            if d.get(k):
                problems.append(f"{k}={d[k]} (mixture of experts: qwen3_moe only)")
    else:
        if d.get("mlp_only_layers"):
            problems.append(f"mlp_only_layers={d['mlp_only_layers']} (every layer must be MoE)")
        if d.get("decoder_sparse_step", 1) != 1:
            problems.append(f"decoder_sparse_step={d['decoder_sparse_step']} (must be 1)")
        if d.get("shared_expert_intermediate_size"):
            problems.append("shared experts (Qwen3-MoE has none)")
    act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
    acts = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
    if act not in acts or (acts[act] != "silu" and not gemma):
        problems.append(f"hidden_act={act!r} (only 'silu'; Gemma 3: 'gelu_pytorch_tanh')")
    if d.get("mlp_bias"):
        problems.append("mlp_bias=True")
    if d.get("pretraining_tp", 1) not in (1, None):
        problems.append(f"pretraining_tp={d['pretraining_tp']}")
    if d.get("attn_logit_softcapping"):
        problems.append(
            f"attn_logit_softcapping={d['attn_logit_softcapping']} (the INT2 decode "
            "attention has no softcap)"
        )
    if d.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention=True")
    # RoPE: transformers 5 keeps everything in rope_parameters (Gemma 3: one dict per layer
    # type); 4.x in rope_theta / rope_scaling (+ rope_local_base_freq for Gemma 3).
    rp = dict(d.get("rope_parameters") or {})
    local_theta = float(d.get("rope_local_base_freq", 10000.0))
    if gemma and "full_attention" in rp:
        loc = rp.get("sliding_attention") or {}
        lt, ltype, _ = _rope(loc, {"rope_theta": local_theta}, problems, "sliding_attention ")
        if ltype != "default":
            problems.append(f"sliding_attention rope_type={ltype!r} (only 'default')")
        local_theta = lt
        rp = dict(rp["full_attention"])
    rs = d.get("rope_scaling") or {}
    theta, rope_type, scaling = _rope({**rs, **rp}, d, problems)
    h = int(d["hidden_size"])
    nh = int(d["num_attention_heads"])
    head_dim = d.get("head_dim") or h // nh
    nl = int(d["num_hidden_layers"])
    attn_bias = bool(d.get("attention_bias", False))
    if gemma and attn_bias:
        problems.append("attention_bias=True")
    extra: dict[str, Any] = {}
    if gemma:
        if not layer_types:
            pat = int(d.get("sliding_window_pattern", 6))
            layer_types = ["sliding_attention" if (i + 1) % pat else "full_attention"
                           for i in range(nl)]  # fmt: skip
        local = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        sw = d.get("sliding_window")
        if local and not sw:
            problems.append(f"sliding_window={sw!r} with sliding layers {list(local)}")
        extra = dict(
            norm_offset=1.0, sandwich_norm=True, hidden_act="gelu_tanh", embed_scale=True,
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
            sliding_window=int(sw) if local and sw else None, local_layers=local,
            rope_local_theta=local_theta,
            final_logit_softcapping=d.get("final_logit_softcapping"),
        )  # fmt: skip
    if moe:
        extra = dict(
            num_experts=int(d.get("num_experts") or d["num_local_experts"]),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        )  # fmt: skip
    if problems:
        raise ValueError(f"unsupported {model_type} config attributes: " + "; ".join(problems))
    eos = _as_tuple_ids(d.get("eos_token_id"))
    return ModelConfig(
        family=family,
        vocab_size=int(d["vocab_size"]),
        hidden_size=h,
        intermediate_size=int(d.get("intermediate_size") or d.get("moe_intermediate_size")),
        num_layers=nl,
        num_heads=nh,
        num_kv_heads=int(d.get("num_key_value_heads") or nh),
        head_dim=int(head_dim),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_type=rope_type,
        rope_scaling=scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
        qkv_bias=family == "qwen2" or attn_bias,
        o_bias=family in ("llama", "qwen3_moe") and attn_bias,
        qk_norm=family in ("qwen3", "gemma3", "qwen3_moe"),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos,
        pad_token_id=d.get("pad_token_id"),
        **extra,
    )


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies [head_dim/2] (float32) of the config's RoPE variant (``local``:
    of the sliding-window layers: base ``rope_local_theta``, no scaling)."""
    d = cfg.head_dim
    if local:
        inv = 1.0 / (cfg.rope_local_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        return inv.astype(np.float32)
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


def qwen3_30b_a3b() -> ModelConfig:
    return ModelConfig(
        family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, qk_norm=True,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, bos_token_id=151643, eos_token_ids=(151645,),
    )  # fmt: skip


def gemma3_270m() -> ModelConfig:
    return ModelConfig(
        family="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048,
        num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
        qk_norm=True, norm_offset=1.0, sandwich_norm=True, hidden_act="gelu_tanh",
        embed_scale=True, query_pre_attn_scalar=256.0, sliding_window=512,
        local_layers=tuple(i for i in range(18) if (i + 1) % 6), bos_token_id=2,
        eos_token_ids=(1, 106),
    )  # fmt: skip
