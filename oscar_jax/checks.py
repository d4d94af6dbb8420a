"""Checked mode: turn the cache's per-row flags into ``checkify`` errors naming the row.

Under ``jit`` the cache never raises: a full row (``FLAG_OVERFLOW``), NaN/Inf input
or an encoding that overflowed float32 (``FLAG_NONFINITE``) and a clipped prefill
length (``FLAG_BAD_LENGTH``) are recorded in ``cache.flags`` [B] (sticky). This
module surfaces them::

    from jax.experimental import checkify
    import oscar_jax as oj

    def step(cache, k, v, q):
        cache = oj.append(cache, k, v)
        oj.check_cache(cache)                   # a checkify.check per flag kind
        return cache, oj.decode_attention(q, cache)

    err, (cache, out) = jax.jit(checkify.checkify(step))(cache, k, v, q)
    err.throw()   # JaxRuntimeError: "oscar_jax cache: FLAG_NONFINITE in row 3 (flags=2) ..."

or in one go: ``cache, out = oj.checked(step)(cache, k, v, q)`` (checks every KVCache
in the output, jit-compiles, raises). ``check_cache`` also takes caches stacked on
leading (layer) axes: the flags are OR-ed over those axes and the row is the batch
index. ``flag_names`` decodes a flags value on the host (e.g. ``generate``'s
``info["flags"]``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from oscar_jax.cache import FLAG_BAD_LENGTH, FLAG_NONFINITE, FLAG_OVERFLOW, KVCache

FLAGS: tuple[tuple[int, str, str], ...] = (
    (FLAG_OVERFLOW, "FLAG_OVERFLOW", "an append found the row full (max_len); token dropped"),
    (FLAG_NONFINITE, "FLAG_NONFINITE", "a key or value was NaN/Inf or overflowed float32"),
    (FLAG_BAD_LENGTH, "FLAG_BAD_LENGTH", "prefill got a length outside [0, T]; it was clipped"),
)
ALL_FLAGS = FLAG_OVERFLOW | FLAG_NONFINITE | FLAG_BAD_LENGTH


def flag_names(flags: int) -> list[str]:
    """Host-side: the names of the FLAG_* bits set in one row's flags value."""
    flags = int(flags)
    return [name for bit, name, _ in FLAGS if flags & bit]


def row_flags(cache: KVCache) -> jax.Array:
    """flags [B] of a cache, OR-ed over any leading (e.g. stacked-layer) axes."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache={type(cache).__name__} must be a KVCache")
    f = cache.flags
    return jnp.bitwise_or.reduce(f.reshape(-1, f.shape[-1]), axis=0)


def check_cache(cache: KVCache, *, mask: int = ALL_FLAGS, what: str = "cache") -> None:
    """``checkify.check`` that no row has a flag in ``mask``; the error names row and flags.

    Use inside a function transformed by ``checkify.checkify`` (jit or not); called
    eagerly outside ``checkify`` it raises at once. One check per flag kind, each
    naming the first row that has it.
    """
    f = row_flags(cache)
    for bit, name, meaning in FLAGS:
        if not mask & bit:
            continue
        bad = (f & bit) != 0
        row = jnp.argmax(bad).astype(jnp.int32)
        checkify.check(
            ~jnp.any(bad),
            f"oscar_jax {what}: {name} in row {{row}} (flags={{flags}}, {{count}} rows): {meaning}",
            row=row,
            flags=f[row],
            count=jnp.sum(bad).astype(jnp.int32),
        )


def check_finite(x: jax.Array, what: str = "output") -> None:
    """``checkify.check`` that x [B, ...] is finite; the error names the first bad row."""
    bad = ~jnp.all(jnp.isfinite(x).reshape(x.shape[0], -1), axis=1)
    checkify.check(
        ~jnp.any(bad),
        f"oscar_jax {what}: non-finite values in row {{row}}",
        row=jnp.argmax(bad).astype(jnp.int32),
    )


def _caches_in(tree) -> list[KVCache]:
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, KVCache))
    return [x for x in leaves if isinstance(x, KVCache)]


def checked(fn, *, mask: int = ALL_FLAGS, jit: bool = True, errors=checkify.user_checks):
    """``fn`` that raises (``JaxRuntimeError``) when a KVCache it returns has a flagged row.

    Every ``KVCache`` in fn's output (and every ``check_cache`` / ``checkify.check`` inside
    fn) is checked; ``errors`` adds checkify's automatic checks (e.g.
    ``checkify.float_checks`` to also catch NaN produced anywhere). ``jit=False`` runs
    the checkified function eagerly.
    """

    def body(*args, **kwargs):
        out = fn(*args, **kwargs)
        for c in _caches_in(out):
            check_cache(c, mask=mask)
        return out

    cf = checkify.checkify(body, errors=errors)
    if jit:
        cf = jax.jit(cf)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        err, out = cf(*args, **kwargs)
        err.throw()
        return out

    return wrapper


def describe_rows(flags) -> dict[int, list[str]]:
    """Host-side: {row: [flag names]} for every row with a flag set (flags [B] or [L, B])."""
    f = np.asarray(flags)
    f = np.bitwise_or.reduce(f.reshape(-1, f.shape[-1]), axis=0)
    return {int(i): flag_names(v) for i, v in enumerate(f) if v}
