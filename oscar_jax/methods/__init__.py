"""Comparison methods and the seed note's proposals, as fake-quant (XLA) configs.

Each lives in its own module and is a ``base.MethodConfig`` (not a ``KVQuantConfig``:
the real cache refuses it). ``parse_name`` maps the evaluation's method names to them::

    oscarb{b}           OScaR on k - RoPE_t(b_k): the k bias's exact contribution taken
                        out, zero bytes (proposal E, ``bias_offset``)
    oscarm{b}           OScaR on k - per-group channel mean, mean stored (E, ``group_mean``)
    kivi{b}_sink{S}     KIVI + the first S tokens in full precision (``sinks``)
    ott{b}_n{N}         KIVI + the N smallest-L1 keys per group in full precision (``ott``)
    turbo{b}            random-sign Hadamard + norm + Lloyd-Max codebook (``turbo``)
    turbob{b}           turbo on k - RoPE_t(b_k), as oscarb (``turbo``)
    oscarc{b}           oscarb with 8-bit scales / zeros / norms (proposal A, ``compact``)
    kvquant{b}          pre-RoPE per-channel keys, per-layer k-means codebook, fp16
                        dense-and-sparse outliers (``kvquant``; calibrated; _ko{N} /
                        _vo{N}: outliers per key group / value token, default 20 / 1;
                        ablations _uni1: uniform levels, _post1: post-RoPE keys;
                        _fisher1: the codebooks' k-means weighted by Fisher information)
    oscarp{b}           oscarb under a per-layer PCA-then-Hadamard rotation (B, ``rotation``;
                        calibrated); oscaro{b}: a random orthogonal one instead;
                        oscars{b}: per layer and KV head Hadamard or no rotation,
                        whichever has the smaller query-weighted key error (calibrated)
    oscard{b}_p{P}_t{X} oscarb whose full-precision window keeps up to P groups of TNI
                        (median / smallest key norm) above X, at R' = R - P G (proposal C,
                        ``dynamic``; default P = 2, X = 4)
    oscarbo{b}          oscarb + KVQuant's dense-and-sparse fp16 outliers in the rotated
                        space (``bias_outliers``; _ko{N} / _vo{N} as kvquant; _nuq1:
                        per-layer k-means levels, calibrated)
    turboq{b}           TurboQuant_prod: (b-1)-bit turbo + 1-bit QJL residual for keys,
                        with the k-bias offset (``turbo``)
    qcov{b}             the *other* OSCAR (arXiv 2605.17757): keys rotated by the query
                        covariance's eigenvectors, values by the attention output's, then
                        Hadamard + bit reversal; token-wise INT-b with fitted clipping,
                        BF16 sinks (``qcov``; calibrated, wants queries; _sink{S}: sink
                        tokens, default 64; _c{C}: channels per token group, default 128;
                        _u0: ablation without the eigenbases, Hadamard + bit reversal;
                        _b1: the RoPE'd k bias taken out first, as oscarb)

each optionally followed by ``_r{R}`` / ``_g{G}`` (residual length, group size).
``bytes_per_token(cfg, head_dim)`` accounts every stored part.
"""

from __future__ import annotations

import re

from oscar_jax.config import KVQuantConfig
from oscar_jax.methods import base
from oscar_jax.methods.base import MethodConfig, masked_group_fake_quant
from oscar_jax.methods.bias_offset import OscarBias, rope_key_offset
from oscar_jax.methods.bias_outliers import OscarBiasOutliers
from oscar_jax.methods.compact import OscarCompact, shared_exponent_norms
from oscar_jax.methods.dynamic import OscarDynamic
from oscar_jax.methods.group_mean import OscarGroupMean
from oscar_jax.methods.kvquant import KVQuant
from oscar_jax.methods.ott import OTT
from oscar_jax.methods.qcov import QCov
from oscar_jax.methods.rotation import OscarRotation
from oscar_jax.methods.sinks import KiviSinks
from oscar_jax.methods.turbo import TurboQuant, TurboQuantBias, TurboQuantProd, lloyd_max_gaussian

FAMILIES = {
    "oscarb": OscarBias,
    "oscarbo": OscarBiasOutliers,
    "oscarm": OscarGroupMean,
    "ott": OTT,
    "turbo": TurboQuant,
    "turbob": TurboQuantBias,
    "oscarc": OscarCompact,
    "kivi": KiviSinks,  # only with a _sink suffix: plain kivi is the library's
    "kvquant": KVQuant,
    "oscarp": OscarRotation,
    "oscaro": lambda **kw: OscarRotation(rotation="random_orthogonal", **kw),
    "oscars": lambda **kw: OscarRotation(rotation="select", **kw),
    "oscard": OscarDynamic,
    "turboq": TurboQuantProd,
    "qcov": QCov,
}
_NAME = re.compile(
    r"^(oscarbo|oscarb|oscarm|ott|turbob|turboq|turbo|oscarc|kivi|kvquant|oscarp|oscaro|oscars|oscard|qcov)"
    r"(\d+)"
    r"((?:_[a-z]+\d+)*)$"
)


_OWN_HELP = {"kivi": ", sink<S>", "ott": ", n<N>", "oscard": ", p<P>, t<TNI>",
             "kvquant": ", ko<N>, vo<N>, uni1, post1, fisher1",
             "oscarbo": ", ko<N>, vo<N>, nuq1", "qcov": ", sink<S>, c<C>, u0, b1",
             "oscars": ", attn1, out1, nll1"}  # fmt: skip


