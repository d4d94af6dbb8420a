"""Pallas GPU kernels (lowered through Triton) for the OScaR cache.

Importing this package registers the ``implementation="pallas"`` paths of
``oscar_jax.prefill`` / ``append`` (fused quantize) and
``oscar_jax.decode_attention`` (INT2 flash-decoding: the INT kernel, then
``decode_merge.merge`` over its splits). ``cache_write.fused_update``
is one layer's decode-step cache update in one launch (used by ``models`` when
``encode_implementation="pallas"``). Without a GPU the kernels run in Pallas
interpret mode.
"""

from pallas_kernels import (
    cache_write,  # noqa: E402,F401
    decode,  # noqa: E402,F401  (registers decode_attention "pallas")
    decode_merge,  # noqa: E402,F401
    quantize,  # noqa: E402,F401  (registers implementation="pallas")
)
