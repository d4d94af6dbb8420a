"""``oscar-jax``: the demo on the bundled model, the full evaluation, the synthetic study.

    oscar-jax demo  [--model DIR] [--out DIR] [--prompt TEXT]
    oscar-jax eval  [--model DIR] --methods bf16,kivi2,oscar2,... --tasks ppl,niah,tni,ablations
                    --out DIR [--time-budget-s S]
    oscar-jax plot  OUT/results.json   (the PNGs of a run made where matplotlib was missing)
    oscar-jax study [...]       (the synthetic TNI study: ``python3 -m oscar_jax``)

``--model`` defaults to the bundled proxy model (``models/proxy/``); any Hugging Face
Llama / Qwen2 / Qwen3 directory (config.json, safetensors, tokenizer.json) works too.
JAX runs on whatever device it finds (CPU or GPU). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

BUNDLED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "proxy")
DEMO_METHODS = "bf16,kivi2,oscar2"


def _ints(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{s!r} must be comma-separated integers") from e


def _model_dir(path: str | None) -> str:
    path = path or BUNDLED
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
    import jax.numpy as jnp

    import models

    t0 = time.perf_counter()
    m = models.from_pretrained(path, dtype=jnp.dtype(dtype))
    return m, time.perf_counter() - t0


def _heldout(args, m, path: str):
    from models.evaluate import load_heldout

    src = args.heldout or os.path.join(path, "heldout_sample.npy")
    if not os.path.isfile(src):
        if args.heldout:
            raise ValueError(f"--heldout {src!r} does not exist")
        return None, src
    return load_heldout(src, m.tokenizer, m.config.bos_token_id), src


def _settings(args):
    from models.evaluate import Settings

    s = Settings(
        methods=args.methods, tasks=args.tasks, ctx=args.ctx, ppl_windows=args.ppl_windows,
        ppl_batch=args.ppl_batch, niah_lengths=args.niah_lengths, niah_depths=args.niah_depths,
        niah_trials=args.niah_trials, niah_batch=args.niah_batch, niah_seed=args.niah_seed,
        tni_windows=args.tni_windows, ablation_base=args.ablation_base,
        residual_length=args.residual, group_size=args.group, cache_dtype=args.cache_dtype,
        show_progress=not args.quiet, niah_group=args.niah_group,
        time_budget_s=args.time_budget_s, compile_workers=args.compile_workers,
    )  # fmt: skip
    if args.quick:  # a small run of every task, for a smoke test
        s.ctx, s.ppl_windows, s.tni_windows = min(s.ctx, 1024), 2, 1
        s.niah_lengths, s.niah_depths, s.niah_trials = (512,), (0, 50, 100), 1
        s.niah_batch = 3
    return s


def cmd_eval(args) -> int:
    import jax

    from models.evaluate import markdown, run_eval

    path = _model_dir(args.model)
    s = _settings(args)
    s.task_list()  # validate before loading anything
    from models.eval_common import parse_methods

    parse_methods(s.methods, s.residual_length, s.group_size)
    m, t_load = _load(path, args.dtype)
    heldout, src = _heldout(args, m, path)
    needs = {"ppl", "tni", "ablations"} & set(s.task_list())
    if heldout is None and needs:
        raise SystemExit(f"oscar-jax: tasks {sorted(needs)} need held-out tokens: {src} does "
                         "not exist (pass --heldout FILE.npy or a text file)")  # fmt: skip
    print(f"oscar-jax eval: {path} on {jax.devices()[0]} (loaded in {t_load:.1f} s)",
          file=sys.stderr)  # fmt: skip
    t0 = time.perf_counter()
    res = run_eval(m, heldout, args.out, s, model_dir=path)
    print(markdown(res))
    print(f"wrote {os.path.join(args.out, 'results.json')}, results.md"
          + "".join(f", {os.path.basename(p)}" for p in _plots(res))
          + f" ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)  # fmt: skip
    return 0


def _plots(res) -> list[str]:
    return [p for p in (res.get("tni", {}).get("plot"), res.get("niah", {}).get("plot")) if p]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="oscar-jax", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="bf16 vs OScaR INT2 cache on the bundled model (CPU, < 2 min)")
    e = sub.add_parser("eval", help="the full evaluation: ppl, niah, tni, ablations")
    pl = sub.add_parser("plot", help="key_norms.png and niah.png from an eval's results.json")
    pl.add_argument("results", help="results.json of oscar-jax eval")
    pl.add_argument("--out", default=None, help="output directory (default: the json's)")
    sub.add_parser("study", help="the synthetic TNI study (python3 -m oscar_jax)", add_help=False)
    for q in (d, e):
        q.add_argument("--model", default=None, help=f"HF model directory (default {BUNDLED})")
        q.add_argument("--heldout", default=None,
                       help="held-out tokens: .npy of ids, or a text file (default "
                            "MODEL/heldout_sample.npy)")  # fmt: skip
        q.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                       help="model and cache dtype")  # fmt: skip
        q.add_argument("--cache-dtype", default="bfloat16",
                       choices=("bfloat16", "float16", "float32"),
                       help="what the caches store full-precision K/V in")  # fmt: skip
        q.add_argument("--quiet", action="store_true", help="no progress bars")
    d.add_argument("--out", default="oscar-jax-demo", help="where the key-norm plot goes")
    d.add_argument("--prompt", default=None, help="prompt text (default: a held-out passage)")
    d.add_argument("--new-tokens", type=int, default=32)
    d.add_argument("--methods", default=DEMO_METHODS, help="methods of the tables")
    e.add_argument("--methods", default=None, help="comma-separated (default: the issue's 13)")
    e.add_argument("--tasks", default="ppl,niah,tni,ablations")
    e.add_argument("--out", default="oscar-jax-eval")
    e.add_argument("--ctx", type=int, default=4096, help="perplexity context")
    e.add_argument("--ppl-windows", type=int, default=None, help="max windows (default all)")
    e.add_argument("--ppl-batch", type=int, default=None,
                   help="windows per call (default: up to 32 off-CPU, 1 on a CPU)")  # fmt: skip
    e.add_argument("--niah-lengths", type=_ints, default=(512, 1024, 2048, 4096))
    e.add_argument("--niah-depths", type=_ints, default=tuple(range(0, 101, 10)))
    e.add_argument("--niah-trials", type=int, default=2, help="prompts per (length, depth)")
    e.add_argument(
        "--niah-batch",
        type=int,
        default=None,
        help="prompts per generate call (default: a whole group)",
    )
    e.add_argument("--niah-group", default="auto", choices=("auto", "length", "all"),
                   help="batch NIAH prompts per length, or all lengths in one program "
                        "(default: all off-CPU, where compiling dominates)")  # fmt: skip
    e.add_argument("--niah-seed", type=int, default=918_273)
    e.add_argument("--tni-windows", type=int, default=4)
    e.add_argument("--ablation-base", default="oscar2")
    e.add_argument("--residual", type=int, default=128, help="R of the methods")
    e.add_argument("--group", type=int, default=32, help="G of the methods")
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
    e.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test of all tasks")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["study"]:
        from oscar_jax.__main__ import main as study

        return study(argv[1:])
    args = p.parse_args(argv)
    try:
        if args.cmd == "plot":
            from models.eval_report import replot

            for path in replot(args.results, args.out):
                print(f"wrote {path}")
            return 0
        if args.cmd == "demo":
            from models.demo import run_demo

            return run_demo(args, _model_dir(args.model), _load, _heldout)
        if args.methods is None:
            from models.eval_common import DEFAULT_METHODS

            args.methods = ",".join(DEFAULT_METHODS)
        return cmd_eval(args)
    except ValueError as err:  # bad user input named by the library
        print(f"oscar-jax: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
