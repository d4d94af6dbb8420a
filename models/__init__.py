"""Flax NNX Llama (2/3/3.1/3.2), Qwen2/2.5 and Qwen3 ports that decode over the OScaR cache.

Usage (``jnp`` is jax.numpy)::

m = models.from_pretrained("path/to/hf_checkpoint", dtype=jnp.float32)
logits = m.logits(input_ids)                                  # [B, T, vocab] float32
toks = models.generate(m, input_ids, max_new_tokens=32,
                       kv=oscar_jax.preset("oscar", bits=2))  # [B, 32] int32
"""

from models.config import ModelConfig, from_hf_config, llama31_8b, qwen3_8b, rope_inv_freq
from models.generate import (
    bucket_length,
    decode_step,
    generate,
    generate_stepwise,
    prefill,
    stack_caches,
    trace_count,
)
from models.loading import from_pretrained, load_config
from models.memory import abstract_caches, abstract_nbytes, format_table, memory_table
from models.model import CausalLM, abstract_model, fold_value_rotation
from models.stopping import STOP_REASONS, describe_stops

__all__ = [
    "CausalLM", "ModelConfig", "abstract_caches", "abstract_model", "abstract_nbytes",
    "bucket_length", "decode_step", "fold_value_rotation", "format_table", "from_hf_config",
    "from_pretrained", "generate", "generate_stepwise", "llama31_8b", "load_config",
    "memory_table", "prefill", "qwen3_8b", "rope_inv_freq", "stack_caches", "trace_count",
    "STOP_REASONS", "describe_stops",
]  # fmt: skip
