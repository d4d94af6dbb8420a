"""The decode path through the real cache against the evaluation's parallel form, on a model.

The evaluation's perplexity (``oscar_eval.ppl``) never runs the cache: it computes, in
one parallel pass, what every token would see if it were decoded (``cached_logits``).
This script checks that claim on a real model: for each method it teacher-forces one
window of held-out text token by token through ``models.prefill`` (the first token) and
``models.decode_step`` (every later one; the real ``KVCache``: ring of R full-precision
tokens, groups of G flushed and quantized by the library's encoder) and compares the
logits with ``oscar_eval.ppl.cached_logits`` on the same ids:

* ``max|d|/max|l|``: the largest logit difference over the largest |logit|;
* ``argmax``: the share of positions whose top token agrees;
* ``nll step`` / ``nll par``: the mean next-token NLL of each path, and their difference;
* ``quant effect``: the largest logit difference between the decoded path and bf16 (what
  the quantized cache changes; the agreement means something only when this is large).

Position 0 is left out of every comparison: ``prefill`` attends to the first token's K/V
before the cache stores them in ``--cache-dtype``; every later token reads them from the
cache, as the parallel form does. The two paths compute K/V with different matmul shapes
([B, 1] against [B, T]), so float32 ulps can move a value across a rounding boundary of the
quantizer: rare, and far below the quantization's own effect.

Text: the bundled held-out documents re-encoded with the model's tokenizer (the eval's own
text path, ``oscar_cli.cli._bundled_text_for``: one BOS per document, the window starting
at one).

Usage::

    python3 -m benchmarks.decode_vs_parallel --model smollm2 [--tokens 512]
        [--methods bf16,kivi2,oscar2,oscar2_pertoken] [--cache-dtype bfloat16] [--json F]

Progress on stderr, a Markdown table on stdout. SmolLM2 with the defaults: about 3 min on
the shared 2-core CPU.
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
from models.fetch import resolve_model
from oscar_cli.cli import _bundled_text_for
from oscar_eval.common import make_windows, parse_methods
from oscar_eval.ppl import cached_logits

DEFAULT_METHODS = "bf16,kivi2,oscar2,oscar2_pertoken"


def say(msg: str) -> None:
    print(f"decode_vs_parallel: {msg}", file=sys.stderr, flush=True)


def decode_backend(m, cache) -> str:
    """The decode attention backend "auto" picks for ``cache`` on this device, and its layout."""
    g = m.config.num_heads // m.config.num_kv_heads
    return f"{oj.backends.choose('decode_attention', cache, g)[0]} ({cache.cfg.layout})"


def stepwise_logits(m, ids: np.ndarray, kv, cache_dtype=None, info=None) -> np.ndarray:
    """Teacher-forced decoding through the real cache: ids [B, T] -> logits [B, T, V] f32.

    Token 0 goes through ``models.prefill``; token t >= 1 through ``models.decode_step``.
    ``info`` (a dict) gets the decode backend of the layers' caches.
    """
    b, t = ids.shape
    logits, caches, p = models.prefill(m, ids[:, :1], kv, max_new_tokens=t, max_len=t + 16,
                                       cache_dtype=cache_dtype)  # fmt: skip
    if info is not None:
        info["backend"] = decode_backend(m, caches[0])
    out = [np.asarray(logits, np.float32)]
    for i in range(1, t):
        logits, caches = models.decode_step(p, caches, ids[:, i], np.full(b, i, np.int32),
                                            donate=True)  # fmt: skip
        out.append(np.asarray(logits, np.float32))
    return np.stack(out, axis=1)


def _nll(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Per-token NLL [B, T-1] of ids[:, 1:] under logits[:, :-1]."""
    lp = jax.nn.log_softmax(jnp.asarray(logits[:, :-1], jnp.float32), axis=-1)
    return -np.take_along_axis(np.asarray(lp), ids[:, 1:, None], axis=-1)[..., 0]


