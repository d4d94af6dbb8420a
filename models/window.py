"""The cache of a sliding-window (local) attention layer: a full-precision ring of the window.

Gemma 3's local layers attend to the last ``sliding_window`` tokens only (a query at
position p sees keys at p - W < j <= p). Their cache is a ring of S = min(W, max_len)
slots per row in the cache dtype (token t in slot t mod S), not the OScaR cache:

* it is small: S tokens whatever the context (gemma-3-270m: W = 512, 15 of 18 layers),
  so at long context the local layers' bytes are a small share of the global layers'
  INT2 caches, and quantizing them would save little;
* it is exact: no quantization error in 5 of every 6 layers, so the measured effect of a
  KV preset is the global layers' alone;
* eviction is free: the slot a new token takes holds the token that just left the
  window; an INT2 cache would keep (or have to re-pack) groups that aged out.

Rows of a ragged batch are independent (each row's slots follow its own length), and a
prefill of n tokens followed by appends gives the same ring as appending all n.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from oscar_jax import persistence

HIGHEST = jax.lax.Precision.HIGHEST


@persistence.register_node  # oscar_jax.save_state / load_state handle rings
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowCache:
    """One local layer's ring: ``k``, ``v`` [B, Hkv, S, D]; ``lengths``, ``flags`` [B] int32
    (tokens seen per row; flags always 0: a ring never overflows)."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    flags: jax.Array

    @property
    def size(self) -> int:
        return self.k.shape[2]


def ring_size(window: int, max_len: int) -> int:
    """Slots of a local layer's ring: the window, or the whole cache if that is shorter."""
    return int(min(window, max_len))


def init(batch: int, heads: int, head_dim: int, size: int, dtype) -> WindowCache:
    """An empty ring of ``size`` slots per row."""
    for name, val in (("batch", batch), ("heads", heads), ("head_dim", head_dim),
                      ("size", size)):  # fmt: skip
        if not isinstance(val, int | np.integer) or val < 1:
            raise ValueError(f"{name}={val!r} must be a positive int")
    z = jnp.zeros((batch, heads, size, head_dim), dtype)
    n = jnp.zeros((batch,), jnp.int32)
    return WindowCache(z, z, n, n)


def prefill(c: WindowCache, k, v, lengths) -> WindowCache:
    """The ring after a prompt: k, v [B, T, Hkv, D] (post-RoPE), lengths [B] (tokens per row).

    Slot s holds the newest token t < n with t = s (mod S); slots no token reached stay zero.
    """
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != c.k.shape[0]:
        raise ValueError(f"k.shape={k.shape} v.shape={v.shape} must be equal [B, T, Hkv, D]")
    s, t = c.size, k.shape[1]
    n = lengths.astype(jnp.int32)[:, None]  # [B, 1]
    slot = jnp.arange(s, dtype=jnp.int32)[None]  # [1, S]
    pos = slot + s * jnp.floor_divide(n - 1 - slot, s)  # newest t < n with t = slot (mod S)
    ok = (pos >= 0) & (slot < n)  # [B, S]
    idx = jnp.clip(pos, 0, t - 1)

    def gather(x):  # [B, T, H, D] -> [B, H, S, D]
        g = jnp.take_along_axis(x, idx[:, :, None, None], axis=1)
        g = jnp.where(ok[:, :, None, None], g, 0).astype(c.k.dtype)
        return jnp.swapaxes(g, 1, 2)

    return WindowCache(gather(k), gather(v), lengths.astype(jnp.int32), c.flags)


def append(c: WindowCache, k_t, v_t) -> WindowCache:
    """One token per row: k_t, v_t [B, Hkv, D] into slot lengths mod S."""
    if k_t.shape != v_t.shape or k_t.shape != (c.k.shape[0], c.k.shape[1], c.k.shape[3]):
        raise ValueError(f"k_t.shape={k_t.shape} must be [B, Hkv, D] = {c.k.shape[:2]}+D")
    slot = jnp.remainder(c.lengths, c.size)
    hit = (jnp.arange(c.size)[None, :] == slot[:, None])[:, None, :, None]  # [B, 1, S, 1]
    k = jnp.where(hit, k_t[:, :, None].astype(c.k.dtype), c.k)
    v = jnp.where(hit, v_t[:, :, None].astype(c.v.dtype), c.v)
    return WindowCache(k, v, c.lengths + 1, c.flags)


def attention(q, c: WindowCache):
    """q [B, Hq, D] (its token already appended) over the ring -> [B, Hq, D] float32.

    Scores scaled by 1/sqrt(D), softmax in float32 over the row's filled slots (all S
    once the row has S tokens: the ring then holds exactly the window)."""
    b, hq, d = q.shape
    h = c.k.shape[1]
    qg = q.astype(jnp.float32).reshape(b, h, hq // h, d)
    s = jnp.einsum("bhgd,bhsd->bhgs", qg, c.k.astype(jnp.float32), precision=HIGHEST)
    s = s * (1.0 / np.sqrt(d))
    filled = (jnp.arange(c.size)[None, :] < c.lengths[:, None])[:, None, None]  # [B,1,1,S]
    s = jnp.where(filled, s, -jnp.inf)
    p = jnp.where(filled, jax.nn.softmax(s, axis=-1), 0.0)
    o = jnp.einsum("bhgs,bhsd->bhgd", p, c.v.astype(jnp.float32), precision=HIGHEST)
    return o.reshape(b, hq, d)


def nbytes(c: WindowCache) -> int:
    """Bytes the ring holds (its whole capacity)."""
    return int(sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in (c.k, c.v)))