def parse_name(name: str, residual_length: int = 128, group_size: int = 32) -> MethodConfig | None:
    """The comparison method of an evaluation name, or None when the name is not one of
    them (then it is the library's own, e.g. ``kivi2``). ValueError for a bad suffix."""
    if not isinstance(name, str):
        raise ValueError(f"name={name!r} must be a string")
    m = _NAME.match(name.strip())
    if m is None:
        return None
    fam, bits, rest = m.group(1), int(m.group(2)), m.group(3)
    sufs = dict((s[: len(s.rstrip("0123456789"))], int(s[len(s.rstrip("0123456789")) :]))
                for s in filter(None, rest.split("_")))  # fmt: skip
    if fam == "kivi" and "sink" not in sufs:
        return None
    kw: dict = {"bits": bits, "residual_length": sufs.pop("r", residual_length),
                "group_size": sufs.pop("g", group_size)}  # fmt: skip
    own = {"kivi": "sink", "ott": "n", "oscard": "p"}.get(fam)
    if own is not None and own in sufs:
        kw[{"kivi": "sinks", "ott": "pool", "oscard": "pins"}[fam]] = sufs.pop(own)
    if fam in ("kvquant", "oscarbo"):
        kw.update({f: sufs.pop(s) for s, f in (("ko", "k_outliers"), ("vo", "v_outliers"))
                   if s in sufs})  # fmt: skip
    if fam == "kvquant":
        if "uni" in sufs:  # ablations: uniform levels, post-RoPE keys
            kw["uniform"] = bool(sufs.pop("uni"))
        if "post" in sufs:
            kw["pre_rope"] = not sufs.pop("post")
        if "fisher" in sufs:  # KVQuant's sensitivity-weighted k-means
            kw["fisher"] = bool(sufs.pop("fisher"))
    if fam == "qcov":  # sink tokens, channels per token-wise group, ablation u0
        kw.update({f: sufs.pop(s) for s, f in (("sink", "sinks"), ("c", "channel_group"))
                   if s in sufs})  # fmt: skip
        if "u" in sufs:
            kw["spectral"] = bool(sufs.pop("u"))
        if "b" in sufs:
            kw["bias_offset"] = bool(sufs.pop("b"))
    if fam == "oscars":  # the selection's criterion (default: the score error)
        if sufs.pop("attn", 0):  # keys' errors weighted by their attention
            kw["criterion"] = "attention"
        for suf, crit in (("out", "output"), ("nll", "nll")):
            if sufs.pop(suf, 0):  # the attention output's error; the calibration NLL
                if "criterion" in kw:
                    raise ValueError(f"method={name!r}: attn1, out1 and nll1 exclude each other")
                kw["criterion"] = crit
    if fam == "oscarbo" and "nuq" in sufs:  # fitted (k-means) levels
        kw["fitted_levels"] = bool(sufs.pop("nuq"))
    if fam == "oscard" and "t" in sufs:  # TNI threshold (median over smallest key norm)
        kw["tni"] = float(sufs.pop("t"))
    if fam == "oscard":  # the window's budget is R: R' = R - P G
        kw["residual_length"] -= kw.setdefault("pins", 2) * kw["group_size"]
    if sufs:
        raise ValueError(
            f"method={name!r}: suffix(es) {sorted(sufs)} must be among r<R>, g<G>"
            + _OWN_HELP.get(fam, "")
            + f" for {fam}"
        )
    try:
        return FAMILIES[fam](**kw)
    except ValueError as e:
        raise ValueError(f"method={name!r}: {e}") from e


def bytes_per_token(
    cfg, head_dim: int, context: int = 2048, num_kv_heads: int = 1
) -> dict[str, float]:
    """Bytes per token and KV head by component (``total`` included) of any method: a
    comparison method's own accounting, or the library's KIVI / OScaR layout (a
    ``per_token`` norm is shared by the ``num_kv_heads`` heads)."""
    if isinstance(cfg, MethodConfig):
        return cfg.bytes_per_token(head_dim, context)
    if not isinstance(cfg, KVQuantConfig):
        raise ValueError(f"cfg={cfg!r} must be a KVQuantConfig or a MethodConfig")
    if not cfg.quantized:
        return base.total({"k": 2.0 * head_dim, "v": 2.0 * head_dim})
    parts = base.kivi_bytes(cfg.bits, head_dim, cfg.group_size, base.DTYPE_BYTES[cfg.param_dtype])
    if cfg.token_scaling:
        share = num_kv_heads if cfg.norm_granularity == "per_token" else 1
        parts["k_norm"] = base.DTYPE_BYTES[cfg.norm_dtype] / share
    return base.total(parts)


__all__ = [
    "OTT", "FAMILIES", "KiviSinks", "MethodConfig", "OscarBias", "OscarCompact",
    "OscarBiasOutliers", "OscarGroupMean", "TurboQuant", "TurboQuantBias", "bytes_per_token",
    "lloyd_max_gaussian",
    "KVQuant", "OscarRotation", "OscarDynamic", "TurboQuantProd", "QCov",
    "masked_group_fake_quant", "parse_name", "rope_key_offset", "shared_exponent_norms",
]  # fmt: skip
