"""The Mosaic GPU INT2 / INT4 decode kernel's constants and tuning (``Int2DecodeConfig``)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from oscar_jax.cache import quantized_count
from oscar_jax.record import TILE

NPAD = 16  # GQA query heads padded to the wgmma N (16-bit B operands need N >= 16)
LOG2E = 1.4426950408889634


def query_scale(softmax_scale, d: int) -> float:
    """What the query is multiplied by: the softmax scale (None: 1 / sqrt(d)) times log2(e),
    the kernels' softmax being base 2."""
    scale = float(1.0 / np.sqrt(d)) if softmax_scale is None else float(softmax_scale)
    return scale * LOG2E


def scaled_query(q_rot, softmax_scale, heads: int):
    """q_rot [B, H, g, D] -> float32 times ``query_scale``, the query heads zero-padded to
    ``heads``."""
    d, g = q_rot.shape[-1], q_rot.shape[-2]
    qt = q_rot.astype(jnp.float32) * query_scale(softmax_scale, d)
    return jnp.pad(qt, ((0, 0), (0, 0), (0, heads - g), (0, 0)))


KERNEL_QUERY_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def kernel_query(q):
    """The query as the kernels read it (TMA into shared memory, converted there): a float32,
    bfloat16 or float16 query as it is, any other dtype as float32."""
    return q if q.dtype in KERNEL_QUERY_DTYPES else q.astype(jnp.float32)


def quantized_of(x, nq_of):
    """A row's quantized tokens inside a kernel, as the Triton kernel's ``quantized_tokens``:
    with ``nq_of`` (the cache's ``KVQuantConfig``) ``oscar_jax.cache.quantized_count`` of its
    length x; None: x is nq already."""
    return x if nq_of is None else quantized_count(x, nq_of)


WARP_PROBES = ("probe_v1",)  # the warp kernel's timing-only stages


