"""The model library: Flax NNX Llama (2/3/3.1/3.2), Qwen2/2.5, Qwen3, Gemma 3 (text) and
Qwen3-MoE ports that decode over the OScaR cache (Gemma 3's sliding-window layers over a
full-precision ring of their window, ``models.window``).

Usage (``jnp`` is jax.numpy)::

    m = models.from_pretrained("path/to/hf_checkpoint", dtype=jnp.float32)
    logits = m.logits(input_ids)                                  # [B, T, vocab] float32
    toks = models.generate(m, input_ids, max_new_tokens=32,
                           kv=oscar_jax.preset("oscar", bits=2))  # [B, 32] int32

Step by step (what ``generate``'s ``lax.scan`` runs, for tools and benchmarks)::

    p = models.prepare(m, ids, max_new_tokens=n, kv=kv)          # validated static config
    logits, caches = models.prefill_forward(p.st, p.decode_params, p.ids, p.lengths)
    state = models.first_state(p.st, logits, caches, p.lengths, key, temperature, top_p)
    state = models.step(p.st, p.decode_params, state, temperature, top_p)   # traced
    logits, caches = models.decode_forward(p.st, p.decode_params, caches, tok, pos)
"""

from models.config import (
    ModelConfig,
    from_hf_config,
    gemma3_270m,
    llama31_8b,
    qwen3_8b,
    qwen3_30b_a3b,
    rope_inv_freq,
)
from models.decoding import (
    DecodeState,
    KeyBiasWarning,
    Prepared,
    bucket_length,
    check_mesh,
    decode_step,
    decode_step_hlo,
    first_state,
    generate,
    generate_program,
    generate_stepwise,
    lower_generate,
    prefill,
    prepare,
    step,
    step_program,
    trace_count,
)
from models.forward import (
    Static,
    decode_forward,
    fused_cache_write,
    layer_params,
    prefill_forward,
    stack_caches,
    unstack_caches,
)
from models.loading import from_pretrained, load_config
from models.memory import (
    abstract_cache,
    abstract_caches,
    abstract_decode_caches,
    abstract_nbytes,
    abstract_window,
    cache_nbytes,
    format_table,
    max_batch,
    memory_table,
    param_nbytes,
)
from models.model import CausalLM, abstract_model, fold_value_rotation
from models.placement import Local, Sharded, placement
from models.stopping import STOP_REASONS, describe_stops
from models.window import WindowCache
from oscar_jax.backends import Backends

__all__ = [
    "abstract_cache", "abstract_caches", "abstract_decode_caches", "abstract_model",
    "abstract_nbytes", "abstract_window", "Backends", "cache_nbytes", "max_batch",
    "bucket_length", "CausalLM", "check_mesh", "decode_forward", "decode_step",
    "decode_step_hlo", "DecodeState", "describe_stops", "first_state", "fold_value_rotation",
    "KeyBiasWarning",
    "format_table", "from_hf_config", "from_pretrained", "fused_cache_write", "generate",
    "gemma3_270m", "generate_program", "generate_stepwise", "layer_params", "llama31_8b",
    "load_config",
    "Local", "lower_generate", "memory_table", "ModelConfig", "param_nbytes", "placement",
    "prefill", "prefill_forward", "prepare", "Prepared", "qwen3_8b", "qwen3_30b_a3b",
    "rope_inv_freq",
    "Sharded", "stack_caches", "Static", "step", "step_program", "STOP_REASONS", "trace_count",
    "unstack_caches", "WindowCache",
]  # fmt: skip
