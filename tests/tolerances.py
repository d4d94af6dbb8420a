"""The one table of numeric tolerances, per dtype, used by every comparison test.

rtol/atol apply elementwise (chex.assert_trees_all_close); ``max_rel`` bounds
max|out - ref| / max|ref| for attention outputs of a kernel against its reference.
"""

import jax.numpy as jnp

TOL = {
    jnp.dtype(jnp.float32): dict(rtol=1e-5, atol=1e-5, max_rel=1e-4),
    jnp.dtype(jnp.float16): dict(rtol=2e-3, atol=2e-3, max_rel=5e-3),
    jnp.dtype(jnp.bfloat16): dict(rtol=1e-2, atol=1e-2, max_rel=1e-2),
}


def tol(dtype) -> dict:
    return TOL[jnp.dtype(dtype)]


# Quantizer kernels against the XLA encoder: fraction of codes allowed off by one
# (an exact rounding tie moved by a different reduction order or division), and
# ulps allowed on scales / zeros / norms (of their 16-bit dtype).
QUANT_CODES_OFF_BY_ONE = {"interpret": 1e-4, "gpu": 0.025}  # measured: 0 and <= 1.9 %
QUANT_PARAM_ULPS = 1
