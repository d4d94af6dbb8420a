"""INT2 / INT4 split-K decode attention in Pallas Mosaic GPU (Hopper, sm_90).

The "mosaic" backend of ``oscar_jax.decode_attention`` (``backend``): it reads the
"record" layout (below; ``oscar_jax.record``), which a cache of
``KVQuantConfig(layout="record")`` holds natively (prefill and the decode-time flushes write
it), so a call reads the cache as it is. A planar cache is refused, or converted on every
call with ``decode_attention_mosaic(..., convert=True)`` (exact, but it reads and writes the
whole quantized part: a check of the kernel, not for speed). The kernel's own timings and
where its time goes: BENCHMARKS.md, "Mosaic GPU decode". Covered: INT2 and INT4 (records
of 4 D (bits + 1) words, 1600 / 2560 at D = 128; the kernel reads the width and the head_dim
from the record), head_dim D = 64, 128 or 256, G = 32, 16-bit parameters, GQA ratio <= 16,
per-head or per-token norms (``unsupported_reason``).
The ``int2_*`` names are historical: they take either width. The kernels need jax >=
0.11.2; the layout functions run on any backend. Modules: ``_config``
(``Int2DecodeConfig``), ``_dequant`` (in-register unpack into wgmma fragments), ``_kernel``
(the split-K partials), ``_merge`` (the ring and LSE merge, in XLA or a second launch),
``_cache`` (the cache in, the output out), ``backend`` (the backend table's entry; fails to
import where the kernel cannot run). Entry points (the record layout itself:
``oscar_jax.record``):

  * ``fragment_layout(k_codes, k_scale, k_zero, k_norm, v_codes, v_scale, v_zero, *,
    param_dtype, block_tokens) -> (rec, kn)``: planar cache arrays -> this kernel's layout
    (exact); ``fragment_layout_inverse(rec, kn, lq, *, param_dtype)`` its inverse.
  * ``int2_decode_attention_2launch(q, q_rot, rec, kn, nq, k_res, v_res, lengths, *,
    cfg, softmax_scale, param_dtype, out_dtype, flags, poison) -> [B, H, g, D]``: the
    decode call in two Mosaic GPU launches (split-K partials; ring + LSE merge, which writes
    the output in its final layout and dtype, flagged rows NaN); XLA is left the query's
    rotation (a GEMM), nq and the ring query's transpose (the warp kernel pairs the rotated
    query itself, the ring walks find their valid slots from nq and lengths).
    Values must be in the original basis (no run-time un-rotation).
  * ``int2_decode_attention_1launch(...same..., out_dtype, flags, poison)``: the whole
    call in one launch of the warp kernel (one split a (b, h); its CTA walks the ring after
    its records and stores the output): for batches that fill the GPU without splits.
  * ``int2_decode_attention(...same..., unrotate=None)``: the partials kernel + the ring
    and merge in XLA (~10 small fusions), with an optional value un-rotation.
  * ``int2_decode_attention_fused(...same..., unrotate=None)``: the ring as one more split of
    the partials kernel (K / V tiles from shared memory), then one LSE merge in XLA.
  * ``int2_decode_partials(q_rot, rec, kn, nq, *, cfg, ...) -> (acc, m, l)``: the kernel
    alone (split partials, log2 units), e.g. for sequence-sharded callers.

Math (per batch row b, KV head h, query head i of its GQA group; rotated basis):
  key   k_t[c] = norm_t * (code_k[t, c] * ks[t // G, c] + kz[t // G, c])
  value v_t[c] = code_v[t, c] * vs[t, c // G] + vz[t, c // G]
  s_t = q_i . k_t * softmax_scale;  out = sum_t softmax(s)_t v_t   (ring merged by LSE)

Kernel design (one CTA = one warpgroup of 128 threads = one (b, h, split)):
  * Tokens are the wgmma M dimension (64 per tile), the GQA query heads the N dimension
    (padded to 16: a 16-bit B operand in shared memory needs N >= 16 in Mosaic GPU).
    Keys: S^T[64, 16] = K[64 tok, D] @ Q^T[D, 16] (m64n16k16 x 8); values:
    O^T[D, 16] += V^T[D, 64 tok] @ P^T[64 tok, 16] (D / 64 channel blocks of M = 64; P^T
    goes registers -> shared memory -> wgmma B operand).
  * The A operands (K, V^T) are dequantized in registers straight into the wgmma
    register-fragment layout: each thread reads its own 16 bytes of codes a tensor at INT2
    (one LDS.128; 32 bytes, two loads, at INT4) and turns them into f16x2 / bf16x2 pairs
    (``_dequant.plane_plan``, emulated per thread on the CPU) by shift, AND/OR onto the
    magic number (0x6400 f16 = 1024, 0x4300 bf16 = 128), subtract the magic (exact), one
    FMA with the scale/zero pair. No layout conversion, no shared-memory round trip of the operand.
  * The cache is read as one "record" per 64 tokens (codes + scales + zeros of K and V,
    1600 uint32 words at INT2 and 2560 at INT4 for D = 128, permuted at quantize time so that every
    thread's parameters are 16-byte vectors) plus a f32 norm vector: two TMA copies per
    block, pipelined by ``plgpu.emit_pipeline``.
  * Online softmax (base 2, log2(e) folded into the query) per block of ``block_tokens``;
    the row sums are kept per element and reduced once at the end.

The record layout of a 64-token tile and the norms' shape: ``oscar_jax.record``'s docstring.
Head_dim 64, 128 or 256, G = 32 (key token groups and value channel groups), 16-bit
parameters (float16 or bfloat16, the dequantization dtype follows them), INT2 or INT4 only.
"""

from oscar_jax.record import (
    OFFSETS,
    TILE,
    WORDS,
    D,
    G,
    fragment_layout,
    fragment_layout_inverse,
    offsets,
    record_words,
)
from pallas_kernels.decode.mosaic._cache import (
    MERGES,
    STAGE_BYTES,
    auto_merge,
    decode_attention_mosaic,
    default_config,
    kernel_inputs,
    quantized_partial_mosaic,
    unsupported_reason,
)
from pallas_kernels.decode.mosaic._config import LOG2E, NPAD, Int2DecodeConfig, quantized_of
from pallas_kernels.decode.mosaic._kernel import int2_decode_partials
from pallas_kernels.decode.mosaic._merge import (
    int2_decode_attention,
    int2_decode_attention_1launch,
    int2_decode_attention_2launch,
    int2_decode_attention_fused,
    int2_merge_ring,
    merge_partials_with_ring,
    merge_splits_with_ring_split,
    merge_step_for,
)

__all__ = [
    "D", "G", "LOG2E", "MERGES", "NPAD", "OFFSETS", "STAGE_BYTES", "TILE", "WORDS",
    "Int2DecodeConfig",
    "auto_merge", "decode_attention_mosaic", "default_config", "fragment_layout",
    "fragment_layout_inverse",
    "int2_decode_attention", "int2_decode_attention_1launch", "int2_decode_attention_2launch",
    "int2_decode_attention_fused",
    "int2_decode_partials", "int2_merge_ring", "kernel_inputs", "merge_partials_with_ring",
    "merge_splits_with_ring_split", "merge_step_for",
    "offsets", "quantized_of", "quantized_partial_mosaic", "record_words", "unsupported_reason",
]  # fmt: skip
