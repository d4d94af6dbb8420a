"""Public ops that compile themselves when called outside ``jit``.

Called eagerly, a JAX function runs primitive by primitive, and each new shape compiles
every primitive on its own: an eager ``prefill`` of a 4 x 700-token prompt took 12.7 s
on a CPU, the same call under ``jax.jit`` 1.2 s. ``compiled`` gives the public ops the
jitted speed without asking users (or tests) to wrap them.

The decorated function is called as written (no jit) whenever

* an array argument holds a tracer: it is already being traced (inside a user's jit,
  ``scan``, ``vmap`` or ``grad``), so the outer transformation compiles it;
* an array argument holds something that is not an array or a number: the function's own
  validation runs in Python and raises its ``ValueError`` naming the value;
* a non-array argument is unhashable (jit's static arguments must be hashable).

Otherwise it runs through one ``jax.jit`` per decorated function, with the arguments
named in ``arrays`` traced and every other argument (configs, ``implementation``, kernel
options) static. Validation that depends on shapes raises the same ``ValueError`` at
trace time. Results equal the traced-inside-jit results, which is how the models and
benchmarks call these ops.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import jax
import numpy as np

_LEAF_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def _traceable(tree) -> bool:
    """True when every leaf is a concrete array or number (no tracer, nothing else)."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.core.Tracer) or not isinstance(leaf, _LEAF_TYPES):
            return False
    return True


def _hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def compiled(*, arrays: tuple[str, ...]) -> Callable[[Callable], Callable]:
    """Decorator: run ``fn`` under ``jax.jit`` when called eagerly (see the module doc).

    ``arrays`` names the parameters that carry arrays or pytrees of arrays; all other
    parameters (including ``**options``) are static.
    """

    def deco(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)

        @functools.partial(jax.jit, static_argnums=1)
        def jitted(dynamic: dict, static: tuple):
            return fn(**dynamic, **dict(static))

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                return fn(*args, **kwargs)  # let Python report the bad call
            dynamic, static = {}, []
            for name, val in bound.arguments.items():
                if name == var_kw:
                    static.extend(val.items())
                elif name in arrays:
                    dynamic[name] = val
                else:
                    static.append((name, val))
            static = tuple(sorted(static, key=lambda kv: kv[0]))
            if _traceable(dynamic) and all(_hashable(v) for _, v in static):
                return jitted(dynamic, static)
            return fn(*args, **kwargs)

        return wrapper

    return deco
