"""Why a method's INT2 keys hurt on a real model: per-layer key statistics on real text.

For each layer of a model (``--model``: a name of ``models.fetch`` such as ``smollm2`` or
``qwen2.5-0.5b``, or a path), on ``--windows`` windows of ``--tokens`` tokens of the
bundled held-out documents re-encoded as text (``oscar_cli.cli._bundled_text_for``, the
eval's own text path: one BOS of the model per document, each window starting at one),
with the model's own layers (``models.layers.qkv`` on the layer input, the keys after
RoPE, as the cache gets them) and the library's own quantizer
(``oscar_jax.fake_quant_keys``: every token quantized, no full-precision residual):

* ``range``: the in-group (G tokens) range of each key channel, max - min, averaged over
  groups, channels and KV heads, before (``raw``) and after the Hadamard rotation
  (``rot``, ``oscar_jax.rotate``); ``sum r^2 rot/raw``: the ratio of sum over channels of
  the squared ranges (what per-channel min/max rounding error grows with), and ``peak``:
  the largest channel's mean range over the median channel's, raw;
* ``|b_k|/|k|``: the norm of the k-projection bias over the median key norm (per KV head,
  mean over heads; RoPE keeps norms, so this is the bias's share of a key), and
  ``bias r^2``: the share of sum r^2 (raw) that the bias's RoPE-turned part alone has
  (keys computed without the bias, subtracted);
* per method (``--methods``, default kivi2, oscar2, rotation_only2, ots_only2; the
  comparison methods of ``oscar_jax.methods`` too, except calibrated and pre-RoPE ones:
  ``oscarb2`` gets the RoPE'd k bias as in the evaluation):
  ``key err``: ||k_hat - k||^2 / ||k||^2; ``score rmse``: the RMS error of the attention
  logits q.k / sqrt(D) over causal (query, key) pairs and query heads; ``attn tv``: the
  mean total-variation distance of the attention rows (0.5 sum |p_hat - p|);
  ``align``: mean (q.e)^2 / (|q|^2 |e|^2 / D) over those pairs (e = k_hat - k): 1 when
  the key error is isotropic, < 1 when it sits in channels the queries ignore;
* ``--first text``: position 0 holds the document's first text token instead of BOS;
* optionally (``--swap-layers N``): perplexity of one window with cache-exact attention
  (``oscar_eval.ppl.cached_attention``, R = 128) where every layer uses method A (oscar2)
  except the N layers of largest ``attn tv`` excess over method B (kivi2), which use B;
  and the converse. It shows whether those layers carry the loss.

Usage::

    python3 -m benchmarks.real_model_keys --model qwen2.5-0.5b [--tokens 512] [--windows 2]
        [--methods kivi2,oscar2,rotation_only2,ots_only2] [--swap-layers 3] [--first text]
        [--json out.json]

Progress on stderr, markdown tables on stdout. About 72 s per model on an idle 2-core CPU
with the defaults and ``--swap-layers 1``; ``--tokens 256 --windows 1`` (no swap, 18 s for
Qwen2.5) is the quick check of ACCURACY.md ("Real pretrained models"): a layer whose oscar2
logit error is several times kivi2's (Qwen2.5's layer 0: 8x) means rotating the keys hurts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import models
import oscar_jax as oj
from models import layers
from models.fetch import resolve_model
from models.forward import layer_params
from oscar_cli.cli import _bundled_text_for
from oscar_eval.common import make_windows, parse_methods
from oscar_eval.ppl import cached_attention

G = 32
HIGHEST = jax.lax.Precision.HIGHEST


def say(msg: str) -> None:
    print(f"real_model_keys: {msg}", file=sys.stderr, flush=True)


def group_ranges(k: np.ndarray, g: int = G) -> np.ndarray:
    """k [B, T, H, D] -> in-group range per (B, group, H, D): max - min over G tokens."""
    b, t, h, d = k.shape
    kg = k[:, : (t // g) * g].reshape(b, t // g, g, h, d)
    return kg.max(axis=2) - kg.min(axis=2)


def range_stats(k: np.ndarray, k_rot: np.ndarray, k_bias: np.ndarray | None) -> dict:
    r, rr = group_ranges(k), group_ranges(k_rot)
    per_ch = r.mean(axis=(0, 1))  # [H, D]
    out = {
        "range_raw": float(r.mean()),
        "range_rot": float(rr.mean()),
        "sum_r2_rot_over_raw": float((rr**2).sum() / (r**2).sum()),
        "peak_raw": float(np.mean(per_ch.max(axis=-1) / np.median(per_ch, axis=-1))),
        "peak_rot": float(
            np.mean(rr.mean(axis=(0, 1)).max(axis=-1) / np.median(rr.mean(axis=(0, 1)), axis=-1))
        ),
    }
    if k_bias is not None:
        out["bias_r2_share"] = float((group_ranges(k_bias) ** 2).sum() / (r**2).sum())
    return out


@jax.jit
def _score_errors(q, k, k_hat):
    """q [B,T,Hq,D], k / k_hat [B,T,Hkv,D] -> (score mse, mean attention TV, alignment)."""
    b, t, hq, d = q.shape
    h = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, t, h, hq // h, d)
    e = (k_hat - k).astype(jnp.float32)
    scale = 1.0 / np.sqrt(d)
    causal = jnp.tril(jnp.ones((t, t), bool))
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32), precision=HIGHEST) * scale
    ds = jnp.einsum("bqhgd,bkhd->bhgqk", qg, e, precision=HIGHEST) * scale
    n = causal.sum() * b * hq
    mse = jnp.sum(jnp.where(causal, ds**2, 0.0)) / n
    p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    p_hat = jax.nn.softmax(jnp.where(causal, s + ds, -jnp.inf), axis=-1)
    tv = 0.5 * jnp.abs(p_hat - p).sum(-1).mean()
    qn2 = jnp.sum(qg**2, -1)[..., None]  # [B,T,h,g,1] -> scores layout below
    en2 = jnp.sum(e**2, -1)  # [B,T,h]
    iso = jnp.einsum("bqhgx,bkh->bhgqk", qn2, en2) * (scale**2) / d
    align = jnp.sum(jnp.where(causal, ds**2, 0.0)) / jnp.maximum(
        jnp.sum(jnp.where(causal, iso, 0.0)), 1e-30
    )
    return mse, tv, align


def method_keys(kv, k: np.ndarray, k_nb: np.ndarray | None) -> np.ndarray:
    """k [B, T, H, D] as method ``kv`` reconstructs it, every token quantized: a cache
    preset through ``oscar_jax.fake_quant_keys``, a comparison method of
    ``oscar_jax.methods`` through its ``fake_quant_kv`` (handed the RoPE'd k bias ``k -
    k_nb`` when it takes one out, as the evaluation does; the keys stand in for the values,
    whose reconstruction is not used)."""
    if isinstance(kv, oj.KVQuantConfig):
        return np.asarray(oj.fake_quant_keys(jnp.asarray(k), kv), np.float32)
    if getattr(kv, "needs_calibration", False) or getattr(kv, "needs_rope", False):
        raise ValueError(f"method {kv!r}: calibrated / pre-RoPE methods are not handled here")
    kw = {}
    if getattr(kv, "needs_key_bias", False) and k_nb is not None:
        kw["key_offset"] = jnp.asarray(k[0] - k_nb[0])  # [T, H, D], the same in every row
    kt = jnp.swapaxes(jnp.asarray(k), 1, 2)  # [B, H, T, D]
    return np.asarray(jnp.swapaxes(kv.fake_quant_kv(kt, kt, **kw)[0], 1, 2), np.float32)


def layer_keys(m, ids: np.ndarray):
    """Per layer: (q, k, k without the k bias or None) [B, T, H, D] float32, and the
    final hidden states; keys as ``models.layers.qkv`` hands them to the cache."""
    cfg, params = m.config, m.params()
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = layers.embed(params, jnp.asarray(ids), cfg)
    out = []
    for i in range(cfg.num_layers):
        lp = layer_params(params, i)
        h = layers.norm(cfg, x, lp["attn_norm"])
        q, k, _ = layers.qkv(cfg, lp, h, pos, cfg.is_local(i))
        k_nb = None
        if "bk" in lp:
            _, k_nb, _ = layers.qkv(cfg, {**lp, "bk": jnp.zeros_like(lp["bk"])}, h, pos)
            k_nb = np.asarray(k_nb, np.float32)
        bias_norm = (
            np.linalg.norm(np.asarray(lp["bk"], np.float32).reshape(cfg.num_kv_heads, -1), axis=-1)
            if "bk" in lp
            else None
        )
        out.append((np.asarray(q, np.float32), np.asarray(k, np.float32), k_nb, bias_norm))
        x, _ = layers.prompt_block(cfg, lp, x, pos, local=cfg.is_local(i))
    return out


def mixed_ppl(m, ids: np.ndarray, kvs: list, cache_dtype: str = "bfloat16") -> float:
    """Perplexity of windows ``ids`` [B, T] with layer i attending through the cache of
    ``kvs[i]`` (``oscar_eval.ppl.cached_attention``: query t sees the cache as when t is
    decoded, R full-precision tokens); value rotation undone on the output there; K/V
    stored in ``cache_dtype`` before encoding, as the eval's default."""
    cfg, params = m.config, m.params()
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = layers.embed(params, jnp.asarray(ids))
    for i in range(cfg.num_layers):
        lp = layer_params(params, i)
        kv = kvs[i]
        x, _ = _block(cfg, kv, cache_dtype, lp, x, pos)
    logits = layers.lm_head(cfg, params, x[:, :-1])
    lp_ = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(lp_, jnp.asarray(ids)[:, 1:, None], axis=-1)[..., 0]
    return float(np.exp(np.asarray(nll, np.float64).mean()))


