"""Token Norm Imbalance of a trained model: key norms by position, sink ratios, INT2 key error.

* ``key_norms``: the l2 norm of every key (after RoPE, as cached; RoPE keeps norms)
  per window, layer, position and KV head, from a full-precision forward.
* ``tni_summary``: per layer and KV head, the median norm over positions >= 1 over
  the sink's (position 0, the BOS that starts each window), and median over min
  (``oscar_jax.diagnostics.tni_ratio``'s definition).
* ``key_mse``: per method and layer, the key reconstruction MSE of the quantizer alone
  (``oscar_jax.fake_quant_keys``: every token quantized, no residual), the mean
  relative error, and the sink's and the other tokens' relative errors.
* ``group_errors``: per method, the relative key error of each group of G tokens (mean
  over layers; group 0 holds the sink), from ``key_mse``'s rows.
* ``plot_key_norms`` / ``plot_tni`` (attention mass on position 0 per layer and query
  head, and the per-group key error) / ``plot_niah``: PNGs with matplotlib, imported
  only there; without it they return None and say so (the GPU machine has no matplotlib).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

import oscar_jax as oj
from models import layers
from models.config import ModelConfig
from models.model import CausalLM
from oscar_eval.common import Method, Progress
from oscar_jax import diagnostics as dg


@functools.partial(jax.jit, static_argnums=0)
def _keys_jit(mc: ModelConfig, params, ids):
    _, (k, _) = layers.forward(mc, params, ids, keep_kv=True)
    return k  # [L, B, T, Hkv, D]


def keys(m: CausalLM, windows) -> np.ndarray:
    """Post-RoPE keys of every layer, [N, L, T, Hkv, D] float32, one window at a time."""
    ids = m.check_ids(windows)
    out = [np.swapaxes(np.asarray(_keys_jit(m.config, m.params(), jnp.asarray(w[None]))), 0, 1)
           for w in ids]  # fmt: skip
    return np.concatenate(out).astype(np.float32)


def keys_program(m: CausalLM, t: int):
    """A thunk compiling ``keys``' program for windows of ``t`` tokens (ahead of use)."""
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), m.params())
    ids = jax.ShapeDtypeStruct((1, t), jnp.int32)
    return lambda: _keys_jit.lower(m.config, params, ids).compile()


def key_err_program(kv: oj.KVQuantConfig, shape, cache_dtype="float32"):
    """A thunk compiling ``key_mse``'s program of one method for keys of ``shape``
    [N, L, T, Hkv, D] (ahead of use)."""
    n, nl, t, h, d = shape
    k = jax.ShapeDtypeStruct((nl, n, t, h, d), jnp.dtype(cache_dtype))
    return lambda: _key_err_jit.lower(kv, k).compile()


def key_norms(k: np.ndarray) -> np.ndarray:
    """[N, L, T, Hkv, D] keys -> [N, L, T, Hkv] l2 norms."""
    return np.linalg.norm(np.asarray(k, np.float32), axis=-1)


def tni_summary(norms: np.ndarray, sink: int = 0) -> tuple[list[dict], dict]:
    """Per (layer, KV head) ratios of the window-averaged norms; and an overall summary.

    norms [N, L, T, Hkv]. ``median`` is over positions other than ``sink``.
    """
    norms = np.asarray(norms, np.float64)
    if norms.ndim != 4 or norms.shape[2] < 2:
        raise ValueError(f"norms.shape={norms.shape} must be [windows, layers, T>=2, kv_heads]")
    prof = norms.mean(axis=0)  # [L, T, H]
    rest = np.delete(prof, sink, axis=1)
    med = np.median(rest, axis=1)  # [L, H]
    snk = prof[:, sink]
    mn = prof.min(axis=1)
    rows = []
    for li in range(prof.shape[0]):
        for h in range(prof.shape[2]):
            rows.append({
                "layer": li, "kv_head": h, "median_norm": float(med[li, h]),
                "sink_norm": float(snk[li, h]),
                "median_over_sink": float(med[li, h] / snk[li, h]) if snk[li, h] > 0 else np.inf,
                "median_over_min": float(med[li, h] / mn[li, h]) if mn[li, h] > 0 else np.inf,
                "argmin_position": int(np.argmin(prof[li, :, h])),
            })  # fmt: skip
    ratios = np.array([r["median_over_sink"] for r in rows])
    summary = {
        "median_over_sink_median": float(np.median(ratios)),
        "median_over_sink_max": float(np.max(ratios)),
        "median_over_sink_min": float(np.min(ratios)),
        "layers_heads_ratio_ge_10": int(np.sum(ratios >= 10)),
        "layers_heads": len(rows),
        "windows": int(norms.shape[0]),
    }
    return rows, summary


