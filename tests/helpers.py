"""Shared test inputs: fresh random keys/values with planted low-norm sink tokens."""

import jax
import jax.numpy as jnp


def kv_with_sinks(seed, b, t, h, d, dtype=jnp.float32, sinks=(0,), ratio=20.0, massive=2):
    """Random K/V [B,T,H,D]; a few massive key channels; sink keys `ratio` times below median."""
    kk, kv, kc = jax.random.split(jax.random.PRNGKey(seed), 3)
    k = jax.random.normal(kk, (b, t, h, d))
    ch = jax.random.choice(kc, d, (massive,), replace=False)
    k = k.at[..., ch].add(8.0)
    n = jnp.linalg.norm(k, axis=-1, keepdims=True)
    med = jnp.median(n, axis=1, keepdims=True)
    sink = jnp.zeros((t,), bool).at[jnp.asarray([s for s in sinks if s < t], jnp.int32)].set(True)
    k = jnp.where(sink[None, :, None, None], k / n * med / ratio, k)
    v = jax.random.normal(kv, (b, t, h, d))
    return k.astype(dtype), v.astype(dtype)


def query(seed, b, hq, d, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed + 1000), (b, hq, d)).astype(dtype)


def small_cfg(method, **kw):
    import oscar_jax as oj

    if method == "bf16":
        return oj.preset("bf16")
    kw.setdefault("residual_length", 64)
    kw.setdefault("group_size", 32)
    return oj.preset(method, **kw)
