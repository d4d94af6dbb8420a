"""Decode-attention benchmark: one layer of Qwen3-8B shape (32 q heads, 8 KV heads, D 128;
``--layer`` sets another, e.g. ``32x8x64`` or ``32x8x256`` for the other head sizes).

Implementations: our INT2 Pallas kernel, our BF16 Pallas kernel, XLA einsum (BF16),
cuDNN (``jax.nn.dot_product_attention(implementation="cudnn")``), Pallas
``ops.gpu.decode_attention.gqa`` (best of several k_splits), and a large
device-to-device copy (x -> -x, read + write) as the bandwidth ceiling.

Timing is device-side: a loop of ``reps`` iterations inside one jit, each iteration
``unroll`` chained calls (each query depends on the previous output); per-call time =
(T(reps) - T(1)) / ((reps - 1) * unroll), which removes the host dispatch; the median
over ``calls`` host calls of each is used. Unrolling matters at small shapes: an XLA
GPU while loop costs ~10-20 us per iteration (the trip predicate goes to the host), as
much as a 1 x 4K call; ``--unroll 1`` times one call per iteration.

    python3 -m benchmarks.bench_decode --out out/decode [--check] [--layer 32x8x128] \
        [--variants '[{"block_tokens":128,"num_warps":4}]'] [--shapes 1x131072,8x32768]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import oscar_jax as oj
from pallas_kernels.decode import config as pcfg
from pallas_kernels.decode import mosaic as mk

HQ, HKV, D = 32, 8, 128  # the layer (``--layer`` sets them for the run)
SHAPES = ((1, 131072), (8, 32768), (48, 4096), (1, 4096))


def device_time(fn, q, reps: int, calls: int, operands=(), unroll: int = 1) -> float:
    """Median seconds per fn(q, *operands) call, device-side (see module docstring).

    The operands (caches) are jit arguments, not closed-over constants, and the chain
    length is traced, so each implementation compiles once.
    """

    @jax.jit
    def chain(q0, n, ops):
        def body(_, qc):
            for _ in range(unroll):  # the barrier keeps XLA from fusing chained calls
                qc = jax.lax.optimization_barrier(qc + (1e-6 * fn(qc, *ops)).astype(qc.dtype))
            return qc

        return jax.lax.fori_loop(0, n, body, q0)

    chain(q, 1, operands).block_until_ready()
    chain(q, reps, operands).block_until_ready()
    t1, tn = [], []
    for _ in range(calls):
        s = time.perf_counter()
        chain(q, 1, operands).block_until_ready()
        t1.append(time.perf_counter() - s)
        s = time.perf_counter()
        chain(q, reps, operands).block_until_ready()
        tn.append(time.perf_counter() - s)
    return max(float(np.median(tn) - np.median(t1)) / ((reps - 1) * unroll), 1e-9)


def copy_bandwidth(nbytes: int, reps: int, calls: int, unroll: int = 1) -> float:
    """Bytes/s of a device-side elementwise copy (read + write), chained in one jit."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    t = device_time(
        lambda y: -y * 1e6, x, reps, calls, unroll=unroll
    )  # body adds 1e-6*fn(y): stays finite
    return 2 * x.size * 4 / t