@functools.partial(jax.jit, static_argnums=0)
def _key_err_jit(kv: oj.KVQuantConfig, k):
    """k [L, B, T, H, D] -> per layer (mse, rel err, sink rel err, other rel err, rel err
    per position [T] (mean over windows and KV heads))."""

    def one(kl):
        kh = oj.fake_quant_keys(kl, kv).astype(jnp.float32)
        kl = kl.astype(jnp.float32)
        rel = dg.relative_token_error(kl, kh)  # [B, T, H]
        return (jnp.mean(jnp.square(kh - kl)), jnp.mean(rel), jnp.mean(rel[:, 0]),
                jnp.mean(rel[:, 1:]), jnp.mean(rel, axis=(0, 2)))  # fmt: skip

    return jax.lax.map(one, k)


def key_mse(
    k: np.ndarray, methods: list[Method], show_progress: bool = True, cache_dtype="float32"
) -> list[dict]:
    """Per quantized method and layer: key MSE and relative errors (sink = position 0).

    The keys are first cast to ``cache_dtype``: the quantizer's input in the cache, and
    the reference the errors are measured against.
    """
    k = jnp.asarray(np.swapaxes(np.asarray(k), 0, 1), cache_dtype)  # [L, N, T, H, D]
    qm = [mt for mt in methods if mt.quantized]
    bar = Progress(len(qm), "tni key error        ", enabled=show_progress)
    rows = []
    for mt in qm:
        mse, rel, srel, orel, pos = (np.asarray(x) for x in _key_err_jit(mt.kv, k))
        g = mt.kv.group_size
        ng = min(pos.shape[1] // g, MAX_GROUPS)
        grp = pos[:, : ng * g].reshape(len(pos), ng, g).mean(-1)  # [L, groups]
        for li in range(k.shape[0]):
            rows.append({"method": mt.name, "bits": mt.kv.bits, "layer": li,
                         "key_mse": float(mse[li]), "key_rel_err": float(rel[li]),
                         "sink_key_rel_err": float(srel[li]),
                         "other_key_rel_err": float(orel[li]),
                         "group_rel_err": np.round(grp[li], 5).tolist()})  # fmt: skip
        bar.update()
    return rows


MAX_GROUPS = 32  # key_mse's per-group error: the first groups of G tokens (the sink's is 0)


def group_errors(rows: list[dict]) -> dict[str, list[float]]:
    """Per method: the relative key error of each group of G tokens (``key_mse`` rows'
    ``group_rel_err``), mean over layers."""
    out: dict[str, list] = {}
    for r in rows:
        if "group_rel_err" in r:
            out.setdefault(r["method"], []).append(r["group_rel_err"])
    return {mt: np.mean(np.asarray(v, np.float64), axis=0).tolist() for mt, v in out.items()}


def plot_tni(attn: np.ndarray, groups: dict[str, list[float]], path: str, title: str = ""):
    """The sink figure: attention mass on position 0 per (layer, query head) ``attn``
    [L, Hq], and the INT2 relative key error per group of G tokens per method (mean over
    layers, windows and KV heads; group 0 holds the sink). None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    attn = np.asarray(attn, np.float64)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    im = a.imshow(attn, aspect="auto", cmap="viridis", vmin=0, vmax=1, origin="lower")
    a.set_xlabel("query head")
    a.set_ylabel("layer")
    a.set_title("attention mass on position 0" + (f": {title}" if title else ""))
    fig.colorbar(im, ax=a)
    for mt, e in groups.items():
        b.plot(np.arange(len(e)), e, marker="o", ms=3, lw=1.2, label=mt)
    b.set_yscale("log")
    b.set_xlabel("key group (G tokens each; group 0 holds the sink)")
    b.set_ylabel("relative key error |k_hat - k| / |k|")
    b.set_title("INT2 key error per group (quantizer only, all tokens)")
    b.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


NO_MPL = "matplotlib is not installed: no PNG written (pip install matplotlib)"
PROFILE_POS = 128  # positions of the key-norm figure (and of results.json's norm_profile)


def plot_key_norms(profile: np.ndarray, ratio: np.ndarray, path: str, title: str = ""):
    """The key-norm figure: l2 norm by position (window mean, median over KV heads) per
    layer, and median/sink ratio per (layer, KV head). ``profile`` [L, P, Hkv] (the first
    P positions), ``ratio`` [L, Hkv]. Returns the path, or None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    prof = np.asarray(profile, np.float64)
    ratio = np.asarray(ratio, np.float64)
    nl, t, nh = prof.shape
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2.2, 1]})
    pos = np.arange(t)
    cmap = plt.get_cmap("viridis")
    for li in range(nl):
        y = np.median(prof[li], axis=-1)
        a.plot(pos, y, lw=1.2, color=cmap(li / max(1, nl - 1)), label=f"layer {li}")
    a.axvline(0, color="red", lw=0.8, ls=":")
    a.set_yscale("log")
    a.set_xlabel("token position (position 0 = BOS, the attention sink)")
    a.set_ylabel("key l2 norm (median over KV heads)")
    a.set_title("Key norm by position" + (f": {title}" if title else ""))
    a.legend(fontsize=7, ncol=2)
    im = b.imshow(ratio, aspect="auto", cmap="magma")
    b.set_xticks(range(nh))
    b.set_yticks(range(nl))
    b.set_xlabel("KV head")
    b.set_ylabel("layer")
    b.set_title("median norm / sink norm")
    for li in range(nl):
        for h in range(nh):
            v = ratio[li, h]
            b.text(h, li, f"{v:.0f}" if v >= 10 else f"{v:.1f}", ha="center", va="center",
                   fontsize=7, color="w" if v < ratio.max() * 0.6 else "k")  # fmt: skip
    fig.colorbar(im, ax=b)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_norms(norms: np.ndarray, path: str, title: str = "", max_pos: int = PROFILE_POS):
    """``plot_key_norms`` of norms [N, L, T, Hkv] (the first ``max_pos`` positions)."""
    rows, _ = tni_summary(norms)
    nl, nh = norms.shape[1], norms.shape[3]
    ratio = np.array([r["median_over_sink"] for r in rows]).reshape(nl, nh)
    return plot_key_norms(norms.mean(axis=0)[:, :max_pos], ratio, path, title)


def plot_niah(cells: list[dict], path: str):
    """Exact-match rate heat maps (depth x length), one per method; None without matplotlib."""
    plt = _pyplot()
    if plt is None or not cells:
        return None
    methods = list(dict.fromkeys(c["method"] for c in cells))
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    n = len(methods)
    cols = min(4, n)
    rws = -(-n // cols)
    fig, axes = plt.subplots(rws, cols, figsize=(3.2 * cols, 3.0 * rws), squeeze=False)
    for ax, mt in zip(axes.flat, methods, strict=False):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for c in cells:
            if c["method"] == mt:
                grid[depths.index(c["depth"]), lengths.index(c["length"])] = c["rate"]
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [str(x) for x in depths], fontsize=7)
        ax.set_title(f"{mt}: {np.nanmean(grid):.2f}", fontsize=9)
        ax.set_xlabel("context", fontsize=8)
        ax.set_ylabel("depth %", fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