@dataclasses.dataclass(frozen=True)
class Int2DecodeConfig:
    """Tuning of the kernel (validated; frozen so it can be a static jit argument).

    The defaults are the fastest configuration measured at 1 x 128K on the H200 (in-place
    unpack by one LOP3, overlapped key wgmma, 8 splits a merge step; docs/mosaic_decode_notes.md).

    block_tokens: tokens per pipeline step (a multiple of 64).
    splits: split-K programs per (b, h) row; None: chosen so that B * H * splits fills
      the GPU about ``waves`` times; ``waves=None`` balances rounds of ``ctas_per_sm``
      resident programs an SM (``num_splits``).
    max_concurrent_steps: TMA pipeline depth.
    stage: "full" (the kernel), "keys" (key path + softmax only, no value dequant/wgmma;
      for timing), "stream" (the TMA pipeline + the code words XOR-folded; for timing),
      "dequant" (K and V dequantized as in "full" but XOR-folded: no wgmma, no softmax),
      "nofma" (as "full" without the magic subtraction and the scale/zero FMA: wrong values,
      timing only). "probe_v1" (warp kernel, timing only, wrong values): the key params
      and V code words loaded at record layout 1's addresses (key params with 2-way bank
      conflicts, V words 16 bytes an owner and a select), the control for layout 2.
    auto_barriers: False sets Mosaic's ``unsafe_no_auto_barriers`` (no warpgroup barrier
      around every shared-memory store / async copy; the kernel's own ordering is: P stores
      -> commit_smem (fence + barrier) -> wgmma; a pipeline slot is refilled only after the
      issuing warp waited on the block's last wgmma, which follows every read of the slot).
    split_operands: dequantize K in two K = 64 halves and V^T one channel half at a time
      (fewer live registers, more wgmma issues; measured slower, kept for experiments).
    merge_step: at most this many splits the merge launch combines a pipeline step (the
      step count balanced, ``merge_step_for``).
    merge_stages: the merge launch's pipeline depth over the splits (steps in flight a CTA);
      None: as many as fit 150 KB of shared memory, at most 5 (``_merge.MERGE_AUTO_BYTES``).
      At 1 x 128K its 16 CTAs each stream ~135 KB of partials, all 5 steps of 7 splits
      (~29 KB a stage) in flight; on an H100 that timed level with 2 steps (within ~1 us).
    reduction_scratch: shared-memory bytes Mosaic reserves for cross-warp reductions (the
      softmax max of a block).
    overlap_keys: issue the key wgmma of all subtiles of a block before waiting, so the
      dequant of subtile j+1 overlaps the wgmma of subtile j (False: wait after each).
    kernel: "wgmma" (one warpgroup walks 64-token tiles with wgmma; ``_kernel``) or "warp"
      (each warp walks its own 16 tokens of every record with mma.sync, no cross-warp step;
      INT2, g <= 8, stage "full" only; ``_warp``).
    fold: (warp kernel) where the scales and zeros are applied: "none" (every code pair
      dequantized by LOP3 + 2 FMA), "k" (key scales folded into the query, zeros and the
      unpack's plane offsets added by mma: one LOP3 a key pair), "v" (the same for values,
      the token scales folded into P), "kv" (both). Experimental: float16 parameters only;
      21% fewer instructions a step at "kv" but no faster on the H200 (the mma count
      triples; docs/mosaic_decode_notes.md, Run Y).
    profile_dir: (warp kernel, diagnostics) a directory for Mosaic's per-CTA trace of the
      kernel's phases (query load, each pipeline step, the end-of-CTA merge, the store;
      %clock stamps from one thread a warpgroup, a Perfetto JSON file a call, written on
      the host after each call; ``benchmarks.mosaic_timeline`` reads it). Empty: off.
    ring_query: how the full-precision ring's wgmma walks take the query: "pair" (a hi + lo
      pair of the ring's 16-bit dtype, two wgmma a tile: ~16 mantissa bits;
      ``_ring.ring_query_pair``) or "bf16" (rounded once; ~0.3 us faster at 1 x 128K, but a
      row whose tokens are all in the ring misses float16 parameters' tolerance at head_dim
      64: 6.4e-3 against 6.0e-3).
    prep: where the call's small per-row inputs are made: "kernel" (the warp kernel and
      the merge launch compute nq from the lengths, ``quantized_of``; the kernel that walks
      the ring makes the ring's query, in ``ring_query``'s form, from the query in the
      original basis: the merge launch always, the warp kernel's ring split or one launch
      where it rotates the query itself (Hadamard rotations); the wgmma kernel's ring split
      takes XLA's) or "xla" (fusions before the launch: the ring's query, ~1.4 us at
      1 x 128K on the H100, and the rows' quantized token counts nq).
    pdl: programmatic dependent launch (``_pdl``): each Mosaic launch of the call waits for
      the launch before it inside the kernel (``griddepcontrol.wait``, before any global
      access) instead of in the stream, and the partials kernel releases the merge launch
      as soon as all of its own CTAs run, so a launch's start and prologue overlap the
      previous one's tail. Off until timed on a GPU. CUPTI's per-kernel durations count a
      dependent launch's wait as its own time: compare chained calls or spans, not sums.
    merge_columns: query-head columns of the partials the split merge (the second launch
      after the ring split, ``merge="fused_mosaic"``) reads: 16 (NPAD, all) or 8 (for
      g <= 8: heads 8-15 are padding, so half the bytes; a merge that walks the ring reads
      16 whatever this says). Untimed on a GPU, so not the default.
    """

    block_tokens: int = 256
    splits: int | None = None
    waves: int | None = None
    ctas_per_sm: int = 2
    max_concurrent_steps: int = 3
    stage: str = "full"
    auto_barriers: bool = False
    split_operands: bool = False
    overlap_keys: bool = True
    unpack: str = "lop3"
    merge_step: int = 8
    merge_stages: int | None = None
    reduction_scratch: int = 2048
    kernel: str = "wgmma"
    fold: str = "none"
    profile_dir: str = ""
    ring_query: str = "pair"
    prep: str = "kernel"
    pdl: bool = False
    merge_columns: int = NPAD

    def __post_init__(self):
        if self.block_tokens % TILE or self.block_tokens <= 0:
            raise ValueError(
                f"block_tokens={self.block_tokens} must be a positive multiple of {TILE}"
            )
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"splits={self.splits} must be >= 1")
        if self.max_concurrent_steps < 1:
            raise ValueError("max_concurrent_steps must be >= 1")
        if self.stage not in ("full", "keys", "stream", "dequant", "nofma", *WARP_PROBES):
            raise ValueError(f"stage={self.stage!r}")
        if self.merge_step < 1:
            raise ValueError(f"merge_step={self.merge_step} must be >= 1")
        if self.merge_stages is not None and self.merge_stages < 1:
            raise ValueError(f"merge_stages={self.merge_stages} must be None or >= 1")
        if self.kernel not in ("wgmma", "warp"):
            raise ValueError(f"kernel={self.kernel!r} must be 'wgmma' or 'warp'")
        if self.stage in WARP_PROBES and self.kernel != "warp":
            raise ValueError(f"stage={self.stage!r} is a probe of kernel='warp': {self.kernel=}")
        if self.fold not in ("none", "k", "v", "kv"):
            raise ValueError(f"fold={self.fold!r} must be 'none', 'k', 'v' or 'kv'")
        if self.profile_dir and self.kernel != "warp":
            raise ValueError(f"profile_dir={self.profile_dir!r} is a knob of kernel='warp': "
                             f"{self.kernel=}")  # fmt: skip
        if self.prep not in ("xla", "kernel"):
            raise ValueError(f"prep={self.prep!r} must be 'xla' or 'kernel'")
        if self.ring_query not in ("bf16", "pair"):
            raise ValueError(f"ring_query={self.ring_query!r} must be 'bf16' or 'pair'")
        if self.merge_columns not in (8, NPAD):
            raise ValueError(f"merge_columns={self.merge_columns} must be 8 or {NPAD}")
        if not isinstance(self.pdl, bool):
            raise ValueError(f"pdl={self.pdl!r} must be a bool")
        if self.unpack not in ("shift", "lop", "lop3"):
            raise ValueError(f"unpack={self.unpack!r} must be 'shift', 'lop' or 'lop3'")

    def split_plan(self, b: int, h: int, capacity: int) -> tuple[int, int]:
        """(blocks a split, splits) over ``capacity`` quantized tokens (a multiple of
        block_tokens): ``num_splits`` rounded so that every split has the same number of
        blocks (the last fewer)."""
        nblk = capacity // self.block_tokens
        bps = -(-nblk // self.num_splits(b, h, capacity))
        return bps, -(-nblk // bps)

    def num_splits(self, b: int, h: int, capacity: int, num_sms: int = 132) -> int:
        """Split-K programs per (b, h) row.

        ``waves`` set: about ``waves`` x num_sms programs in all. ``waves=None`` (default):
        the kernel holds ``ctas_per_sm`` programs an SM at once (its ~250 registers a
        thread allow 2), so B H s programs run in ceil(B H s / (ctas_per_sm num_sms))
        rounds and a row's time goes as rounds / s: the smallest s within 5% of the best
        rounds / s over s <= min(blocks, 64) (few splits: a cheaper merge)."""
        nblk = max(1, -(-capacity // self.block_tokens))
        if self.splits is not None:
            return min(self.splits, nblk)
        if self.waves is not None:
            want = max(1, -(-(self.waves * num_sms) // (b * h)))
            return min(want, nblk)
        slots = self.ctas_per_sm * num_sms
        cost = {s: -(-(b * h * s) // slots) / s for s in range(1, min(nblk, 64) + 1)}
        best = min(cost.values())
        return min(s for s, c in cost.items() if c <= 1.05 * best)
