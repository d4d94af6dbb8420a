"""KV-cache memory of full-size models from shapes only (``jax.eval_shape``: nothing allocated)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import oscar_jax as oj
from models.config import ModelConfig, llama31_8b, qwen3_8b
from models.model import abstract_model


def abstract_cache(cfg: ModelConfig, kv: oj.KVQuantConfig, *, batch: int, max_len: int,
                   dtype=jnp.bfloat16):  # fmt: skip
    """One layer's cache [B, ...] as ShapeDtypeStructs (``models.generate`` holds L of them)."""
    if kv.rotate_values:  # the model folds the value rotation; the cache stores values as given
        kv = kv.replace(rotate_values=False)
    return jax.eval_shape(lambda: oj.init_cache(
        kv, batch=batch, max_len=max_len, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, dtype=dtype,
    ))  # fmt: skip


def abstract_caches(cfg: ModelConfig, kv: oj.KVQuantConfig, *, batch: int, max_len: int,
                    dtype=jnp.bfloat16):  # fmt: skip
    """The model's caches stacked on a layer axis [L, ...] as ShapeDtypeStructs (byte counts)."""
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
    """Rows (model, context, bf16 bytes, int2 bytes, ratio) of KV-cache capacity per sequence."""
    rows = []
    for name, cfg in configs.items():
        for ctx in contexts:
            bf = abstract_nbytes(abstract_caches(cfg, oj.preset("bf16"), batch=batch, max_len=ctx))
            q = abstract_nbytes(
                abstract_caches(cfg, oj.preset("oscar", bits=2), batch=batch, max_len=ctx)
            )
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
    """The KV-cache table of Llama-3.1-8B and Qwen3-8B at 32K and 128K (``oscar-jax memory``)."""
    return format_table(memory_table({"Llama-3.1-8B": llama31_8b(), "Qwen3-8B": qwen3_8b()}))
