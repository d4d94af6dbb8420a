"""Charts (PNG) and merged Markdown of the end-to-end benchmarks' JSONs.

Run where matplotlib is installed (the GPU machine has none); several e2e JSONs (e.g. one
process per model) are merged:

    python3 -m benchmarks.plot_e2e --e2e out/e2e_llama/e2e.json out/e2e_qwen/e2e.json \
        --sharded out/sharded/sharded.json --out out/e2e_plots
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks.e2e_report import COMPONENTS, breakdown, e2e_summary, sharded_summary  # noqa: E402


# -- charts -------------------------------------------------------------------------------
def plot_e2e(datas: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = (("lat32k", "ms_per_step"), ("lat128k", "ms_per_step"),
              ("tp48x4k", "tokens_per_s"), ("tpmax32k", "tokens_per_s"))  # fmt: skip
    _memory_panel(axes.flat[4], datas)
    _breakdown_panel(axes.flat[5], datas)
    for ax, (w, fld) in zip(list(axes.flat)[:4], panels, strict=True):
        labels, vals = [], []
        for d in datas:
            for k, u in d["units"].items():
                parts = k.split("/")
                if len(parts) == 3 and parts[1] == w and u.get("status") == "ok":
                    extra = f"\nB={u['batch']}" if w == "tpmax32k" else ""
                    labels.append(f"{parts[0]}\n{parts[2]}{extra}")
                    vals.append(u[fld])
        colors = ["tab:gray" if "bf16" in lab else "tab:blue" for lab in labels]
        ax.bar(range(len(vals)), vals, color=colors)
        ax.set_xticks(range(len(vals)), labels, fontsize=6)
        ax.set_title(f"{w}: {'ms per token (lower is better)' if 'ms' in fld else 'tokens/s'}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _memory_panel(ax, datas):
    labels, vals, colors = [], [], []
    for d in datas:
        for k, u in d["units"].items():
            parts = k.split("/")
            if len(parts) == 3 and parts[1] == "mem" and u.get("status") == "ok":
                for ctx, c in u["contexts"].items():
                    n = int(ctx)
                    labels.append(
                        f"{parts[0]}\n{parts[2]} " + (f"{n // 1024}K" if n >= 1024 else ctx)
                    )
                    vals.append((c["allocator_delta_bytes"] or c["live_bytes"]) / 1024**3)
                    colors.append("tab:gray" if parts[2] == "bf16" else "tab:blue")
    ax.bar(range(len(vals)), vals, color=colors)
    ax.set_xticks(range(len(vals)), labels, fontsize=6)
    ax.set_yscale("log")
    ax.set_title("KV cache GiB per sequence (measured)")


def _breakdown_panel(ax, datas):
    merged = merge(datas)
    models = sorted({k.split("/")[0] for k in merged["units"]})
    rows = [(f"{m}\n{k}", v) for m in models
            for k, v in breakdown(merged["units"], m, merged["meta"]).items()]  # fmt: skip
    bottom = [0.0] * len(rows)
    for c in COMPONENTS:
        h = [max(v.get(c, 0.0), 0.0) for _, v in rows]
        ax.bar(range(len(rows)), h, bottom=bottom, label=c)
        bottom = [b + x for b, x in zip(bottom, h, strict=True)]
    ax.set_xticks(range(len(rows)), [r for r, _ in rows], fontsize=6)
    ax.set_title("decode step breakdown (ms)")
    if rows:
        ax.legend(fontsize=6)


def plot_sharded(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    units = [(k, u) for k, u in data["units"].items()
             if u.get("status") == "ok" and "ms_per_step" in u]  # fmt: skip
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(
        range(len(units)),
        [u["ms_per_step"] for _, u in units],
        color=["tab:gray" if "/1gpu" in k else "tab:green" for k, _ in units],
    )
    ax.set_xticks(range(len(units)), [k.replace("/", "\n") for k, _ in units], fontsize=6)
    ax.set_ylabel("ms per decode step")
    ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge(datas: list[dict]) -> dict:
    """One e2e result from several runs (e.g. one process per model)."""
    out = dict(meta=dict(datas[0]["meta"]), units={})
    for d in datas:
        out["units"].update(d["units"])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description="Markdown + PNG from the e2e / sharded JSONs")
    ap.add_argument("--e2e", nargs="*", default=[])
    ap.add_argument("--sharded", default="")
    ap.add_argument("--out", default="out/e2e_plots")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.e2e:
        datas = [json.load(open(p)) for p in a.e2e]
        merged = merge(datas)
        summ, md = e2e_summary(merged)
        merged["summary"] = summ
        json.dump(merged, open(os.path.join(a.out, "e2e_merged.json"), "w"), indent=1)
        png = _plot(plot_e2e, datas, os.path.join(a.out, "e2e.png"))
        open(os.path.join(a.out, "e2e.md"), "w").write(md + (f"\n![e2e]({png})\n" if png else ""))
        print(md)
    if a.sharded:
        data = json.load(open(a.sharded))
        summ, md = sharded_summary(data)
        png = _plot(plot_sharded, data, os.path.join(a.out, "sharded.png"))
        open(os.path.join(a.out, "sharded.md"), "w").write(md + (f"\n![sharded]({png})\n"
                                                               if png else ""))  # fmt: skip
        print(md)


def _plot(fn, data, path) -> str:
    """Draw with matplotlib when installed (not on the GPU machine); the PNG's name or ""."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"matplotlib is not installed: {path} not drawn (pip install matplotlib)")
        return ""
    fn(data, path)
    return os.path.basename(path)


if __name__ == "__main__":
    main()
