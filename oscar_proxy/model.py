"""The training half of the proxy model: recipe, Llama forward with fused attention, AdamW step.

The forward is ``models.layers``' decoder (the same norms, projections, RoPE and
MLP the inference model runs) with ``jax.nn.dot_product_attention`` in place of
the reference attention: cuDNN flash attention on GPU, XLA elsewhere. Params are
float32 masters, cast to ``compute_dtype`` (bfloat16) inside the step. The state
(params, optimizer, step) is saved as one npz + a json, replaced atomically.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from models import layers
from models.config import ModelConfig
from oscar_jax import gpu_available


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that fixes the result of a run (a resumed run must match it)."""

    hidden: int = 384
    layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 128
    intermediate: int = 768
    seq_len: int = 2048
    batch: int = 64
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 200
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip: float = 1.0
    passkey_frac: float = 0.125
    seed: int = 0
    rope_theta: float = 10000.0
    compute_dtype: str = "bfloat16"
    corpus_sha256: str = ""


def model_config(r: Recipe, vocab: int, bos: int, eos: int) -> ModelConfig:
    return ModelConfig(
        family="llama", vocab_size=vocab, hidden_size=r.hidden, intermediate_size=r.intermediate,
        num_layers=r.layers, num_heads=r.heads, num_kv_heads=r.kv_heads, head_dim=r.head_dim,
        rms_norm_eps=1e-5, rope_theta=r.rope_theta, max_position_embeddings=r.seq_len,
        tie_word_embeddings=True, bos_token_id=bos, eos_token_ids=(eos,),
    )  # fmt: skip


def init_params(cfg: ModelConfig, seed: int) -> dict:
    """float32 params: N(0, 0.02) matrices and embeddings, ones for norms (Llama's init)."""
    shapes = layers.param_shapes(cfg)
    flat = [("", k, s) for k, s in shapes.items() if k != "layers"]
    flat += [("layers", k, s) for k, s in shapes["layers"].items()]
    keys = jax.random.split(jax.random.PRNGKey(seed), len(flat))
    out: dict = {"layers": {}}
    for key, (grp, name, shape) in zip(keys, sorted(flat), strict=True):
        val = (jnp.ones(shape, jnp.float32) if "norm" in name
               else 0.02 * jax.random.normal(key, shape, jnp.float32))  # fmt: skip
        (out["layers"] if grp else out)[name] = val
    return out


@jax.custom_vjp
def embed_lookup(table, ids):
    """table[ids]; the gradient is a one-hot matmul (deterministic, no scatter-add)."""
    return jnp.take(table, ids, axis=0)


def _embed_fwd(table, ids):
    return jnp.take(table, ids, axis=0), (ids, jnp.zeros((0,), table.dtype), table.shape[0])


def _embed_bwd(res, g):
    ids, proto, vocab = res
    oh = jax.nn.one_hot(ids.reshape(-1), vocab, dtype=g.dtype)
    d = jnp.einsum("nv,nh->vh", oh, g.reshape(-1, g.shape[-1]), preferred_element_type=jnp.float32)
    return d.astype(proto.dtype), None


embed_lookup.defvjp(_embed_fwd, _embed_bwd)


def forward_train(cfg: ModelConfig, p: dict, ids, impl: str | None):
    """Hidden states [B, T, Hd] of ids [B, T]: ``layers.block`` with fused causal attention."""
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = embed_lookup(p["embed"], ids)
    for i in range(cfg.num_layers):
        lp = {k: v[i] for k, v in p["layers"].items()}
        attend = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True, implementation=impl
        )
        x, _ = layers.block(cfg, lp, x, pos, attend)
    return x


def token_losses(cfg, params, rows, impl, dtype):
    """Per-token cross-entropy [B, T] of rows [B, T+1] (float32 logits)."""
    p = jax.tree.map(lambda a: a.astype(dtype), params)
    x = forward_train(cfg, p, rows[:, :-1], impl)
    logits = layers.lm_head(cfg, p, x)
    tgt = jnp.sum(logits * jax.nn.one_hot(rows[:, 1:], cfg.vocab_size, dtype=logits.dtype), -1)
    return jax.nn.logsumexp(logits, axis=-1) - tgt, logits


