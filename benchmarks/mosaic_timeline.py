"""Where a warp-kernel CTA's time goes: Mosaic's per-CTA trace, summarised.

The warp kernel names its phases (``query``, ``pipeline`` with one ``step`` a block,
``finish``, ``store``); with ``Int2DecodeConfig.profile_dir`` set, Mosaic records %clock
at each phase's start and end (one thread a warpgroup) and each CTA's start on the global
timer, and writes a Perfetto JSON file a call. This script runs the INT2 partials kernel
(Qwen3-8B layer: 8 KV heads x 4 query heads, head_dim 128) on a random record cache and
prints, over the CTAs, when they start, how long each phase takes, the wait for data
between steps and when the last CTA ends: the split of a kernel's time into a fixed part
and a per-step part, which CUPTI's one number a kernel cannot give.

usage: python3 -m benchmarks.mosaic_timeline [--shapes 1x65536,1x131072] [--ghz 1.98]
  [--options JSON] [--out DIR]
Cycles are converted at ``--ghz`` (the SM clock under load: 1.98 GHz on H100 / H200 SXM).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import statistics
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_mosaic import HKV, HQ, random_cache
from pallas_kernels.decode import mosaic as K

STATS = ("min", "p10", "med", "p90", "max")
PHASES = ("start", "query", "fill", "step", "gap", "busy", "waits", "drain", "finish", "store",
          "span", "end")  # fmt: skip


def read_trace(path: str) -> list[dict]:
    """One dict a CTA: start (ns on the global timer, low 32 bits), sm, and its phases as
    (name, begin cycle, end cycle) relative to its first event."""
    ev = json.load(open(path))["traceEvents"]
    by = {}
    for e in ev:
        by.setdefault(e["tid"], []).append(e)
    ctas = []
    for tid, es in by.items():
        t0 = es[0]["ts"]
        stack, phases = [], []
        for e in es:
            cyc = round((e["ts"] - t0) * 1e3)  # the dump adds cycles as if they were ns
            if e["ph"] == "B":
                stack.append((e["name"], cyc))
            else:  # the innermost open region of that name
                at = max(i for i, (n, _) in enumerate(stack) if n == e["name"])
                name, beg = stack.pop(at)
                phases.append((name, beg, cyc))
        ctas.append(dict(tid=tid, sm=es[0]["pid"] - 1, start_ns=round(t0 * 1e3), phases=phases))
    starts = np.array([c["start_ns"] for c in ctas], np.int64)
    ref = int(np.median(starts))
    for c in ctas:  # the global timer's low word may wrap inside a kernel
        c["start_ns"] = ref + ((c["start_ns"] - ref + 2**31) % 2**32 - 2**31)
    return ctas


def summarise(ctas: list[dict], ghz: float) -> dict:
    """Medians (and spreads) over CTAs of each phase in microseconds."""
    us = 1e-3 / ghz  # microseconds a cycle
    t_min = min(c["start_ns"] for c in ctas)
    rows = []
    for c in ctas:
        ph = {}
        steps = []
        for name, b, e in c["phases"]:
            if name == "step":
                steps.append((b, e))
            else:
                ph[name] = (b, e)
        steps.sort()
        pipe_b, pipe_e = ph.get("pipeline", (0, 0))
        first = steps[0][0] if steps else pipe_e
        gaps = [b2 - e1 for (_, e1), (b2, _) in zip(steps, steps[1:], strict=False)]
        end = max(e for _, _, e in c["phases"])
        rows.append(dict(
            start=(c["start_ns"] - t_min) * 1e-3,
            query=(ph["query"][1] - ph["query"][0]) * us if "query" in ph else 0.0,
            fill=(first - pipe_b) * us,
            steps=len(steps),
            step=statistics.median(e - b for b, e in steps) * us if steps else 0.0,
            gap=statistics.median(gaps) * us if gaps else 0.0,
            busy=sum(e - b for b, e in steps) * us,
            waits=sum(gaps) * us,
            drain=(pipe_e - steps[-1][1]) * us if steps else 0.0,
            finish=(ph["finish"][1] - ph["finish"][0]) * us if "finish" in ph else 0.0,
            store=(ph["store"][1] - ph["store"][0]) * us if "store" in ph else 0.0,
            span=end * us,
            end=(c["start_ns"] - t_min) * 1e-3 + end * us,
            sm=c["sm"],
            step_list=[(e - b) * us for b, e in steps],
        ))  # fmt: skip
    out = {}
    for k in PHASES:
        v = np.array([r[k] for r in rows])
        out[k] = dict(min=float(v.min()), p10=float(np.percentile(v, 10)),
                      med=float(np.median(v)), p90=float(np.percentile(v, 90)),
                      max=float(v.max()))  # fmt: skip
    nmax = max(r["steps"] for r in rows)
    out["step_by_index"] = [
        float(np.median([r["step_list"][i] for r in rows if len(r["step_list"]) > i]))
        for i in range(nmax)
    ]
    sms = np.bincount([r["sm"] for r in rows])
    out["ctas"] = len(rows)
    out["ctas_per_sm"] = {int(n): int((sms == n).sum()) for n in np.unique(sms)}
    out["span_us"] = max(r["end"] for r in rows)
    return out


def run(shape: str, options: dict, ghz: float, calls: int) -> dict:
    """The kernel's trace at one B x L shape (the last of ``calls`` calls), summarised."""
    b, L = map(int, shape.split("x"))
    nq_n = L - 128
    c = random_cache(jax.random.PRNGKey(L), b, HKV, L, [nq_n] * b)
    tdir = tempfile.mkdtemp(prefix="mosaic_trace_")
    cfg = dataclasses.replace(K.default_config(1 << 20, 2, 128), kernel="warp",
                              profile_dir=tdir, **options)  # fmt: skip
    rec, kn = jax.jit(lambda c: K.fragment_layout(**c, block_tokens=cfg.block_tokens))(c)
    q = jax.random.normal(jax.random.PRNGKey(7), (b, HKV, HQ // HKV, 128), jnp.float32)
    nq = jnp.full((b,), nq_n, jnp.int32)
    fn = jax.jit(lambda q, r, n: K.int2_decode_partials(q, r, n, nq, cfg=cfg))
    for _ in range(calls):
        jax.block_until_ready(fn(q, rec, kn))
    jax.effects_barrier()
    traces = sorted(glob.glob(os.path.join(tdir, "*trace.json")), key=os.path.getmtime)
    if not traces:
        raise RuntimeError(f"no trace written under {tdir}")
    s = summarise(read_trace(traces[-1]), ghz)
    s["shape"] = shape
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x65536,1x131072")
    ap.add_argument("--options", default="{}", help="JSON of Int2DecodeConfig fields")
    ap.add_argument("--ghz", type=float, default=1.98)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    a = ap.parse_args()
    results = []
    for shape in a.shapes.split(","):
        s = run(shape, json.loads(a.options), a.ghz, a.calls)
        results.append(s)
        print(
            f"== {shape}: {s['ctas']} CTAs, CTAs an SM {s['ctas_per_sm']}, "
            f"span {s['span_us']:.1f} us (start of the first CTA to the end of the last)"
        )
        print(f"{'phase (us)':>10} " + " ".join(f"{k:>7}" for k in STATS))
        for k in PHASES:
            print(f"{k:>10} " + " ".join(f"{s[k][x]:7.2f}" for x in STATS))
        print("step by index (median us):", " ".join(f"{x:.2f}" for x in s["step_by_index"]))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        json.dump(results, open(os.path.join(a.out, "timeline.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
