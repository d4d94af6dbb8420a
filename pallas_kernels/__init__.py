"""Pallas GPU kernels for the OScaR cache, one folder per op; without a GPU they run in
Pallas interpret mode.

- ``decode``: INT2/INT4 split-K flash-decoding and its merge (``decode.triton``, lowered
  through Triton), the BF16 split-K kernel, launch configs.
- ``quantize``: the fused rotate / norm / quantize / pack encoder (``quantize.triton``).
- ``cache_write``: one layer's decode-step cache update in one launch.

Nothing registers itself: ``oscar_jax.backends.TABLES`` names these functions as the
``"triton"`` backend of each op and imports them on first use.
"""
