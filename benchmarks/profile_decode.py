"""Where one decode-attention call spends its device time: per-kernel durations.

Runs ``calls`` jitted decode-attention calls under ``jax.profiler`` and sums the GPU
kernel events of the trace by name (the Pallas kernel, XLA's query rotation, padding
and the split merge), per call. Complements ``bench_decode.py``'s chained timing,
which includes the gaps between kernels.

    python3 -m benchmarks.profile_decode --out out/profile --shape 1x131072 \
        [--variants '[{}, {"num_warps": 2}]'] [--bf16]
"""

from __future__ import annotations

import argparse  # noqa: E402
import collections  # noqa: E402
import glob  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import os
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import oscar_jax as oj  # noqa: E402
from benchmarks.bench_decode import HKV, D, make_inputs  # noqa: E402


def kernel_times(trace_dir: str) -> dict[str, list[float]]:
    """Kernel name -> durations (us) of the device events in a jax.profiler trace."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return {}
    with gzip.open(max(files, key=os.path.getmtime)) as f:
        trace = json.load(f)
    pids = {
        p["pid"]
        for p in trace.get("traceEvents", [])
        if p.get("ph") == "M"
        and p.get("name") == "process_name"
        and "/device:GPU" in str(p.get("args", {}).get("name", ""))
    }
    out = collections.defaultdict(list)
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e:
            out[e["name"]].append(float(e["dur"]))
    return out


def traced_kernels(fn, args, calls: int) -> dict[str, list[float]]:
    """Kernel name -> durations (us) of ``calls`` calls of fn(*args), after one warm-up,
    from a jax.profiler trace (``kernel_times``; empty without a GPU)."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
        jax.profiler.stop_trace()
        return kernel_times(d)


def profile(fn, args, calls: int) -> dict[str, float]:
    """Median us per call of each kernel run by fn(*args) (calls calls, after warm-up)."""
    times = traced_kernels(fn, args, calls)
    per_call = {}
    for name, ds in times.items():
        per = len(ds) / calls
        per_call[name] = float(np.median(ds)) * per if per >= 1 else float(np.sum(ds)) / calls
    return dict(sorted(per_call.items(), key=lambda kv: -kv[1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/profile")
    ap.add_argument("--shape", default="1x131072")
    ap.add_argument("--variants", default="[{}]", help="JSON list of INT2 option dicts")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--bf16", action="store_true", help="also profile our BF16 kernel")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    b, ctx = (int(x) for x in a.shape.split("x"))
    q, k, v = make_inputs(b, ctx)
    caches = {"int2": oj.preset("oscar", bits=2)}
    if a.bf16:
        caches["bf16"] = oj.preset("bf16")
    report = {}
    for name, cfg in caches.items():
        c = oj.init_cache(cfg, batch=b, max_len=ctx, num_kv_heads=HKV, head_dim=D)
        c = jax.jit(oj.prefill)(c, k, v)
        variants = json.loads(a.variants) if name == "int2" else [{}]
        for ov in variants:
            fn = jax.jit(
                lambda qq, cc, ov=ov: oj.decode_attention(qq, cc, implementation="pallas", **ov)
            )
            per = profile(fn, (q, c), a.calls)
            key = f"{name} {json.dumps(ov, sort_keys=True)}"
            report[key] = per
            total = sum(per.values())
            print(f"{a.shape} {key}: kernels {total:.1f} us/call", flush=True)
            for kn, us in per.items():
                print(f"    {us:9.2f} us  {kn[:110]}", flush=True)
    with open(os.path.join(a.out, "profile_decode.json"), "w") as f:
        json.dump(dict(shape=a.shape, device=jax.devices()[0].device_kind, report=report), f,
                  indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
