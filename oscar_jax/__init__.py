"""oscar-jax: OScaR INT2 KV-cache quantization in pure, functional JAX.

Public API (shapes: B batch, T tokens, Hkv KV heads, Hq query heads, D head_dim)::

    cfg = preset("oscar", bits=2)
    k_hat = fake_quant_keys(k, cfg)                  # [B, T, Hkv, D]
    cache = init_cache(cfg, batch=B, max_len=L, num_kv_heads=Hkv, head_dim=D)
    cache = prefill(cache, k, v, lengths)            # [B, T, Hkv, D], [B]
    cache = append(cache, k_t, v_t)                  # [B, Hkv, D]
    out = decode_attention(q, cache)                 # [B, Hq, D]
    k_deq, v_deq = dequantize(cache)                 # [B, L, Hkv, D]
    check_cache(cache)                               # checkify error on a flagged row
    save_state("c.safetensors", cache); cache = load_state("c.safetensors")
"""

from oscar_jax import backends, checks, diagnostics, persistence
from oscar_jax.attention import (
    decode_attention,
    decode_attention_xla,
    merge_partials,
)
from oscar_jax.backends import Backends
from oscar_jax.cache import (
    FLAG_BAD_LENGTH,
    FLAG_NONFINITE,
    FLAG_OVERFLOW,
    KVCache,
    cache_capacity_nbytes,
    cache_nbytes,
    convert_layout,
    dequantize,
    init_cache,
    prefill,
    storage_layout,
)
from oscar_jax.checks import check_cache, checked
from oscar_jax.codec import (
    EncodedKeys,
    EncodedValues,
    decode_keys,
    decode_values,
    encode,
    encode_keys_xla,
    encode_values_xla,
)
from oscar_jax.config import METHODS, KVQuantConfig, preset
from oscar_jax.devices import gpu_available
from oscar_jax.fake_quant import fake_quant_keys, fake_quant_values
from oscar_jax.hadamard import fwht, hadamard_matrix, rotate, rotation_matrix, unrotate
from oscar_jax.persistence import load as load_state
from oscar_jax.persistence import save as save_state
from oscar_jax.quant import dequantize_groups, pack, quantize_groups, unpack
from oscar_jax.ring import append

__all__ = [
    "FLAG_BAD_LENGTH", "FLAG_NONFINITE", "FLAG_OVERFLOW", "METHODS", "Backends", "EncodedKeys",
    "EncodedValues", "KVCache", "KVQuantConfig", "append", "backends", "cache_capacity_nbytes",
    "cache_nbytes", "check_cache", "convert_layout", "checked", "checks", "decode_attention",
    "decode_attention_xla", "decode_keys",
    "decode_values", "dequantize", "dequantize_groups", "diagnostics", "encode",
    "encode_keys_xla", "encode_values_xla", "fake_quant_keys", "fake_quant_values", "fwht",
    "gpu_available", "storage_layout",
    "hadamard_matrix", "init_cache", "load_state", "merge_partials", "pack", "persistence",
    "prefill", "preset",
    "quantize_groups", "rotate",
    "rotation_matrix", "save_state", "unpack", "unrotate",
]  # fmt: skip
