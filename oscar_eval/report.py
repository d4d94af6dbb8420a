"""Reports of ``oscar-jax eval``: results.md from a results dict, and the PNGs again from a
results.json (``oscar-jax plot``, for a run made where matplotlib was missing)."""

from __future__ import annotations

import json
import math
import os

import numpy as np

from oscar_eval import tni as eval_tni
from oscar_eval.common import ci, md_table


def replot(results_json: str, out_dir: str | None = None) -> list[str]:
    """Write key_norms.png, tni.png and niah.png from a results.json (e.g. of a run on a
    machine without matplotlib); returns the paths written."""
    with open(results_json) as f:
        res = json.load(f)
    out_dir = out_dir or os.path.dirname(os.path.abspath(results_json))
    if eval_tni._pyplot() is None:
        raise ValueError(eval_tni.NO_MPL)
    done = []
    if "tni" in res:
        rows = res["tni"]["per_head"]
        nl = 1 + max(r["layer"] for r in rows)
        ratio = np.array([r["median_over_sink"] for r in rows]).reshape(nl, -1)
        title = os.path.basename(res.get("model", "").rstrip("/"))
        done.append(
            eval_tni.plot_key_norms(
                np.asarray(res["tni"]["norm_profile"]),
                ratio,
                os.path.join(out_dir, "key_norms.png"),
                title,
            )
        )
        if "group_error" in res["tni"]:
            done.append(eval_tni.plot_tni(res["tni"]["attn_on_sink"], res["tni"]["group_error"],
                                          os.path.join(out_dir, "tni.png"), title))  # fmt: skip
    if "niah" in res:
        done.append(eval_tni.plot_niah(res["niah"]["cells"], os.path.join(out_dir, "niah.png")))
    return [p for p in done if p]


# one precision per column: perplexities to 2 decimals, differences to 3
PPL_FORMATS = {"ppl": ".2f", "delta_vs_bf16": ".3f"}


def _ppl_cis(r: dict) -> dict:
    """A perplexity row with its CIs as text, in the precisions of PPL_FORMATS."""
    return dict(r, ci=ci(r["ppl_lo"], r["ppl_hi"], spec=".2f"),
                dci=ci(r.get("delta_lo"), r.get("delta_hi"), spec=".3f"))  # fmt: skip


def _tni_layers(t: dict) -> list[dict]:
    """One Markdown row per layer from the per-(layer, KV head) TNI rows."""
    out = []
    attn = t["summary"].get("attn_on_sink_by_layer")
    for li in sorted({r["layer"] for r in t["per_head"]}):
        rs = [r for r in t["per_head"] if r["layer"] == li]
        j = lambda k, rs=rs: " ".join(f"{r[k]:.3g}" for r in rs)  # noqa: E731
        out.append({"layer": li, "attn": attn[li] if attn else "", "ratio": j("median_over_sink"),
                    "ratio_min": j("median_over_min"), "median": j("median_norm"),
                    "sink": j("sink_norm")})  # fmt: skip
    return out