def lr_at(r: Recipe, step, total):
    """Linear warmup to r.lr over r.warmup steps, then cosine to r.lr * r.min_lr_frac at total."""
    s = jnp.asarray(step, jnp.float32) + 1.0
    warm = r.lr * s / r.warmup
    prog = jnp.clip((s - r.warmup) / jnp.maximum(jnp.asarray(total, jnp.float32) - r.warmup, 1.0),
                    0.0, 1.0)  # fmt: skip
    lo = r.lr * r.min_lr_frac
    return jnp.where(s <= r.warmup, warm, lo + (r.lr - lo) * 0.5 * (1 + jnp.cos(jnp.pi * prog)))


def optimizer(r: Recipe, params) -> optax.GradientTransformation:
    decay = lambda path, _: "norm" not in jax.tree_util.keystr(path)  # not on norm weights
    mask = jax.tree_util.tree_map_with_path(decay, params)
    return optax.chain(
        optax.clip_by_global_norm(r.clip), optax.scale_by_adam(r.b1, r.b2, 1e-8),
        optax.add_decayed_weights(r.weight_decay, mask),
    )  # fmt: skip


def attention_impl(dtype: str) -> str:
    gpu = gpu_available()
    return "cudnn" if gpu and dtype == "bfloat16" else "xla"


def make_step(cfg: ModelConfig, r: Recipe, tx, impl: str):
    dtype = jnp.dtype(r.compute_dtype)

    def loss_fn(params, rows):
        return jnp.mean(token_losses(cfg, params, rows, impl, dtype)[0])

    def step(params, opt_state, rows, step, total):
        loss, grads = jax.value_and_grad(loss_fn)(params, rows)
        gnorm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        upd, opt_state = tx.update(grads, opt_state, params)
        lr = lr_at(r, step, total)
        params = jax.tree.map(lambda p, u: p - lr * u, params, upd)
        return params, opt_state, loss, gnorm

    return jax.jit(step, donate_argnums=(0, 1))


# -- state on disk ----------------------------------------------------------------------
def save_state(d: str, params, opt_state, step: int, meta: dict) -> None:
    """params + optimizer state (npz) and meta (json), each replaced atomically."""
    os.makedirs(d, exist_ok=True)
    leaves = jax.tree_util.tree_flatten_with_path((params, opt_state))[0]
    arrays = {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
    arrays["__step__"] = np.asarray(step, np.int64)
    with open(os.path.join(d, "state.npz.tmp"), "wb") as f:
        np.savez(f, **arrays)
    with open(os.path.join(d, "meta.json.tmp"), "w") as f:
        json.dump({**meta, "step": step}, f, indent=1)
    os.replace(os.path.join(d, "state.npz.tmp"), os.path.join(d, "state.npz"))
    os.replace(os.path.join(d, "meta.json.tmp"), os.path.join(d, "meta.json"))


def load_state(d: str, params, opt_state):
    """-> (params, opt_state, meta) with the structure of the given (freshly built) ones."""
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    z = np.load(os.path.join(d, "state.npz"))
    if int(z["__step__"]) != meta["step"]:
        raise ValueError(f"{d}: state.npz (step {int(z['__step__'])}) and meta.json disagree")
    leaves, tree = jax.tree_util.tree_flatten_with_path((params, opt_state))
    out = []
    for k, v in leaves:
        a = z[jax.tree_util.keystr(k)]
        if a.shape != v.shape or a.dtype != v.dtype:
            raise ValueError(f"{d}: {jax.tree_util.keystr(k)} is {a.shape} {a.dtype}, "
                             f"expected {v.shape} {v.dtype}")  # fmt: skip
        out.append(jnp.asarray(a))
    params, opt_state = jax.tree_util.tree_unflatten(tree, out)
    return params, opt_state, meta
