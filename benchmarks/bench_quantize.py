"""Fused Pallas encoder vs the XLA path: correctness on the device and device-side timing.

    python3 -m benchmarks.bench_quantize --check --bench --out out/quantize

``--check`` compiles the kernel for a representative set of configs and compares it
with ``encode_keys_xla`` / ``encode_values_xla`` run on the same device (code
mismatches, ulp distance of scales/zeros/norms). ``--bench`` times encoding K and V
of a Qwen3-8B-shaped prefill (batch 1, 8 KV heads, head_dim 128, bf16, oscar, 2 bits)
for 32K and 128K tokens as the device time of each encode's kernels, summed from a
profiler trace of 10 calls (``kernel_time``: host dispatch and the gaps between XLA's
kernels excluded, which favours the many-kernel XLA path); ``--chain`` adds the slope of
chained encodes inside one jit (``chain_time``). Bandwidth = (bytes read + written) /
kernel time, against a 1 GiB device copy timed the same way (the issue's yardstick) and,
as a second figure, against a copy moving the encoder's own bytes (its fixed costs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import oscar_jax as oj  # noqa: E402
from benchmarks.profile_decode import profile  # noqa: E402
from oscar_jax import hadamard  # noqa: E402
from pallas_kernels.quantize import triton as qk  # noqa: E402


def make_kv(key, shape, dtype):
    """Gaussian keys/values with a few massive channels and low-norm sink tokens."""
    kk, kv = jax.random.split(key)
    d = shape[-1]
    boost = jnp.ones((d,), jnp.float32).at[jnp.array([1, d // 3, d - 2])].set(25.0)
    k = jax.random.normal(kk, shape, jnp.float32) * boost
    k = k.at[:, :, 0].multiply(0.02).at[:, :, shape[2] // 2].multiply(0.05)
    v = jax.random.normal(kv, shape, jnp.float32)
    return k.astype(dtype), v.astype(dtype)


def ulp_dist(a, b) -> int:
    a, b = np.asarray(a), np.asarray(b)
    nbits = a.dtype.itemsize * 8
    it = {16: np.int16, 32: np.int32}[nbits]

    def key(x):
        i = x.view(it).astype(np.int64)
        return np.where(i < 0, -(i & ((1 << (nbits - 1)) - 1)), i)

    return int(np.max(np.abs(key(a) - key(b)))) if a.size else 0


def compare(ek, ev, rk, rv, bits):
    out = {}
    for name, a, b in (("k", ek.codes, rk.codes), ("v", ev.codes, rv.codes)):
        ua = np.asarray(oj.unpack(a, bits)).astype(int)
        ub = np.asarray(oj.unpack(b, bits)).astype(int)
        out[f"{name}_code_mismatch"] = int(np.sum(ua != ub))
        out[f"{name}_code_maxdiff"] = int(np.max(np.abs(ua - ub)))
        out[f"{name}_codes"] = int(ua.size)
    for name, a, b in (("k_scale", ek.scale, rk.scale), ("k_zero", ek.zero, rk.zero),
                       ("k_norm", ek.norm, rk.norm), ("v_scale", ev.scale, rv.scale),
                       ("v_zero", ev.zero, rv.zero)):  # fmt: skip
        out[f"{name}_ulp"] = ulp_dist(a, b)
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
        out[f"{name}_rel"] = float(np.max(np.abs(a32 - b32)) / max(np.max(np.abs(b32)), 1e-30))
    return out


CHECKS = [  # (method, bits, D, G, dtype, overrides, T)
    ("oscar", 2, 128, 32, "bfloat16", {}, 96),
    ("oscar", 2, 128, 32, "bfloat16", {"norm_granularity": "per_token"}, 160),
    ("oscar", 4, 128, 32, "float16", {}, 96),
    ("oscar", 2, 64, 64, "float32", {}, 192),
    ("oscar", 4, 256, 128, "bfloat16", {}, 384),
    ("oscar", 2, 256, 32, "float32", {"norm_granularity": "per_token"}, 96),
    ("kivi", 2, 128, 32, "bfloat16", {}, 96),
    ("rotation_only", 4, 64, 32, "bfloat16", {}, 96),
    ("ots_only", 2, 128, 64, "float16", {}, 192),
    ("oscar", 2, 128, 32, "bfloat16", {"rotation": "randomized_hadamard"}, 96),
    ("oscar", 2, 128, 32, "bfloat16", {"rotation": "random_orthogonal"}, 96),
    ("oscar", 2, 128, 32, "bfloat16", {"param_dtype": "float32"}, 4096),
]


def xla_division_check(log):
    """Does XLA on this device divide IEEE-exactly (as numpy does)?"""
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(7), (1 << 20,), jnp.float32))
    y = np.asarray(jax.random.uniform(jax.random.PRNGKey(8), (1 << 20,), jnp.float32, 0.1, 9))
    q = np.asarray(jax.jit(lambda a, b: a / b)(x, y))
    r = np.asarray(jax.jit(lambda b: 1.0 / b)(y))
    s = np.asarray(jax.jit(lambda a: jnp.sqrt(a))(y))
    out = dict(
        div_mismatch=int(np.sum(q != x / y)),
        rcp_mismatch=int(np.sum(r != 1 / y)),
        sqrt_mismatch=int(np.sum(s != np.sqrt(y))),
        n=x.size,
    )
    log(json.dumps(out))
    return out


def run_checks(log, limit=None):
    rows = [xla_division_check(log)]
    for i, (method, bits, d, g, dt, ov, t) in enumerate(CHECKS[:limit]):
        cfg = oj.preset(method, bits=bits, group_size=g, **ov)
        k, v = make_kv(jax.random.PRNGKey(i), (2, 4, t, d), jnp.dtype(dt))
        row = dict(method=method, bits=bits, D=d, G=g, dtype=dt, T=t, **ov)
        try:
            ek, ev = qk.encode(k, v, cfg, interpret=False)
            rk, rv = jax.jit(
                lambda k, v, c=cfg: (oj.encode_keys_xla(k, c), oj.encode_values_xla(v, c))
            )(k, v)
            row.update(compare(ek, ev, rk, rv, bits))
            fk, fv = qk.encode(k, v, cfg, interpret=False, exact_division=False)
            row["fastdiv_vs_xla"] = compare(fk, fv, rk, rv, bits)
            cpu = jax.devices("cpu")[0]  # XLA on the host CPU divides IEEE-exactly
            with jax.default_device(cpu):
                kc, vc = jax.device_put(k, cpu), jax.device_put(v, cpu)
                ck, cv = oj.encode_keys_xla(kc, cfg), oj.encode_values_xla(vc, cfg)
            row["kernel_vs_xla_cpu"] = compare(ek, ev, ck, cv, bits)
            row["xla_gpu_vs_xla_cpu"] = compare(rk, rv, ck, cv, bits)
        except Exception as e:  # report every config, keep going
            row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        log(json.dumps(row))
        rows.append(row)
    return rows


def chain_fn(enc):
    """A jitted loop of n encodes (n traced), each waiting for the previous one.

    Each iteration passes k, v and the previous output through an
    ``optimization_barrier`` and encodes k, v again; the output is the loop's carry, so
    XLA computes every encode whole. (Feeding a code of the previous output into one key
    instead makes XLA rewrite all of k every encode, a ``loop_dynamic_update_slice_fusion``
    that would count as encode time. Unrolled encodes inside one iteration are no remedy:
    XLA drops the barriers and merges the identical encodes.)
    """

    @jax.jit
    def run(k, v, n):  # n traced: one compile serves every chain length
        def body(i, c):
            k, v, out = jax.lax.optimization_barrier(c)
            return k, v, enc(k, v)

        return jax.lax.fori_loop(0, n, body, (k, v, enc(k, v)))[2]

    return run


def chain_time(enc, args, n1=2, n2=12, calls=5):
    """Device seconds per encode: slope between chains of n1 and n2 encodes in one jit
    (it includes the while loop's cost per iteration)."""
    run = chain_fn(enc)
    meds = []
    for n in (n1, n2):
        jax.block_until_ready(run(*args, n))
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(run(*args, n))
            ts.append(time.perf_counter() - t0)
        meds.append(statistics.median(ts))
    return (meds[1] - meds[0]) / (n2 - n1)


def kernel_time(fn, args, calls=10, warm_s=0.3) -> tuple[float, dict[str, float]]:
    """Device seconds of fn(*args)'s GPU kernels per call (their sum: gaps between them
    and host dispatch excluded) and each kernel's median microseconds per call
    (``profile_decode.profile``: a profiler trace of ``calls`` separate jitted calls);
    (nan, {}) without a GPU. The function first runs for ``warm_s`` seconds, a guard
    against a clock still ramping after a compile."""
    fn = jax.jit(fn)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        jax.block_until_ready(fn(*args))
    per = profile(fn, args, calls)
    return (sum(per.values()) * 1e-6 if per else float("nan")), per


VARIANTS = {  # name -> encode options (None: the XLA path; "dense": XLA, matmul rotation)
    "xla": None,
    "xla dense": "dense",
    "pallas": {},  # the defaults of ``pallas_kernels.quantize.triton.encode``
    "pallas fastdiv": dict(exact_division=False),
}
_KNOBS = {"gpb": "groups_per_block", "w": "num_warps", "s": "num_stages", "r": "max_registers"}


def variant_options(name: str):
    """Encode options of a variant: a VARIANTS name, or "pallas" (or "triton") followed by knobs
    such as ``gpb4 w2 s2 r144`` (groups per block, warps, stages, register cap; ``r0``: none) and
    ``fastdiv``."""
    if name in VARIANTS:
        return VARIANTS[name]
    head, *knobs = name.split()
    opts = {}
    for knob in knobs:
        key, num = knob.rstrip("0123456789"), knob.lstrip("abcdefghijklmnopqrstuvwxyz")
        if knob == "fastdiv":
            opts["exact_division"] = False
        elif key in _KNOBS and num and key + num == knob:
            opts[_KNOBS[key]] = int(num) if knob != "r0" else None  # r0: no register cap
        else:
            head = None
    if head not in ("pallas", "triton"):
        raise ValueError(f"variant {name!r} must be one of {list(VARIANTS)} or 'pallas gpb4 w2 s2'")
    return opts


def run_bench(log, tokens=(32768, 131072), variants=None, chain=False, warm_s=0.3):
    """Each variant's device time per encode: its kernels' sum from a profiler trace
    (``kernel_time``), and with ``chain`` also ``chain_time``'s slope. Bandwidth = bytes
    read + written over the kernel time, against a 1 GiB copy (x -> -x) timed the same way.
    """
    cfg = oj.preset("oscar", bits=2)
    x = jnp.ones((1 << 28,), jnp.float32)
    copy_s, _ = kernel_time(lambda y: -y, (x,), warm_s=warm_s)
    bw_copy = 2 * x.nbytes / copy_s
    del x
    log(f"copy bandwidth (x -> -x, 1 GiB, read+write, kernel time): {bw_copy / 1e12:.3f} TB/s")
    rows = []
    for t in tokens:
        k, v = make_kv(jax.random.PRNGKey(0), (1, 8, t, 128), jnp.bfloat16)
        ek, ev = oj.encode_keys_xla(k, cfg), oj.encode_values_xla(v, cfg)
        nbytes = 2 * k.nbytes + sum(x.nbytes for x in (*ek, *ev))
        xm = jnp.ones((nbytes // 8,), jnp.float32)  # a copy moving the encoder's bytes
        bw_matched = 2 * xm.nbytes / kernel_time(lambda y: -y, (xm,), warm_s=warm_s)[0]
        del xm
        log(f"T={t}: copy of the same {nbytes / 2**20:.1f} MiB: {bw_matched / 1e12:.3f} TB/s")
        for name, opts in (variants or VARIANTS).items():
            if opts is None or opts == "dense":
                enc = lambda k, v: (oj.encode_keys_xla(k, cfg), oj.encode_values_xla(v, cfg))
            else:
                enc = lambda k, v, o=opts: qk.encode(k, v, cfg, interpret=False, **o)
            dense_default = hadamard.DENSE_DEFAULT
            try:
                if opts == "dense":  # the rotation as one [D, D] matmul instead of butterflies
                    hadamard.DENSE_DEFAULT = True
                sec, kernels = kernel_time(enc, (k, v), warm_s=warm_s)
                row = dict(
                    T=t,
                    variant=name,
                    ms=sec * 1e3,
                    tbps=nbytes / sec / 1e12,
                    frac_copy=nbytes / sec / bw_copy,
                    frac_copy_matched=nbytes / sec / bw_matched,
                    mbytes=nbytes / 2**20,
                    kernels_us=kernels,
                )
                if chain:
                    row["chain_ms"] = chain_time(enc, (k, v)) * 1e3
            except Exception as e:
                row = dict(T=t, variant=name, error=f"{type(e).__name__}: {str(e)[:800]}")
            finally:
                hadamard.DENSE_DEFAULT = dense_default
            log(json.dumps(row))
            rows.append(row)
    return dict(copy_tbps=bw_copy / 1e12, rows=rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--out", default="out/quantize")
    ap.add_argument("--tokens", default="32768,131072", help="comma-separated prefill lengths")
    ap.add_argument(
        "--variants",
        default="",
        help="comma-separated variants, e.g. 'pallas gpb4 w2 s2' (see variant_options)",
    )
    ap.add_argument("--chain", action="store_true", help="also time chained encodes in one jit")
    ap.add_argument("--checks", type=int, default=None, help="run only the first N checks")
    ap.add_argument("--warm", type=float, default=0.3, help="seconds of calls before a trace")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    logf = open(os.path.join(a.out, "quantize_log.txt"), "a")

    def log(s):
        print(s, flush=True)
        logf.write(s + "\n")
        logf.flush()

    res = dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        device=str(jax.devices()[0]),
        jax=jax.__version__,
    )
    if a.check:
        res["checks"] = run_checks(log, a.checks)
    if a.bench:
        names = [n for n in a.variants.split(",") if n] or list(VARIANTS)
        if "xla" not in names:
            names.insert(0, "xla")
        tokens = tuple(int(x) for x in a.tokens.split(","))
        res["bench"] = run_bench(
            log, tokens, {n: variant_options(n) for n in names}, a.chain, a.warm
        )
        xla = {r["T"]: r["ms"] for r in res["bench"]["rows"] if r["variant"] == "xla" and "ms" in r}
        print(
            "\n| T | variant | kernel ms | chained ms | TB/s | of copy | of same-size copy "
            "| vs XLA |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in res["bench"]["rows"]:
            if "ms" in r:
                chained = r.get("chain_ms", float("nan"))
                print(
                    f"| {r['T']} | {r['variant']} | {r['ms']:.4f} | {chained:.4f} | "
                    f"{r['tbps']:.2f} | {r['frac_copy']:.2f} | {r['frac_copy_matched']:.2f} | "
                    f"{xla.get(r['T'], float('nan')) / r['ms']:.1f}x |"
                )
    with open(os.path.join(a.out, "quantize.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
