"""The "mosaic" backend of ``oscar_jax.decode_attention``: the Mosaic GPU INT2 / INT4 kernel
(``pallas_kernels.decode.mosaic``) over a layout='record' cache.

Importing this module fails (ImportError) where the kernel cannot run: jax < 0.11.2, or no
NVIDIA GPU of compute capability >= 9.0 (Hopper). ``oscar_jax.backends`` turns that into a
ValueError naming the backend and the reason, so nothing falls back silently.
"""

from __future__ import annotations

import jax

from oscar_jax.devices import gpu_available
from pallas_kernels.decode.mosaic import decode_attention_mosaic, quantized_partial_mosaic


def unavailable_reason() -> str | None:
    """Why the Mosaic GPU kernel cannot run here (None: it can)."""
    version = tuple(int(x) for x in jax.__version__.split(".")[:3] if x.isdigit())
    if version < (0, 11, 2):
        return f"jax {jax.__version__}: the Mosaic GPU kernels need jax >= 0.11.2"
    if not gpu_available():
        return "no GPU: the Mosaic GPU kernels need an NVIDIA Hopper (sm_90) GPU or newer"
    cc = getattr(jax.devices("gpu")[0], "compute_capability", "0")
    if float(cc) < 9.0:
        return f"GPU compute capability {cc}: the Mosaic GPU kernels need >= 9.0 (Hopper)"
    return None


_WHY = unavailable_reason()
if _WHY is not None:
    raise ImportError(_WHY)


def decode_attention(q, cache, *, softmax_scale=None, **options):
    """``decode_attention(q [B, Hq, D], cache, implementation="mosaic")`` -> [B, Hq, D].

    ``cache``: layout='record' (``KVQuantConfig(layout="record")``; a planar cache is a
    ValueError: converting it every step would read and write the whole cache). Options:
    ``cfg`` (``Int2DecodeConfig``), ``merge`` ("auto", "xla", "mosaic"). FLAG_NONFINITE
    rows come back NaN."""
    return decode_attention_mosaic(q, cache, softmax_scale=softmax_scale, **options)


def quantized_partial(q_rot, cache, scale, *, offset=0, **options):
    """The "mosaic" entry of ``quantized_partial`` (a sequence shard's quantized part;
    ``oscar_jax.sharding``): a layout='record' cache. Option: ``cfg``."""
    return quantized_partial_mosaic(q_rot, cache, scale, offset=offset, **options)
