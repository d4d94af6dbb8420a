"""Issue 36: quality against bytes per token for every method of one or more eval runs.

Reads each ``oscar-jax eval --tasks ppl`` results.json (per-window NLL sums in
``ppl_nll``), counts each method's bytes per token per KV head
(``oscar_jax.methods.bytes_per_token``, every code, scale, zero, norm, outlier and
full-precision token; the R-token residual, the same for all methods, is not counted),
prints a Markdown table per run with paired 95% bootstrap intervals against oscar2 and
kivi2 (``--refs``), and draws relative perplexity (over bf16) against bytes per token, one panel per
run, Pareto front marked::

    python -m benchmarks.methods_pareto out/m36_qwen1024/results.json \
        out/m36_smollm2_1024/results.json --png docs/figures/methods_pareto.png
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap

import numpy as np

from oscar_eval.common import bootstrap_ppl, parse_method
from oscar_jax import methods as oscar_methods

REFS = ("oscar2", "kivi2")


def load(path: str, refs=REFS) -> dict:
    """One run: a results.json, or several joined with "+" (runs of one model on the same
    windows, e.g. methods split over two processes; their ``ppl_key`` must agree); paired
    differences against bf16 and each of ``refs``."""
    parts = []
    for p in path.split("+"):
        with open(p) as f:
            parts.append(json.load(f))
    res = parts[0]
    if any(r["ppl_key"] != res["ppl_key"] for r in parts):
        raise ValueError(f"{path}: the runs' windows / settings (ppl_key) differ")
    nll = {k: np.asarray(v, np.float64) for r in parts for k, v in r["ppl_nll"].items()}
    mc = res["model_config"]
    ctx = int(res["ppl_key"]["ctx"])
    score = res.get("settings", {}).get("ppl_score", "all")
    start = 0 if score == "all" else max(ctx // 2 - 1, 0)
    count = np.full(len(next(iter(nll.values()))), ctx - 1 - start, np.float64)
    rows = []
    for name, s in nll.items():
        kv = parse_method(name).kv
        b = oscar_methods.bytes_per_token(kv, mc["head_dim"], ctx, mc["num_kv_heads"])["total"]
        r = {"method": name, "bytes": b, **bootstrap_ppl(s, count)}
        for ref in ("bf16", *refs):
            if ref in nll and ref != name:
                d = bootstrap_ppl(s, count, nll[ref])
                r[f"d_{ref}"] = (d["delta_vs_bf16"], d["delta_lo"], d["delta_hi"])
                r[f"worse_{ref}"] = int(np.sum(s > nll[ref]))
        rows.append(r)
    bf = rows[[r["method"] for r in rows].index("bf16")]["ppl"] if "bf16" in nll else None
    for r in rows:
        r["rel"] = (r["ppl"] / bf - 1) * 100 if bf else float("nan")
    name = os.path.basename(str(res.get("model", "")).rstrip("/"))
    return {"rows": rows, "model": name, "ctx": ctx, "windows": len(count), "score": score,
            "date": res["runs"][-1]["date"], "n": len(count), "refs": tuple(refs),
            "head_dim": mc["head_dim"]}  # fmt: skip


def pareto(rows: list[dict]) -> set[str]:
    """Methods no other method beats in both bytes and perplexity."""
    front = set()
    for r in rows:
        if not any(o["bytes"] <= r["bytes"] and o["ppl"] < r["ppl"]
                   and (o["bytes"], o["ppl"]) != (r["bytes"], r["ppl"]) for o in rows):  # fmt: skip
            front.add(r["method"])
    return front


def table(run: dict) -> str:
    def d(r, ref):
        if f"d_{ref}" not in r:
            return ""
        x, lo, hi = r[f"d_{ref}"]
        return f"{x:+.2f} ({lo:+.2f} to {hi:+.2f}), {r[f'worse_{ref}']}/{run['n']}"

    refs = run.get("refs", REFS)
    head = "| method | bytes/token/head | ppl (95% CI) | vs bf16 |" + "".join(
        f" - {ref} (paired CI), windows worse |" for ref in refs
    )
    out = [head, "|---|---|---|---|" + "---|" * len(refs)]
    front = pareto(run["rows"])
    for r in sorted(run["rows"], key=lambda r: -r["bytes"]):
        star = " *" if r["method"] in front else ""
        rel = "" if r["method"] == "bf16" else f"{r['rel']:+.1f}%"
        out.append(f"| {r['method']}{star} | {r['bytes']:.2f} | {r['ppl']:.2f} "
                   f"({r['ppl_lo']:.2f}-{r['ppl_hi']:.2f}) | {rel} |"
                   + "".join(f" {d(r, ref)} |" for ref in refs))  # fmt: skip
    return "\n".join(out)


def plot(runs: list[dict], png: str, caption: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, len(runs), figsize=(6.2 * len(runs), 4.8), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        rows = [r for r in run["rows"] if r["method"] != "bf16"]
        front = pareto(rows)
        for r in rows:
            on = r["method"] in front
            ax.scatter(r["bytes"], r["rel"], s=40, c="C3" if on else "C0", zorder=3)
            ax.annotate(r["method"], (r["bytes"], r["rel"]), fontsize=8,
                        xytext=(4, 3), textcoords="offset points")  # fmt: skip
        fr = sorted((r for r in rows if r["method"] in front), key=lambda r: r["bytes"])
        ax.step([r["bytes"] for r in fr], [r["rel"] for r in fr], where="post", c="C3", lw=1,
                label="Pareto front")  # fmt: skip
        if min(r["rel"] for r in rows) > 0:
            ax.set_yscale("log")
        else:  # a method at or below bf16 (noise of few windows): log would drop it silently
            ax.set_yscale("symlog", linthresh=1.0)
            ax.axhline(0.0, c="0.5", lw=0.8)
        ax.set_xlabel(f"bytes per token per KV head (quantized part, head_dim {run['head_dim']})")
        ax.set_ylabel("perplexity over bf16, %")
        ax.set_title(f"{run['model']}: ctx {run['ctx']}, {run['windows']} windows, "
                     f"score {run['score']}", fontsize=9)  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.text(0.01, 0.01, textwrap.fill(caption, 190), fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    helps = "results.json of oscar-jax eval --tasks ppl (a.json+b.json: one model's runs)"
    ap.add_argument("results", nargs="+", help=helps)
    ap.add_argument("--png", default="", help="write the Pareto plot here")
    ap.add_argument("--caption", default="", help="text under the plot (command, commit, date)")
    ap.add_argument("--refs", default=",".join(REFS), help="paired-difference references")
    a = ap.parse_args(argv)
    runs = [load(p, [r for r in a.refs.split(",") if r]) for p in a.results]
    for p, run in zip(a.results, runs, strict=True):
        print(f"\n{run['model']} ({p}; ctx {run['ctx']}, {run['windows']} windows, score "
              f"{run['score']}, run of {run['date']}); * = on the Pareto front\n")  # fmt: skip
        print(table(run))
    if a.png:
        plot(runs, a.png, a.caption)
        print(f"\nwrote {a.png}")


if __name__ == "__main__":
    main()
