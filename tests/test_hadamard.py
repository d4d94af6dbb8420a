"""Rotations: orthonormal, self-inverse (Hadamard), inner products preserved, O(d log d) path."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import oscar_jax as oj
from oscar_jax import hadamard


class HadamardTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(8, 64, 128, 256, 1024, 80, 96, 192)
    def test_fwht_matches_dense_matrix(self, d):
        x = jax.random.normal(jax.random.PRNGKey(d), (3, 5, d))
        y = self.variant(oj.fwht)(x)
        ref = np.asarray(x, np.float64) @ oj.hadamard_matrix(d).T
        np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)

    @parameterized.parameters(64, 128, 256, 96)
    def test_orthonormal_and_self_inverse(self, d):
        h = oj.hadamard_matrix(d)
        np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-12)
        np.testing.assert_allclose(h, h.T, atol=0)
        x = jax.random.normal(jax.random.PRNGKey(1), (4, d))
        chex.assert_trees_all_close(oj.fwht(oj.fwht(x)), x, rtol=1e-5, atol=1e-5)

    @parameterized.product(
        d=(64, 128, 256, 80),
        rotation=("hadamard", "randomized_hadamard", "random_orthogonal"),
    )
    def test_rotation_preserves_inner_products(self, d, rotation):
        cfg = oj.preset("oscar", rotation=rotation, rotation_seed=7)
        kq, kk = jax.random.split(jax.random.PRNGKey(d))
        q = jax.random.normal(kq, (16, d))
        k = jax.random.normal(kk, (16, d)) * 3.0
        dots = jnp.sum(q * k, -1)
        rdots = jnp.sum(oj.rotate(q, cfg) * oj.rotate(k, cfg), -1)
        np.testing.assert_allclose(rdots, dots, rtol=1e-5, atol=1e-5 * float(jnp.abs(dots).max()))
        chex.assert_trees_all_close(oj.unrotate(oj.rotate(k, cfg), cfg), k, rtol=1e-5, atol=1e-5)
        r = oj.rotation_matrix(cfg, d)
        np.testing.assert_allclose(r @ r.T, np.eye(d), atol=1e-10)
        np.testing.assert_allclose(np.asarray(oj.rotate(k, cfg)), np.asarray(k) @ r.T, atol=1e-4)

    def test_random_rotation_is_seeded(self):
        a = oj.rotation_matrix(
            oj.preset("oscar", rotation="random_orthogonal", rotation_seed=1), 64
        )
        b = oj.rotation_matrix(
            oj.preset("oscar", rotation="random_orthogonal", rotation_seed=1), 64
        )
        c = oj.rotation_matrix(
            oj.preset("oscar", rotation="random_orthogonal", rotation_seed=2), 64
        )
        np.testing.assert_array_equal(a, b)
        assert np.abs(a - c).max() > 0.1

    def test_fwht_is_not_a_dense_matmul(self):
        hlo = jax.jit(oj.fwht).lower(jnp.ones((4, 128))).as_text()
        assert "dot" not in hlo  # butterflies only: O(d log d)

    def test_spreads_a_massive_channel(self):
        x = jnp.zeros((128,)).at[5].set(100.0) + jax.random.normal(jax.random.PRNGKey(0), (128,))
        y = oj.fwht(x)
        assert float(jnp.abs(y).max()) < 0.2 * float(jnp.abs(x).max())


if __name__ == "__main__":
    pytest.main([__file__])


@pytest.mark.parametrize("rotation", ["hadamard", "randomized_hadamard"])
@pytest.mark.parametrize("dense", [False, True])
def test_rotate_dense_and_butterfly_paths_agree(rotation, dense):
    """The butterflies (encoders) and one dense matmul (decode queries) are both R x."""
    from oscar_jax import hadamard

    d = 64
    cfg = oj.preset("oscar", bits=2, rotation=rotation)
    x = jax.random.normal(jax.random.PRNGKey(7), (5, 3, d), jnp.float32)
    r = np.asarray(hadamard.rotation_matrix(cfg, d), np.float64)
    want = np.asarray(x, np.float64) @ r.T
    got = hadamard.rotate(x, cfg, dense=dense)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    back = hadamard.unrotate(got, cfg, dense=dense)
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), atol=1e-5)


@pytest.mark.parametrize("rotation", ["hadamard", "randomized_hadamard"])
@pytest.mark.parametrize("d,w", [(64, 16), (128, 32), (128, 64), (256, 64), (128, 128)])
def test_kronecker_factor_rotates_and_unrotates(rotation, d, w):
    """Chunk dots with the +-1 factors plus butterflies across chunks are R x and R^T y
    (what the decode kernel computes with ``kronecker_factor``)."""
    cfg = oj.preset("oscar", rotation=rotation, rotation_seed=3)
    f = hadamard.kronecker_factor(cfg, d, w)
    assert f.shape == (d, w) and set(np.unique(f)) == {-1.0, 1.0}
    x = np.random.default_rng(0).standard_normal((5, d))
    n, h = d // w, hadamard.sylvester(d // w)
    chunks = [x[:, a * w : (a + 1) * w] for a in range(n)]
    z = [c @ f[a * w : (a + 1) * w] for a, c in enumerate(chunks)]
    rot = np.concatenate([sum(h[a, b] * z[a] for a in range(n)) for b in range(n)], 1)
    np.testing.assert_allclose(rot / np.sqrt(d), np.asarray(hadamard.rotate(x, cfg)), atol=1e-5)
    y = [sum(h[a, b] * chunks[b] for b in range(n)) for a in range(n)]
    un = np.concatenate([ya @ f[a * w : (a + 1) * w].T for a, ya in enumerate(y)], 1)
    np.testing.assert_allclose(un / np.sqrt(d), np.asarray(hadamard.unrotate(x, cfg)), atol=1e-5)


def test_kronecker_factor_none_without_the_form():
    d = 128
    assert (
        hadamard.kronecker_factor(oj.preset("oscar", rotation="random_orthogonal"), d, 32) is None
    )
    assert hadamard.kronecker_factor(oj.preset("kivi"), d, 32) is None
    assert hadamard.kronecker_factor(oj.preset("oscar"), 96, 32) is None  # block-diagonal
    with pytest.raises(ValueError, match="w="):
        hadamard.kronecker_factor(oj.preset("oscar"), d, 48)
