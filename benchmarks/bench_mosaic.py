# ruff: noqa: E501, B905, B023  (wide result tables; the jitted closures run in their loop)
"""Device-side timing (CUPTI via jax.experimental.mosaic.gpu.profiler.measure; medians) of
the Mosaic GPU INT2 / INT4 decode (variant key bits=4) against cuDNN BF16, XLA einsum BF16 and an XLA copy, in one run.
Calls: "callX" the partials kernel + the ring and merge in XLA; "call2" + the ring and merge in
a second Mosaic launch; "call3" the ring as the partials kernel's last split + a second launch
that merges the splits (``ring_in_kernel=True``); "call1" (warp kernel variants) the one-launch
call, one split a (b, h) walking its records and the ring and storing the output
(``int2_decode_attention_1launch``). These take the query rotated and in f32;
"3gemm" is call3 as the backend calls it with a GEMM rotation: a bfloat16 query in the
original basis, rotated by a GEMM in XLA first (its kernels counted); the warp kernel's rows
add "2rot", "3rot" and "1rot", call2, call3 and call1 from that bfloat16 query rotated by the
kernel itself (``signs``, the backend's choice for the Hadamard rotations). These four take the
lengths as an argument and get nq from them as the backend's call does (an XLA fusion, or the
kernels with ``prep=kernel``); the other columns take nq as a constant.

Shapes: B x L tokens, 32 query heads, 8 KV heads, head_dim 128 (``HEAD_DIM=64`` or ``256`` in
the environment for the other head sizes). INT2: L - 128 quantized
tokens + a 160-slot ring with 128 valid. For small shapes every implementation runs over
``copies`` distinct input sets per timed call (sum of kernel times / copies), so that the
working set is >= ~100 MB and not L2-resident; where that would take more than
``FLUSH_ABOVE`` (4) copies, one set with a 256 MiB write before each run (its kernels left
out of the sum).

usage: python3 -m benchmarks.bench_mosaic SHAPE[,SHAPE..] VARIANT[;VARIANT..]
  SHAPE = BxL (e.g. 1x131072); VARIANT = comma list of k=v for Int2DecodeConfig over the
  backend's default_config for the shape: capacity L, B x 8 rows, e.g.
  "stage=stream;block_tokens=256,waves=4" or "ring_query=pair".
  A "pdl=true" variant's sums mislead: CUPTI counts the time a dependent launch waits in
  the kernel (``griddepcontrol.wait``) as its own; time it with ``bench_decode``'s chained
  calls (``--mosaic-variants '[{"pdl": true}]'``).
"""

import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

import oscar_jax as oj
from oscar_jax import hadamard, quant
from pallas_kernels.decode import mosaic as K

HQ, HKV, RING = 32, 8, 160
# the method's Hadamard rotation of keys and query; its G 32 and R 128 (RING = R + G slots)
# also give nq from the lengths
ROTATION = oj.preset("oscar", bits=2)
DH = int(os.environ.get("HEAD_DIM", 128))
ITERS = int(os.environ.get("ITERS", 20))
rows = []


FLUSH = {}  # the L2 flush: its buffer and the names of its kernels


def flushed(f):
    """f preceded, in the same program, by a write of 256 MiB (5x the L2) that its inputs
    wait on (an optimization barrier), so that each timed run reads them from DRAM."""
    if not FLUSH:
        FLUSH["buf"] = jnp.zeros((64 * 1024 * 1024,), jnp.uint32)
        fl = jax.jit(lambda x: x ^ 1)
        jax.block_until_ready(fl(FLUSH["buf"]))
        _, ts = profiler.measure(fl, aggregate=False, iterations=2)(FLUSH["buf"])
        FLUSH["names"] = {n for it in ts for n, _ in it}

    def g(buf, *args):
        buf, args = jax.lax.optimization_barrier((buf ^ 1, args))
        return buf, f(*args)

    return jax.jit(g)


def med(f, *args, iters=ITERS, detail=False, flush=False):
    """Median device time of f(*args) in us (CUPTI; the sum of its kernels a run), or with
    ``detail`` a kernel name -> median dict; with ``flush`` the L2 is flushed before each
    run and the flush's own kernels are left out."""
    if flush:
        f = flushed(f)
        args = (FLUSH["buf"], *args)
    f(*args)  # compile + warm
    jax.block_until_ready(f(*args))
    _, ts = profiler.measure(f, aggregate=not (detail or flush), iterations=iters)(*args)
    if not (detail or flush):
        return statistics.median(ts) * 1e3  # us
    runs = [[(n, t) for n, t in it if n not in FLUSH.get("names", ())] for it in ts]
    if not detail:
        return statistics.median(sum(t for _, t in it) for it in runs) * 1e3
    agg = {}
    for it in runs:
        for name, t in it:
            agg.setdefault(name, []).append(t)
    return {n: statistics.median(v) * 1e3 for n, v in agg.items()}


