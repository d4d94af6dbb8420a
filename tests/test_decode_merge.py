"""The Pallas split merge (``decode.merge.merge``) against the XLA merge (``merge_splits``).

Random partials (never zeros), every slot the INT kernel leaves unwritten filled with NaN,
empty splits (m = NEG, l = 0) and rows with no split at all. ``TestMergeGPU`` compiles
through Triton (skipped without a GPU); ``TestMergeInterpret`` runs the same cases in
Pallas interpret mode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gpu_available
from tolerances import tol

from oscar_jax.cache import FLAG_NONFINITE, FLAG_OVERFLOW
from pallas_kernels.decode import merge as decode_merge
from pallas_kernels.decode.int_kernel import GP, NEG

# (batch, kv heads, splits written incl. the ring, rows, sub-blocks, ring, head_dim, cols,
#  chunk, warps)
CASES = {
    "gqa4_sub2_ring_65": (2, 3, 65, 4, 2, True, 128, 32, 16, 1),
    "gqa4_sub2_ring_65_oneshot": (2, 3, 65, 4, 2, True, 128, 16, 128, 4),
    "gqa4_sub1_ring_5": (3, 2, 5, 4, 1, True, 64, 16, 16, 2),
    "gqa1_sub2_noring_17": (2, 2, 17, 1, 2, False, 64, 64, 4, 1),  # 5 chunks
    "gqa6_sub2_ring_9": (1, 2, 9, 6, 2, True, 128, 128, 16, 1),  # 6 rows: tiles of 8, sliced
    "gqa3_sub1_ring_2": (2, 1, 2, 3, 1, True, 256, 32, 16, 1),
    "gqa16_sub1_noring_33": (1, 2, 33, 16, 1, False, 64, 32, 1, 1),  # 33 steps: a fori_loop
    "gqa8_sub2_ring_1": (2, 1, 1, 8, 2, True, 128, 32, 16, 1),  # the ring alone
}


def make_partials(b, h, ns, rows, sub, ring, d, cols=32, chunk=decode_merge.CHUNK, seed=0):
    """Raw partials as the INT kernel leaves them, and the XLA reference output."""
    sp = decode_merge.padded_splits(ns, decode_merge.step_splits(ns, rows, sub, cols, chunk))
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    acc = jax.random.normal(ks[0], (b, h, sp, GP, d), jnp.float32)
    m = 3.0 * jax.random.normal(ks[1], (b, h, sp, GP), jnp.float32)
    lsum = jax.random.uniform(ks[2], (b, h, sp, GP), jnp.float32, 0.5, 8.0)
    empty = jax.random.uniform(ks[3], (b, h, sp)) < 0.3  # splits past a row's tokens
    empty = empty.at[0, 0].set(True)  # (row 0, head 0): no split at all -> zeros
    m = jnp.where(empty[..., None], NEG, m)
    lsum = jnp.where(empty[..., None], 0.0, lsum)
    nqs = ns - 1 if ring else ns
    split = np.arange(sp)[:, None]
    live = np.where(split < nqs, sub * rows, np.where(split < ns, rows, 0))  # [Sp, 1]
    written = np.arange(GP)[None, :] < live  # [Sp, GP]
    acc = jnp.where(written[..., None], acc, jnp.nan)
    m = jnp.where(written, m, jnp.nan)
    lsum = jnp.where(written, lsum, jnp.nan)

    def splits(x):  # as decode.partials.quantized_partials lays them out
        q = x[:, :, :nqs, : sub * rows].reshape(b, h, nqs * sub, rows, *x.shape[4:])
        return jnp.concatenate([q, x[:, :, nqs:ns, :rows]], axis=2) if ring else q

    a, mm, ll = decode_merge.merge_splits(splits(acc), splits(m), splits(lsum))
    ref = jnp.where(ll[..., None] > 0, a / jnp.where(ll > 0, ll, 1.0)[..., None], 0.0)
    return (acc, m, lsum), ref


class TestMergeGPU:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if not self.INTERPRET and not gpu_available():
            pytest.skip("no GPU: TestMergeInterpret runs the same cases on CPU")

    @pytest.mark.parametrize("name", sorted(CASES))
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    def test_matches_xla_merge(self, name, dtype):
        b, h, ns, rows, sub, ring, d, cols, chunk, warps = CASES[name]
        (acc, m, lsum), ref = make_partials(b, h, ns, rows, sub, ring, d, cols, chunk)
        kw = dict(cols=cols, chunk=chunk, num_warps=warps, interpret=self.INTERPRET)
        flags = jnp.where(jnp.arange(b) == 1, FLAG_NONFINITE | FLAG_OVERFLOW, FLAG_OVERFLOW)
        flags = flags.astype(jnp.int32)  # row 1 poisoned; another flag leaves a row alone
        out = decode_merge.merge(
            acc, m, lsum, ns=ns, rows=rows, sub=sub, ring=ring, out_dtype=dtype, flags=flags, **kw
        )
        assert out.shape == (b, h, rows, d) and out.dtype == dtype
        out = np.asarray(out.astype(jnp.float32))
        poisoned = np.arange(b) == 1
        assert np.all(np.isnan(out[poisoned])) and np.all(np.isfinite(out[~poisoned]))
        assert np.max(np.abs(out[0, 0])) == 0.0  # no split: zeros, not NaN
        ref = np.where(poisoned[:, None, None, None], np.nan, np.asarray(ref))
        t = tol(dtype)
        np.testing.assert_allclose(out, ref, rtol=t["rtol"], atol=t["atol"])  # NaN == NaN
        unpoisoned = decode_merge.merge(
            acc, m, lsum, ns=ns, rows=rows, sub=sub, ring=ring, out_dtype=dtype, **kw
        )
        assert np.all(np.isfinite(np.asarray(unpoisoned.astype(jnp.float32))))

    def test_bad_inputs(self):
        (acc, m, lsum), _ = make_partials(1, 1, 5, 4, 1, True, 64)  # 8 split slots
        kw = dict(ns=5, rows=4, sub=1, ring=True, out_dtype=jnp.float32, interpret=True)
        with pytest.raises(ValueError, match="cols"):
            decode_merge.merge(acc, m, lsum, **{**kw, "cols": 24})
        with pytest.raises(ValueError, match="split slots"):
            decode_merge.merge(acc, m, lsum, **{**kw, "ns": 9})
        with pytest.raises(ValueError, match="rows"):
            decode_merge.merge(acc, m, lsum, **{**kw, "rows": 9, "sub": 2})
        with pytest.raises(ValueError, match="chunk"):
            decode_merge.merge(acc, m, lsum, **{**kw, "chunk": 3})
        with pytest.raises(ValueError, match="flags"):
            decode_merge.merge(acc, m, lsum, **{**kw, "flags": jnp.zeros((2,), jnp.int32)})
        with pytest.raises(ValueError, match="acc.shape"):
            decode_merge.merge(acc[..., :8, :], m, lsum, **kw)


class TestMergeInterpret(TestMergeGPU):
    INTERPRET = True
