"""Bookkeeping and reports of the end-to-end benchmarks (``bench_e2e.py``, ``bench_sharded.py``).

``Runner``: a timestamped unbuffered log, a global time budget (units past it are recorded
as "not run (budget)"), errors recorded per unit, and the JSON and Markdown rewritten after
every unit, so a killed run still leaves its data. ``e2e_summary`` / ``sharded_summary``
turn the raw units into comparisons, targets and tables (``plot_e2e.py`` draws the charts).
"""

from __future__ import annotations

import json
import os
import time
import traceback

import numpy as np

GiB = 1024**3


def _ok(units, key):
    u = units.get(key)
    return u if u and u.get("status") == "ok" else None


def _f(x, nd=3, unit=""):
    if x is None:
        return "n/a"
    return f"{x:.{nd}g}{unit}" if abs(x) < 1e4 else f"{x:,.0f}{unit}"


def _table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def _best(units, prefix, bf16: bool, field="ms_per_step", lower=True):
    """The best ok unit among ``prefix + label`` units of BF16 (or quantized) caches."""
    cands = []
    for k, u in units.items():
        if not k.startswith(prefix) or u.get("status") != "ok" or k.count("/") != prefix.count("/"):
            continue
        label = k[len(prefix) :]
        if label.startswith("bf16") == bf16 and field in u:
            cands.append((u[field], label, u))
    if not cands:
        return None, None
    v, label, u = (min if lower else max)(cands, key=lambda c: c[0])
    return label, u


def _status(units, prefix):
    st = [u.get("status", "") for k, u in units.items() if k.startswith(prefix)]
    if not st:
        return "not requested"
    bad = [s for s in st if s != "ok"]
    return bad[0] if bad else "ok"


