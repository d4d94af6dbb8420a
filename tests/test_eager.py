"""``oscar_jax.eager.compiled``: public ops compile once when called eagerly, run as written
under a trace, and still raise their own ValueError for bad arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oscar_jax as oj
from oscar_jax.eager import compiled

TRACES = []


@compiled(arrays=("x", "extra"))
def _op(x, scale, extra=None, *, name="op", **options):
    TRACES.append((type(x).__name__, scale, name, tuple(sorted(options))))
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"x.shape={getattr(x, 'shape', None)} must be [rows, cols]")
    y = x * scale
    return y if extra is None else y + extra["a"]


def test_eager_calls_compile_once_per_shape_and_static_args():
    TRACES.clear()
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(_op(x, 2.0), 2.0 * x)
    np.testing.assert_array_equal(_op(x + 1, 2.0), 2.0 * (x + 1))  # cached: no new trace
    assert len(TRACES) == 1 and TRACES[0][0] != "ArrayImpl"  # traced, not run eagerly
    _op(x, 3.0)  # a new static value
    _op(x, 3.0, tile=4)  # a new **options entry (static)
    _op(jnp.ones((4, 3)), 3.0)  # a new shape
    assert len(TRACES) == 4
    np.testing.assert_array_equal(_op(x, 1.0, {"a": np.ones(3)}), x + 1)  # pytree of arrays


def test_under_a_trace_the_function_runs_as_written():
    TRACES.clear()
    x = jnp.ones((2, 3))
    out = jax.jit(lambda x: _op(x, 2.0, name="inner"))(x)
    np.testing.assert_array_equal(out, 2.0 * x)
    assert [t[2] for t in TRACES] == ["inner"]  # traced once, with the outer jit
    g = jax.grad(lambda x: jnp.sum(_op(x, 3.0)))(x)
    np.testing.assert_array_equal(g, 3.0 * x)


def test_bad_arguments_reach_the_functions_own_checks():
    with pytest.raises(ValueError, match="x.shape"):
        _op("not an array", 2.0)  # not traceable: called directly
    with pytest.raises(ValueError, match="x.shape"):
        _op(jnp.ones(3), 2.0)  # traced: the shape check raises at trace time
    with pytest.raises(TypeError):
        _op(jnp.ones((2, 3)))  # missing argument: Python's own error
    out = _op(jnp.ones((2, 3)), 2.0, name=["unhashable"])  # unhashable static: direct call
    np.testing.assert_array_equal(out, 2.0 * jnp.ones((2, 3)))


def test_public_ops_eager_equal_jit():
    """The decorated cache ops give the same bits eagerly and inside a user's jit."""
    cfg = oj.preset("oscar", bits=2)
    kk = jax.random.split(jax.random.PRNGKey(0), 4)
    k = jax.random.normal(kk[0], (2, 200, 2, 64), jnp.bfloat16)
    v = jax.random.normal(kk[1], (2, 200, 2, 64), jnp.bfloat16)
    q = jax.random.normal(kk[2], (2, 8, 64), jnp.bfloat16)
    lens = jnp.asarray([200, 77], jnp.int32)
    cache = oj.init_cache(cfg, batch=2, max_len=320, num_kv_heads=2, head_dim=64)

    def run(cache, k, v, q, lens):
        c = oj.prefill(cache, k, v, lens)
        c = oj.append(c, k[:, 0], v[:, 0])
        return c, oj.decode_attention(q, c), oj.dequantize(c)

    eager = run(cache, k, v, q, lens)
    jitted = jax.jit(run)(cache, k, v, q, lens)
    leaves = jax.tree_util.tree_leaves
    for a, b in zip(leaves(eager), leaves(jitted), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="lengths"):
        oj.prefill(cache, k, v, [200, 77, 5])
    with pytest.raises(ValueError, match="cache"):
        oj.decode_attention(q, "not a cache")
