"""Decode attention over the packed cache: the Triton INT2/INT4 split-K kernel
(``triton``: ``decode_attention_triton``, ``quantized_partial_triton``), its parts
(``int_kernel``, ``tiles``, ``partials``), the split merge (``merge``), the BF16 kernel
(``bf16``) and the launch configuration (``config``)."""