# -- end to end, one GPU -------------------------------------------------------------
def e2e_summary(data: dict):
    units, meta = data["units"], data["meta"]
    targets = meta.get("targets", {})
    models = sorted({k.split("/")[0] for k in units})
    head = f"# End-to-end decode: {meta.get('device')}, jax {meta.get('jax')}, "
    summary, md = {}, [head + f"{meta.get('date')}", ""]
    bw = meta.get("copy_bytes_per_s")
    if bw:
        md.append(f"Device copy bandwidth (read + write, device-side): {bw / 1e9:.0f} GB/s.\n")
    for m in models:
        s, rows = {}, []
        for w, what in (("lat32k", "latency"), ("lat128k", "latency"), ("tp48x4k", "throughput"),
                        ("tpmax32k", "throughput")):  # fmt: skip
            pre = f"{m}/{w}/"
            lat = what == "latency"
            fld = "ms_per_step" if lat else "tokens_per_s"
            bl, bu = _best(units, pre, True, fld, lower=lat)
            ql, qu = _best(units, pre, False, fld, lower=lat)
            ratio = None
            if bu and qu:
                ratio = bu[fld] / qu[fld] if lat else qu[fld] / bu[fld]
            tgt = targets.get(w)
            s[w] = dict(bf16=bl, quant=ql, bf16_value=bu and bu[fld], quant_value=qu and qu[fld],
                        ratio=ratio, target=tgt, met=None if ratio is None or tgt is None
                        else ratio >= tgt, status=_status(units, pre))  # fmt: skip
            name = {"lat32k": "ms/token, batch 1, 32K", "lat128k": "ms/token, batch 1, 128K",
                    "tp48x4k": "tokens/s, batch 48, 4K",
                    "tpmax32k": "tokens/s, largest batch, 32K"}[w]  # fmt: skip
            rows.append([name, _cell(bu, bl, lat), _cell(qu, ql, lat), _f(ratio, 3, "x"),
                         f">= {tgt}x" if tgt else "", _met(s[w]["met"])])  # fmt: skip
        # memory
        bm, qm = _ok(units, f"{m}/mem/bf16"), None
        for k, u in units.items():
            if k.startswith(f"{m}/mem/") and not k.endswith("/bf16") and u.get("status") == "ok":
                qm = qm or u
        if bm and qm:
            for i, ctx in enumerate(bm["contexts"]):
                b_, q_ = bm["contexts"][ctx], qm["contexts"].get(ctx)
                if not q_:
                    continue
                meas = lambda x: x["allocator_delta_bytes"] or x["live_bytes"]  # noqa: E731
                r = meas(b_) / max(meas(q_), 1)
                met = r >= 5.0 if i == 0 else None
                s[f"mem{ctx}"] = dict(bf16_bytes=meas(b_), quant_bytes=meas(q_), ratio=r,
                                      analytic_ratio=b_["analytic_bytes"] / q_["analytic_bytes"],
                                      target=5.0 if i == 0 else None, met=met)  # fmt: skip
                rows.append([f"cache bytes, 1 row, {_ctx(int(ctx))} (analytic)",
                             f"{meas(b_) / GiB:.3f} GiB ({b_['analytic_bytes'] / GiB:.3f})",
                             f"{meas(q_) / GiB:.3f} GiB ({q_['analytic_bytes'] / GiB:.3f}; "
                             f"{q_['bytes_per_token_per_head']:.1f} B/token/head)",
                             _f(r, 3, "x"), ">= 5x" if i == 0 else "", _met(met)])  # fmt: skip
        # prefill
        pre = f"{m}/prefill32k/"
        fws = {k[len(pre):]: u for k, u in units.items()  # forward, forward:cudnn, ...
               if k.startswith(pre + "forward") and u.get("status") == "ok"}  # fmt: skip
        for lab, u in fws.items():
            s[f"prefill_{lab}_s"] = u["median_s"]
            rows.append([f"prefill forward, {u['tokens']} tokens, attention "
                         f"{u.get('attention', 'reference')}", f"{u['median_s']:.3f} s",
                         "(same forward)", "", "", ""])  # fmt: skip
        fw = min(fws.values(), key=lambda u: u["median_s"]) if fws else None
        if fw:
            for k, u in units.items():
                if k.startswith(pre) and not k[len(pre):].startswith("forward") \
                        and u.get("status") == "ok":  # fmt: skip
                    lab = k.split("/")[-1]
                    tot = fw["median_s"] + u["median_s"]
                    s[f"prefill_{lab}"] = dict(forward_s=fw["median_s"], fill_s=u["median_s"],
                                               total_s=tot)  # fmt: skip
                    rows.append([f"prefill {fw['tokens']} tokens + fill ({lab}; fastest forward)",
                                 f"forward {fw['median_s']:.3f} s", f"fill {u['median_s']:.4f} s",
                                 f"total {tot:.3f} s", "", ""])  # fmt: skip
        summary[m] = s
        md += [f"## {m}", "", _table(["measurement", "BF16", "OScaR INT2", "INT2 vs BF16",
                                      "target", "met"], rows), ""]  # fmt: skip
        bd = breakdown(units, m, meta)
        if bd:
            summary[m]["breakdown"] = bd
            md += [
                "Time per decode step (ms), from variants (attention skipped; attention skipped "
                "with a 256-token cache; logits + argmax alone):",
                "",
            ]
            extra = [c for c in ("of which append", "of which carry", "cache_read_ms_at_copy_bw")
                     if any(c in v for v in bd.values())]  # fmt: skip
            brow = [[k, *(_f(v.get(c), 3) for c in COMPONENTS + tuple(extra)), _f(v["total"], 4),
                     v["largest"]] for k, v in bd.items()]  # fmt: skip
            md += [_table(["workload / cache", *COMPONENTS, *extra, "total", "largest"], brow), ""]
            md += [
                f"Next bottleneck ({k}): **{v['largest']}** ({v[v['largest']]:.3f} of "
                f"{v['total']:.3f} ms per step)."
                for k, v in bd.items()
            ] + [""]
        comp = [(k, u.get("compile_s")) for k, u in units.items()
                if k.startswith(m + "/") and u.get("compile_s")]  # fmt: skip
        if comp:
            md += [
                "Compile seconds: " + ", ".join(f"{k[len(m) + 1 :]} {v:.1f}" for k, v in comp),
                "",
            ]
    md += _skipped(units)
    return summary, "\n".join(md) + "\n"


COMPONENTS = ("attention", "cache update + carry", "projections + MLP", "logits + sampling")


