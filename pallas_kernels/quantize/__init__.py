"""The fused encoder of a block of keys and values (``triton.encode``: rotate, token norm,
group quantize, pack in one launch), its float numerics (``numerics``) and the in-kernel
Hadamard rotation (``rotation``)."""
