"""The *other* OSCAR (Zhou et al., arXiv 2605.17757, "Offline Spectral Covariance-Aware
Rotation"), as a comparison method: ``qcov{b}``. Not the library's OScaR (Su et al.,
arXiv 2605.19660: Hadamard + per-token l2 key norm on KIVI groups); the two share a name
only.

What it does (fake-quant, XLA; no kernel):

* keys: a per-layer, per-KV-head rotation ``R_K = U_Q H P`` (row-vector form, ``k R_K``)
  fitted offline: ``U_Q`` the eigenvectors of the query second moment ``C_Q = E[q q^T]``
  (post-RoPE queries of the KV head's query group, descending eigenvalues), because a key
  error ``e`` moves the logit by ``q . e``, whose mean square is ``e^T C_Q e``; then the
  orthonormal Walsh-Hadamard matrix ``H`` and the bit-reversal permutation ``P`` of the
  channels (so that each channel group gets one representative of every importance level);
* values: the same with ``U_S`` from the score-weighted value second moment
  ``C_S = E[o o^T]``, ``o = softmax(q k^T) V`` the attention output of each query head
  (``V^T S^T S V`` of the paper);
* token-wise asymmetric INT-b: per token, min/max over each group of ``channel_group``
  rotated channels, both shrunk by a clipping ratio ``a`` in (0, 1] fitted per layer and
  KV head on the calibration windows (keys: the C_Q-weighted error, values: plain squared
  error), codes clipped to [0, 2^b - 1], scale and zero stored in ``param_dtype``;
* the first ``sinks`` tokens (attention sinks) kept in ``fp_dtype`` (BF16); the newest R
  tokens in full precision as every method here (the cache's residual window).

Confirmed from the paper's abstract, project page and model card (searched 2026-12):
the composite ``R_K = U_Q H_Had P_br`` and ``R_V = U_S H_Had P_br``, the offline
per-layer/head eigendecomposition, token-wise affine asymmetric INT2 with a fitted clip
``k+ = Q2(clip(k R_K, tau))``, quantization groups of 128 along head_dim, 64 BF16 sink
tokens and a 256-token BF16 recent window. **Assumed** (not confirmed from the paper's
text): the clip is a ratio on each token group's min and max chosen on a grid
(1.0, 0.95, ..., 0.5) per layer and KV head by the errors named above; ``H`` is the full
D x D Hadamard (then ``P`` only reorders equally loaded channels, and with one group per
token, ``channel_group >= D``, it changes nothing); the second moments are uncentred
and the query group's heads are pooled per KV head; fp16 scale and zero; R = 128 recent
tokens here (the library's window, as the other methods: ``_r{R}`` sets it).
``_u0`` (ablation: no eigenbases, only ``H P``) and ``_b1`` (the RoPE'd k bias taken
out before quantizing, as ``oscarb``) are ours, not the paper's.

Bytes per token per KV head: K and V codes (b D / 8 each), K and V scale + zero per
token per channel group (2 x 2 x param bytes x D / channel_group), and the sink tokens'
K and V in ``fp_dtype`` amortised over the context (as ``sinks``: their code slots
still counted). The rotations are model constants (2 D^2 per KV head per layer), not cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from oscar_jax import quant
from oscar_jax.methods import base
from oscar_jax.methods.rotation import hadamard_matrix

HIGHEST = jax.lax.Precision.HIGHEST
CLIP_GRID = tuple(np.round(np.arange(1.0, 0.499, -0.05), 2).tolist())  # 1.0 ... 0.5


def bit_reversal(d: int) -> np.ndarray:
    """The bit-reversal permutation of range(d) (d a power of two), int64."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"d={d} must be a power of two")
    nb = d.bit_length() - 1
    return np.array([int(format(i, f"0{nb}b")[::-1], 2) if nb else 0 for i in range(d)])


def spectral_rotation(cov: np.ndarray) -> np.ndarray:
    """The rotation (rows: rotated channels, ``x_rot = R x``) of ``U H P`` for a second
    moment ``cov`` [D, D]: ``U`` its eigenvectors by descending eigenvalue (ties in index
    order, each sign fixed so that its largest entry is positive), ``H`` the orthonormal
    Hadamard matrix, ``P`` the bit-reversal permutation. Orthogonal, float64."""
    c = np.asarray(cov, np.float64)
    if c.ndim != 2 or c.shape[0] != c.shape[1]:
        raise ValueError(f"cov.shape={c.shape} must be [D, D]")
    c = (c + c.T) / 2
    w, u = np.linalg.eigh(c)
    u = u[:, np.argsort(-w, kind="stable")]
    sign = np.sign(u[np.argmax(np.abs(u), axis=0), np.arange(u.shape[1])])
    u = u * np.where(sign == 0, 1.0, sign)
    d = c.shape[0]
    return (hadamard_matrix(d) @ u.T)[bit_reversal(d)]