def parse_variant(s):
    kw = {}
    flags = {f.name for f in dataclasses.fields(K.Int2DecodeConfig) if f.type in ("bool", bool)}
    for item in filter(None, s.split(",")):
        k, v = item.split("=")
        if k in ("stage", "unpack", "kernel", "fold", "ring_query", "prep"):
            kw[k] = v
        else:  # "pdl=1" / "pdl=true" for the bool fields
            kw[k] = v.lower() in ("1", "true") if k in flags else int(v)
    return kw  # "bits" (2 or 4) picks the cache; the rest are Int2DecodeConfig fields


def random_cache(key, b, h, lq, nq, *, pdt=jnp.float16, sinks=True, bits=2):
    """A random planar INT2 (or INT4) cache (zero past nq, as the repo's invariants) with planted
    low-norm sink tokens (norm 0.02 at token 0 and a few others) and a few tokens of very
    large norm (far-off scores that set the softmax max in one split only)."""
    ks_ = jax.random.split(key, 8)
    nq = jnp.asarray(nq, jnp.int32)
    tok = jnp.arange(lq)
    live = (tok[None, :] < nq[:, None])[:, None, :]  # [B, 1, Lq]
    top = 1 << bits
    kc = jax.random.randint(ks_[0], (b, h, lq, DH), 0, top).astype(jnp.uint8)
    vc = jax.random.randint(ks_[1], (b, h, lq, DH), 0, top).astype(jnp.uint8)
    kc = jnp.where(live[..., None], kc, 0)
    vc = jnp.where(live[..., None], vc, 0)
    gl = (jnp.arange(lq // K.G)[None, :] * K.G < nq[:, None])[:, None, :, None]
    k_scale = jnp.where(
        gl, jax.random.uniform(ks_[2], (b, h, lq // K.G, DH), minval=0.02, maxval=0.2), 0
    )
    k_zero = jnp.where(
        gl, -(top - 1) / 2 * k_scale + 0.05 * jax.random.normal(ks_[3], (b, h, lq // K.G, DH)), 0
    )
    norm = jax.random.uniform(ks_[4], (b, h, lq), minval=0.5, maxval=2.0)
    if sinks:
        sink = (tok % 997 == 0) | (tok == 1)
        norm = jnp.where(sink[None, None], 0.02, norm)
        big = tok % 1531 == 700
        norm = jnp.where(big[None, None], 12.0, norm)
    norm = jnp.where(live, norm, 0)
    v_scale = jnp.where(
        live[..., None],
        jax.random.uniform(ks_[5], (b, h, lq, DH // K.G), minval=0.05, maxval=1.0),
        0,
    )
    v_zero = jnp.where(
        live[..., None],
        -(top - 1) / 2 * v_scale + 0.3 * jax.random.normal(ks_[6], (b, h, lq, DH // K.G)),
        0,
    )
    c = dict(
        k_codes=quant.pack(kc, bits), v_codes=quant.pack(vc, bits),
        k_scale=k_scale.astype(pdt), k_zero=k_zero.astype(pdt), k_norm=norm.astype(jnp.float32),
        v_scale=v_scale.astype(pdt), v_zero=v_zero.astype(pdt),
    )  # fmt: skip
    return c


def run_shape(b, L, variants, copies, flush=False):
    g = HQ // HKV
    nq_n = L - 128
    key = jax.random.PRNGKey(b * 7 + L)
    # --- BF16 baselines
    kb = [
        jax.random.normal(jax.random.fold_in(key, i), (b, L, HKV, DH), jnp.bfloat16)
        for i in range(copies)
    ]
    vb = [
        jax.random.normal(jax.random.fold_in(key, 100 + i), (b, L, HKV, DH), jnp.bfloat16)
        for i in range(copies)
    ]
    qb = jax.random.normal(jax.random.fold_in(key, 999), (b, 1, HQ, DH), jnp.bfloat16)

    @jax.jit
    def cudnn(q, ks, vs):
        return [
            jax.nn.dot_product_attention(q, k, v, implementation="cudnn") for k, v in zip(ks, vs)
        ]

    kh = [jnp.swapaxes(k, 1, 2) for k in kb]  # [B, H, L, D] for the einsum version
    vh = [jnp.swapaxes(v, 1, 2) for v in vb]
    del kb, vb

    @jax.jit
    def xla(q, ks, vs):
        qg = q.reshape(b, HKV, g, DH)
        outs = []
        for k, v in zip(ks, vs):
            s = jnp.einsum("bhgd,bhtd->bhgt", qg, k, preferred_element_type=jnp.float32) / np.sqrt(
                DH
            )
            p = jax.nn.softmax(s, axis=-1)
            outs.append(
                jnp.einsum(
                    "bhgt,bhtd->bhgd", p.astype(jnp.bfloat16), v, preferred_element_type=jnp.float32
                )
            )
        return outs

    bf16_bytes = 2 * b * L * HKV * DH * 2
    kbt = [jnp.swapaxes(k, 1, 2) for k in kh]
    vbt = [jnp.swapaxes(v, 1, 2) for v in vh]
    t_cudnn = med(cudnn, qb, kbt, vbt, flush=flush) / copies
    del kbt, vbt
    t_xla = med(xla, qb, kh, vh, flush=flush) / copies
    del kh, vh
    # --- copy
    xc = jax.random.normal(key, (64 * 1024 * 1024,), jnp.float32)  # 256 MiB
    t_copy = med(jax.jit(lambda x: x + 1.0), xc)
    copy_rate = 2 * xc.nbytes / t_copy / 1e3  # GB/s
    del xc
    q = jax.random.normal(jax.random.fold_in(key, 7), (b, HKV, g, DH), jnp.float32)
    k_res = jax.random.normal(key, (b, HKV, RING, DH), jnp.bfloat16)
    v_res = jax.random.normal(key, (b, HKV, RING, DH), jnp.bfloat16)
    nq = jnp.full((b,), nq_n, jnp.int32)
    lengths = nq + 128  # 128 of the ring's slots hold tokens
    base = dict(
        shape=f"{b}x{L}",
        copies=copies,
        l2_flush=flush,
        cudnn_us=t_cudnn,
        xla_us=t_xla,
        copy_GBps=copy_rate,
        bf16_GBps_cudnn=bf16_bytes / t_cudnn / 1e3,
    )
    print(json.dumps(base), flush=True)
    sets_of = {}  # bits -> the INT2 / INT4 caches, built once

    def cache_sets(bits):
        if bits not in sets_of:
            sets_of.clear()  # one width's caches at a time
            sets_of[bits] = [random_cache(jax.random.fold_in(key, 500 + i), b, HKV, L,
                                          [nq_n] * b, bits=bits) for i in range(copies)]  # fmt: skip
        return sets_of[bits]

    for vs in variants:
        kw = parse_variant(vs)
        bits = kw.pop("bits", 2)
        # the backend's defaults for this shape (default_config: its capacity, batch rows and
        # GQA group), the variant's knobs over them
        cfg = dataclasses.replace(K.default_config(L, bits, DH, g, rows=b * HKV), **kw)
        bt = cfg.block_tokens
        layout = jax.jit(lambda c: K.fragment_layout(**c, block_tokens=bt))  # compiled once
        recs = [layout(c) for c in cache_sets(bits)]
        rec_l = [r for r, _ in recs]
        kn_l = [n for _, n in recs]
        # bytes the kernel must read: records + norms of the quantized tokens, q, ring
        nrec = -(-nq_n // 64)
        int2_bytes = (
            b * HKV * nrec * (K.record_words(bits, DH) * 4 + 64 * 4) + 2 * b * HKV * RING * DH * 2
        )

        @jax.jit
        def part(q, recs, kns):
            return [K.int2_decode_partials(q, r, n, nq, cfg=cfg) for r, n in zip(recs, kns)]

        @jax.jit
        def full(q, recs, kns):
            return [K.int2_decode_attention(q, q, r, n, nq, k_res, v_res, lengths, cfg=cfg)
                    for r, n in zip(recs, kns)]  # fmt: skip

        @jax.jit
        def full2(q, recs, kns):
            return [K.int2_decode_attention_2launch(q, q, r, n, nq, k_res, v_res, lengths, cfg=cfg)
                    for r, n in zip(recs, kns)]  # fmt: skip

        @jax.jit
        def full3(q, recs, kns):
            return [K.int2_decode_attention_2launch(q, q, r, n, nq, k_res, v_res, lengths, cfg=cfg,
                                                    ring_in_kernel=True)
                    for r, n in zip(recs, kns)]  # fmt: skip

        @jax.jit
        def full1(q, recs, kns):
            return [K.int2_decode_attention_1launch(q, q, r, n, nq, k_res, v_res, lengths, cfg=cfg)
                    for r, n in zip(recs, kns)]  # fmt: skip

        qb16 = q.astype(jnp.bfloat16)  # a model's query, original basis
        signs = hadamard.fwht_signs(ROTATION, DH)  # all ones: the plain Hadamard

        def counts(lens):
            """nq as the backend's call gets it from the lengths (a jit argument here, so not
            constant-folded): by an XLA fusion, or with prep="kernel" by the kernels."""
            if cfg.prep == "kernel" and cfg.kernel == "warp":
                return lens, ROTATION
            return K.quantized_of(lens, ROTATION), None

        @jax.jit
        def full3_gemm(q, recs, kns, lens):  # call3 with the query rotated by the GEMM in XLA
            q_rot = hadamard.rotate(q.astype(jnp.float32), ROTATION, dense=True)
            n_q, rule = counts(lens)
            return [K.int2_decode_attention_2launch(q, q_rot, r, n, n_q, k_res, v_res, lens,
                                                    cfg=cfg, ring_in_kernel=True, nq_of=rule)
                    for r, n in zip(recs, kns)]  # fmt: skip

        @jax.jit
        def full2_rot(q, recs, kns, lens):  # call2 with the warp kernel rotating the query
            n_q, rule = counts(lens)
            return [K.int2_decode_attention_2launch(q, None, r, n, n_q, k_res, v_res, lens,
                                                    cfg=cfg, signs=signs, nq_of=rule)
                    for r, n in zip(recs, kns)]  # fmt: skip

        @jax.jit
        def full3_rot(q, recs, kns, lens):  # call3 with the warp kernel rotating the query
            n_q, rule = counts(lens)
            return [K.int2_decode_attention_2launch(q, None, r, n, n_q, k_res, v_res, lens,
                                                    cfg=cfg, ring_in_kernel=True, signs=signs,
                                                    nq_of=rule)
                    for r, n in zip(recs, kns)]  # fmt: skip

        @jax.jit
        def full1_rot(q, recs, kns, lens):  # call1 with the warp kernel rotating the query
            n_q, rule = counts(lens)
            return [K.int2_decode_attention_1launch(q, None, r, n, n_q, k_res, v_res, lens,
                                                    cfg=cfg, signs=signs, nq_of=rule)
                    for r, n in zip(recs, kns)]  # fmt: skip

        nan = float("nan")
        rot = cfg.stage == "full" and cfg.kernel == "warp"
        try:
            t_part = med(part, q, rec_l, kn_l, flush=flush) / copies
            t_full = med(full, q, rec_l, kn_l, flush=flush) / copies
            t_full2 = (
                med(full2, q, rec_l, kn_l, flush=flush) / copies if cfg.stage == "full" else nan
            )
            t_full3 = (
                med(full3, q, rec_l, kn_l, flush=flush) / copies if cfg.stage == "full" else nan
            )
            # either kernel: the wgmma kernel's backend call is this one (no in-kernel rotation)
            t_gemm3 = (
                med(full3_gemm, qb16, rec_l, kn_l, lengths, flush=flush) / copies
                if cfg.stage == "full" else nan
            )  # fmt: skip
            t_rot2 = (
                med(full2_rot, qb16, rec_l, kn_l, lengths, flush=flush) / copies if rot else nan
            )
            t_rot3 = (
                med(full3_rot, qb16, rec_l, kn_l, lengths, flush=flush) / copies if rot else nan
            )
            t_full1 = med(full1, q, rec_l, kn_l, flush=flush) / copies if rot else nan
            t_rot1 = (
                med(full1_rot, qb16, rec_l, kn_l, lengths, flush=flush) / copies if rot else nan
            )
            det = med(full2, q, rec_l[:1], kn_l[:1], detail=True, iters=5, flush=flush)
            det3 = (
                med(full3, q, rec_l[:1], kn_l[:1], detail=True, iters=5, flush=flush)
                if cfg.stage == "full"
                else {}
            )
        except Exception as e:  # noqa: BLE001
            print(json.dumps(dict(shape=f"{b}x{L}", variant=vs, error=repr(e)[:600])), flush=True)
            continue
        fastest = min(t_cudnn, t_xla)
        row = dict(base, variant=vs, splits=cfg.num_splits(b, HKV, nrec * 64), kernel_us=t_part,
                   call_us=t_full, int2_MB=int2_bytes / 1e6,
                   kernel_GBps=int2_bytes / t_part / 1e3, kernel_frac_copy=int2_bytes / t_part / 1e3 / copy_rate,
                   call_frac_copy=int2_bytes / t_full / 1e3 / copy_rate,
                   x_vs_fastest_bf16_call=fastest / t_full, x_vs_cudnn_call=t_cudnn / t_full,
                   x_vs_xla_call=t_xla / t_full, call2_us=t_full2, x_vs_fastest_bf16_call2=fastest / t_full2,
                   call2_frac_copy=int2_bytes / t_full2 / 1e3 / copy_rate, kernels_call2=det,
                   call3_us=t_full3, x_vs_fastest_bf16_call3=fastest / t_full3,
                   x_vs_cudnn_call3=t_cudnn / t_full3, kernels_call3=det3,
                   call3_gemm_us=t_gemm3, call2_rot_us=t_rot2,
                   x_vs_fastest_bf16_call2_rot=fastest / t_rot2, call3_rot_us=t_rot3,
                   x_vs_fastest_bf16_call3_rot=fastest / t_rot3, call1_us=t_full1,
                   x_vs_fastest_bf16_call1=fastest / t_full1, call1_rot_us=t_rot1,
                   x_vs_fastest_bf16_call1_rot=fastest / t_rot1)  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
        del recs, rec_l, kn_l


if __name__ == "__main__":
    shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[1].split(",")]
    variants = sys.argv[2].split(";") if len(sys.argv) > 2 else [""]
    t0 = time.time()
    for b, L in shapes:
        # enough distinct input sets for >= ~100 MB a timed call; a shape that would need more
        # than FLUSH_ABOVE of them (each its own kernel instance to trace and compile) runs
        # one set with the L2 flushed before each run instead
        copies = min(int(os.environ.get("MAX_COPIES", 32)), -(-100_000_000 // (b * L * HKV * 100)))
        flush = copies > int(os.environ.get("FLUSH_ABOVE", 4))
        run_shape(b, L, variants, 1 if flush else max(1, copies), flush=flush)
    print(f"bench done in {time.time() - t0:.0f}s")
    print(
        f"{'shape':>9} {'variant':>30} {'kern':>6} {'callX':>6} {'call2':>6} {'call3':>6} {'GB/s':>5} {'%copy':>6} {'c2%cp':>6} {'cudnn':>6} {'xla':>6} {'xX':>5} {'x2':>5} {'x3':>5} {'3gemm':>6} {'2rot':>6} {'x2rot':>5} {'3rot':>6} {'x3rot':>5} {'call1':>6} {'1rot':>6} {'x1rot':>5}"
    )
    for r in rows:
        print(
            f"{r['shape']:>9} {r['variant'][:30]:>30} {r['kernel_us']:6.1f} {r['call_us']:6.1f} {r['call2_us']:6.1f} {r['call3_us']:6.1f} {r['kernel_GBps']:5.0f} "
            f"{100 * r['kernel_frac_copy']:5.1f}% {100 * r['call2_frac_copy']:5.1f}% {r['cudnn_us']:6.1f} {r['xla_us']:6.1f} {r['x_vs_fastest_bf16_call']:5.2f} {r['x_vs_fastest_bf16_call2']:5.2f} {r['x_vs_fastest_bf16_call3']:5.2f}"
            f" {r['call3_gemm_us']:6.1f} {r['call2_rot_us']:6.1f} {r['x_vs_fastest_bf16_call2_rot']:5.2f} {r['call3_rot_us']:6.1f} {r['x_vs_fastest_bf16_call3_rot']:5.2f} {r['call1_us']:6.1f} {r['call1_rot_us']:6.1f} {r['x_vs_fastest_bf16_call1_rot']:5.2f}"
        )
    if os.environ.get("OUT"):
        tag = os.environ.get("TAG", "bench")
        json.dump(rows, open(os.path.join(os.environ["OUT"], f"{tag}.json"), "w"), indent=1)