def compare(m, ids: np.ndarray, methods, cache_dtype=None, log=None) -> list[dict]:
    """One row per method: the decode path against the parallel form on ``ids`` [B, T]."""
    ids = np.asarray(ids, np.int32)
    if ids.ndim != 2 or ids.shape[1] < 3:
        raise ValueError(f"ids.shape={ids.shape} must be [B, T] with T >= 3")
    rows, ref = [], None
    for mt in methods:
        t0, info = time.perf_counter(), {}
        step = stepwise_logits(m, ids, mt.kv, cache_dtype, info)
        par = np.asarray(cached_logits(m, ids, mt.kv, cache_dtype), np.float32)
        if ref is None:
            ref = step  # the first method's decoded logits (bf16 when listed first)
        d = np.abs(par[:, 1:] - step[:, 1:])
        ns, np_ = _nll(step, ids)[:, 1:], _nll(par, ids)[:, 1:]
        rows.append({
            "method": mt.name, "tokens": int(ids.shape[1]), "backend": info["backend"],
            "max_diff_rel": float(d.max() / np.abs(step[:, 1:]).max()),
            "median_diff": float(np.median(d)),
            "argmax_agree": float(np.mean(par[:, 1:].argmax(-1) == step[:, 1:].argmax(-1))),
            "nll_step": float(ns.mean()), "nll_par": float(np_.mean()),
            "nll_diff": float(np_.mean() - ns.mean()),
            "quant_effect": float(np.abs(step[:, 1:] - ref[:, 1:]).max()),
            "seconds": round(time.perf_counter() - t0, 1),
        })  # fmt: skip
        if log is not None:
            r = rows[-1]
            log(f"{mt.name} [{r['backend']}]: max|d|/max|l| {r['max_diff_rel']:.2e}, argmax "
                f"{r['argmax_agree']:.4f}, nll {r['nll_step']:.4f} / {r['nll_par']:.4f} "
                f"({r['seconds']} s)")  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| method | decode attention | tokens | max abs diff / max abs logit | median abs diff "
           "| argmax agree | NLL decode | NLL parallel | NLL diff | max logit change vs first "
           "method |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(
            f"| {r['method']} | {r['backend']} | {r['tokens']} | {r['max_diff_rel']:.2e} | "
            f"{r['median_diff']:.1e} | {r['argmax_agree']:.4f} | {r['nll_step']:.4f} | "
            f"{r['nll_par']:.4f} | {r['nll_diff']:+.1e} | {r['quant_effect']:.2f} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.decode_vs_parallel",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--model", required=True, help="a models.fetch name or a checkpoint path")
    ap.add_argument("--tokens", type=int, default=512, help="window length (default 512)")
    ap.add_argument("--methods", default=DEFAULT_METHODS, help=f"default {DEFAULT_METHODS}")
    ap.add_argument("--cache-dtype", default="bfloat16",
                    choices=("bfloat16", "float16", "float32"))  # fmt: skip
    ap.add_argument("--residual", type=int, default=128, help="R (default 128)")
    ap.add_argument("--group", type=int, default=32, help="G (default 32)")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    if a.tokens < 3:
        raise SystemExit(f"--tokens={a.tokens} must be >= 3")
    methods = parse_methods(a.methods, a.residual, a.group)
    path = resolve_model(a.model)
    m = models.from_pretrained(path, dtype=jnp.float32)
    ids = make_windows(_bundled_text_for(m), a.tokens, 1, m.config.bos_token_id)
    say(f"{path}: 1 window of {a.tokens} tokens, cache {a.cache_dtype}, R={a.residual}, "
        f"G={a.group}")  # fmt: skip
    rows = compare(m, ids, methods, a.cache_dtype, log=say)
    print(markdown(rows))
    if a.json:
        with open(a.json, "w") as f:
            info = {"model": path, "tokens": a.tokens, "cache_dtype": a.cache_dtype,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
            json.dump({**info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
