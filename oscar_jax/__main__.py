"""oscar-jax study / python3 -m oscar_jax: the synthetic TNI study and the cache's compression.

Runs on the bundled default (synthetic keys with massive channels and low-norm
sink tokens, seeded) and prints Markdown tables: per method and bit width the
key/value MSE, the sink tokens' relative key error, the attention-output error,
and the bytes per token per KV head of a real cache against BF16.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import oscar_jax as oj
from oscar_jax import diagnostics as dg

QUANTIZED = ("kivi", "ots_only", "rotation_only", "oscar")


def method_table(seed: int, tokens: int, head_dim: int, bits_list=(2, 4)) -> list[dict]:
    q, k, v, sink = dg.synthetic_kv(jax.random.PRNGKey(seed), tokens=tokens, head_dim=head_dim)
    rows = []
    for bits in bits_list:
        for m in QUANTIZED:
            cfg = oj.preset(m, bits=bits)
            rep = dg.reconstruction_report(q, k, v, cfg, sink)
            rows.append({"method": m, "bits": bits, **rep})
    tni = float(jnp.median(dg.tni_ratio(k)))
    for r in rows:
        r["tni_ratio"] = tni
    return rows


def memory_table(seed: int, tokens: int, heads: int = 8, head_dim: int = 128) -> list[dict]:
    """Bytes per token per KV head of a prefilled cache (quantized part and whole cache)."""
    key = jax.random.PRNGKey(seed)
    k = jax.random.normal(key, (1, tokens, heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 1), k.shape, jnp.bfloat16)
    ref = None
    rows = []
    for m, bits in (("bf16", 16), ("oscar", 2), ("oscar", 4), ("kivi", 2)):
        cfg = oj.preset(m) if m == "bf16" else oj.preset(m, bits=bits)
        cache = oj.init_cache(cfg, batch=1, max_len=tokens, num_kv_heads=heads, head_dim=head_dim)
        cache = oj.prefill(cache, k, v)
        total = oj.cache_nbytes(cache)
        per_q, _ = oj.cache.bytes_per_token(cache)
        ref = ref or total
        rows.append({
            "method": m, "bits": bits, "tokens": tokens,
            "quantized_bytes_per_token_head": per_q / heads if per_q else 2 * 2 * head_dim,
            "cache_bytes": total, "ratio_vs_bf16": ref / total,
        })  # fmt: skip
    return rows


def _md(rows: list[dict], cols: list[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None, prog: str = "python3 -m oscar_jax") -> int:
    """The study's command line (``oscar-jax study`` passes its own ``prog``)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split(": ", 1)[1].split("\n\n")[0].replace("\n", " "),
        epilog=__doc__.split("\n\n", 1)[1].strip(),
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic keys and values")
    p.add_argument("--tokens", type=int, default=1024,
                   help="synthetic sequence length (default: %(default)s)")  # fmt: skip
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default: 128)")
    p.add_argument("--memory-tokens", type=int, default=4096,
                   help="cache length of the memory table (default: %(default)s)")  # fmt: skip
    p.add_argument("--json", default=None, help="also write the tables as JSON to this file")
    a = p.parse_args(argv)
    rows = method_table(a.seed, a.tokens, a.head_dim)
    print(f"# Synthetic TNI study (jax {jax.__version__}, {jax.devices()[0].platform})\n")
    print(f"median TNI ratio (median/min key norm per head): {rows[0]['tni_ratio']:.1f}\n")
    cols = ["method", "bits", "key_mse", "value_mse", "sink_key_rel_err",
            "other_key_rel_err", "attn_rel_err"]  # fmt: skip
    print(_md(rows, cols))
    mem = memory_table(a.seed, a.memory_tokens)
    print("\n# Cache memory (8 KV heads, head_dim 128, G=32, R=128, bf16 params)\n")
    print(_md(mem, ["method", "bits", "tokens", "quantized_bytes_per_token_head",
                    "cache_bytes", "ratio_vs_bf16"]))  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"methods": rows, "memory": mem}, f, indent=2, default=np.asarray)
    return 0


if __name__ == "__main__":
    sys.exit(main())
