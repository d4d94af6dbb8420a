"""What the comparison methods share: their config base class, a masked group quantizer,
and the byte accounting of every part a method stores.

A comparison method is a frozen dataclass (static under ``jit``, hashable) with the
attributes the evaluation reads from a ``KVQuantConfig`` (``quantized``, ``bits``,
``group_size``, ``residual_length``, ``rotate_keys``, ``rotate_values``, ``replace``)
and one entry point, ``fake_quant_kv``: whole groups of keys and values through the
method's quantizer and back, in the original basis. It is deliberately *not* a
``KVQuantConfig``: the real cache (``oscar_jax.init_cache``) refuses it, so no path can
silently run a comparison method through OScaR's own encoder.

Shapes (head-major, as the cache holds them): B batch, H KV heads, T tokens (a
multiple of G), D head_dim, G key group (tokens).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from oscar_jax import codec, hadamard, quant
from oscar_jax.config import PARAM_DTYPES, KVQuantConfig, preset

HIGHEST = jax.lax.Precision.HIGHEST
# bytes of one stored element per dtype name
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


def _int(name: str, val, lo: int) -> None:
    if isinstance(val, bool) or not isinstance(val, int | np.integer) or val < lo:
        raise ValueError(f"{name}={val!r} must be an int >= {lo}")


class Calibration:
    """Per-layer arrays a method fitted offline (numpy float32, leading axis = layer),
    equal and hashed by content, so that a config holding them stays a static ``jit``
    argument. The evaluation scans them with the layers and hands each layer's slice to
    ``fake_quant_kv`` as ``state`` (``oscar_eval.ppl.method_inputs``)."""

    def __init__(self, **arrays):
        self.arrays = {k: np.ascontiguousarray(np.asarray(a, np.float32))
                       for k, a in sorted(arrays.items())}  # fmt: skip
        h = hashlib.sha256()
        for k, a in self.arrays.items():
            h.update(f"{k}{a.shape}".encode())
            h.update(a.tobytes())
        self.key = h.hexdigest()

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, Calibration) and other.key == self.key

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}{list(a.shape)}" for k, a in self.arrays.items())
        return f"Calibration({shapes}, {self.key[:8]})"


@dataclasses.dataclass(frozen=True)
class MethodConfig:
    """Common fields of the comparison methods (see each module for its own).

    Attributes:
      bits: code width of keys and values.
      group_size: G: tokens per key group (per channel), channels per value group.
      residual_length: R: the newest tokens kept in full precision (as in the cache).
      param_dtype: dtype of the stored scales / zeros (a name of ``PARAM_DTYPES``).
      norm_dtype: dtype of stored token norms, where the method has any.
      fp_dtype: dtype of the tokens a method keeps in full precision (sinks, outliers).
      calibration: per-layer arrays fitted by ``fit`` (methods with ``needs_calibration``).
    """

    bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    param_dtype: str = "float16"
    norm_dtype: str = "bfloat16"
    fp_dtype: str = "bfloat16"
    calibration: Calibration | None = None

    # what the evaluation reads from a cache config ---------------------------------
    quantized = True
    rotate_keys = False  # fake_quant_kv returns keys in the original basis
    rotate_values = False  # ... and values too: nothing to fold into W_V / W_O
    needs_key_bias = False  # True: fake_quant_kv wants the RoPE'd k-projection bias
    needs_rope = False  # True: fake_quant_kv wants rope=(cos, sin) [T, D] of the positions
    needs_calibration = False  # True: ``fit`` on calibration keys / values before use
    needs_queries = False  # True: ``fit`` also wants query_cov / output_cov (calibrate)
    needs_grads = False  # True: ``fit`` also wants grads, the calibration loss's (calibrate)
    needs_attention = False  # True: ``fit`` also wants key_weight (calibrate)
    needs_query_samples = False  # True: ``fit`` also wants queries, query_pos (calibrate)
    needs_loss = False  # True: ``fit`` also wants loss, config -> calibration NLL (calibrate)

    def __post_init__(self):
        _int("bits", self.bits, 1)
        if self.bits not in (1, 2, 3, 4, 8):
            raise ValueError(f"bits={self.bits!r} must be one of (1, 2, 3, 4, 8)")
        _int("group_size", self.group_size, 1)
        if self.group_size & (self.group_size - 1):
            raise ValueError(f"group_size={self.group_size!r} must be a power of two")
        _int("residual_length", self.residual_length, 0)
        if self.residual_length % self.group_size:
            raise ValueError(
                f"residual_length={self.residual_length!r} must be a multiple of "
                f"group_size={self.group_size}"
            )
        for name in ("param_dtype", "norm_dtype", "fp_dtype"):
            if getattr(self, name) not in PARAM_DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {PARAM_DTYPES}")

    @property
    def method(self) -> str:
        return type(self).__name__

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def replace(self, **kw) -> MethodConfig:
        return dataclasses.replace(self, **kw)

    def base(self, method: str, **kw: Any) -> KVQuantConfig:
        """The library's config of ``method`` at this one's bits / G / R / dtypes."""
        kw = {"param_dtype": self.param_dtype, **kw}
        if method in ("ots_only", "oscar"):
            kw.setdefault("norm_dtype", self.norm_dtype)
        return preset(method, bits=self.bits, group_size=self.group_size,
                      residual_length=self.residual_length, **kw)  # fmt: skip

    # to be provided by each method --------------------------------------------------
    def fake_quant_kv(
        self,
        k: Float[Array, "B H T D"],
        v: Float[Array, "B H T D"],
        key_offset: Float[Array, "T H D"] | None = None,
    ) -> tuple[Float[Array, "B H T D"], Float[Array, "B H T D"]]:
        raise NotImplementedError

    def fit(
        self,
        k: Float[Array, "L N H T D"],
        v: Float[Array, "L N H T D"],
        rope: tuple[Array, Array],
        key_offset: Float[Array, "L T H D"] | None = None,
    ) -> MethodConfig:
        """This config with its ``calibration`` fitted on full-precision keys (post-RoPE,
        as the cache gets them) and values of every layer of N calibration windows;
        ``rope``: cos, sin [T, D] of their positions; ``key_offset``: the RoPE'd k bias
        per layer (None without one). Only for methods with ``needs_calibration``."""
        raise NotImplementedError(f"{self.method} needs no calibration")

    def calibrated_state(self, layer: int | None = None) -> dict:
        """One layer's calibration arrays (``layer`` may be None for a one-layer fit):
        what ``fake_quant_kv`` takes as ``state``. ValueError unless fitted."""
        if self.calibration is None:
            raise ValueError(f"{self.method} must be fitted first (oscar_eval.calibrate)")
        arrays = self.calibration.arrays
        n = len(next(iter(arrays.values())))
        if layer is None and n != 1:
            raise ValueError(f"{self.method} was fitted on {n} layers: pass state= one's")
        return {k: a[0 if layer is None else layer] for k, a in arrays.items()}

    def calibration_note(self) -> str | None:
        """A line on what ``fit`` chose, for the evaluation's notes (None: nothing to say)."""
        return None

    def bytes_per_token(self, head_dim: int, context: int = 2048) -> dict[str, float]:
        """Bytes per token per KV head of the quantized part, by component, and ``total``.

        ``context``: the sequence length over which per-sequence parts (sink tokens) are
        amortised. The R full-precision residual tokens are the same for every method and
        are not counted (``residual_note``).
        """
        raise NotImplementedError