def markdown(res: dict) -> str:
    """The results as Markdown tables (what ``results.md`` holds)."""
    out = [
        f"# oscar-jax evaluation: {res['model']}",
        "",
        f"device {res['device']}, jax {res['jax']}; methods: {', '.join(res['methods'])}",
        "",
    ]
    for n in res.get("notes", []):
        out += [f"> {n}", ""]
    if "ppl" in res:
        st = res["settings"]
        rows = [_ppl_cis(r) for r in res["ppl"]]
        scored = (
            "second half of each window" if st.get("ppl_score") == "second_half" else "every token"
        )
        out += [f"## Perplexity (context {st['ctx']}, {res['ppl_windows']} windows, "
                f"scored: {scored}, "
                "cache-exact: each token attends to the cache as when decoded; full-precision "
                f"K/V in {st['cache_dtype']})", "",
                md_table(rows, ["method", "ppl", "ci", "delta_vs_bf16", "dci", "tokens"],
                         ["method", "ppl", "95% CI", "ppl - bf16", "95% CI (paired)",
                          "tokens"], PPL_FORMATS), ""]  # fmt: skip
    if "niah" in res:
        nz = res["niah"]
        lens = sorted(int(x) for x in nz["prompt_tokens"])
        forced = lambda r: r.get("hit_from") == "teacher-forced"  # noqa: E731
        rows = [dict(r, ci=ci(r["rate_lo"], r["rate_hi"], spec=".3f"),
                     llci=ci(r.get("ll_delta_lo"), r.get("ll_delta_hi"), spec=".3f"),
                     method=r["method"] + (" (*)" if forced(r) else ""))
                for r in nz["summary"]]  # fmt: skip
        form = "chat template" if nz.get("grid", {}).get("chat") else "plain text after BOS"
        fcol = ["forced_rate"] if all("forced_rate" in r for r in rows) else []
        out += [f"## Needle in a haystack (passkey exact match, greedy through the cache; "
                f"prompts: {form})", "",
                md_table(rows, ["method", "rate", "ci", *[f"rate@{n}" for n in lens], *fcol,
                                "prompts"],
                         ["method", "rate", "95% CI (Wilson)", *[f"@{n}" for n in lens],
                          *["greedy = answer (teacher-forced)"][: len(fcol)], "prompts"],
                         {"rate": ".3f", "forced_rate": ".3f",
                          **{f"rate@{n}": ".3f" for n in lens}}),
                ""]  # fmt: skip
        if any(forced(r) for r in nz["summary"]):
            out += [
                "(*) fake-quant method (no real cache): its rate is the teacher-forced one, "
                "every answer token the greedy choice (stricter than a decoded match); "
                "compare it with the other methods' teacher-forced column.",
                "",
            ]
        if all("answer_ll" in r for r in rows):
            out += ["Log-likelihood of the answer tokens (\" 12345\", nats summed over them; the "
                    "prompt prefilled at full precision, the answer teacher-forced through the "
                    "cache), mean over prompts:", "",
                    md_table(rows, ["method", "answer_ll", "ll_delta", "llci",
                                    *[f"ll@{n}" for n in lens]],
                             ["method", "answer log-lik", "minus bf16 (paired)",
                              "95% CI (bootstrap)", *[f"@{n}" for n in lens]],
                             {"answer_ll": ".3f", "ll_delta": ".3f",
                              **{f"ll@{n}": ".3f" for n in lens}}), ""]  # fmt: skip
    if "tni" in res:
        t = res["tni"]
        sm = t["summary"]
        out += [
            "## Token Norm Imbalance",
            "",
            f"median key norm / sink (position 0) key norm over {sm['layers_heads']} "
            f"(layer, KV head) pairs: median {sm['median_over_sink_median']:.1f}, "
            f"min {sm['median_over_sink_min']:.1f}, max {sm['median_over_sink_max']:.1f}; "
            f"{sm['layers_heads_ratio_ge_10']} pairs >= 10; query heads putting >= 0.5 of "
            f"their attention on position 0: {sm.get('sink_heads')}/{sm.get('query_heads')}. "
            f"Plots: {t['plot'] or 'none'}, {t.get('sink_plot') or 'none'}",
            "",
            md_table(
                _tni_layers(t),
                ["layer", "attn", "ratio", "ratio_min", "median", "sink"],
                [
                    "layer",
                    "attention on pos 0",
                    "median/sink norm per KV head",
                    "median/min",
                    "median norm",
                    "sink norm",
                ],
            ),  # fmt: skip
            "",
        ]
        ke = t["key_error"]
        layers = sorted({r["layer"] for r in ke})
        by = {}
        for r in ke:
            by.setdefault(r["method"], {})[r["layer"]] = r
        rows = [{"method": mt, **{f"L{li}": by[mt][li]["key_mse"] for li in layers},
                 "sink": float(np.mean([by[mt][li]["sink_key_rel_err"] for li in layers])),
                 "other": float(np.mean([by[mt][li]["other_key_rel_err"] for li in layers]))}
                for mt in by]  # fmt: skip
        out += ["### INT2 key reconstruction error per layer (quantizer only, all tokens)", "",
                md_table(rows, ["method", *[f"L{li}" for li in layers], "sink", "other"],
                         ["method", *[f"MSE L{li}" for li in layers], "sink rel. err",
                          "other rel. err"]), ""]  # fmt: skip
        ge = t.get("group_error")
        if ge:
            rows = [{"method": mt, "g0": e[0], "g1": e[1] if len(e) > 1 else math.nan,
                     "rest": float(np.median(e[1:])) if len(e) > 1 else math.nan}
                    for mt, e in ge.items()]  # fmt: skip
            out += ["Relative key error per group of G tokens (mean over layers; group 0 "
                    "holds the sink; all groups in results.json and tni.png):", "",
                    md_table(rows, ["method", "g0", "g1", "rest"],
                             ["method", "group 0 (sink)", "group 1", "median of groups >= 1"],
                             {"g0": ".3f", "g1": ".3f", "rest": ".3f"}), ""]  # fmt: skip
    if "ablations" in res:
        rows = [_ppl_cis(r) for r in res["ablations"]]
        st = res["settings"]
        out += [f"## Ablations of {st['ablation_base']} (one factor changed from R="
                f"{st['residual_length']}, G={st['group_size']}, Hadamard, bf16 norms per KV head)",
                "",
                md_table(rows, ["factor", "setting", "method", "ppl", "ci", "delta_vs_bf16",
                                "dci", "key_mse_layer_mean"],
                         ["factor", "setting", "method", "ppl", "95% CI", "ppl - bf16",
                          "95% CI (paired)", "INT2 key MSE"], PPL_FORMATS), ""]  # fmt: skip
    tm = res.get("timing_s", {})
    if tm:
        out += ["Time: " + ", ".join(f"{k} {v:.0f} s" for k, v in tm.items()), ""]
    last = (res.get("runs") or [{}])[-1]
    if last.get("compile"):
        c = last["compile"]
        done = last.get("done", "wall_s" in last)  # results.json of older runs: no "done"
        wall = (f"{last['wall_s']} s wall" if done else
                f"not finished (running, or interrupted) after {last.get('wall_s', 0)} s: "
                "the tables hold the units finished so far")  # fmt: skip
        out += [
            f"Last run: {wall}, {c['programs']} programs "
            f"compiled ({c['compile_s']:.0f} s of compiling, summed over threads)",
            "",
        ]
    if res.get("skipped"):
        out += [
            "Skipped by the time budget (not run, no rows): "
            + ", ".join(f"{u['task']} {u['unit']}" for u in res["skipped"]),
            "",
        ]
    return "\n".join(out)
