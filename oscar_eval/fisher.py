"""Gradients of the loss with respect to every layer's cached keys and values, for
sensitivity-weighted codebooks (KVQuant, arXiv 2401.18079, section 3.3: k-means weighted
by the diagonal Fisher information, the squared gradient of the loss with respect to each
activation).

``layer_grads`` runs the model at full precision over calibration windows with a zero
perturbation added to each layer's post-RoPE K and V where the attention reads them, and
returns the gradients of the windows' summed next-token NLL with respect to those
perturbations. They are returned unsquared: a method that quantizes keys before RoPE
rotates them back first (RoPE is orthogonal), then squares.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models import layers
from models.config import ModelConfig
from models.model import CausalLM


@functools.partial(jax.jit, static_argnums=(0,))
def _grads_jit(mc: ModelConfig, params, ids):
    """ids [N, T] -> dNLL/dk, dNLL/dv, each [L, N, Hkv, T, D] float32."""
    b, t = ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    shape = (mc.num_layers, b, t, mc.num_kv_heads, mc.head_dim)

    def nll(dk, dv):
        def step(x, xs):
            lp, ek, ev = xs

            def attend(q, k, v):
                return layers.causal_attention(q, k + ek.astype(k.dtype), v + ev.astype(v.dtype))

            x, _ = layers.block(mc, lp, x, positions, attend)
            return x, None

        x, _ = jax.lax.scan(step, layers.embed(params, ids, mc), (params["layers"], dk, dv))
        logp = jax.nn.log_softmax(layers.lm_head(mc, params, x[:, :-1]), axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    zeros = jnp.zeros(shape, jnp.float32)
    gk, gv = jax.grad(nll, argnums=(0, 1))(zeros, zeros)
    return jnp.swapaxes(gk, 2, 3), jnp.swapaxes(gv, 2, 3)


def layer_grads(m: CausalLM, windows) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of the summed next-token NLL of windows [N, T] with respect to every
    layer's post-RoPE keys and values, [L, N, Hkv, T, D] float32 (the layout of
    ``oscar_eval.calibrate.layer_kv``). Models with sliding-window layers are refused."""
    if m.config.local_layers:
        raise ValueError("Fisher calibration does not handle sliding-window layers (Gemma 3)")
    gk, gv = _grads_jit(m.config, m.params(), jnp.asarray(m.check_ids(windows)))
    return np.asarray(gk), np.asarray(gv)
