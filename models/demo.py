"""``oscar-jax demo``: the bf16 and the OScaR INT2 cache side by side on one model.

Small sizes so that it runs in well under two minutes on two CPU cores, JAX
compilation included: a greedy continuation of a held-out passage (or
``--prompt``) through each cache, the bytes each cache holds afterwards, the
perplexity of two 1024-token held-out windows (cache-exact, ``models.eval_ppl``),
five passkey prompts of 1024 tokens (``models.eval_niah``) and the key-norm plot
(``models.eval_tni``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import oscar_jax as oj
from models import eval_ppl, eval_tni
from models.eval_common import Progress, ci, make_windows, md_table, parse_method, parse_methods
from models.generate import bucket_length, generate
from models.passkey import score_passkey

DEMO_CTX = 1024
DEMO_WINDOWS = 2
PROMPT_TOKENS = 512  # held-out prefix used as the default prompt (> R + G: the INT2 part is used)
NIAH_LENGTH = 1024
NIAH_DEPTHS = (0, 25, 50, 75, 100)
LONG = 32768  # the compression of a long context, from the same byte accounting


def cache_bytes(kv: oj.KVQuantConfig, mc, n_tokens: int, max_len: int, dtype) -> tuple[int, int]:
    """(bytes held for n_tokens, bytes allocated) of the model's caches (all layers, one row).

    ``oscar_jax.cache_nbytes`` of a cache in the state ``generate`` leaves (n_tokens
    stored, capacity max_len): codes, scales, zeros, norms and the full-precision ring.
    """
    c = oj.init_cache(eval_ppl.cache_kv_config(kv), batch=1, max_len=max_len,
                      num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, dtype=dtype)  # fmt: skip
    c = dataclasses.replace(c, lengths=jnp.asarray([n_tokens], jnp.int32))
    return mc.num_layers * oj.cache_nbytes(c), mc.num_layers * oj.cache_capacity_nbytes(c)


def _short(text: str, n: int = 220) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else "..." + text[-n:]


def run_demo(args, path: str, load, heldout_fn) -> int:
    """Print the side-by-side continuation, cache bytes, ppl / passkey tables, plot path.

    One ``generate`` call per method serves both the continuation and the passkey
    prompts (one batch, one compilation): the continuation prompt is the batch's
    last row.
    """
    from models import eval_niah
    from models.evaluate import decoder

    t_start = time.perf_counter()
    show = not args.quiet
    cdt = args.cache_dtype
    methods = parse_methods(args.methods)
    names = [mt.name for mt in methods]
    if "bf16" not in names or "oscar2" not in names:
        raise ValueError(f"--methods {args.methods!r} must include bf16 and oscar2 (the demo pair)")
    if args.new_tokens < 8:
        raise ValueError(f"--new-tokens {args.new_tokens} must be >= 8 (a passkey has 5 digits)")
    m, t_load = load(path, args.dtype)
    if m.tokenizer is None:
        raise ValueError(f"{path} has no tokenizer.json: the demo needs one to read and write text")
    mc = m.config
    print(f"# oscar-jax demo: {path}\n")
    print(
        f"{mc.family}, {mc.num_params() / 1e6:.1f}M params, {mc.num_layers} layers, "
        f"{mc.num_heads} query / {mc.num_kv_heads} KV heads, head_dim {mc.head_dim}; "
        f"jax {jax.__version__} on {jax.devices()[0].platform} (loaded in {t_load:.1f} s)\n"
    )
    heldout, src = heldout_fn(args, m, path)
    enc = eval_niah.make_encode(m.tokenizer, mc.bos_token_id)
    if args.prompt is not None:
        ids = enc(args.prompt)
    elif heldout is not None:
        ids = [int(i) for i in make_windows(heldout, PROMPT_TOKENS, 1, mc.bos_token_id)[0]]
    else:
        raise ValueError(f"no --prompt and no held-out sample at {src}")
    dec = decoder(m.tokenizer, set(mc.eos_token_ids))
    prompts = eval_niah.build_prompts(enc, (NIAH_LENGTH,), NIAH_DEPTHS, 1)
    rows_ids = [p["ids"] for p in prompts] + [ids]
    longest = max(map(len, rows_ids))
    batch = np.zeros((len(rows_ids), longest), np.int32)
    for r, x in enumerate(rows_ids):
        batch[r, : len(x)] = x
    lens = np.array([len(x) for x in rows_ids], np.int32)
    max_len = bucket_length(longest) + args.new_tokens
    bar = Progress(len(methods), "generate (all methods)", enabled=show)
    gen = {}
    for mt in methods:
        out, info = generate(m, batch, args.new_tokens, kv=mt.kv, lengths=lens, max_len=max_len,
                             cache_dtype=cdt, return_info=True)  # fmt: skip
        gen[mt.name] = (np.asarray(out), np.asarray(info["cache_lengths"]))
        bar.update()
    print(f"## Greedy continuation of a {len(ids)}-token prompt\n")
    print(f"prompt: {_short(dec(ids))!r}\n")
    for mt in methods:
        print(f"{mt.name + ' cache:':<14} {dec(gen[mt.name][0][-1])!r}")
    n_tok = int(gen["bf16"][1][-1])
    bf = parse_method("bf16").kv
    ref = cache_bytes(bf, mc, n_tok, max_len, cdt)[0]
    ref_long = cache_bytes(bf, mc, LONG, LONG, cdt)[0]
    table = []
    for mt in methods:
        held, alloc = cache_bytes(mt.kv, mc, int(gen[mt.name][1][-1]), max_len, cdt)
        kind = "no quantization" if not mt.quantized else (
            f"INT{mt.kv.bits}, R={mt.kv.residual_length}, G={mt.kv.group_size}")  # fmt: skip
        table.append({"cache": f"{mt.name} ({kind})", "held": held, "alloc": alloc,
                      "ratio": ref / held,
                      "long": ref_long / cache_bytes(mt.kv, mc, LONG, LONG, cdt)[0]})  # fmt: skip
    print(f"\n## KV cache after {n_tok} tokens ({mc.num_layers} layers, one sequence)\n")
    print(md_table(table, ["cache", "held", "alloc", "ratio", "long"],
                   ["cache", "bytes held", "bytes allocated", "compression vs bf16",
                    f"compression at {LONG // 1024}K tokens"]))  # fmt: skip
    print(
        f"\n(Full-precision tokens are stored in {cdt}. A quantized cache keeps its newest "
        "R to R+G-1 tokens at full precision, so its ratio grows with the context towards "
        "5.2x at INT2; allocated bytes include the capacity reserved for generation.)\n"
    )
    if heldout is not None:
        windows = make_windows(heldout, DEMO_CTX, DEMO_WINDOWS, mc.bos_token_id)
        rows = eval_ppl.perplexity(m, windows, methods, cache_dtype=cdt, show_progress=show)
        rows = [dict(r, ci=ci(r["ppl_lo"], r["ppl_hi"])) for r in rows]
        print(
            f"## Perplexity ({len(windows)} held-out windows of {DEMO_CTX} tokens, "
            "each token attending to the cache as when decoded)\n"
        )
        print(md_table(rows, ["method", "ppl", "ci", "delta_vs_bf16"],
                       ["method", "ppl", "95% CI", "ppl - bf16"]) + "\n")  # fmt: skip
    rows = []
    for mt in methods:
        hits = [score_passkey(dec(o), p["answer"])
                for o, p in zip(gen[mt.name][0], prompts, strict=False)]  # fmt: skip
        rows.append({"method": mt.name, "rate": float(np.mean(hits)),
                     "hits": " ".join("x" if h else "." for h in hits)})  # fmt: skip
    print(
        f"## Passkey retrieval ({len(prompts)} prompts of <= {NIAH_LENGTH} tokens, needle "
        f"depths {', '.join(f'{d}%' for d in NIAH_DEPTHS)}; greedy through the cache)\n"
    )
    print(md_table(rows, ["method", "rate", "hits"], ["method", "exact match", "per depth"]))
    if heldout is not None:
        k = eval_tni.keys(m, make_windows(heldout, DEMO_CTX, 1, mc.bos_token_id))
        norms = eval_tni.key_norms(k)
        _, sm = eval_tni.tni_summary(norms)
        plot = eval_tni.plot_norms(norms, os.path.join(args.out, "key_norms.png"),
                                   title=os.path.basename(path.rstrip("/")))  # fmt: skip
        print(
            f"\n## Token Norm Imbalance\n\nmedian key norm / BOS (sink) key norm, median over "
            f"layers and KV heads: {sm['median_over_sink_median']:.1f} (range "
            f"{sm['median_over_sink_min']:.1f}-{sm['median_over_sink_max']:.1f})"
        )
        print(
            f"key-norm plot: {os.path.abspath(plot)}"
            if plot
            else f"key-norm plot: {eval_tni.NO_MPL}"
        )
    print(f"\ndemo time: {time.perf_counter() - t_start:.1f} s", file=sys.stderr)
    return 0
