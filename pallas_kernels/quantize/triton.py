"""Fused rotate -> token-scale -> group-quantize -> planar-pack kernel (Pallas, Triton).

One ``pallas_call`` encodes a block of keys *and* values straight into the cache's
layout (see ``oscar_jax.codec``): every program reads ``groups_per_block`` groups of
G tokens of one KV head (all KV heads for ``per_token`` norms) once from HBM and
writes codes, scales/zeros and norms; nothing intermediate goes back to HBM. One
program encodes a group's keys and its values (separate key and value programs were
slower at the same register count). The groups of a program are a loop that Triton
software-pipelines (``num_stages=2``: the next group's tiles are prefetched by cp.async
while one is encoded).

Per group of G tokens, the tile is read as D/W chunks of W = min(P, Gv) channels (P =
D*bits/8 channels per packed plane, Gv the value group), rotated by
``rotation.rotated_chunks`` (Kronecker-factored Hadamard on the tensor cores); the key
tile is held as [W, G] (channels x tokens, see ``_encode_key_head``). Chunks line up
with the planar packing (byte j holds channels j + i*P), so packing is shifts and adds
of whole chunks and nothing slices a loaded value (Pallas-Triton lowers no such
slicing).

The kernel is bound by its instruction stream, so the per-element numerics
(``numerics``) spend as few instructions as they can while reproducing the reference:
codes rounded by a magic-number add in one inline-PTX op an element (no quarter-rate
conversions), clamped at 0 by the multiply's own saturation and packed onto the higher
planes by one shift-add; the level division without ``div.rn``; 16-bit scales and norms
inverted by one Newton step; the norm's squares added by explicit ``fma.rn``; the norm's
power-of-two prescale only in a branch for the tiles that need it (``head_norms``); and
a 128-register cap (``default_max_registers``: 8 programs an SM instead of 6). At 128K
tokens it runs at 57% of the device copy rate on the H200 (BENCHMARKS.md).

Numerics follow ``encode_keys_xla`` / ``encode_values_xla``: overflow-safe norm
(``codec.token_norm_and_prescale``: a power-of-two prescale s, exact; the kernel skips
s where it cannot change a bit, see ``head_norms``), division by the
*stored* norm d as (y s) * ``quant.scaled_reciprocal`` (one IEEE-rounded 1 / (d s) per
token, as the reference does; y s is the norm's own scaled tile), min/max per group, codes from
the *stored* (rounded) scale/zero times the inverse scale, round half to even,
constant group -> code 0.
With ``exact_division=True`` (default) divisions are IEEE round-to-nearest
(``div.rn.f32``; Triton's ``/`` is approximate); ``exact_division=False`` multiplies
by reciprocals instead (faster; norms and scales may differ by an ulp, codes only at
near-ties). Reduction order differs from XLA's, so norms may differ by an ulp and a
code may rarely differ by one where the reference value sits on a rounding tie.

Where the kernel does not apply, ``encode`` falls back to the XLA path (documented,
silent): bits 1, 3 and 8; float8 scale dtype; head_dim not a power of two (block-
diagonal Hadamard of 80, 96, ...), or W < 16 (e.g. head_dim 32 at 2 bits, head_dim 16);
group_size < 16 (Triton dots need 16 rows).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import oscar_jax
from oscar_jax import codec, hadamard, quant
from oscar_jax.config import KVQuantConfig
from pallas_kernels import register_cap
from pallas_kernels.quantize.numerics import (
    _quantize,
    _recip,
    _row_max_abs,
    _row_sumsq,
)
from pallas_kernels.quantize.rotation import rotated_chunks, rotation_operand


@dataclasses.dataclass(frozen=True)
class QuantizeTuning:
    """Launch knobs of the fused encoder (validated; hashable, static under jit).

    groups_per_block: G-token groups one program encodes (1..64).
    num_warps: Triton warps per program (1, 2, 4, 8, 16).
    num_stages: Triton software-pipelining stages (1..8).
    exact_division: IEEE-rounded divisions as in XLA (True) or reciprocal multiplies.
    max_registers: a cap on registers a thread (``register_cap``; None: ptxas decides).
    """

    groups_per_block: int = 4
    num_warps: int = 2
    num_stages: int = 2
    exact_division: bool = True
    max_registers: int | None = None

    def __post_init__(self):
        for name, lo, hi in (("groups_per_block", 1, 64), ("num_stages", 1, 8)):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int | np.integer):
                raise ValueError(f"{name}={val!r} must be an int")
            if not lo <= val <= hi:
                raise ValueError(f"{name}={val} must be in [{lo}, {hi}]")
        if self.num_warps not in (1, 2, 4, 8, 16) or isinstance(self.num_warps, bool):
            raise ValueError(f"num_warps={self.num_warps!r} must be one of 1, 2, 4, 8, 16")
        if not isinstance(self.exact_division, bool):
            raise ValueError(f"exact_division={self.exact_division!r} must be a bool")
        r = self.max_registers
        if r is not None and (
            isinstance(r, bool) or not isinstance(r, int | np.integer) or not 24 <= r <= 255
        ):
            raise ValueError(f"max_registers={r!r} must be None or an int in [24, 255]")


def kernel_unsupported_reason(cfg: KVQuantConfig, head_dim: int) -> str | None:
    """Why the fused kernel cannot encode this config / head_dim (None: it can)."""
    if cfg.bits not in (2, 4):
        return f"bits={cfg.bits} (the kernel packs 2 and 4 bits)"
    if cfg.param_dtype not in ("bfloat16", "float16", "float32"):
        return f"param_dtype={cfg.param_dtype}"
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 512:
        return f"head_dim={head_dim} is not a power of two in [16, 512]"
    if _chunk_width(cfg, head_dim) < 16:
        return f"chunk width {_chunk_width(cfg, head_dim)} < 16 (head_dim too small)"
    if cfg.group_size < 16:
        return f"group_size={cfg.group_size} < 16"
    return None


def _chunk_width(cfg: KVQuantConfig, d: int) -> int:
    return min(d * cfg.bits // 8, cfg.value_group(d))


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static facts one kernel instance is built from."""

    cfg: KVQuantConfig
    t: int  # tokens
    h: int  # KV heads
    d: int
    in_dtype: str
    tuning: QuantizeTuning
    interpret: bool

    @property
    def w(self) -> int:
        return _chunk_width(self.cfg, self.d)

    @property
    def p(self) -> int:  # channels (bytes) per packed plane
        return self.d * self.cfg.bits // 8

    @property
    def rot_scale(self):
        if self.cfg.rotation == "random_orthogonal":
            return None
        return np.float32(1.0 / np.sqrt(hadamard.hadamard_block_size(self.d)))


