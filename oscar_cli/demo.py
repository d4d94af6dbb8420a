"""``oscar-jax demo``: the bf16 and the OScaR INT2 cache side by side on one model.

Small sizes so that it runs in well under two minutes on two CPU cores, JAX
compilation included: a greedy continuation of a held-out passage (or
``--prompt``) through each cache, the bytes each cache holds afterwards, the
perplexity of two 1024-token held-out windows (cache-exact, ``oscar_eval.ppl``),
five passkey prompts of 1024 tokens (``oscar_eval.niah``) and the key-norm plot
(``oscar_eval.tni``), written to ``default_out()`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import oscar_jax as oj
from models import bucket_length, generate
from oscar_eval import niah as eval_niah
from oscar_eval import ppl as eval_ppl
from oscar_eval import tni as eval_tni
from oscar_eval.common import (
    Progress,
    ci,
    make_encode,
    make_windows,
    md_table,
    parse_method,
    parse_methods,
)
from oscar_eval.passkey import score_passkey
from oscar_eval.tasks import decoder

DEMO_CTX = 1024
DEMO_WINDOWS = 2
PROMPT_TOKENS = 512  # held-out prefix used as the default prompt (> R + G: the INT2 part is used)
NIAH_LENGTH = 1024
NIAH_DEPTHS = (0, 25, 50, 75, 100)
LONG = 32768  # the compression of a long context, from the same byte accounting
SINK_RATIO = 3.0  # median / position-0 key norm from which a model "has low-norm sink keys"


def default_out() -> str:
    """Where the demo writes its plot by default: ``$XDG_CACHE_HOME/oscar-jax/demo``
    (``~/.cache/oscar-jax/demo``), or under the system's temp directory without a home;
    never the current directory (a checkout's ``git status`` would show it)."""
    home = os.path.expanduser("~")
    base = os.environ.get("XDG_CACHE_HOME") or (
        os.path.join(home, ".cache") if home != "~" else tempfile.gettempdir()
    )
    return os.path.join(base, "oscar-jax", "demo")


def sink_note(ratio: float) -> str:
    """What the median / sink key-norm ratio of a model says about OScaR's premise."""
    if ratio >= SINK_RATIO:
        return (f"This model has low-norm sink keys (position 0's key is {ratio:.0f}x shorter "
                "than the median): the imbalance OScaR's token scaling is made for.")  # fmt: skip
    return (
        f"This model has NO attention sinks: its position-0 keys are about as long as the "
        f"others (ratio {ratio:.1f}; the paper reports 10-50 on Llama-3.1 and Qwen3, "
        "SmolLM2-135M shows ~3), so the plot has no dip at position 0 and the demo does not "
        "exercise OScaR's premise (low-norm sink keys). The bundled proxy is such a model "
        "(ACCURACY.md in the repository: three training recipes, no sinks); "
        "'oscar-jax demo --model smollm2' fetches a real model with sinks (94 MB), or pass "
        "--model with a checkpoint directory or .gguf file."
    )


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
    enc = make_encode(m.tokenizer, mc.bos_token_id)
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
                    f"compression at {LONG // 1024}K tokens"],
                   {"ratio": ".2f", "long": ".2f"}))  # fmt: skip
    print(
        f"\n(Full-precision tokens are stored in {cdt}. A quantized cache keeps its newest "
        "R to R+G-1 tokens at full precision, so its ratio grows with the context towards "
        "5.2x at INT2; allocated bytes include the capacity reserved for generation.)\n"
    )
    if heldout is not None:
        windows = make_windows(heldout, DEMO_CTX, DEMO_WINDOWS, mc.bos_token_id)
        rows = eval_ppl.perplexity(m, windows, methods, cache_dtype=cdt, show_progress=show)
        rows = [dict(r, ci=ci(r["ppl_lo"], r["ppl_hi"], spec=".2f")) for r in rows]
        print(
            f"## Perplexity ({len(windows)} held-out windows of {DEMO_CTX} tokens, "
            "each token attending to the cache as when decoded)\n"
        )
        print(md_table(rows, ["method", "ppl", "ci", "delta_vs_bf16"],
                       ["method", "ppl", "95% CI", "ppl - bf16"],
                       {"ppl": ".2f", "delta_vs_bf16": ".3f"}) + "\n")  # fmt: skip
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
    print(md_table(rows, ["method", "rate", "hits"],
                   ["method", "exact match", "per depth (x: found, .: missed)"],
                   {"rate": ".2f"}))  # fmt: skip
    print(
        "\n(per depth: one mark per prompt, the needle at "
        f"{', '.join(f'{d}%' for d in NIAH_DEPTHS)} of it from left to right; x: the greedy "
        "continuation holds the 5-digit passkey, "
        ".: it does not)"
    )
    if heldout is not None:
        k = eval_tni.keys(m, make_windows(heldout, DEMO_CTX, 1, mc.bos_token_id))
        norms = eval_tni.key_norms(k)
        _, sm = eval_tni.tni_summary(norms)
        out_dir = args.out or default_out()
        plot = eval_tni.plot_norms(norms, os.path.join(out_dir, "key_norms.png"),
                                   title=os.path.basename(path.rstrip("/")))  # fmt: skip
        ratio = sm["median_over_sink_median"]
        print(
            f"\n## Token Norm Imbalance\n\nmedian key norm / BOS (position 0, where sinks "
            f"form) key norm, median over layers and KV heads: {ratio:.1f} (range "
            f"{sm['median_over_sink_min']:.1f}-{sm['median_over_sink_max']:.1f})\n"
        )
        print(sink_note(ratio) + "\n")
        print(
            f"key-norm plot: {os.path.abspath(plot)} (the demo's one file; --out DIR for "
            "another directory)"
            if plot
            else f"key-norm plot: {eval_tni.NO_MPL}"
        )
    print(f"\ndemo time: {time.perf_counter() - t_start:.1f} s", file=sys.stderr)
    return 0
