"""Method presets: one frozen, validated config per KV-cache quantization method.

A config is hashable and static under ``jit``: it decides shapes and code paths,
never values.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from oscar_jax import record

Method = Literal["bf16", "kivi", "ots_only", "rotation_only", "oscar"]
NormGranularity = Literal["per_head", "per_token"]
RotationKind = Literal["hadamard", "randomized_hadamard", "random_orthogonal", "none"]

METHODS: tuple[str, ...] = ("bf16", "kivi", "ots_only", "rotation_only", "oscar")
SUPPORTED_BITS: tuple[int, ...] = (1, 2, 3, 4, 8)
NORM_GRANULARITIES: tuple[str, ...] = ("per_head", "per_token")
ROTATION_KINDS: tuple[str, ...] = ("hadamard", "randomized_hadamard", "random_orthogonal", "none")
PARAM_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32", "float8_e4m3fn")
LAYOUTS: tuple[str, ...] = ("auto", "planar", "record")


_BITS = ", ".join(map(str, SUPPORTED_BITS[:-1])) + f" or {SUPPORTED_BITS[-1]}"
_BF16 = (
    "it is unquantized (keys and values stored as they come, 16 bits) and takes no bits; "
    "bits are for the quantized methods kivi, ots_only, rotation_only and oscar"
)


@dataclasses.dataclass(frozen=True)
class KVQuantConfig:
    """How one layer's KV cache is stored.

    Attributes:
      method: which of the paper's methods (see ``preset``).
      bits: code width for keys and values; 16 means "not quantized" (``bf16``).
      group_size: G. Keys: one scale/zero per channel per G consecutive tokens.
        Values: one scale/zero per token per G consecutive channels (capped at
        head_dim, see ``value_group(head_dim)``).
      residual_length: R. The newest R tokens (up to R + G - 1) stay in full
        precision; older ones are quantized in whole groups of G.
      rotate_keys: apply the channel rotation to keys (and the query) before quantizing.
      token_scaling: divide each rotated key by its l2 norm and keep the norm (OTS).
      rotate_values: rotate values before quantizing (undone on the attention output).
      norm_granularity: ``per_head`` (one norm per token and KV head) or ``per_token``
        (one norm per token over all KV heads, as the official CUDA code does).
      rotation: the rotation kind; ``hadamard`` is the method's, the others are ablations.
      rotation_seed: seed of the random rotations (ignored for ``hadamard``).
      param_dtype: dtype of the scales and zeros (name). ``"float16"`` (default): 3 more
        mantissa bits than bfloat16, and the Pallas decode kernel needs no conversions
        (6-9% faster on the H200 at 1 x 128K, 8 x 32K, 48 x 4K); it bounds keys and values
        to |x| <= 65504 (a row whose parameters overflow is flagged ``FLAG_NONFINITE``).
        ``"bfloat16"`` / ``"float32"`` for wider ranges.
      norm_dtype: dtype of the stored token norms.
      layout: how the quantized part is stored. ``"planar"``: codes, scales, zeros and
        norms in separate arrays (``oscar_jax.cache``), read by the "xla" and "triton"
        backends. ``"record"``: one record per 64 tokens (1600 words at INT2, 2560 at
        INT4, head_dim 128) and float32 norms (``oscar_jax.record``), what the "mosaic"
        decode backend reads without a conversion; INT2 or INT4, group_size 32,
        float16/bfloat16 parameters and head_dim 64, 128 or 256 only (``record_reason``).
        ``"auto"`` (default): decided when a cache is made (``oscar_jax.storage_layout``):
        "record" where the decode attention would read it with the Mosaic kernel (a Hopper
        GPU, a covered config; the fastest decode step measured there), "planar"
        everywhere else. A cache's config always names a concrete layout.
    """

    method: str = "oscar"
    bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    rotate_keys: bool = True
    token_scaling: bool = True
    rotate_values: bool = True
    norm_granularity: str = "per_head"
    rotation: str = "hadamard"
    rotation_seed: int = 0
    param_dtype: str = "float16"
    norm_dtype: str = "bfloat16"
    layout: str = "auto"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} must be one of {METHODS}")
        if self.method == "bf16":
            if self.bits != 16:
                raise ValueError(
                    f"bits={self.bits!r} must not be given for method 'bf16': " + _BF16
                )
        elif isinstance(self.bits, bool) or self.bits not in SUPPORTED_BITS:
            raise ValueError(
                f"bits={self.bits!r} must be one of {_BITS} for method {self.method!r} (the "
                "code width of keys and values; 2 and 4 are the paper's settings, 16 is the "
                "unquantized method 'bf16')"
            )
        for name in ("group_size", "residual_length", "rotation_seed"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int | np.integer):
                raise ValueError(f"{name}={val!r} must be an int")
        if self.group_size < 1 or self.group_size & (self.group_size - 1):
            raise ValueError(f"group_size={self.group_size!r} must be a positive power of two")
        if self.residual_length < 0 or self.residual_length % self.group_size:
            raise ValueError(
                f"residual_length={self.residual_length!r} must be >= 0 and a multiple of "
                f"group_size={self.group_size}"
            )
        if self.norm_granularity not in NORM_GRANULARITIES:
            raise ValueError(
                f"norm_granularity={self.norm_granularity!r} must be one of {NORM_GRANULARITIES}"
            )
        if self.rotation not in ROTATION_KINDS:
            raise ValueError(f"rotation={self.rotation!r} must be one of {ROTATION_KINDS}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype={self.param_dtype!r} must be one of {PARAM_DTYPES}")
        if self.norm_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"norm_dtype={self.norm_dtype!r} must be float32, bfloat16 or float16")
        if (self.rotate_keys or self.rotate_values) and self.rotation == "none":
            raise ValueError(
                f"rotation={self.rotation!r} conflicts with rotate_keys={self.rotate_keys}, "
                f"rotate_values={self.rotate_values}"
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} must be one of {LAYOUTS}")
        why = self.record_reason() if self.layout == "record" else None
        if why is not None:
            raise ValueError(f"layout='record' must have {why}")

    # -- derived, static properties -------------------------------------------------
    @property
    def quantized(self) -> bool:
        return self.method != "bf16"

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def scale_dtype(self) -> Any:
        return jnp.dtype(self.param_dtype)

    @property
    def norm_jnp_dtype(self) -> Any:
        return jnp.dtype(self.norm_dtype)

    def value_group(self, head_dim: int) -> int:
        """Channels per value group: G, capped at head_dim."""
        return min(self.group_size, head_dim)

    def record_reason(self, head_dim: int | None = None) -> str | None:
        """What keeps this config (and head_dim, if given) out of the record layout, which
        the Mosaic GPU decode kernel reads (None: nothing)."""
        if not self.quantized or self.bits not in (2, 4):
            return f"bits=2 or 4 (INT2, INT4), not bits={self.bits}"
        if self.group_size != 32:
            return f"group_size=32, not group_size={self.group_size}"
        if self.param_dtype not in ("float16", "bfloat16"):
            return f"param_dtype float16 or bfloat16, not param_dtype={self.param_dtype!r}"
        if head_dim is not None and head_dim not in record.DIMS:
            return f"head_dim in {record.DIMS}, not head_dim={head_dim}"
        return None

    def validate_head_dim(self, head_dim: int, name: str = "head_dim") -> None:
        """Raise ValueError when head_dim cannot be stored with this config."""
        if isinstance(head_dim, bool) or not isinstance(head_dim, int | np.integer):
            raise ValueError(f"{name}={head_dim!r} must be an int")
        if head_dim < 8 or head_dim % 8:
            raise ValueError(f"{name}={head_dim} must be a positive multiple of 8")
        if self.quantized and head_dim % self.value_group(head_dim):
            raise ValueError(
                f"{name}={head_dim} must be a multiple of group_size={self.group_size} "
                "(values are grouped along channels)"
            )
        if self.layout == "record" and head_dim not in record.DIMS:
            raise ValueError(f"{name}={head_dim} must be one of {record.DIMS} for layout='record'")

    def replace(self, **kw) -> KVQuantConfig:
        return dataclasses.replace(self, **kw)


_PRESETS: dict[str, dict[str, Any]] = {
    "bf16": dict(bits=16, rotate_keys=False, token_scaling=False, rotate_values=False),
    "kivi": dict(rotate_keys=False, token_scaling=False, rotate_values=False),
    "ots_only": dict(rotate_keys=False, token_scaling=True, rotate_values=False),
    "rotation_only": dict(rotate_keys=True, token_scaling=False, rotate_values=True),
    "oscar": dict(rotate_keys=True, token_scaling=True, rotate_values=True),
}


def preset(method: str = "oscar", **overrides: Any) -> KVQuantConfig:
    """The config of a named method, with keyword overrides.

    ``bf16``: no quantization. ``kivi``: per-channel keys / per-token values, no
    rotation or scaling. ``ots_only``: token l2 scaling without rotation (the
    paper's failure mode). ``rotation_only``: Hadamard rotation only. ``oscar``:
    rotation + omni-token scaling.
    """
    if method not in _PRESETS:
        raise ValueError(f"{method=} must be one of {tuple(_PRESETS)}")
    fields = {f.name for f in dataclasses.fields(KVQuantConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"overrides {unknown} must be fields of KVQuantConfig: {sorted(fields)}")
    if method == "bf16" and "bits" in overrides and overrides["bits"] != 16:
        raise ValueError(
            f"bits={overrides['bits']!r} must not be given for method 'bf16': " + _BF16
        )
    kw = dict(_PRESETS[method])
    kw.update(overrides)
    if method != "bf16" and "rotation" not in kw and not (kw["rotate_keys"] or kw["rotate_values"]):
        kw["rotation"] = "none"
    return KVQuantConfig(method=method, **kw)
