"""Sharded cache and decode attention on 8 simulated CPU devices equal the unsharded run."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from helpers import kv_with_sinks, query, small_cfg
from jax.sharding import Mesh

import oscar_jax as oj
from oscar_jax import sharding as osh

MESHES = ((8, 1, 1), (2, 4, 1), (1, 2, 4), (1, 1, 8))


def make_mesh(shape):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("data", "model", "sequence"))


class ShardedCacheTest(parameterized.TestCase):
    @parameterized.product(mesh_shape=MESHES, method=("bf16", "oscar"))
    def test_decode_and_append_equal_unsharded(self, mesh_shape, method):
        mesh = make_mesh(mesh_shape)
        b, h, d, gqa = 8, 4, 64, 2
        max_len = 64 + 32 * 16  # quantized capacity 512 = 8 shards x 64 tokens
        cfg = small_cfg(method)
        k, v = kv_with_sinks(1, b, 300, h, d)
        lengths = jnp.array([300, 5, 97, 250, 64, 96, 200, 131])  # ragged
        c = oj.init_cache(cfg, batch=b, max_len=max_len, num_kv_heads=h, head_dim=d,
                          dtype=jnp.float32)  # fmt: skip
        ref = oj.prefill(c, k, v, lengths)
        sh = osh.cache_shardings(ref, mesh)
        cs = jax.jit(oj.prefill, out_shardings=sh)(c, k, v, lengths)
        chex.assert_trees_all_equal(cs, ref)
        # each device holds only its shard
        n_seq = mesh_shape[2]
        if cfg.quantized:
            shard = cs.k_codes.addressable_shards[0].data.shape
            assert shard == (b // mesh_shape[0], h // mesh_shape[1],
                             ref.quant_capacity // n_seq, ref.k_codes.shape[3])  # fmt: skip
        else:
            assert cs.k_res.addressable_shards[0].data.shape[2] == ref.slots // n_seq
        dec = jax.jit(lambda q, c: osh.sharded_decode_attention(q, c, mesh))
        app = jax.jit(lambda c, k, v: osh.sharded_append(c, k, v, mesh), out_shardings=sh)
        k2, v2 = kv_with_sinks(2, b, 40, h, d)
        ref_dec, ref_app = jax.jit(oj.decode_attention), jax.jit(oj.append)
        for step in range(40):  # crosses a group flush for every row
            q = query(step, b, h * gqa, d)
            out = dec(q, cs)
            want = ref_dec(q, ref)
            np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
            cs = app(cs, k2[:, step], v2[:, step])
            ref = ref_app(ref, k2[:, step], v2[:, step])
        chex.assert_trees_all_equal(cs, ref)

    @parameterized.parameters("bf16", "oscar")
    def test_no_all_gather_of_the_cache(self, method):
        mesh = make_mesh((1, 2, 4))
        cfg = small_cfg(method)
        c = oj.init_cache(cfg, batch=2, max_len=64 + 32 * 64, num_kv_heads=4, head_dim=64)
        sh = osh.cache_shardings(c, mesh)
        c = jax.device_put(c, sh)
        kt = jnp.ones((2, 4, 64), c.dtype)
        q = jnp.ones((2, 8, 64), c.dtype)
        for fn, args in (
            (lambda c, k, v: osh.sharded_append(c, k, v, mesh), (c, kt, kt)),
            (lambda q, c: osh.sharded_decode_attention(q, c, mesh), (q, c)),
        ):
            hlo = jax.jit(fn).lower(*args).compile().as_text()
            gathers = [ln for ln in hlo.splitlines() if "all-gather(" in ln]
            assert not gathers, gathers[:3]

    @parameterized.parameters("bf16", "oscar")
    def test_explicit_axes_mesh_takes_unplaced_inputs(self, method):
        """jax.make_mesh's default from jax 0.11 is Explicit axes, where shard_map refuses an
        argument not laid out by its spec: the sharded ops place their arguments first."""
        if len(jax.devices()) < 8:
            pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
        explicit = (jax.sharding.AxisType.Explicit,) * 3
        mesh = jax.make_mesh((1, 2, 4), ("data", "model", "sequence"), axis_types=explicit)
        b, h, d = 2, 4, 64
        c = oj.init_cache(small_cfg(method), batch=b, max_len=64 + 32 * 16, num_kv_heads=h,
                          head_dim=d, dtype=jnp.float32)  # fmt: skip
        k, v = kv_with_sinks(3, b, 200, h, d)
        c = oj.prefill(c, k, v, jnp.array([200, 77]))  # on one device, not on the mesh
        q, (k2, v2) = query(4, b, 2 * h, d), kv_with_sinks(5, b, 1, h, d)
        got = osh.sharded_decode_attention(q, c, mesh)
        np.testing.assert_allclose(got, oj.decode_attention(q, c), rtol=1e-5, atol=1e-5)
        app = osh.sharded_append(c, k2[:, 0], v2[:, 0], mesh)
        want = oj.append(c, k2[:, 0], v2[:, 0])
        for a, w in zip(jax.tree.leaves(app), jax.tree.leaves(want), strict=True):
            assert a.shape == w.shape  # (a zero-size sharded leaf cannot be fetched)
            if a.size:
                np.testing.assert_array_equal(a, w)

    def test_bad_mesh(self):
        mesh = make_mesh((1, 1, 8))
        cfg = small_cfg("oscar", group_size=64)
        c = oj.init_cache(cfg, batch=2, max_len=64 + 64 * 2, num_kv_heads=4, head_dim=64)
        with self.assertRaisesRegex(ValueError, "quantized capacity 256"):
            osh.cache_shardings(c, mesh)
        mesh2 = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
        with self.assertRaisesRegex(ValueError, "sequence"):
            osh.cache_shardings(c, mesh2)
