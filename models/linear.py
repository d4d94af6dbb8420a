"""Projections shared by the decoder block and the experts: ``dense`` (x @ W for a weight
stored [in, out] or ``Transposed`` [out, in]) and the gated MLP's activation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.config import ModelConfig

HIGHEST = jax.lax.Precision.HIGHEST


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Transposed:
    """A projection weight stored ``[out, in]``: how the per-layer (decoding) form keeps them.

    At batch 1 XLA turns ``x @ W`` into a reduce fusion over W's rows; with ``[in, out]``
    that reduces the major axis and only the output columns run in parallel, with
    ``[out, in]`` it reduces the contiguous axis and streams the weights at ~90% of the
    copy rate on the H200 (BENCHMARKS.md). At batch 48 both run alike (cuBLAS).
    """

    w: jax.Array  # [out, in]


def dense(x, w, b=None):
    """x [..., in] @ w -> [..., out]: w is [in, out] or ``Transposed`` ([out, in])."""
    f32 = jnp.float32
    if isinstance(w, Transposed):
        y = jnp.einsum("...i,oi->...o", x, w.w, precision=HIGHEST, preferred_element_type=f32)
    else:
        y = jnp.einsum("...i,io->...o", x, w, precision=HIGHEST, preferred_element_type=f32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def activation(cfg: ModelConfig, g):
    """The gate's activation (float32 in, float32 out)."""
    if cfg.hidden_act == "gelu_tanh":
        return jax.nn.gelu(g, approximate=True)
    return jax.nn.silu(g)