def token_fake_quant(
    x: Float[Array, "... D"], bits: int, channel_group: int, clip, param_dtype: str
) -> Float[Array, "... D"]:
    """Token-wise asymmetric INT-b over groups of ``channel_group`` channels (last axis):
    min and max of each group times ``clip`` (broadcastable to x[..., :1]), stored scale
    and zero rounded to ``param_dtype``; float32."""
    xf = x.astype(jnp.float32)
    d = xf.shape[-1]
    c = min(channel_group, d)
    xg = xf.reshape(*xf.shape[:-1], d // c, c)
    a = jnp.asarray(clip, jnp.float32)[..., None]
    mn = jnp.min(xg, axis=-1, keepdims=True) * a
    mx = jnp.max(xg, axis=-1, keepdims=True) * a
    levels = (1 << bits) - 1
    s = quant.round_to_dtype((mx - mn) / levels, param_dtype)
    z = quant.round_to_dtype(mn, param_dtype)
    inv = jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)
    q = jnp.clip(jnp.round((xg - z) * inv), 0, levels)
    return (q * s + z).reshape(xf.shape)


def rotated_fake_quant(
    x: Float[Array, "B H T D"], rot: Float[Array, "H D D"], clip: Float[Array, " H"],
    bits: int, channel_group: int, param_dtype: str,
) -> Float[Array, "B H T D"]:  # fmt: skip
    """x rotated per KV head (``rot`` rows: rotated channels), token-wise fake-quant
    with each head's clipping ratio, rotated back (float32)."""
    r = jnp.einsum("hed,bhtd->bhte", rot, x.astype(jnp.float32), precision=HIGHEST)
    r = token_fake_quant(r, bits, channel_group, clip[None, :, None, None], param_dtype)
    return jnp.einsum("hed,bhte->bhtd", rot, r, precision=HIGHEST)