def _block_impl(cfg, kv, cache_dtype, lp, x, pos):
    attend = lambda q, k, v: cached_attention(q, k, v, kv, cache_dtype=cache_dtype)  # noqa: E731
    return layers.block(cfg, lp, x, pos, attend)


_block = jax.jit(_block_impl, static_argnums=(0, 1, 2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.real_model_keys")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--methods", default="kivi2,oscar2,rotation_only2,ots_only2")
    ap.add_argument("--swap-layers", type=int, default=0)
    ap.add_argument("--swap-tokens", type=int, default=1024)
    ap.add_argument(
        "--cache-dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="what the swap's caches store K/V in (the eval's default: bfloat16)",
    )
    ap.add_argument("--first", choices=("bos", "text"), default="bos",
                    help="what position 0 holds: the model's BOS (the eval's text path), or "
                         "the document's first text token (BOS dropped)")  # fmt: skip
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    t0 = time.perf_counter()
    path = resolve_model(a.model)
    m = models.from_pretrained(path, dtype=jnp.float32)
    cfg = m.config
    ids_all = _bundled_text_for(m)
    drop = int(a.first == "text")  # windows one token longer, their BOS dropped
    win = make_windows(ids_all, a.tokens + drop, a.windows, cfg.bos_token_id)[:, drop:]
    say(f"{path}: {cfg.family}, {cfg.num_layers} layers, {cfg.num_kv_heads} KV heads; "
        f"{win.shape[0]} windows of {a.tokens} tokens, first token {int(win[0, 0])}")  # fmt: skip
    methods = parse_methods(a.methods)
    rot_cfg = oj.preset("oscar", bits=2)
    per_layer = layer_keys(m, win)
    say(f"keys of {cfg.num_layers} layers in {time.perf_counter() - t0:.0f} s")
    rows = []
    for i, (q, k, k_nb, bias_norm) in enumerate(per_layer):
        k_rot = np.asarray(oj.rotate(jnp.asarray(k), rot_cfg), np.float32)
        row = {"layer": i, **range_stats(k, k_rot, None if k_nb is None else k - k_nb)}
        knorm = np.linalg.norm(k, axis=-1)  # [B, T, H]
        row["k_norm_median"] = float(np.median(knorm))
        row["sink_ratio"] = float(np.median(np.median(knorm[:, 1:], axis=1) / knorm[:, 0]))
        if bias_norm is not None:
            row["bias_over_k"] = float(np.mean(bias_norm / np.median(knorm, axis=(0, 1))))
        for mt in methods:
            k_hat = method_keys(mt.kv, k, k_nb)
            mse, tv, align = _score_errors(jnp.asarray(q), jnp.asarray(k), jnp.asarray(k_hat))
            row[f"{mt.name}.key_err"] = float(((k_hat - k) ** 2).sum() / (k**2).sum())
            row[f"{mt.name}.score_rmse"] = float(np.sqrt(mse))
            row[f"{mt.name}.attn_tv"] = float(tv)
            row[f"{mt.name}.align"] = float(align)
        rows.append(row)
        say(f"layer {i}: done ({time.perf_counter() - t0:.0f} s)")

    names = [mt.name for mt in methods]
    cols = ["layer", "range_raw", "range_rot", "sum_r2_rot_over_raw", "peak_raw", "sink_ratio"]
    if "bias_over_k" in rows[0]:
        cols += ["bias_over_k", "bias_r2_share"]
    print(f"## {a.model}: {cfg.num_layers} layers, {win.shape[0]} x {a.tokens} tokens, G = {G}, "
          f"position 0: {a.first} (token {int(win[0, 0])})\n")  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3g}" if c != "layer" else str(r[c]) for c in cols) + " |")
    for metric in ("key_err", "score_rmse", "attn_tv", "align"):
        print(f"\n### {metric} per layer\n")
        print("| layer | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for r in rows:
            vals = " | ".join(f"{r[f'{n}.{metric}']:.3g}" for n in names)
            print(f"| {r['layer']} | {vals} |")
        means = [np.mean([r[f"{n}.{metric}"] for r in rows]) for n in names]
        print("| mean | " + " | ".join(f"{v:.3g}" for v in means) + " |")

    result = {"model": a.model, "path": path, "tokens": a.tokens, "windows": int(win.shape[0]),
              "first": a.first, "first_token": int(win[0, 0]), "rows": rows}  # fmt: skip
    if a.swap_layers and {"kivi2", "oscar2"} <= set(names):
        excess = np.array([r["oscar2.attn_tv"] - r["kivi2.attn_tv"] for r in rows])
        top = sorted(np.argsort(-excess)[: a.swap_layers].tolist())
        w1 = make_windows(ids_all, a.swap_tokens + drop, 1, cfg.bos_token_id)[:, drop:]
        ko, kk = oj.preset("oscar", bits=2), oj.preset("kivi", bits=2)
        n = cfg.num_layers
        runs = {
            "bf16": [oj.preset("bf16")] * n,
            "kivi2": [kk] * n,
            "oscar2": [ko] * n,
            f"oscar2, kivi2 in layers {top}": [kk if i in top else ko for i in range(n)],
            f"kivi2, oscar2 in layers {top}": [ko if i in top else kk for i in range(n)],
        }
        print(f"\n### perplexity, 1 window of {a.swap_tokens} tokens, R = 128, G = 32, "
              f"cache {a.cache_dtype}\n")  # fmt: skip
        print("| keys | ppl |\n|---|---|")
        swap = {}
        for name, kvs in runs.items():
            swap[name] = mixed_ppl(m, w1, kvs, a.cache_dtype)
            print(f"| {name} | {swap[name]:.3f} |", flush=True)
            say(f"swap {name}: {swap[name]:.3f} ({time.perf_counter() - t0:.0f} s)")
        result["swap"] = {"layers": top, "tokens": a.swap_tokens, "cache_dtype": a.cache_dtype,
                          "ppl": swap}  # fmt: skip
    say(f"done in {time.perf_counter() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