def _store_codes(ref, b, h, t0, packed, spec: _Spec):
    g, w = spec.cfg.group_size, spec.w
    for j, acc in enumerate(packed):
        ref[b, h, pl.ds(t0, g), pl.ds(j * w, w)] = acc.astype(jnp.uint8)


def _encode_key_head(k_ref, mat_ref, outs, b, h, t0, den, spec: _Spec, ys=None):
    """Quantize one head's key tile ys (rotated here if None), divided by the norms as
    (y s) r with den = (s, r) [G] if given (s None: ys already scaled), and store it.
    The tile is held as [W, G] chunks (channels x tokens): the MMA splits the channels
    between the warps, so a channel's min/max over the group's tokens is
    one warp's (8 values a thread, two shuffle steps) where [G, W] tiles took three steps
    and an exchange through shared memory, and each thread derives the scales of 2
    channels a chunk instead of 8 (fewer instructions a group, though more registers)."""
    cfg, w = spec.cfg, spec.w
    kc_ref, ks_ref, kz_ref = outs
    if ys is None:
        ys = rotated_chunks(k_ref, mat_ref, b, h, t0, cfg.rotate_keys, spec, transpose=True)
    npl = spec.p // w  # chunks per plane
    packed = [None] * npl
    grp = t0 // cfg.group_size
    for k in reversed(range(len(ys))):  # planes from the highest down (see _codes)
        y = ys[k]  # [W, G]
        if den is not None:
            y = y if den[0] is None else y * den[0][None, :]
            y = y * den[1][None, :]
        mn, mx = jnp.min(y, axis=1, keepdims=True), jnp.max(y, axis=1, keepdims=True)
        scale, zero, packed[k % npl] = _quantize(y, mn, mx, spec, packed[k % npl])
        ks_ref[b, h, grp, pl.ds(k * w, w)] = scale[:, 0]
        kz_ref[b, h, grp, pl.ds(k * w, w)] = zero[:, 0]
    _store_codes(kc_ref, b, h, t0, [x.T for x in packed], spec)


