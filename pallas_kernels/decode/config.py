"""Launch parameters of the decode kernels and the heuristic that picks them.

Heuristic (``choose_config``), tuned on the H200 (132 SMs) at the benchmark shapes:

- INT kernel: ``T = 64`` tokens per block (a multiple of G; faster than 32 and 128),
  2 warps and 3 pipeline stages. Splits so that ``B * H * splits`` is about one wave of
  ``4 * 132`` programs (4 resident per SM at 255 registers), 1 to 32 blocks per split;
  where full 32-block programs exceed a wave and leave the last one less than 3/4 full,
  the blocks per split that finish first when the programs are list-scheduled in grid
  order, each costing its blocks plus 4 of fixed work (``int_blocks_per_split``).
- BF16 kernel: ``T = 128``, 4 warps and 2 stages; splits so that ``B * H * splits`` is
  about ``8 * 132`` programs, 4 to 32 blocks per split (longer splits leave a near-empty
  second wave).
- The residual ring is one extra split of the INT launch (``fuse_ring``); two token
  sub-blocks fill the padded MMA rows where they apply and a split walks >= 4 blocks
  (``token_split``); the INT kernel rotates the query and un-rotates its partials itself
  and one Pallas launch merges the splits (``rotate_in_kernel``, ``merge``), so that a
  call is two launches.

Every field can be overridden by keyword. Current decode figures: BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq

import numpy as np

import oscar_jax

TARGET_PROGRAMS = 8 * 132  # BF16 kernel: about 8 programs per H200 SM
TARGET_PROGRAMS_INT = 4 * 132  # INT kernel: one wave (255 registers x 2 warps: 4 per SM)
MAX_BLOCKS_PER_SPLIT = 32  # more (e.g. 57 at 8 x 32K) leave a ragged last wave
PROGRAM_COST, RING_COST = 4.0, 3.0  # INT programs' fixed work and the ring split, in blocks
# B x H from which the INT kernel rotates the query and un-rotates its partials itself:
# all. With the Pallas merge (every partial in the original basis) a call is two launches,
# faster than the XLA rotations and merge around the kernel at every shape timed.
ROTATE_IN_KERNEL_ROWS = 1


@functools.lru_cache(maxsize=512)
def _makespan(rows: int, nblk: int, bps: int, slots: int) -> float:
    """Finish time (in blocks) of ``rows`` x (splits of ``bps`` blocks + the ring split)
    programs list-scheduled in grid order on ``slots`` resident-program slots."""
    n = -(-nblk // bps)
    row = [min(bps, nblk - j * bps) + PROGRAM_COST for j in range(n)] + [RING_COST]
    free, end = [0.0] * slots, 0.0
    for _ in range(rows):
        for cost in row:
            t = heapq.heappop(free) + cost
            heapq.heappush(free, t)
            end = max(end, t)
    return end


def int_blocks_per_split(rows: int, nblk: int, slots: int = TARGET_PROGRAMS_INT) -> int:
    """Blocks per split of the INT kernel for ``rows`` = B * H and ``nblk`` blocks per row.

    Up to one wave of full 32-block programs: splits for about one wave (``slots``
    programs), at least 1 block each. Where the full 32-block programs end in a last wave
    less than 3/4 full (48 x 4K: 768 programs on 528 slots), the earliest finish of
    ``_makespan`` over the distinct choices <= 32 (ties: fewer splits); otherwise, or
    beyond 8 waves, 32. (The list-scheduling model alone picks 23 at 8 x 33024 tokens,
    10% slower than 32 there: short remainder programs cost less than it says.)
    """
    top = min(MAX_BLOCKS_PER_SPLIT, nblk)
    full = rows * (nblk // top)  # programs of the full 32 blocks
    if full <= slots:
        want = -(-slots // rows)
        return max(1, min(top, -(-nblk // want)))
    waves = full / slots
    if waves >= 8 or waves % 1 == 0 or waves % 1 >= 0.75:
        return top
    cands = {-(-nblk // n) for n in range(1, nblk + 1)} & set(range(1, top + 1))
    cands = [b for b in cands if rows * -(-nblk // b) <= 16 * slots] or [top]
    return min(cands, key=lambda b: (_makespan(rows, nblk, b, slots), -b))


def _triton_params(num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static launch parameters of the decode kernels.

    block_tokens: tokens per inner block T (power of two, a multiple of the key
      group G for quantized caches). blocks_per_split: consecutive blocks one
      program walks. num_warps / num_stages: Triton launch parameters.
    fuse_ring: the residual ring is the last split of the INT launch (else XLA); its
      loop walks ``partials.ring_block(slots)`` rows a block.
    unpack: code -> 16-bit float unpacking: "asm" (inline PTX, 4 codes per
      instruction group) or "jnp" (the same bit trick in Pallas ops; interpret mode
      always uses it).
    vparams: how the kernel reads the per-token value scales / zeros: "col" (one
      2-byte column per value group: 128 synchronous ld.global.b16 per thread per
      block of 64 tokens at D 128), "pair" (the same arrays bitcast to uint32 pairs
      outside the kernel, no copy of the cache: 4-byte columns, half the loads, which
      Triton pipelines as cp.async; 255 registers and no spills) or "auto" (default:
      "pair" where it applies, i.e. 16-bit scales and an even number of value groups
      per head, else "col").
    token_split: token sub-blocks per key group in the INT kernel's MMA rows: 2, 1 (off)
      or 0 (auto: 2 where it applies, i.e. 2 x GQA ratio <= 16, G >= 32 and 16-bit
      norms, and each split walks >= 4 blocks; ``partials.token_split``). Rows (j, h)
      hold query head h over the tokens j, j + 2, ..: the key tile of G tokens is read
      as [G / 2, 2 P] (the same bytes), the query as a block-diagonal A operand, so one
      key MMA and one softmax step serve 2 tokens on rows GQA leaves idle; the merge
      treats each sub-block as one more split. Fewer loop instructions per block
      (offline: 1,563 against 1,760 per 64 tokens), but 255 registers against 188.
    rotate_in_kernel: with a Hadamard rotation (``hadamard`` or ``randomized_hadamard``)
      and the fused ring, the INT kernel rotates the query and un-rotates each split's
      partial itself (Kronecker factors: per program a few [16, W] x [W, W] dots and
      butterflies, ~600 instructions per thread against ~1,560 per 64-token block), in
      place of the two XLA GEMM launches around it. False: XLA rotates. The heuristic
      takes it (``ROTATE_IN_KERNEL_ROWS``): with it every partial is in the original basis,
      so the Pallas merge applies too.
    merge: how the split partials become the output where the ring is fused: "pallas"
      (``merge.merge``: one launch, programs per (row, KV head, ``merge_cols``
      channels); needs every partial in the original basis, i.e. ``rotate_in_kernel``
      with a Hadamard rotation or no value rotation), "xla" (``merge_splits``, a max
      reduction, the weighted sums, the un-rotation GEMM and the division: seven XLA
      launches) or "auto" ("pallas" where it applies).
    merge_cols: channels per program of the Pallas merge, a power of two >= 16, or 0
      (auto: 16 where B x H x D / 32 programs would be fewer than the H200's 132 SMs,
      else 32). merge_warps: its warps; merge_chunk: splits per step (powers of two;
      capped so a step's tiles stay at 64 registers a thread). One 128-split step at 4
      warps beats smaller steps at 1 warp (a cross-thread reduction per step) and a
      fori_loop over smaller steps (each step waits on its loads).
    interpret: run in Pallas interpret mode (CPU).
    """

    block_tokens: int = 128
    blocks_per_split: int = 8
    num_warps: int = 4
    num_stages: int = 2
    interpret: bool = False
    fuse_ring: bool = True
    unpack: str = "asm"
    vparams: str = "auto"
    token_split: int = 0
    rotate_in_kernel: bool = False
    merge: str = "auto"
    merge_cols: int = 0
    merge_warps: int = 4
    merge_chunk: int = 128

    def __post_init__(self):
        for name in ("block_tokens", "blocks_per_split", "num_warps", "num_stages"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int | np.integer) or val < 1:
                raise ValueError(f"{name}={val!r} must be a positive int")
        if not _pow2(self.block_tokens) or self.block_tokens < 16:
            raise ValueError(f"block_tokens={self.block_tokens} must be a power of two >= 16")
        if not _pow2(self.num_warps):
            raise ValueError(f"num_warps={self.num_warps} must be a power of two")
        if isinstance(self.token_split, bool) or self.token_split not in (0, 1, 2):
            raise ValueError(f"token_split={self.token_split!r} must be 0 (auto), 1 or 2")
        if self.vparams not in ("auto", "col", "pair"):
            raise ValueError(f"vparams={self.vparams!r} must be 'auto', 'col' or 'pair'")
        if self.merge not in ("auto", "xla", "pallas"):
            raise ValueError(f"merge={self.merge!r} must be 'auto', 'xla' or 'pallas'")
        mc = self.merge_cols
        if (
            isinstance(mc, bool)
            or not isinstance(mc, int | np.integer)
            or (mc != 0 and (mc < 16 or not _pow2(mc)))
        ):
            raise ValueError(f"merge_cols={mc!r} must be 0 (auto) or a power of two >= 16")
        for name in ("merge_warps", "merge_chunk"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int | np.integer) or not _pow2(val):
                raise ValueError(f"{name}={val!r} must be a power of two")
        if self.unpack not in ("asm", "jnp"):
            raise ValueError(f"unpack={self.unpack!r} must be 'asm' or 'jnp'")
        for name in ("fuse_ring", "rotate_in_kernel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if not isinstance(self.interpret, bool):
            raise ValueError(f"interpret={self.interpret!r} must be a bool")


def choose_config(
    batch: int, heads: int, tokens: int, group: int = 1, *, block: int = 64, **overrides
) -> DecodeConfig:
    """The documented heuristic; keyword overrides win (see module docstring)."""
    unknown = set(overrides) - {f.name for f in dataclasses.fields(DecodeConfig)}
    if unknown:
        raise ValueError(
            f"unknown options {sorted(unknown)}; valid: "
            f"{[f.name for f in dataclasses.fields(DecodeConfig)]}"
        )
    t = overrides.get("block_tokens", max(block, group))
    nblk = max(1, -(-tokens // t))
    if group > 1:
        bps = int_blocks_per_split(batch * heads, nblk)
    else:
        want_splits = max(1, -(-TARGET_PROGRAMS // (batch * heads)))
        bps = max(min(4, nblk), min(MAX_BLOCKS_PER_SPLIT, -(-nblk // want_splits)))
    kw = dict(
        block_tokens=t,
        blocks_per_split=bps,
        num_warps=2 if group > 1 else 4,
        num_stages=3 if group > 1 else 2,
        interpret=not oscar_jax.gpu_available(),
        rotate_in_kernel=group > 1 and batch * heads >= ROTATE_IN_KERNEL_ROWS,
    )
    kw.update(overrides)
    return DecodeConfig(**kw)