def breakdown(units, m, meta) -> dict:
    out = {}
    for k, u in units.items():
        if not (k.startswith(m + "/") and k.endswith("/skip_attn")) or u.get("status") != "ok":
            continue
        base = k[: -len("/skip_attn")]
        full = _ok(units, base)
        wo = _ok(units, f"{m}/b{u['batch']}/weights_only")
        hd = _ok(units, f"{m}/b{u['batch']}/head")
        if not full:
            continue
        row = {"attention": full["ms_per_step"] - u["ms_per_step"], "total": full["ms_per_step"]}
        co = _ok(units, base + "/carry_only")
        if wo:
            row["cache update + carry"] = u["ms_per_step"] - wo["ms_per_step"]
            row["projections + MLP"] = wo["ms_per_step"] - (hd["ms_per_step"] if hd else 0.0)
            if co:  # split: append vs carrying the caches through the layer scan
                row["of which append"] = u["ms_per_step"] - co["ms_per_step"]
                row["of which carry"] = co["ms_per_step"] - wo["ms_per_step"]
        if hd:
            row["logits + sampling"] = hd["ms_per_step"]
        parts = {c: row[c] for c in COMPONENTS if c in row}
        row["largest"] = max(parts, key=parts.get)
        bw = meta.get("copy_bytes_per_s")
        if bw:
            row["cache_read_ms_at_copy_bw"] = full["cache_bytes"] / bw * 1e3
        out[base[len(m) + 1 :]] = row
    return out


def _cell(u, lab, lat: bool) -> str:
    if not u:
        return "not run"
    if lat:
        return f"{u['ms_per_step']:.3f} ms ({lab})"
    return f"{u['tokens_per_s']:.0f} tok/s at batch {u['batch']} ({lab})"


