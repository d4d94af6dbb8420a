"""TurboQuant-style vector quantization (Zandieh et al., arXiv 2504.19874), MSE variant.

Keys and values alike, per token and KV head: rotate with a random-sign Hadamard
(``randomized_hadamard``), store the l2 norm ``n``, and quantize every coordinate of
``sqrt(D) x / n`` (approximately N(0, 1) after the rotation) with one fixed Lloyd-Max
codebook of 2^b levels for the standard normal: no scale or zero at all. Dequantized:
``n / sqrt(D) * R^T codebook[q]``.

The codebook is the Gaussian's, not the exact Beta law of a coordinate of a uniform
point on the sphere (for D >= 64 the two differ by O(1/D)).

``TurboQuantProd`` (``turboq``) is the paper's inner-product variant for the keys: the
(b-1)-bit MSE quantizer above, then the QJL 1-bit sketch of the residual
``r = k - k_mse``: ``sign(S r)`` with S a fixed D x D standard Gaussian matrix, and the
residual's norm. The paper's unbiased estimator of ``q . r`` is
``sqrt(pi/2) / D * |r| * (S q) . sign(S r)``, linear in q, so it is exactly
``q . r_hat`` with ``r_hat = sqrt(pi/2) / D * |r| * S^T sign(S r)``: the fake-quant key
``k_mse + r_hat`` gives every score the estimator's value (unbiased over S, with
variance). Values use the b-bit MSE quantizer (outputs are not inner products with a
query).

Bytes per token and KV head: b D / 8 for K codes and for V codes, plus two norms (a
third, the residual's, for ``turboq``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from oscar_jax import codec, hadamard, quant
from oscar_jax.config import preset
from oscar_jax.methods import base

HIGHEST = jax.lax.Precision.HIGHEST


@functools.cache
def lloyd_max_gaussian(bits: int, iters: int = 500) -> np.ndarray:
    """The 2^bits reconstruction levels (ascending, float64, symmetric) of the Lloyd-Max
    (MSE-optimal scalar) quantizer of the standard normal, by Lloyd's iteration."""
    if isinstance(bits, bool) or bits not in (1, 2, 3, 4):
        raise ValueError(f"{bits=} must be one of (1, 2, 3, 4)")
    n = 1 << bits
    pdf = lambda x: math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    lv = np.linspace(-2.0, 2.0, n)
    for _ in range(iters):
        edges = [-math.inf, *((lv[:-1] + lv[1:]) / 2), math.inf]
        new = []
        for a, b in zip(edges[:-1], edges[1:], strict=True):
            pa = 0.0 if a == -math.inf else pdf(a)
            pb = 0.0 if b == math.inf else pdf(b)
            new.append((pa - pb) / (cdf(b) - cdf(a)))
        lv = np.asarray(new)
    return lv


def codebook_fake_quant(
    x: Float[Array, "B H T D"], bits: int, seed: int, norm_dtype: str
) -> Float[Array, "B H T D"]:
    """One tensor through the TurboQuant-style quantizer and back (float32)."""
    cfg = preset("rotation_only", rotation="randomized_hadamard", rotation_seed=seed)
    d = x.shape[-1]
    y = hadamard.rotate(x.astype(jnp.float32), cfg)
    n, s = codec.token_norm_and_prescale(y, "per_head")
    n = quant.round_to_dtype(n, norm_dtype)
    r = quant.scaled_reciprocal(n, s)
    u = (y * s[..., None]) * (r * math.sqrt(d))[..., None]  # ~N(0, 1); zero where n = 0
    lv = jnp.asarray(lloyd_max_gaussian(bits), jnp.float32)
    q = jnp.argmin(jnp.abs(u[..., None] - lv), axis=-1)
    u_hat = lv[q]
    return hadamard.unrotate(u_hat * (n / math.sqrt(d))[..., None], cfg)


