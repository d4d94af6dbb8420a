"""KV-cache memory of full-size models from shapes only (``jax.eval_shape``: nothing allocated).

Decoding holds one cache per layer (``models.prefill``): the OScaR ``KVCache`` on the
global layers, and on Gemma 3's sliding-window layers a full-precision ring of
``min(sliding_window, max_len)`` slots (``models.window``: per row ring x Hkv x D x 2 x
dtype bytes). ``abstract_decode_caches`` / ``cache_nbytes`` / ``max_batch`` count both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import oscar_jax as oj
from models import window as mwin
from models.config import ModelConfig, gemma3_270m, llama31_8b, qwen3_8b, qwen3_30b_a3b
from models.model import abstract_model


def cache_config(cfg: ModelConfig, kv: oj.KVQuantConfig, *, attention="auto",
                 sharded: bool = False) -> oj.KVQuantConfig:  # fmt: skip
    """The config of model ``cfg``'s caches: the value rotation folded into the weights (the
    cache stores values as given) and a ``layout="auto"`` decided for this model's head_dim
    and GQA group and the decode attention backend (``oscar_jax.storage_layout``)."""
    kv = kv.replace(rotate_values=False) if kv.rotate_values else kv
    return oj.storage_layout(
        kv, head_dim=cfg.head_dim, num_kv_heads=cfg.num_kv_heads,
        group=cfg.num_heads // cfg.num_kv_heads, attention=attention, sharded=sharded,
    )  # fmt: skip


def abstract_cache(cfg: ModelConfig, kv: oj.KVQuantConfig, *, batch: int, max_len: int,
                   dtype=jnp.bfloat16):  # fmt: skip
    """One layer's cache [B, ...] as ShapeDtypeStructs (``models.generate`` holds L of them)."""
    kv = cache_config(cfg, kv)
    return jax.eval_shape(lambda: oj.init_cache(
        kv, batch=batch, max_len=max_len, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, dtype=dtype,
    ))  # fmt: skip


def abstract_window(cfg: ModelConfig, *, batch: int, max_len: int, dtype=jnp.bfloat16):
    """One sliding-window layer's ring (``models.window.WindowCache``) as ShapeDtypeStructs."""
    if not cfg.local_layers:
        raise ValueError(
            f"local_layers={cfg.local_layers}: the config has no sliding-window layers"
        )
    size = mwin.ring_size(cfg.sliding_window, max_len)
    return jax.eval_shape(
        lambda: mwin.init(batch, cfg.num_kv_heads, cfg.head_dim, size, jnp.dtype(dtype))
    )


def abstract_decode_caches(cfg: ModelConfig, kv: oj.KVQuantConfig, *, batch: int, max_len: int,
                           dtype=jnp.bfloat16) -> tuple:  # fmt: skip
    """The per-layer caches decoding holds (tuple of L) as ShapeDtypeStructs: a ``KVCache``
    per global layer, a ``WindowCache`` ring per sliding-window layer."""
    one = abstract_cache(cfg, kv, batch=batch, max_len=max_len, dtype=dtype)
    ring = None
    if cfg.local_layers:
        ring = abstract_window(cfg, batch=batch, max_len=max_len, dtype=dtype)
    return tuple(ring if cfg.is_local(i) else one for i in range(cfg.num_layers))


def cache_nbytes(cfg: ModelConfig, kv: oj.KVQuantConfig, *, batch: int, max_len: int,
                 dtype=jnp.bfloat16) -> int:  # fmt: skip
    """Bytes of all the layers' caches (rings included) at ``batch`` x ``max_len``."""
    return abstract_nbytes(abstract_decode_caches(cfg, kv, batch=batch, max_len=max_len,
                                                  dtype=dtype))  # fmt: skip


def max_batch(cfg: ModelConfig, kv: oj.KVQuantConfig, budget_bytes: int, *, max_len: int,
              dtype=jnp.bfloat16, multiple: int = 1) -> int:  # fmt: skip
    """The largest batch (a multiple of ``multiple``; 0 if none) whose caches (``cache_nbytes``:
    every array is per row) fit in ``budget_bytes``; weights and temporaries are the caller's."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int | float | np.number) \
            or not budget_bytes >= 0:  # fmt: skip
        raise ValueError(f"budget_bytes={budget_bytes!r} must be a number >= 0")
    if isinstance(multiple, bool) or not isinstance(multiple, int | np.integer) or multiple < 1:
        raise ValueError(f"multiple={multiple!r} must be a positive int")
    row = cache_nbytes(cfg, kv, batch=1, max_len=max_len, dtype=dtype)
    return int(budget_bytes // row) // multiple * multiple


def abstract_caches(cfg: ModelConfig, kv: oj.KVQuantConfig, *, batch: int, max_len: int,
                    dtype=jnp.bfloat16):  # fmt: skip
    """The model's caches stacked on a layer axis [L, ...] as ShapeDtypeStructs (byte counts).

    Only for models whose layers all hold a ``KVCache``: with sliding-window layers
    (Gemma 3) there is no such stack; ``abstract_decode_caches`` / ``cache_nbytes``."""
    if cfg.local_layers:
        raise ValueError(
            f"local_layers={cfg.local_layers}: the sliding-window layers hold rings, not "
            "KVCaches; use abstract_decode_caches or cache_nbytes"
        )
    one = abstract_cache(cfg, kv, batch=batch, max_len=max_len, dtype=dtype)
    L = cfg.num_layers
    return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct((L, *s.shape), s.dtype), one)


def abstract_nbytes(tree) -> int:
    """Bytes of a pytree of arrays or ShapeDtypeStructs."""
    return int(sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree_util.tree_leaves(tree)))  # fmt: skip


def param_nbytes(cfg: ModelConfig, dtype=jnp.bfloat16) -> int:
    return abstract_nbytes(nnx.state(abstract_model(cfg, dtype), nnx.Param))


def memory_table(configs: dict[str, ModelConfig], contexts=(32768, 131072), batch: int = 1):
    """Rows (model, context, bf16 bytes, int2 bytes, ratio) of KV-cache capacity per sequence
    (Gemma 3: its rings, the same in both columns, included)."""
    rows = []
    for name, cfg in configs.items():
        for ctx in contexts:
            bf = cache_nbytes(cfg, oj.preset("bf16"), batch=batch, max_len=ctx)
            q = cache_nbytes(cfg, oj.preset("oscar", bits=2), batch=batch, max_len=ctx)
            rows.append((name, ctx, bf, q, bf / q))
    return rows


def format_table(rows) -> str:
    gib = 1024**3
    lines = [
        "| model | context | BF16 KV cache | OScaR INT2 KV cache | ratio |",
        "|---|---|---|---|---|",
    ]
    for name, ctx, bf, q, r in rows:
        lines.append(
            f"| {name} | {ctx // 1024}K | {bf / gib:.2f} GiB | {q / gib:.3f} GiB | {r:.2f}x |"
        )
    return "\n".join(lines)


def full_size_table() -> str:
    """The KV-cache table of full-size models (``oscar-jax memory``): Llama-3.1-8B, Qwen3-8B
    and Qwen3-30B-A3B at 32K and 128K; gemma-3-270m at its 32K maximum (15 of its 18 layers
    keep a 512-token full-precision ring, the same in both columns)."""
    rows = memory_table(
        {"Llama-3.1-8B": llama31_8b(), "Qwen3-8B": qwen3_8b(), "Qwen3-30B-A3B": qwen3_30b_a3b()}
    )
    rows += memory_table({"gemma-3-270m": gemma3_270m()}, contexts=(32768,))
    return format_table(rows)