def _ctx(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _met(v):
    return "" if v is None else ("yes" if v else "**no**")


def _skipped(units):
    bad = [(k, u["status"]) for k, u in units.items() if u.get("status") != "ok"]
    if not bad:
        return []
    return ["Not run / failed:", ""] + [f"* `{k}`: {s}" for k, s in bad] + [""]


# -- sharded, several GPUs -----------------------------------------------------------
def _verified(v) -> str:
    """maxctx's verification per mesh: the context that decoded, its ms per step."""
    if not isinstance(v, dict):
        return str(v)
    out = []
    for lay, r in v.items():
        if r.get("context"):
            ms = r.get("ms_per_step")
            out.append(f"{lay}: {r['context']:,} decoded" + (f" ({ms:.1f} ms/step)" if ms else ""))
        else:
            out.append(f"{lay}: none of {[t['context'] for t in r['tries']]} fit")
    return "; ".join(out)


def sharded_summary(data: dict):
    units, meta = data["units"], data["meta"]
    n = meta.get("num_devices")
    md = [f"# Sharded decoding: {n} x {meta.get('device')}, jax {meta.get('jax')}, "
          f"{meta.get('date')}", ""]  # fmt: skip
    summary, rows = {}, []
    for k, u in units.items():
        if u.get("status") != "ok" or "ms_per_step" not in u:
            continue
        w, cache, where = k.split("/")[:3]
        rows.append([w, cache, where, u.get("mesh", ""), u["batch"], u["context"],
                     f"{u['ms_per_step']:.3f}", f"{u['tokens_per_s']:.0f}",
                     _f(u.get("compile_s"), 3)])  # fmt: skip
        one = _ok(units, f"{w}/{cache}/1gpu")
        if one and where != "1gpu":
            sp = one["ms_per_step"] / u["ms_per_step"]
            tp = u["tokens_per_s"] / one["tokens_per_s"]
            summary[k] = dict(speedup_vs_1gpu=sp, throughput_vs_1gpu=tp)
    md += [_table(["workload", "cache", "run", "mesh (data, model, sequence)", "batch", "context",
                   "ms/step", "tokens/s", "compile s"], rows), ""]  # fmt: skip
    if summary:
        md += [_table(["unit", "latency speedup vs 1 GPU", "throughput vs 1 GPU"],
                      [[k, _f(v["speedup_vs_1gpu"], 3, "x"), _f(v["throughput_vs_1gpu"], 3, "x")]
                       for k, v in summary.items()]), ""]  # fmt: skip
    chk = [(k, u) for k, u in units.items() if k.startswith("check/") and u.get("status") == "ok"]
    if chk:
        head = ["check", "kernel", "mesh", "steps", "mismatches (teacher-forced)",
                "free-run equal", "logits max |diff|", "near ties"]  # fmt: skip
        md += [_table(head, [[k, u.get("impl", ""), u["mesh"], u["steps"], u["mismatches"],
                              u["tokens_equal"], _f(u["logits_max_abs_diff"], 3), u["near_ties"]]
                             for k, u in chk]), ""]  # fmt: skip
        summary["tokens_equal"] = all(u["tokens_equal"] for _, u in chk)
    mx = [(k, u) for k, u in units.items() if k.startswith("maxctx/") and u.get("status") == "ok"]
    if mx:
        md += [_table(["cache", "devices", "largest context (analytic)", "verified"],
                      [[k.split("/")[1], k.split("/")[2], f"{u['analytic_context']:,}",
                        _verified(u.get("verified", "not run"))] for k, u in mx]), ""]  # fmt: skip
    md += _skipped(units)
    return summary, "\n".join(md) + "\n"


# -- run bookkeeping ------------------------------------------------------------------
class Runner:
    """Timestamped unbuffered log, a global budget, incremental JSON + Markdown output."""

    def __init__(self, out_dir: str, stem: str, budget_s: float, meta: dict, summarize=None,
                 resume: str = ""):  # fmt: skip
        """``resume``: a JSON of an earlier run; its "ok" units are kept and not run again."""
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.stem, self.budget_s = out_dir, stem, budget_s
        self.t0 = time.perf_counter()
        self.data = dict(meta=meta, units={}, summary={})
        self.summarize = summarize
        if resume:
            with open(resume) as f:
                old = json.load(f)["units"]
            self.data["units"] = {k: dict(u, resumed=True) for k, u in old.items()
                                  if u.get("status") == "ok"}  # fmt: skip
            meta["resumed_from"] = resume

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{self.elapsed():7.1f}s] {msg}", flush=True)

    def over_budget(self, grace_s: float = 0.0) -> bool:
        return bool(self.budget_s) and self.elapsed() > self.budget_s + grace_s

    def unit(self, key: str, fn, grace_s: float = 0.0):
        """Run ``fn() -> dict`` as one unit: skipped past the budget, errors recorded.

        ``grace_s``: extra budget for a cheap unit (e.g. one whose program is compiled).
        """
        if self.data["units"].get(key, {}).get("status") == "ok":
            return self.data["units"][key]  # shared unit (e.g. a breakdown's weights-only run)
        if self.over_budget(grace_s):
            self.data["units"][key] = dict(status="not run (budget)")
            self.log(f"{key}: not run (budget)")
            self.write()
            return None
        self.log(f"{key}: start")
        t = time.perf_counter()
        try:
            res = fn() or {}
            res = dict(status=res.pop("status", "ok"), **res)
        except Exception as e:  # noqa: BLE001  (record, go on with the next unit)
            res = dict(status=f"error: {type(e).__name__}: {str(e)[:400]}",
                       traceback=traceback.format_exc()[-2000:])  # fmt: skip
        res["wall_s"] = time.perf_counter() - t
        self.data["units"][key] = res
        self.log(f"{key}: {res['status']} ({res['wall_s']:.1f} s) {short(res)}")
        self.write()
        return res if res["status"] == "ok" else None

    def write(self) -> None:
        self.data["meta"]["elapsed_s"] = self.elapsed()
        md = ""
        if self.summarize is not None:
            try:
                self.data["summary"], md = self.summarize(self.data)
            except Exception as e:  # noqa: BLE001
                self.data["summary"] = dict(error=f"{type(e).__name__}: {e}")
        _atomic(os.path.join(self.out_dir, f"{self.stem}.json"),
                json.dumps(self.data, indent=1, default=_jsonable))  # fmt: skip
        if md:
            _atomic(os.path.join(self.out_dir, f"{self.stem}.md"), md)


def short(res: dict) -> str:
    keys = ("ms_per_step", "tokens_per_s", "batch", "compile_s", "mismatches", "ratio")
    return " ".join(f"{k}={res[k]:.4g}" if isinstance(res[k], float) else f"{k}={res[k]}"
                    for k in keys if k in res)  # fmt: skip


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def _atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(tmp, path)