@dataclasses.dataclass(frozen=True)
class QCov(base.MethodConfig):
    """arXiv 2605.17757's OSCAR: query-covariance key rotation (score-weighted value
    covariance for values) + Hadamard + bit reversal, token-wise INT-b with fitted clipping
    ratios, BF16 sinks. ``channel_group``: channels per token-wise group (clamped to D);
    ``spectral=False``: the ablation without the eigenbases (Hadamard + bit reversal);
    ``bias_offset``: keys quantized minus the k bias's RoPE'd part, added back (as
    ``oscarb``; zero bytes, known from the weights) -- a diagnostic, not the paper's."""

    sinks: int = 64
    channel_group: int = 128
    spectral: bool = True  # False (ablation ``_u0``): no U_Q / U_S, only H P (clip fitted)
    bias_offset: bool = False  # True (``_b1``, ours, not the paper's): RoPE'd k bias out

    needs_calibration = True
    needs_queries = True  # ``fit`` wants query_cov / output_cov (oscar_eval.calibrate)

    def __post_init__(self):
        super().__post_init__()
        base._int("sinks", self.sinks, 0)
        base._int("channel_group", self.channel_group, 1)
        if self.channel_group & (self.channel_group - 1):
            raise ValueError(f"channel_group={self.channel_group!r} must be a power of two")
        for name in ("spectral", "bias_offset"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")

    @property
    def needs_key_bias(self) -> bool:  # the evaluation hands key_offset only then
        return self.bias_offset

    def _cg(self, d: int) -> int:
        return min(self.channel_group, d)

    def fake_quant_kv(
        self,
        k: Float[Array, "B H T D"],
        v: Float[Array, "B H T D"],
        key_offset: Float[Array, "T H D"] | None = None,
        *,
        state: dict | None = None,
    ):
        base.check_kv(k, v, 1, self.group_size)
        st = self.calibrated_state() if state is None else state
        b, h, t, d = k.shape
        rk = jnp.asarray(st["rot_k"], jnp.float32)
        rv = jnp.asarray(st["rot_v"], jnp.float32)
        if rk.shape != (h, d, d) or rv.shape != (h, d, d):
            raise ValueError(f"rot_k / rot_v shapes {rk.shape} / {rv.shape} must be [H, D, D] "
                             f"of k {k.shape}")  # fmt: skip
        ck, cv = jnp.asarray(st["clip_k"]), jnp.asarray(st["clip_v"])
        off = 0.0
        if self.bias_offset and key_offset is not None:
            off = jnp.swapaxes(key_offset.astype(jnp.float32), 0, 1)[None]  # [1, H, T, D]
        kh = rotated_fake_quant(k - off, rk, ck, self.bits, self._cg(d), self.param_dtype) + off
        vh = rotated_fake_quant(v, rv, cv, self.bits, self._cg(d), self.param_dtype)
        keep = (jnp.arange(t) < self.sinks)[None, None, :, None]
        kh = jnp.where(keep, base.round_fp(k, self.fp_dtype), kh)
        vh = jnp.where(keep, base.round_fp(v, self.fp_dtype), vh)
        return kh, vh

    def _fit_clip(self, x: np.ndarray, rot: np.ndarray, weight: np.ndarray | None) -> float:
        """The grid ratio with the least error of x [M, D] (``weight``: the [D, D] matrix
        of the error's quadratic form, None: squared error); ties to the larger ratio."""
        d = x.shape[-1]
        xj = jnp.asarray(x, jnp.float32)[None, None]  # [1, 1, M, D]
        rj = jnp.asarray(rot, jnp.float32)[None]
        best, best_err = 1.0, np.inf
        for a in CLIP_GRID:
            xh = rotated_fake_quant(xj, rj, jnp.asarray([a]), self.bits, self._cg(d),
                                    self.param_dtype)  # fmt: skip
            e = np.asarray(xh[0, 0], np.float64) - x
            err = np.sum(e * e) if weight is None else np.einsum("md,de,me->", e, weight, e)
            if err < best_err * (1 - 1e-9):
                best, best_err = a, err
        return best

    def fit(self, k, v, rope=None, key_offset=None, *, query_cov=None, output_cov=None) -> QCov:
        """``rot_k`` / ``rot_v`` [L, H, D, D] from the query second moment ``query_cov`` and
        the attention output's ``output_cov`` [L, H, D, D] (per KV head, its query group
        pooled; ``oscar_eval.calibrate``), and ``clip_k`` / ``clip_v`` [L, H] fitted on the
        calibration keys / values [L, N, H, T, D] past the sink tokens. Without
        ``output_cov`` the values use their own second moment (an assumption)."""
        if query_cov is None:
            raise ValueError(f"{self.method} needs query_cov (the calibration's query "
                             "second moments, [L, H, D, D])")  # fmt: skip
        k = np.asarray(k, np.float64)
        v = np.asarray(v, np.float64)
        n_l, _, n_h, t, d = k.shape
        qc = np.asarray(query_cov, np.float64)
        if qc.shape != (n_l, n_h, d, d):
            raise ValueError(f"query_cov.shape={qc.shape} must be {(n_l, n_h, d, d)}")
        if output_cov is not None and np.shape(output_cov) != (n_l, n_h, d, d):
            raise ValueError(f"output_cov.shape={np.shape(output_cov)} must be "
                             f"{(n_l, n_h, d, d)}")  # fmt: skip
        s0 = min(self.sinks, t - 1)
        rot_k, rot_v = np.zeros((n_l, n_h, d, d)), np.zeros((n_l, n_h, d, d))
        clip_k, clip_v = np.ones((n_l, n_h)), np.ones((n_l, n_h))
        for li in range(n_l):
            kl = k[li]
            if self.bias_offset and key_offset is not None:
                kl = kl - np.swapaxes(np.asarray(key_offset[li], np.float64), 0, 1)[None]
            for h in range(n_h):
                kx = kl[:, h, s0:].reshape(-1, d)
                vx = v[li, :, h, s0:].reshape(-1, d)
                oc = vx.T @ vx / len(vx) if output_cov is None else output_cov[li, h]
                eye = np.eye(d)
                rot_k[li, h] = spectral_rotation(qc[li, h] if self.spectral else eye)
                rot_v[li, h] = spectral_rotation(oc if self.spectral else eye)
                clip_k[li, h] = self._fit_clip(kx, rot_k[li, h], qc[li, h])
                clip_v[li, h] = self._fit_clip(vx, rot_v[li, h], None)
        cal = base.Calibration(rot_k=rot_k, rot_v=rot_v, clip_k=clip_k, clip_v=clip_v)
        return self.replace(calibration=cal)

    def bytes_per_token(self, head_dim: int, context: int = 2048) -> dict[str, float]:
        if context < 1:
            raise ValueError(f"{context=} must be >= 1")
        pb = base.DTYPE_BYTES[self.param_dtype]
        groups = head_dim / self._cg(head_dim)
        return base.total({
            "k_codes": self.bits * head_dim / 8,
            "v_codes": self.bits * head_dim / 8,
            "k_params": 2 * pb * groups,
            "v_params": 2 * pb * groups,
            "sink_kv": self.sinks * 2 * head_dim * base.DTYPE_BYTES[self.fp_dtype] / context,
        })  # fmt: skip
