"""A row's output written by the Mosaic kernel that finishes it: normalised, and either as
O^T channel blocks (f32) or in the library's layout and dtype with flagged rows NaN.

Shared by the merge launch (``_merge.int2_merge_ring``: one channel block a CTA) and the warp
kernel's one-launch call (``_warp``, ``final=``: every channel block of its (b, h)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from oscar_jax.record import TILE


def store_output(o, lsum, o_smem, out_ref, *, t_smem=None, bad=None):
    """Issue the TMA store of o / lsum (0 where lsum is 0).

    o [64, N] f32 in the WGMMA layout (O^T of one 64-channel block, unnormalised; N = NPAD
    query-head columns, or 8 from the split merge's ``columns``), lsum [N]
    (``WGMMA.reduce(0)``) its row sums; o_smem [64, N] f32 scratch. ``t_smem``
    None: out_ref [64, N] f32 gets O^T. Else t_smem [N, 64] scratch in out_ref's dtype
    and out_ref [g, 64] (the block's channels of the [g, D] output): O read back transposed,
    NaN where the traced bool ``bad`` holds (``poison_flagged_rows``), cast, its first g rows
    stored. The caller waits (``plgpu.wait_smem_to_gmem``) before the kernel ends."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n = o.shape[1]
    inv = jnp.where(lsum > 0, 1.0 / jnp.where(lsum > 0, lsum, 1.0), 0.0)
    o_smem[...] = o * jax.lax.broadcast_in_dim(inv, (TILE, n), [1])
    plgpu.commit_smem()
    if t_smem is None:
        plgpu.copy_smem_to_gmem(o_smem, out_ref)
        return
    ot = plgpu.load(o_smem.transpose((1, 0)), layout=plgpu.Layout.WG_STRIDED((n, TILE), 1))
    if bad is not None:
        ot = ot + jnp.where(bad, jnp.nan, 0.0).astype(jnp.float32)
    t_smem[...] = ot.astype(t_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(t_smem.at[pl.ds(0, out_ref.shape[0])], out_ref)