def check_kv(k, v, head_dim_multiple: int, group_size: int) -> None:
    """ValueError unless k, v are [B, H, T, D] floats of one shape, T a multiple of G."""
    for name, x in (("k", k), ("v", v)):
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) != 4:
            raise ValueError(f"{name}.shape={shape} must be [batch, kv_heads, tokens, head_dim]")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name}.dtype={x.dtype} must be floating")
    if k.shape != v.shape:
        raise ValueError(f"k.shape={k.shape} must equal v.shape={v.shape}")
    if k.shape[2] % group_size:
        raise ValueError(f"tokens={k.shape[2]} must be a multiple of group_size={group_size}")
    if k.shape[3] % head_dim_multiple:
        raise ValueError(f"head_dim={k.shape[3]} must be a multiple of {head_dim_multiple}")


def kivi_bytes(bits: int, head_dim: int, group_size: int, param_bytes: int) -> dict[str, float]:
    """KIVI's layout per token per head: codes of K and V, K scale+zero per channel per G
    tokens, V scale+zero per token per Gv = min(G, D) channels."""
    gv = min(group_size, head_dim)
    return {
        "k_codes": bits * head_dim / 8,
        "v_codes": bits * head_dim / 8,
        "k_params": 2 * param_bytes * head_dim / group_size,
        "v_params": 2 * param_bytes * head_dim / gv,
    }


def total(parts: dict[str, float]) -> dict[str, float]:
    out = dict(parts)
    out["total"] = float(sum(parts.values()))
    return out


