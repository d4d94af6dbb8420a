"""Which accelerator this process sees (kernel dispatch and interpret-mode defaults)."""

from __future__ import annotations

import jax


def gpu_available() -> bool:
    """True when JAX sees a GPU; False without one or when no backend initialises."""
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False
