"""KVQuant-style quantization (Hooper et al., arXiv 2401.18079), fake-quant.

- **Pre-RoPE keys**: the key is rotated back to its pre-RoPE form (the evaluation hands
  the positions' cos / sin), quantized, and RoPE is applied to the dequantized key. The
  quantizer never sees RoPE's turning of a channel pair (a k bias is a constant per
  channel before RoPE: the zero point takes it).
- **Per-channel keys, per-token values**: keys per channel over groups of G tokens (one
  fp16 scale and zero per channel per group), values per token over Gv = min(G, D)
  channels (KIVI's layout, so that bytes compare).
- **Non-uniform codebook** (``nuq``): each group is normalised to [0, 1] by its min and
  max, and every entry is rounded to the nearest of 2^b levels, one codebook per layer
  for keys and one for values, fitted by k-means (Lloyd) on the normalised entries of
  calibration windows (``fit``): plain (unweighted) k-means, or with ``fisher`` KVQuant's
  sensitivity-weighted k-means: each entry weighted by its diagonal Fisher information
  (the squared gradient of the calibration loss with respect to it, pre-RoPE for keys)
  times its group's squared scale, so that the fit minimises sum F (x - Q(x))^2 in the
  entry's own units (``oscar_eval.fisher`` computes the gradients).
- **Dense-and-sparse outliers**: per vector, the entries furthest from their group's
  mean (in units of the group's standard deviation) are kept in fp16 with their index,
  left out of the min / max: ``k_outliers`` per key group of G x D entries (default 20
  of 2,048, ~1%), ``v_outliers`` per value token (default 1 of 64 at D = 64). KVQuant
  sets per-channel thresholds offline for keys and per-token online for values; a fixed
  count per vector makes the bytes exact.

Not built: attention-sink-aware (first token fp16) and Q-Norm of the later versions.

Bytes per token and KV head at D = 64, G = 32, INT2: 16 + 16 codes, 8 + 8 fp16 scales
and zeros, keys' outliers 20 x (2 value + 2 index) / 32 = 2.5, values' 1 x (2 + 1) = 3:
53.5. The codebooks are model constants (per layer, 2 x 2^b values), not cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from oscar_jax import quant
from oscar_jax.methods import base


def outlier_mask(x: Float[Array, "... N M"], count: int, axis: int) -> Bool[Array, "... N M"]:
    """The ``count`` entries of each [N, M] block furthest from their group's mean in
    group standard deviations (the groups run along ``axis``, -1 or -2)."""
    if count == 0:
        return jnp.zeros(x.shape, bool)
    mu = jnp.mean(x, axis=axis, keepdims=True)
    sd = jnp.std(x, axis=axis, keepdims=True)
    z = jnp.abs(x - mu) / jnp.where(sd > 0, sd, 1.0)
    flat = z.reshape(*z.shape[:-2], -1)
    rank = jnp.argsort(jnp.argsort(-flat, axis=-1, stable=True), axis=-1, stable=True)
    return (rank < count).reshape(x.shape)


def normalise(
    x: Float[Array, "... N M"], out: Bool[Array, "... N M"], axis: int, param_dtype: str
) -> tuple[Array, Array, Array]:
    """(u in [0, 1], scale, zero): each group (along ``axis``) mapped to [0, 1] by the
    min and max of its non-outlier entries, scale = max - min and zero = min stored in
    ``param_dtype`` (float32 outputs; scale 0 for a constant or all-outlier group)."""
    mn = jnp.min(jnp.where(out, jnp.inf, x), axis=axis, keepdims=True)
    mx = jnp.max(jnp.where(out, -jnp.inf, x), axis=axis, keepdims=True)
    empty = ~jnp.isfinite(mn)
    mn, mx = jnp.where(empty, 0.0, mn), jnp.where(empty, 0.0, mx)
    s = quant.round_to_dtype(mx - mn, param_dtype)
    z = quant.round_to_dtype(mn, param_dtype)
    u = jnp.clip((x - z) / jnp.where(s > 0, s, 1.0), 0.0, 1.0)
    return u, s, z


def codebook_round(u: Array, levels: Float[Array, " L"]) -> Array:
    """Each entry of ``u`` replaced by the nearest of ``levels``."""
    return levels[jnp.argmin(jnp.abs(u[..., None] - levels), axis=-1)]


def lloyd(samples: np.ndarray, n: int, iters: int = 60, weights=None) -> np.ndarray:
    """k-means (Lloyd) in 1-D: ``n`` ascending levels (float64) minimising the (weighted)
    squared error of rounding ``samples`` to the nearest; initialised at the quantiles.
    ``weights`` (>= 0, the samples' shape): each level is its cell's weighted mean."""
    x = np.asarray(samples, np.float64).ravel()
    if x.size < n:
        raise ValueError(f"{x.size} samples cannot fit {n} levels")
    w = np.ones_like(x) if weights is None else np.asarray(weights, np.float64).ravel()
    if w.shape != x.shape or not np.all(np.isfinite(w)) or np.any(w < 0) or not w.sum() > 0:
        raise ValueError(f"weights must be finite, >= 0, not all 0, one per sample ({x.size})")
    lv = np.quantile(x, (np.arange(n) + 0.5) / n)
    for _ in range(iters):
        idx = np.searchsorted((lv[:-1] + lv[1:]) / 2, x)  # nearest level of each sample
        cnt = np.bincount(idx, weights=w, minlength=n)
        tot = np.bincount(idx, weights=x * w, minlength=n)
        lv = np.where(cnt > 0, tot / np.where(cnt > 0, cnt, 1), lv)  # an empty cell keeps its level
    return np.sort(lv)


def dense_and_sparse(
    xg: Float[Array, "... N M"],
    out: Bool[Array, "... N M"],
    axis: int,
    levels: Float[Array, " L"] | None,
    param_dtype: str,
    outlier_dtype: str,
) -> tuple[Array, Array | None]:
    """(u, x_hat): each group (along ``axis``) normalised to [0, 1] by its non-outlier
    range (``normalise``) and, when ``levels`` is given, dequantized by rounding to them,
    with the ``out`` entries read back from ``outlier_dtype`` (else x_hat is None)."""
    u, s, z = normalise(xg, out, axis, param_dtype)
    if levels is None:
        return u, None
    xh = codebook_round(u, levels) * s + z
    return u, jnp.where(out, quant.round_to_dtype(xg, outlier_dtype), xh)


def keys_dense_and_sparse(
    x: Float[Array, "B H T D"], count: int, group_size: int, levels, param_dtype: str,
    outlier_dtype: str,
) -> tuple[Array, Array, Array | None]:  # fmt: skip
    """(u, out, x_hat) [B, H, T, D] of per-channel groups of G tokens with ``count``
    outliers per G x D group (``dense_and_sparse``; x_hat None without ``levels``)."""
    b, h, t, d = x.shape
    g = group_size
    if count >= g * d:
        raise ValueError(f"k_outliers={count} must be < G x D = {g * d}")
    xg = x.reshape(b, h, t // g, g, d)
    out = outlier_mask(xg, count, axis=-2)
    u, xh = dense_and_sparse(xg, out, -2, levels, param_dtype, outlier_dtype)
    back = lambda a: None if a is None else a.reshape(b, h, t, d)  # noqa: E731
    return back(u), back(out), back(xh)


def values_dense_and_sparse(
    v: Float[Array, "B H T D"], count: int, group: int, levels, param_dtype: str,
    outlier_dtype: str,
) -> tuple[Array, Array, Array | None]:  # fmt: skip
    """(u, out, x_hat) [B, H, T, D] of per-token groups of ``group`` channels with
    ``count`` outliers per token (``dense_and_sparse``; x_hat None without ``levels``)."""
    b, h, t, d = v.shape
    if count >= d:
        raise ValueError(f"v_outliers={count} must be < head_dim={d}")
    out = outlier_mask(v[..., None, :], count, axis=-1)[..., 0, :]
    xg, og = v.reshape(b, h, t, d // group, group), out.reshape(b, h, t, d // group, group)
    u, xh = dense_and_sparse(xg, og, -1, levels, param_dtype, outlier_dtype)
    back = lambda a: None if a is None else a.reshape(b, h, t, d)  # noqa: E731
    return back(u), out, back(xh)


def fit_codebooks(layers, bits: int, seed: int = 0) -> base.Calibration:
    """Per-layer codebooks ``k_levels``, ``v_levels`` [L, 2^b]: k-means (``lloyd``) on up
    to 200,000 sampled normalised non-outlier entries. ``layers`` yields, per layer, the
    (u, out) of its keys and of its values (as ``keys_dense_and_sparse`` gives them), or
    (u, out, weight) for a weighted fit."""
    rng = np.random.default_rng(seed)
    acc: dict[str, list] = {"k_levels": [], "v_levels": []}
    for pair in layers:
        for name, (u, out, *w) in zip(acc, pair, strict=True):
            keep = ~np.asarray(out)
            s, w = np.asarray(u)[keep], (np.asarray(w[0])[keep] if w else None)
            pick = rng.choice(s.size, min(s.size, 200_000), replace=False)
            acc[name].append(lloyd(s[pick], 1 << bits, weights=None if w is None else w[pick]))
    return base.Calibration(**{k: np.stack(a) for k, a in acc.items()})


def entry_weights(
    x: Float[Array, "B H T D"], grad: Float[Array, "B H T D"], out: Bool[Array, "B H T D"],
    axis: int, group: int, param_dtype: str,
) -> Array:  # fmt: skip
    """grad^2 x scale^2 per entry: the diagonal Fisher information of ``x`` in the
    normalised units the codebook is fitted in (scale: its group's max - min over the
    non-outliers; groups of ``group`` along ``axis``, -2 tokens or -1 channels)."""
    b, h, t, d = x.shape
    shape = (b, h, t // group, group, d) if axis == -2 else (b, h, t, d // group, group)
    _, s, _ = normalise(x.reshape(shape), out.reshape(shape), axis, param_dtype)
    return (jnp.square(grad.reshape(shape)) * jnp.square(s)).reshape(b, h, t, d)


def outlier_bytes(
    k_outliers: int, v_outliers: int, outlier_dtype: str, group_size: int, head_dim: int
) -> dict[str, float]:
    """Bytes per token of the fp outliers with their indices: ``k_outliers`` per key
    group of G x D entries, ``v_outliers`` per value token (1-byte index up to 256)."""
    ob = base.DTYPE_BYTES[outlier_dtype]
    k_index = 1 if group_size * head_dim <= 256 else 2
    v_index = 1 if head_dim <= 256 else 2
    return {"k_outliers": k_outliers * (ob + k_index) / group_size,
            "v_outliers": v_outliers * (ob + v_index)}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class KVQuant(base.MethodConfig):
    """Pre-RoPE per-channel keys, per-token values, per-layer k-means codebooks,
    ``k_outliers`` / ``v_outliers`` fp16 outliers per key group / value token."""

    k_outliers: int = 20
    v_outliers: int = 1
    outlier_dtype: str = "float16"
    uniform: bool = False  # ablation: KIVI's uniform levels instead of the fitted codebook
    pre_rope: bool = True  # ablation: False quantizes the post-RoPE keys
    fisher: bool = False  # k-means weighted by Fisher information (``fit``'s ``grads``)

    needs_rope = True
    needs_calibration = True

    def __post_init__(self):
        super().__post_init__()
        base._int("k_outliers", self.k_outliers, 0)
        base._int("v_outliers", self.v_outliers, 0)

    def _keys(self, kp: Float[Array, "B H T D"], levels=None):
        """(u, out, x_hat) of pre-RoPE keys: normalised entries, outlier mask, and the
        dequantized keys (when ``levels`` is given), [B, H, T, D]."""
        return keys_dense_and_sparse(kp, self.k_outliers, self.group_size, levels,
                                     self.param_dtype, self.outlier_dtype)  # fmt: skip

    def _values(self, v: Float[Array, "B H T D"], levels=None):
        return values_dense_and_sparse(v, self.v_outliers, min(self.group_size, v.shape[-1]),
                                       levels, self.param_dtype, self.outlier_dtype)  # fmt: skip

    def fake_quant_kv(
        self,
        k: Float[Array, "B H T D"],
        v: Float[Array, "B H T D"],
        key_offset: Float[Array, "T H D"] | None = None,
        *,
        rope: tuple[Float[Array, "T D"], Float[Array, "T D"]] | None = None,
        state: dict | None = None,
    ):
        base.check_kv(k, v, 2, self.group_size)
        if rope is None:
            raise ValueError("KVQuant quantizes pre-RoPE keys: it needs rope=(cos, sin)")
        st = self.calibrated_state() if state is None else state
        if self.uniform:
            st = {n: jnp.linspace(0.0, 1.0, 1 << self.bits) for n in ("k_levels", "v_levels")}
        cos, sin = rope
        kp = base.rope_rotate(k, cos, sin, inverse=True) if self.pre_rope else k
        _, _, kph = self._keys(kp.astype(jnp.float32), jnp.asarray(st["k_levels"], jnp.float32))
        _, _, vh = self._values(v.astype(jnp.float32), jnp.asarray(st["v_levels"], jnp.float32))
        return (base.rope_rotate(kph, cos, sin) if self.pre_rope else kph), vh

    @property
    def needs_grads(self) -> bool:
        """``fit`` wants the calibration loss's gradients (``oscar_eval.fisher``)."""
        return self.fisher

    def fit(self, k, v, rope, key_offset=None, grads=None) -> KVQuant:
        """Per-layer codebooks (``k_levels``, ``v_levels`` [L, 2^b]) by k-means on the
        normalised non-outlier entries of the calibration keys (pre-RoPE) and values.

        k, v [L, N, H, T, D]; ``grads``: (dL/dk, dL/dv) of the calibration loss in that
        layout (post-RoPE keys), required with ``fisher``: the k-means weights."""
        if self.fisher and grads is None:
            raise ValueError("fisher=True: fit needs grads=(dL/dk, dL/dv) (oscar_eval.fisher)")
        cos, sin = (jnp.asarray(x, jnp.float32) for x in rope)
        unrope = (
            (lambda x, c, s: base.rope_rotate(x, c, s, inverse=True))
            if self.pre_rope
            else (lambda x, c, s: x)
        )
        vgroup, kgroup = min(self.group_size, np.shape(v)[-1]), self.group_size
        pdt = self.param_dtype

        @jax.jit
        def keys(x, c, s, gk):
            kp = unrope(x, c, s)
            u, out, _ = self._keys(kp)
            if gk is None:
                return u, out
            return u, out, entry_weights(kp, unrope(gk, c, s), out, -2, kgroup, pdt)

        @jax.jit
        def values(x, gv):
            u, out, _ = self._values(x)
            return (u, out) if gv is None else (u, out, entry_weights(x, gv, out, -1, vgroup, pdt))

        def layers():
            gks, gvs = (None, None) if not self.fisher else (np.asarray(a) for a in grads)
            for i, (kk, vv) in enumerate(zip(np.asarray(k), np.asarray(v), strict=True)):
                t = kk.shape[2] - kk.shape[2] % self.group_size  # [N, H, T, D]
                gk = None if gks is None else jnp.asarray(gks[i][:, :, :t])
                gv = None if gvs is None else jnp.asarray(gvs[i][:, :, :t])
                yield (
                    keys(jnp.asarray(kk[:, :, :t]), cos[:t], sin[:t], gk),
                    values(vv[:, :, :t], gv),
                )

        return self.replace(calibration=fit_codebooks(layers(), self.bits))

    def bytes_per_token(self, head_dim: int, context: int = 2048) -> dict[str, float]:
        parts = base.kivi_bytes(self.bits, head_dim, self.group_size,
                                base.DTYPE_BYTES[self.param_dtype])  # fmt: skip
        parts.update(outlier_bytes(self.k_outliers, self.v_outliers, self.outlier_dtype,
                                   self.group_size, head_dim))  # fmt: skip
        return base.total(parts)
