"""Batch-1 projections (GEMV) of an 8B model: how fast XLA streams the weights.

A decode step at batch 1 spends most of its time in ``x @ W`` with x [1, in]: XLA
strength-reduces such a dot into a reduce fusion over W [in, out]'s major axis, whose
parallelism is the number of output columns, so a [14336, 4096] down projection
occupies few SMs. Variants (``models.layers.dense`` is the "einsum" row):

* einsum: ``einsum("mi,io->mo", precision=HIGHEST, preferred_element_type=f32)``;
* default: the same at default precision;
* splitK: the reduction split into K chunks (a batched dot over [K, in / K, out],
  then a sum over K): K x more parallel outputs;
* transposed: W stored [out, in] (reduction along the contiguous axis).

Device-side timing as ``bench_decode.device_time`` (chained calls inside one jit).

    python3 -m benchmarks.bench_gemv --out out/gemv [--rows 1,48]
"""

from __future__ import annotations

import argparse  # noqa: E402
import json  # noqa: E402
import os

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.bench_decode import copy_bandwidth, device_time  # noqa: E402

HIGHEST = jax.lax.Precision.HIGHEST
F32 = jnp.float32
# Llama-3.1-8B per-layer projections: (name, in, out)
SHAPES = (("q/o", 4096, 4096), ("k/v", 4096, 1024), ("gate/up", 4096, 14336), ("down", 14336, 4096))


def variant(name: str):
    """fn(x [M, in], w) -> [M, out] bf16; w as ``prepare(name, w)`` returns it."""
    if name == "einsum":
        return lambda x, w: jnp.einsum(
            "mi,io->mo", x, w, precision=HIGHEST, preferred_element_type=F32
        ).astype(x.dtype)
    if name == "default":
        return lambda x, w: jnp.einsum("mi,io->mo", x, w, preferred_element_type=F32).astype(
            x.dtype
        )
    if name == "transposed":
        return lambda x, w: jnp.einsum(
            "mi,oi->mo", x, w, precision=HIGHEST, preferred_element_type=F32
        ).astype(x.dtype)
    if name.startswith("split"):
        k = int(name[5:])

        def fn(x, w):
            m, n = x.shape
            xs = x.reshape(m, k, n // k)
            ws = w.reshape(k, n // k, w.shape[1])
            y = jnp.einsum("mkc,kco->mko", xs, ws, precision=HIGHEST, preferred_element_type=F32)
            return jnp.sum(y, axis=1).astype(x.dtype)

        return fn
    raise ValueError(f"variant={name!r} unknown")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/gemv")
    ap.add_argument("--rows", default="1")
    ap.add_argument("--variants", default="einsum,default,transposed,split4,split8,split16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--unroll", type=int, default=8)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bw = copy_bandwidth(256 << 20, args.reps, args.calls, args.unroll)
    print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
    names = args.variants.split(",")
    rows, res = [], []
    for m in (int(r) for r in args.rows.split(",")):
        for label, n_in, n_out in SHAPES:
            key = jax.random.PRNGKey(n_in * n_out + m)
            w = jax.random.normal(key, (n_in, n_out), jnp.bfloat16)
            x = jax.random.normal(key, (m, n_in), jnp.bfloat16)
            line = [f"{m} x {label} [{n_in}, {n_out}]"]
            for name in names:
                ww = w.T.copy() if name == "transposed" else w
                f = variant(name)
                # chain: the next input is the output folded back to [M, in]
                fn = lambda xc, ww, f=f, n_in=n_in: jnp.resize(f(xc, ww), xc.shape)  # noqa: E731
                t = device_time(fn, x, args.reps, args.calls, (ww,), args.unroll)
                gbs = n_in * n_out * 2 / t / 1e9
                res.append(dict(rows=m, shape=label, variant=name, us=t * 1e6, gbs=gbs))
                line.append(f"{t * 1e6:.1f} us ({100 * gbs * 1e9 / bw:.0f}%)")
                print(res[-1], flush=True)
            rows.append("| " + " | ".join(line) + " |")
    dev = jax.devices()[0].device_kind
    md = "\n".join(
        [
            f"Batch-M projections, {dev}, jax {jax.__version__}; device-side time per call "
            f"(% of a {bw / 1e9:.0f} GB/s device copy, on the weight bytes).",
            "",
            "| rows x projection [in, out] | " + " | ".join(names) + " |",
            "|---" * (len(names) + 1) + "|",
            *rows,
        ]
    )
    print(md)
    with open(os.path.join(args.out, "gemv.md"), "w") as fh:
        fh.write(md + "\n")
    with open(os.path.join(args.out, "gemv.json"), "w") as fh:
        json.dump(dict(copy_bytes_per_s=bw, results=res, device=dev, jax=jax.__version__), fh)


if __name__ == "__main__":
    main()
