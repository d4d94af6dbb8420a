"""Run one Pallas kernel of ours a few times, for Nsight Compute to profile.

Hardware counters (stall reasons, occupancy, achieved bandwidth) say where a kernel's
time goes, which chained timing cannot. On the H200 (Firecracker runtime, ncu works):

    ncu --clock-control none -k regex:oscar_quantize --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats --section SourceCounters \
        python3 -m benchmarks.ncu_kernels quantize --tokens 32768

``decode`` runs INT2 decode attention (Qwen3-8B layer shape) on a prefilled cache;
``mosaic`` the same through the Mosaic GPU kernel over a layout='record' cache (its
partials kernel and merge launch; jax >= 0.11.2, Hopper):

    ncu --clock-control none --launch-skip 4 --launch-count 4 --section WarpStateStats \
        --section SourceCounters --section Occupancy --section LaunchStats -o mosaic \
        python3 -m benchmarks.ncu_kernels mosaic --tokens 131072

``--options`` is a JSON dict of decode or quantize tuning knobs (mosaic:
``Int2DecodeConfig`` fields).
"""

from __future__ import annotations

import argparse
import json

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import oscar_jax as oj  # noqa: E402
from benchmarks.bench_decode import HKV, D, make_inputs  # noqa: E402
from benchmarks.bench_quantize import make_kv  # noqa: E402
from pallas_kernels.decode import mosaic as mk  # noqa: E402
from pallas_kernels.quantize import triton as qk  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kernel", choices=("quantize", "decode", "mosaic"))
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--options", default="{}", help="JSON dict of tuning knobs")
    ap.add_argument("--calls", type=int, default=2)
    a = ap.parse_args()
    opts = json.loads(a.options)
    cfg = oj.preset("oscar", bits=2)
    if a.kernel == "quantize":
        k, v = make_kv(jax.random.PRNGKey(0), (a.batch, HKV, a.tokens, D), jnp.bfloat16)
        fn = jax.jit(lambda k, v: qk.encode(k, v, cfg, **opts))
        args = (k, v)
    else:
        q, k, v = make_inputs(a.batch, a.tokens)
        impl, kw = "pallas", opts
        if a.kernel == "mosaic":
            cfg = cfg.replace(layout="record", rotate_values=False)
            impl, kw = "mosaic", dict(cfg=mk.Int2DecodeConfig(**opts)) if opts else {}
        c = oj.init_cache(cfg, batch=a.batch, max_len=a.tokens, num_kv_heads=HKV, head_dim=D)
        c = jax.jit(oj.prefill)(c, k, v)
        fn = jax.jit(lambda q, c: oj.decode_attention(q, c, implementation=impl, **kw))
        args = (q, c)
    for i in range(a.calls):
        jax.block_until_ready(fn(*args))
        print(f"{a.kernel} call {i} done", flush=True)


if __name__ == "__main__":
    main()
