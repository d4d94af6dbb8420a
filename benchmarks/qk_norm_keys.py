"""Key norms before and after the per-head k_norm of a q/k-norm model (Gemma 3, Qwen3).

Per layer and KV head: median key l2 norm over positions >= 1 divided by the norm at
position 0 (the sink), for the k projection's output (before k_norm) and for the key
after k_norm (what the cache gets; RoPE keeps norms). The held-out text is the one
``oscar-jax eval`` uses for a model without its own (the bundled proxy's documents,
re-tokenized), cut into windows as the evaluation cuts them.

    python3 -m benchmarks.qk_norm_keys --model gemma3-270m --ctx 1024 --windows 2
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

import models
from models import fetch, layers
from models.forward import layer_params
from oscar_cli.cli import _bundled_text_for
from oscar_eval.common import make_windows


def key_norm_ratios(m, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ids [B, T] -> (before, after) [L, Hkv]: median(norm[1:]) / norm[0], averaged over rows."""
    cfg, params = m.config, m.params()
    if not cfg.qk_norm:
        raise ValueError(f"family={cfg.family!r} must have a per-head q/k norm")
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = layers.embed(params, jnp.asarray(ids), cfg)
    before, after = [], []
    for i in range(cfg.num_layers):
        lp = layer_params(params, i)
        h = layers.norm(cfg, x, lp["attn_norm"])
        k = layers.dense(h, lp["wk"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        kn = layers.norm(cfg, k, lp["k_norm"])
        for out, kk in ((before, k), (after, kn)):
            n = np.linalg.norm(np.asarray(kk, np.float32), axis=-1)  # [B, T, Hkv]
            out.append(np.mean(np.median(n[:, 1:], axis=1) / n[:, 0], axis=0))
        x, _ = layers.prompt_block(cfg, lp, x, pos, local=cfg.is_local(i))
    return np.stack(before), np.stack(after)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.qk_norm_keys")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=2)
    a = ap.parse_args(argv)
    path = fetch.resolve_model(a.model)
    m = models.from_pretrained(path)
    tokens = _bundled_text_for(m)
    w = make_windows(tokens, a.ctx, a.windows, m.config.bos_token_id)
    before, after = key_norm_ratios(m, np.asarray(w, np.int32))
    print(f"{path}: {len(w)} windows of {a.ctx} tokens; median key norm / position-0 key norm")
    print("| layer | kind | before k_norm | after k_norm |\n|---|---|---|---|")
    for i in range(m.config.num_layers):
        kind = "local" if m.config.is_local(i) else "global"
        print(f"| {i} | {kind} | {', '.join(f'{r:.2f}' for r in before[i])} | "
              f"{', '.join(f'{r:.2f}' for r in after[i])} |")  # fmt: skip
    print(f"median over (layer, head): before {np.median(before):.2f} (max {before.max():.2f}), "
          f"after {np.median(after):.2f} (max {after.max():.2f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