def _encode_value_head(v_ref, mat_ref, outs, b, h, t0, spec: _Spec):
    cfg, w, g = spec.cfg, spec.w, spec.cfg.group_size
    vc_ref, vs_ref, vz_ref = outs
    ys = rotated_chunks(v_ref, mat_ref, b, h, t0, cfg.rotate_values, spec)
    npl, per_group = spec.p // w, cfg.value_group(spec.d) // w
    packed = [None] * npl
    ranges = []  # per value group: min, max [G, 1] over its chunks
    for gi in range(len(ys) // per_group):
        group = ys[gi * per_group : (gi + 1) * per_group]
        mn, mx = jnp.min(group[0], axis=1), jnp.max(group[0], axis=1)
        for y in group[1:]:
            mn, mx = jnp.minimum(mn, jnp.min(y, axis=1)), jnp.maximum(mx, jnp.max(y, axis=1))
        ranges.append((mn[:, None], mx[:, None]))
    for k in reversed(range(len(ys))):  # planes from the highest down (see _codes)
        gi = k // per_group
        scale, zero, packed[k % npl] = _quantize(ys[k], *ranges[gi], spec, packed[k % npl])
        if k % per_group == 0:
            vs_ref[b, h, pl.ds(t0, g), gi] = scale[:, 0]
            vz_ref[b, h, pl.ds(t0, g), gi] = zero[:, 0]
    _store_codes(vc_ref, b, h, t0, packed, spec)


def _kernel(*refs, spec: _Spec):
    cfg = spec.cfg
    rot = cfg.rotate_keys or cfg.rotate_values
    k_ref, v_ref, *rest = refs
    mat_ref = rest.pop(0) if rot else None
    kc, ks, kz, *rest = rest
    kn_ref = rest.pop(0) if cfg.token_scaling else None
    vouts = tuple(rest)
    b, hb, blk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g, gpb = cfg.group_size, spec.tuning.groups_per_block
    per_token = cfg.token_scaling and cfg.norm_granularity == "per_token"
    norm_dt = cfg.norm_jnp_dtype

    def stored_norm(m, sumsq, sc, inv):  # sumsq = sum((y s)^2), inv = 1 / s: the norm, r
        n = jnp.where(m > 0, jnp.sqrt(sumsq) * inv, 0.0).astype(norm_dt)
        return n, _recip(n.astype(jnp.float32), sc, spec)

    def prescaled_norms(ys):  # the reference's way: a power-of-two prescale from max |y|
        m = _row_max_abs(ys)
        sc, inv = quant.pow2_prescale(jnp.where(m > 0, m, 1.0), quant.NORM_MAX_EXPONENT)
        sumsq, zs = _row_sumsq(ys, sc, spec)  # zs = ys * sc
        return (*stored_norm(m, sumsq, sc, inv), zs)

    def head_norms(ys):
        """(stored norm, r, keys to multiply by r) of one head's rotated [W, G] tile ys.

        Most tokens need no prescale: their sum of squares is in [2^-60, 2^60], so no
        square overflows and only elements below 2^-63 (2^-60 times smaller than the
        norm) square to subnormals. Then sqrt(sum(y^2)) and y * RN(1 / n) are the bits of
        the prescaled sqrt(sum((y s)^2)) / s and (y s) * RN(1 / (n s)) (s a power of
        two). A tile with any other token (a sum of 0 too: a zero key and a tiny one
        that underflowed look alike) takes the prescaled path in a branch, so that the
        common case spends no max |y| an element."""
        sumsq, _ = _row_sumsq(ys, None, spec)
        ok = (sumsq >= 2.0**-60) & (sumsq <= 2.0**60)

        def direct():
            n = jnp.sqrt(sumsq).astype(norm_dt)
            return n, _recip(n.astype(jnp.float32), jnp.ones_like(sumsq), spec), ys

        all_ok = jnp.min(jnp.where(ok, 1, 0)) > 0  # (Pallas-Triton lowers no reduce_and)
        return jax.lax.cond(all_ok, direct, lambda: prescaled_norms(ys))

    def one_group(i):
        t0 = (blk * gpb + i) * g

        @_when(t0 < spec.t, (spec.t // g) % gpb != 0)
        def _():
            if not per_token:
                den = None
                ys = rotated_chunks(k_ref, mat_ref, b, hb, t0, cfg.rotate_keys, spec, True)
                if cfg.token_scaling:
                    n, r, ys = head_norms(ys)
                    den = (None, r)
                    kn_ref[b, hb, pl.ds(t0, g)] = n
                _encode_key_head(k_ref, mat_ref, (kc, ks, kz), b, hb, t0, den, spec, ys)
                _encode_value_head(v_ref, mat_ref, vouts, b, hb, t0, spec)
                return

            def head_max(h, m):  # one norm over all KV heads: three passes over the heads
                ys = rotated_chunks(k_ref, mat_ref, b, h, t0, cfg.rotate_keys, spec, True)
                return jnp.maximum(m, _row_max_abs(ys))

            m = jax.lax.fori_loop(0, spec.h, head_max, jnp.zeros((g,), jnp.float32))
            sc, inv = quant.pow2_prescale(jnp.where(m > 0, m, 1.0), quant.NORM_MAX_EXPONENT)

            def head_sumsq(h, s):
                ys = rotated_chunks(k_ref, mat_ref, b, h, t0, cfg.rotate_keys, spec, True)
                return s + _row_sumsq(ys, sc, spec)[0]

            s = jax.lax.fori_loop(0, spec.h, head_sumsq, jnp.zeros((g,), jnp.float32))
            n, r = stored_norm(m, s, sc, inv)
            den = (sc, r)
            kn_ref[b, 0, pl.ds(t0, g)] = n

            def head_encode(h, carry):
                _encode_key_head(k_ref, mat_ref, (kc, ks, kz), b, h, t0, den, spec)
                _encode_value_head(v_ref, mat_ref, vouts, b, h, t0, spec)
                return carry

            jax.lax.fori_loop(0, spec.h, head_encode, 0)

    if gpb == 1:
        one_group(0)
    else:  # a loop (not unrolled): Triton's pipeliner prefetches group i+1 with num_stages > 1
        jax.lax.fori_loop(0, gpb, lambda i, c: (one_group(i), c)[1], 0)


def _when(cond, needed: bool):
    """pl.when(cond) where the grid has a partial last block; unguarded otherwise, so
    the group loop's loads stay unconditional and pipelineable."""
    return pl.when(cond) if needed else (lambda f: f())


@functools.partial(jax.jit, static_argnames=("spec",))
def _encode_pallas(k, v, spec: _Spec):
    cfg, (bsz, h, t, d) = spec.cfg, k.shape
    g, pdt, db = cfg.group_size, cfg.scale_dtype, d * cfg.bits // 8
    hn = 1 if cfg.norm_granularity == "per_token" else h
    gv = cfg.value_group(d)
    out_shape = [
        jax.ShapeDtypeStruct((bsz, h, t, db), jnp.uint8),
        jax.ShapeDtypeStruct((bsz, h, t // g, d), pdt),
        jax.ShapeDtypeStruct((bsz, h, t // g, d), pdt),
    ]
    if cfg.token_scaling:
        out_shape.append(jax.ShapeDtypeStruct((bsz, hn, t), cfg.norm_jnp_dtype))
    out_shape += [
        jax.ShapeDtypeStruct((bsz, h, t, db), jnp.uint8),
        jax.ShapeDtypeStruct((bsz, h, t, d // gv), pdt),
        jax.ShapeDtypeStruct((bsz, h, t, d // gv), pdt),
    ]
    args = [k, v]
    if cfg.rotate_keys or cfg.rotate_values:
        args.append(jnp.asarray(rotation_operand(spec)))
    per_token = cfg.token_scaling and cfg.norm_granularity == "per_token"
    nblk = pl.cdiv(t // g, spec.tuning.groups_per_block)
    kwargs = {}
    if not spec.interpret:
        if spec.tuning.max_registers is not None:
            register_cap.install()
        kwargs["compiler_params"] = plgpu.CompilerParams(
            num_warps=spec.tuning.num_warps, num_stages=spec.tuning.num_stages
        )
    outs = pl.pallas_call(
        functools.partial(_kernel, spec=spec),
        out_shape=out_shape,
        grid=(bsz, 1 if per_token else h, nblk),
        interpret=spec.interpret,
        name=register_cap.capped_name(f"oscar_quantize_int{cfg.bits}", spec.tuning.max_registers),
        **kwargs,
    )(*args)
    kc, ks, kz, *rest = outs
    kn = rest.pop(0) if cfg.token_scaling else jnp.ones((bsz, hn, t), cfg.norm_jnp_dtype)
    return codec.EncodedKeys(kc, ks, kz, kn), codec.EncodedValues(*rest)


def default_num_warps(group_size: int, head_dim: int) -> int:
    """Warps per program: 2 for a 32 x 128 group tile (the fastest on the H200), more
    as the G x D tile grows, so that it stays in registers. Offline ``ptxas`` (Triton
    3.6, 2 stages): G 128 x D 128 at 2 warps spills 1.4 KB per thread, at 8 warps uses
    164 registers; G 128 x D 256 spills 20 KB at 2 warps and nothing at 8; G 64 x D 128:
    255 registers at 2 warps, 167 at 4. Only the 32 x 128 tile is timed on a GPU."""
    return int(min(8, max(2, 2 * group_size * head_dim // 4096)))


def default_max_registers(group_size: int, head_dim: int, num_warps: int) -> int | None:
    """A cap of 128 registers a thread (8 programs of 2 warps an SM instead of 6) for
    tiles up to 32 x 128 at 2 warps, where ptxas fits the encoder in 128 without spills
    (offline: 138 live at the peak uncapped, 121 capped; 16 more loop instructions; 4-bit
    codes too). Timed on the H200 for bf16 inputs with per-head norms only; the GPU tests
    cover the other capped cases. Larger tiles: no cap."""
    return 128 if num_warps == 2 and group_size * head_dim <= 4096 else None


def encode(
    k, v, cfg: KVQuantConfig, *, interpret: bool | None = None, groups_per_block: int = 4,
    num_warps: int | None = None, num_stages: int = 2, exact_division: bool = True,
    max_registers: int | None | str = "auto",
) -> tuple[codec.EncodedKeys, codec.EncodedValues]:  # fmt: skip
    """Fused encoder of head-major k, v [B, H, T, D] (T a multiple of G); codec's layout.

    ``interpret=None`` runs Pallas interpret mode when no GPU is present. The knobs
    build a ``QuantizeTuning`` (``num_warps=None``: ``default_num_warps``;
    ``max_registers="auto"``: ``default_max_registers``, None: no cap). Configs the
    kernel does not cover (see ``kernel_unsupported_reason``: bits 1/3/8, float8
    params, odd head_dim, G < 16) are encoded by the XLA path instead.
    """
    if not isinstance(cfg, KVQuantConfig) or not cfg.quantized:
        raise ValueError(f"cfg={cfg!r} must be a quantized KVQuantConfig")
    for name, x in (("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4 or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(
                f"{name} must be a floating [B, H, T, D] array, got "
                f"{getattr(x, 'shape', None)} {getattr(x, 'dtype', None)}"
            )
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k {k.shape} {k.dtype} must match v {v.shape} {v.dtype}")
    t, d = k.shape[2], k.shape[3]
    if num_warps is None:
        num_warps = default_num_warps(cfg.group_size, d)
    if isinstance(max_registers, str) and max_registers == "auto":
        max_registers = default_max_registers(cfg.group_size, d, num_warps)
    tuning = QuantizeTuning(groups_per_block, num_warps, num_stages, exact_division, max_registers)
    if t % cfg.group_size:
        raise ValueError(f"tokens T={t} must be a multiple of group_size={cfg.group_size}")
    if kernel_unsupported_reason(cfg, d) is not None or jnp.dtype(k.dtype).itemsize > 4:
        return codec.encode_keys_xla(k, cfg), codec.encode_values_xla(v, cfg)
    if t == 0:
        return codec.encode_keys_xla(k, cfg), codec.encode_values_xla(v, cfg)
    if interpret is None:
        interpret = not oscar_jax.gpu_available()
    spec = _Spec(cfg, t, k.shape[1], d, jnp.dtype(k.dtype).name, tuning, bool(interpret))
    if spec.in_dtype not in ("bfloat16", "float16", "float32"):
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        spec = dataclasses.replace(spec, in_dtype="float32")
    return _encode_pallas(k, v, spec)