def make_inputs(b: int, ctx: int, seed: int = 0):
    key = jax.random.PRNGKey(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    k = jax.random.normal(k1, (b, ctx, HKV, D), jnp.bfloat16)
    v = jax.random.normal(k2, (b, ctx, HKV, D), jnp.bfloat16)
    k = k.at[:, :4].multiply(0.05)  # low-norm sink tokens
    q = jax.random.normal(k3, (b, HQ, D), jnp.bfloat16)
    return q, k, v


def int2_bytes(cache) -> int:
    """Bytes the INT2 path reads: quantized part up to nq per row + the whole ring + q."""
    per_q, _ = oj.cache.bytes_per_token(cache)
    nq = np.asarray(cache.num_quantized(), np.int64)
    ring = cache.k_res.size * cache.k_res.dtype.itemsize * 2
    return int(np.sum(nq) * per_q + ring)


def xla_bf16(q, k_hm, v_hm):
    b = q.shape[0]
    qg = q.reshape(b, HKV, HQ // HKV, D)
    s = jnp.einsum("bhgd,bhtd->bhgt", qg, k_hm, preferred_element_type=jnp.float32) / np.sqrt(D)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum(
        "bhgt,bhtd->bhgd", p.astype(v_hm.dtype), v_hm, preferred_element_type=jnp.float32
    )
    return o.reshape(b, HQ, D).astype(q.dtype)


def mosaic_call(b, ctx, k, v, knobs, bits=2):
    """The "mosaic" backend's decode call (``mk.decode_attention_mosaic``, the public call:
    query rotation by one GEMM, kernel, merge, output) over an OScaR INT2 (``bits=2``) or
    INT4 cache of layout="record" (read as it is) whose values are stored unrotated.
    Returns (fn(q, cache), (cache,)), bytes read (records + norms of the quantized tokens,
    the ring). ``knobs``: Int2DecodeConfig fields over the backend's defaults for the
    cache's capacity and bits, and ``merge`` (default "auto", the backend's choice;
    ``MERGES``)."""
    knobs = dict(knobs)
    merge = knobs.pop("merge", "auto")
    if merge not in mk.MERGES:
        raise ValueError(f"{merge=} must be one of {mk.MERGES}")
    kcfg = oj.preset("oscar", bits=bits, rotate_values=False).replace(layout="record")
    c = oj.init_cache(kcfg, batch=b, max_len=ctx, num_kv_heads=HKV, head_dim=D)
    # the backend's defaults for this capacity and width, with the knobs given
    cfg = mk.default_config(c.quant_capacity, bits, D, HQ // HKV, rows=b * HKV)
    cfg = dataclasses.replace(cfg, **knobs)
    c = jax.jit(oj.prefill)(c, k, v)

    def fn(q, cache):
        return mk.decode_attention_mosaic(q, cache, cfg=cfg, merge=merge)

    nrec = np.asarray(-(-c.num_quantized() // 64), np.int64)
    per_rec = mk.record_words(bits, D) * 4 + 64 * 4  # a record and its norms
    nbytes = int(np.sum(nrec) * HKV * per_rec) + 2 * c.k_res.size * 2
    return (fn, (c,)), nbytes


def run_shape(b, ctx, args, log):
    q, k, v = make_inputs(b, ctx)
    res = {}
    caches = {}

    def int2_cache(param_dtype):  # the INT2 cache with these scales / zeros, built once
        if param_dtype not in caches:
            cfg2 = oj.preset("oscar", bits=2, param_dtype=param_dtype)
            c = oj.init_cache(cfg2, batch=b, max_len=ctx, num_kv_heads=HKV, head_dim=D)
            caches[param_dtype] = jax.jit(oj.prefill)(c, k, v)
        return caches[param_dtype]

    c2 = int2_cache(args.param_dtype)
    cb = oj.init_cache(oj.preset("bf16"), batch=b, max_len=ctx, num_kv_heads=HKV, head_dim=D)
    cb = jax.jit(oj.prefill)(cb, k, v)
    k_hm, v_hm = cb.k_res, cb.v_res  # [B, H, L, D] bf16
    k_bl, v_bl = jnp.swapaxes(k_hm, 1, 2), jnp.swapaxes(v_hm, 1, 2)
    bf_bytes = 2 * k_hm.size * 2
    T = lambda f, ops: device_time(f, q, args.reps, args.calls, ops, args.unroll)  # noqa: E731

    def timed_row(name, f, ops, nbytes, ref_cache=None, **extra):
        """res[name]: f(q, *ops) timed and, with --check and a ``ref_cache``, its max error
        against the XLA reference over that cache; a failure is reported in the row."""
        try:
            res[name] = dict(ms=T(f, ops) * 1e3, bytes=nbytes, **extra)
            if args.check and ref_cache is not None:
                ref = oj.decode_attention(q, ref_cache, implementation="xla").astype(jnp.float32)
                out = f(q, *ops).astype(jnp.float32)
                err = jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref))
                res[name]["max_rel"] = float(err)
        except Exception as e:  # noqa: BLE001  (report and continue)
            res[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        log(f"{b}x{ctx} {name}: {res[name]}")

    # the defaults first, always: they are the "int2" row of the table and the plot
    variants = [{}] + [ov for ov in json.loads(args.variants or "[]") if ov]
    if args.variant_shapes and f"{b}x{ctx}" not in args.variant_shapes.split(","):
        variants = variants[:1]
    for i, ov in enumerate(variants):
        name = "int2" if i == 0 else "int2 " + json.dumps(ov, sort_keys=True)
        ov = dict(ov)
        cv = int2_cache(ov.pop("param_dtype", args.param_dtype))  # a cache option
        f = lambda qq, c, ov=ov: oj.decode_attention(qq, c, implementation="pallas", **ov)  # noqa: E731
        timed_row(name, f, (cv,), int2_bytes(cv), cv, opts=ov)
    peers = {  # name -> (fn(q, *operands), operands)
        "bf16 pallas (ours)": (
            lambda qq, c: oj.decode_attention(qq, c, implementation="pallas"),
            (cb,),
        ),
        "xla einsum bf16": (xla_bf16, (k_hm, v_hm)),
        "cudnn bf16": (
            lambda qq, kk, vv: jax.nn.dot_product_attention(
                qq[:, None], kk, vv, implementation="cudnn"
            )[:, 0],
            (k_bl, v_bl),
        ),
    }
    if not args.no_gqa:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu import decode_attention as gqa_mod
        for ks in (int(x) for x in args.gqa_splits.split(",")):
            if ctx % ks or (ctx // ks) % 128:
                continue
            peers[f"pallas gqa k_splits={ks}"] = (
                lambda qq, kk, vv, ks=ks: gqa_mod.gqa(qq, kk, vv, k_splits=ks),
                (k_bl, v_bl),
            )
    mosaics = [
        (n, kn, bits)
        for n, kn, bits in (("mosaic int2", args.mosaic, 2), ("mosaic int4", args.mosaic4, 4))
        if kn is not None
    ] + [(f"mosaic int2 {json.dumps(kn, sort_keys=True)}", kn, 2) for kn in args.mosaic_variants]
    if args.triton4:  # the Triton INT4 kernel over a planar INT4 cache
        c4 = oj.init_cache(oj.preset("oscar", bits=4), batch=b, max_len=ctx, num_kv_heads=HKV,
                           head_dim=D)  # fmt: skip
        c4 = jax.jit(oj.prefill)(c4, k, v)
        f = lambda qq, c: oj.decode_attention(qq, c, implementation="pallas")  # noqa: E731
        timed_row("triton int4", f, (c4,), int2_bytes(c4), c4)
        del c4
    for mos_name, knobs, bits in mosaics:
        (f, ops), mbytes = mosaic_call(b, ctx, k, v, knobs, bits)
        timed_row(mos_name, f, ops, mbytes, ops[-1], opts=knobs)
        del f, ops
    for name, (f, ops) in peers.items():
        timed_row(name, f, ops, bf_bytes)
    gq = {n: r for n, r in res.items() if n.startswith("pallas gqa") and "ms" in r}
    if gq:
        best = min(gq, key=lambda n: gq[n]["ms"])
        res["pallas gqa (best)"] = dict(gq[best], which=best)
    if args.check:
        ref = oj.decode_attention(q, c2, implementation="xla").astype(jnp.float32)
        out = oj.decode_attention(q, c2, implementation="pallas").astype(jnp.float32)
        res["check_int2_max_rel"] = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
        ref = xla_bf16(q, k_hm, v_hm).astype(jnp.float32)
        out = oj.decode_attention(q, cb, implementation="pallas").astype(jnp.float32)
        res["check_bf16_max_rel"] = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
        log(
            f"{b}x{ctx} checks: int2 {res['check_int2_max_rel']:.2e} "
            f"bf16 {res['check_bf16_max_rel']:.2e}"
        )
    return res


def label(name: str) -> str:
    """A result row's name as tables and plots show it ("int2" is the Triton INT2 kernel)."""
    return "triton int2" if name == "int2" else name


def table(results, copy_bw, header):
    bf_cols = ["bf16 pallas (ours)", "xla einsum bf16", "cudnn bf16", "pallas gqa (best)"]
    int_cols = [c for c in ("mosaic int2", "int2", "mosaic int4", "triton int4")
                if any(c in r for r in results.values())]  # fmt: skip
    int_cols += sorted({c for r in results.values() for c in r if c.startswith("mosaic int2 ")})
    cols = int_cols + bf_cols
    names = {c: label(c) for c in cols}
    extra_h = [f"fastest BF16 / {names[c]} | {names[c]} GB/s (% of copy)" for c in int_cols]
    lines = [
        header,
        "",
        "| batch x context | "
        + " | ".join(names[c] for c in cols)
        + " | "
        + " | ".join(extra_h)
        + " |",
        "|" + "---|" * (len(cols) + 1 + 2 * len(int_cols)),
    ]
    for shape, res in results.items():
        cells = [f"{res[c]['ms']:.4f} ms" if "ms" in res.get(c, {}) else "n/a" for c in cols]
        bf = [res[c]["ms"] for c in bf_cols if "ms" in res.get(c, {})]
        extra = []
        for c in int_cols:
            if "ms" in res.get(c, {}) and bf:
                bw = res[c]["bytes"] / (res[c]["ms"] * 1e-3)
                extra += [
                    f"{min(bf) / res[c]['ms']:.2f}x",
                    f"{bw / 1e9:.0f} ({100 * bw / copy_bw:.0f}%)",
                ]
            else:
                extra += ["n/a", "n/a"]
        lines.append(f"| {shape} | " + " | ".join(cells + extra) + " |")
    lines.append("")
    lines.append(f"Device copy (x -> -x, read + write, device-side): {copy_bw / 1e9:.0f} GB/s.")
    return "\n".join(lines)


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = ["mosaic int2", "int2", "mosaic int4", "triton int4", "bf16 pallas (ours)",
             "xla einsum bf16", "cudnn bf16", "pallas gqa (best)"]  # fmt: skip
    fig, ax = plt.subplots(figsize=(8, 4))
    colors = dict(zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    markers = "os^Dv"  # one marker per batch size, one colour per implementation
    for i, b in enumerate(sorted({int(s.split("x")[0]) for s in results})):
        rows = sorted(
            (int(s.split("x")[1]), r) for s, r in results.items() if int(s.split("x")[0]) == b
        )
        for n in names:
            pts = [(c, r[n]["ms"]) for c, r in rows if "ms" in r.get(n, {})]
            if len(pts):
                ax.plot(*zip(*pts, strict=True), marker=markers[i % len(markers)],
                        color=colors[n], label=f"{label(n)} (batch {b})")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length")
    ax.set_ylabel("ms per decode step (one layer)")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def layer_name(layer: str) -> str:
    """'32x8x128' -> '32 q heads, 8 KV heads, D 128 (Qwen3-8B shape)'."""
    hq, hkv, d = (int(x) for x in layer.split("x"))
    return f"{hq} q heads, {hkv} KV heads, D {d}" + (
        " (Qwen3-8B shape)" if (hq, hkv, d) == (32, 8, 128) else "")  # fmt: skip


def render_saved(paths, out):
    """Merge earlier runs' results (per shape, later paths win) into one table and plot."""
    saved = [json.load(open(p)) for p in paths]
    results = {}
    for d in saved:
        results.update(d["results"])
    rates = ", ".join(f"{d['copy_bytes_per_s'] / 1e9:.0f}" for d in saved)
    header = (
        f"Decode attention, one layer of {layer_name(saved[0].get('layer', '32x8x128'))}, "
        f"{saved[0]['device']}, jax {saved[0]['jax']}; merged from {', '.join(paths)} "
        f"(device copies in those runs: {rates} GB/s; the table uses the first)."
    )
    md = table(results, saved[0]["copy_bytes_per_s"], header)
    with open(os.path.join(out, "decode_bench.md"), "w") as f:
        f.write(md + "\n")
    plot(results, os.path.join(out, "decode_bench.png"))
    print(md)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/decode")
    ap.add_argument("--shapes", default=",".join(f"{b}x{c}" for b, c in SHAPES))
    ap.add_argument("--variants", default="",
                    help="JSON list of INT2 option dicts (decode options; 'param_dtype' picks "
                    "the cache's scale dtype), each timed beside the defaults, which are "
                    "always the 'int2' row")  # fmt: skip
    ap.add_argument("--param-dtype", default=oj.KVQuantConfig().param_dtype,
                    help="INT2 cache scales / zeros (default: the config's)")  # fmt: skip
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--unroll", type=int, default=8, help="chained calls per loop iteration")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--no-gqa", action="store_true")
    ap.add_argument("--mosaic", type=json.loads, default=None,
                    help="JSON dict of Int2DecodeConfig knobs: also time the Mosaic GPU INT2 "
                    "kernel (jax >= 0.11.2, Hopper), '{}' for its defaults (merge 'auto', "
                    "the backend's); '{\"merge\": \"xla\"}' merges in XLA")  # fmt: skip
    ap.add_argument(
        "--mosaic4",
        type=json.loads,
        default=None,
        help="as --mosaic, for the Mosaic GPU kernel over an INT4 cache",
    )
    ap.add_argument(
        "--triton4", action="store_true", help="also time the Triton kernel over an INT4 cache"
    )
    ap.add_argument("--mosaic-variants", type=json.loads, default=[],
                    help="JSON list of knob dicts: more Mosaic INT2 rows, e.g. "
                    "'[{\"merge\": \"fused\"}]'")  # fmt: skip
    ap.add_argument("--layer", default="32x8x128",
                    help="query heads x KV heads x head_dim (Qwen3-8B: 32x8x128)")  # fmt: skip
    ap.add_argument("--copy-mib", type=int, default=2048)
    ap.add_argument("--gqa-splits", default="8,16,32", help="k_splits tried for Pallas gqa")
    ap.add_argument("--variant-shapes", default="", help="shapes that run all --variants")
    ap.add_argument(
        "--from-json", default="", help="comma-separated earlier decode_bench.json: re-render "
        "their table and plot into --out (later files win per shape; copy rate of the first)"
    )  # fmt: skip
    args = ap.parse_args()
    global HQ, HKV, D
    HQ, HKV, D = (int(x) for x in args.layer.split("x"))
    if HQ % HKV:
        raise ValueError(f"{args.layer=} must have query heads a multiple of KV heads")
    os.makedirs(args.out, exist_ok=True)
    if args.from_json:
        return render_saved(args.from_json.split(","), args.out)
    logf = open(os.path.join(args.out, "bench_decode.log"), "a")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    dev = jax.devices()[0]
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    log(f"jax {jax.__version__} device {dev.device_kind} date {now}")
    bw = copy_bandwidth(args.copy_mib << 20, args.reps, args.calls, args.unroll)
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    results = {}

    def save():  # after every shape: partial results survive a timeout
        meta = dict(device=dev.device_kind, jax=jax.__version__, unroll=args.unroll,
                    layer=args.layer)  # fmt: skip
        with open(os.path.join(args.out, "decode_bench.json"), "w") as f:
            json.dump(dict(copy_bytes_per_s=bw, results=results, **meta), f, indent=1)

    for s in args.shapes.split(","):
        b, c = (int(x) for x in s.split("x"))
        log(f"heuristic for {s}: {pcfg.choose_config(b, HKV, c, 32)}")
        results[s] = run_shape(b, c, args, log)
        save()
    header = (
        f"Decode attention, one layer of {layer_name(args.layer)}, "
        f"{dev.device_kind}, jax {jax.__version__}, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}; device-side per-call time "
        f"(median of {args.calls} host calls of {args.reps} loop steps x {args.unroll} "
        "chained calls)."
    )
    md = table(results, bw, header)
    with open(os.path.join(args.out, "decode_bench.md"), "w") as f:
        f.write(md + "\n")
    plot(results, os.path.join(args.out, "decode_bench.png"))
    print(md)


if __name__ == "__main__":
    main()