@dataclasses.dataclass(frozen=True)
class TurboQuant(base.MethodConfig):
    """Random-sign Hadamard + per-token norm + Lloyd-Max codebook, for K and V."""

    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        base._int("seed", self.seed, 0)
        if self.bits > 4:
            raise ValueError(f"bits={self.bits} must be <= 4 for the Lloyd-Max codebook")

    def fake_quant_kv(
        self,
        k: Float[Array, "B H T D"],
        v: Float[Array, "B H T D"],
        key_offset: Float[Array, "T H D"] | None = None,
    ):
        base.check_kv(k, v, 8, self.group_size)
        kh = codebook_fake_quant(k, self.bits, self.seed, self.norm_dtype)
        vh = codebook_fake_quant(v, self.bits, self.seed + 1, self.norm_dtype)
        return kh, vh

    def bytes_per_token(self, head_dim: int, context: int = 2048) -> dict[str, float]:
        nb = base.DTYPE_BYTES[self.norm_dtype]
        return base.total({
            "k_codes": self.bits * head_dim / 8, "v_codes": self.bits * head_dim / 8,
            "k_norm": nb, "v_norm": nb,
        })  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TurboQuantBias(TurboQuant):
    """``TurboQuant`` on ``k - RoPE_t(b_k)`` (the k-bias offset of ``bias_offset``, zero
    bytes), values as ``TurboQuant``: the same repair for the other rotating quantizer."""

    needs_key_bias = True

    def fake_quant_kv(
        self,
        k: Float[Array, "B H T D"],
        v: Float[Array, "B H T D"],
        key_offset: Float[Array, "T H D"] | None = None,
    ):
        if key_offset is None:
            return super().fake_quant_kv(k, v)
        base.check_kv(k, v, 8, self.group_size)
        t, h, d = k.shape[2], k.shape[1], k.shape[3]
        if key_offset.shape != (t, h, d):
            raise ValueError(f"key_offset.shape={key_offset.shape} must be {(t, h, d)}")
        off = jnp.swapaxes(key_offset.astype(jnp.float32), 0, 1)[None]  # [1, H, T, D]
        kh = codebook_fake_quant(k.astype(jnp.float32) - off, self.bits, self.seed,
                                 self.norm_dtype) + off  # fmt: skip
        return kh, codebook_fake_quant(v, self.bits, self.seed + 1, self.norm_dtype)


def qjl_fake_quant(
    x: Float[Array, "B H T D"], bits: int, seed: int, norm_dtype: str
) -> Float[Array, "B H T D"]:
    """TurboQuant_prod: (bits-1)-bit MSE codes plus the QJL sign sketch of the residual,
    as the key whose dot with any query is the paper's estimator (float32)."""
    d = x.shape[-1]
    xf = x.astype(jnp.float32)
    x_mse = codebook_fake_quant(xf, bits - 1, seed, norm_dtype)
    r = xf - x_mse
    rn = quant.round_to_dtype(jnp.linalg.norm(r, axis=-1, keepdims=True), norm_dtype)
    s = jnp.asarray(qjl_matrix(d, seed), jnp.float32)  # [D, D]
    sk = jnp.einsum("ed,bhtd->bhte", s, r, precision=HIGHEST)
    sgn = jnp.where(sk >= 0, 1.0, -1.0)
    r_hat = math.sqrt(math.pi / 2) / d * rn * jnp.einsum("ed,bhte->bhtd", s, sgn,
                                                         precision=HIGHEST)  # fmt: skip
    return x_mse + r_hat


@functools.cache
def qjl_matrix(d: int, seed: int) -> np.ndarray:
    """The fixed D x D standard Gaussian sketch of ``qjl_fake_quant``."""
    return np.random.default_rng(1_000_003 + seed).standard_normal((d, d))


@dataclasses.dataclass(frozen=True)
class TurboQuantProd(TurboQuantBias):
    """Keys: (b-1)-bit MSE + 1-bit QJL residual (TurboQuant_prod); values: b-bit MSE.
    The k-bias offset of ``bias_offset`` is taken out first when the model has one."""

    def __post_init__(self):
        super().__post_init__()
        if self.bits < 2:
            raise ValueError(f"bits={self.bits} must be >= 2 (one bit goes to the QJL sketch)")

    def fake_quant_kv(
        self,
        k: Float[Array, "B H T D"],
        v: Float[Array, "B H T D"],
        key_offset: Float[Array, "T H D"] | None = None,
    ):
        base.check_kv(k, v, 8, self.group_size)
        off = 0.0
        if key_offset is not None:
            t, h, d = k.shape[2], k.shape[1], k.shape[3]
            if key_offset.shape != (t, h, d):
                raise ValueError(f"key_offset.shape={key_offset.shape} must be {(t, h, d)}")
            off = jnp.swapaxes(key_offset.astype(jnp.float32), 0, 1)[None]
        kh = qjl_fake_quant(k.astype(jnp.float32) - off, self.bits, self.seed,
                            self.norm_dtype) + off  # fmt: skip
        return kh, codebook_fake_quant(v, self.bits, self.seed + 1, self.norm_dtype)

    def bytes_per_token(self, head_dim: int, context: int = 2048) -> dict[str, float]:
        parts = super().bytes_per_token(head_dim, context)
        parts.pop("total")
        parts["k_residual_norm"] = base.DTYPE_BYTES[self.norm_dtype]
        return base.total(parts)