def masked_group_fake_quant(
    x: Float[Array, "B H T D"],
    keep: Bool[Array, "B H T"],
    bits: int,
    group_size: int,
    param_dtype: str,
) -> Float[Array, "B H T D"]:
    """Per-channel min/max quantization over groups of G tokens (axis 2) with the ``keep``
    tokens excluded from their group's min/max and returned exactly (float32).

    The others get ``q * scale + zero`` with the stored (``param_dtype``-rounded) scale and
    zero, as ``quant.quantize_groups``. A group whose tokens are all kept, or whose other
    tokens are constant, has scale 0 and no NaN.
    """
    b, h, t, d = x.shape
    xf = x.astype(jnp.float32)
    xg = xf.reshape(b, h, t // group_size, group_size, d)
    kg = keep.reshape(b, h, t // group_size, group_size, 1)
    mn = jnp.min(jnp.where(kg, jnp.inf, xg), axis=3, keepdims=True)
    mx = jnp.max(jnp.where(kg, -jnp.inf, xg), axis=3, keepdims=True)
    empty = ~jnp.isfinite(mn)  # every token of the group kept
    mn, mx = jnp.where(empty, 0.0, mn), jnp.where(empty, 0.0, mx)
    levels = (1 << bits) - 1
    s = quant.round_to_dtype((mx - mn) / levels, param_dtype)
    z = quant.round_to_dtype(mn, param_dtype)
    inv = jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)
    q = jnp.clip(jnp.round((xg - z) * inv), 0, levels)
    out = jnp.where(kg, xg, q * s + z)
    return out.reshape(b, h, t, d)


def round_fp(x: Array, dtype: str) -> Array:
    """``x`` as a full-precision token stored in ``dtype`` would read back (float32)."""
    return quant.round_to_dtype(x, dtype)


def rope_rotate(
    x: Float[Array, "B H T D"], cos: Float[Array, "T D"], sin: Float[Array, "T D"],
    inverse: bool = False,
) -> Float[Array, "B H T D"]:  # fmt: skip
    """The rotate-half RoPE of Llama / Qwen at each token's position (``inverse``: back
    to the pre-RoPE key; the rotation by -angle), float32."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return xf * cos + rot * (-sin if inverse else sin)


def oscar_keys_scaled(
    k: Float[Array, "B H T D"],
    cfg: KVQuantConfig,
    offset: Float[Array, "B H T D"] | None = None,
    norm_round=None,
    rotation: Float[Array, "H D D"] | None = None,
) -> tuple[Float[Array, "B H T D"], Float[Array, "B H T"]]:
    """(u, n): OScaR's key path up to its quantizer: ``k - offset`` rotated and divided
    by its stored l2 norm ``n`` (arguments as ``oscar_keys_fake_quant``; float32)."""
    x = k.astype(jnp.float32)
    if offset is not None:
        x = x - offset
    if rotation is None:
        x = hadamard.rotate(x, cfg)
    else:
        x = jnp.einsum("hed,bhtd->bhte", rotation, x, precision=HIGHEST)
    n, s = codec.token_norm_and_prescale(x, "per_head")  # [B, H, T]
    n = norm_round(n) if norm_round is not None else quant.round_to_dtype(n, cfg.norm_jnp_dtype)
    r = quant.scaled_reciprocal(n, s)
    return (x * s[..., None]) * r[..., None], n


def oscar_keys_fake_quant(
    k: Float[Array, "B H T D"],
    cfg: KVQuantConfig,
    offset: Float[Array, "B H T D"] | None = None,
    norm_round=None,
    rotation: Float[Array, "H D D"] | None = None,
    quantize=None,
) -> Float[Array, "B H T D"]:
    """OScaR's key path (rotate, divide by the stored l2 norm, per-channel INT-b over G
    tokens) on ``k - offset``, back in the original basis with ``offset`` added (float32).

    ``offset`` (broadcastable to k, float32) is what the method stores or knows apart
    from the codes; ``norm_round`` maps the float32 norms [B, H, T] to the values stored
    (default: rounding to ``cfg.norm_dtype``). A zero-norm key comes back as the offset.
    ``rotation``: one orthogonal matrix per KV head (rows: the rotated channels) used
    instead of ``cfg``'s rotation. ``quantize``: a map of the normed rotated keys
    [B, H, T, D] to their dequantized values used instead of the per-channel INT-b.
    """
    u, n = oscar_keys_scaled(k, cfg, offset, norm_round, rotation)
    if quantize is None:
        codes, scale, zero = quant.quantize_groups(u, cfg.bits, cfg.group_size, 2, cfg.scale_dtype)
        u_hat = quant.dequantize_groups(codes, scale, zero, cfg.group_size, axis=2)
    else:
        u_hat = quantize(u)
    if rotation is None:
        out = hadamard.unrotate(u_hat * n[..., None], cfg)
    else:
        out = jnp.einsum("hed,bhte->bhtd", rotation, u_hat * n[..., None], precision=HIGHEST)
    return out if offset is None else out + offset


def values_fake_quant(v: Float[Array, "B H T D"], cfg: KVQuantConfig) -> Float[Array, "B H T D"]:
    """Values through the library's value quantizer of ``cfg`` and back (original basis)."""
    ev = codec.encode_values_xla(v.astype(jnp.float32), cfg)
    return codec.decode_values(ev, cfg, rotated=False)
