"""Soak: N decode steps through one INT2 OScaR cache on CPU, against a token-by-token reference.

What runs (the bare cache, no model: a model would only add matmuls around the
same cache ops, and random K/V/q exercise every code path without a checkpoint):

* ``oj.preset("oscar", bits=2)`` (G = 32, R = 128, bf16 scales and norms), cache
  dtype float32, batch 2, 2 KV heads, 4 query heads (GQA 2), head_dim 64,
  ``max_len`` = steps + 64. Row 1 starts with a 45-token prefill, row 0 empty, so
  the rows flush at different steps; each row flushes a group every 32 steps once
  past R + G tokens (every group boundary), 625 flushes per row over 20,000 steps.
* Each step: fresh random k, v [B, H, D] and q [B, Hq, D] (keys with two massive
  channels and a low-norm sink every 97 tokens), ``oj.append`` then
  ``oj.decode_attention(implementation="xla")``.
* Reference, built token by token independently of the cache: every token is kept
  exactly; when a row's group [nq, nq + G) is due (the same rule as the cache), the
  reference replaces it by ``oj.fake_quant_keys`` / ``oj.fake_quant_values`` of the
  original tokens of that group (the quantizer on its own). Reference output: exact
  float32 softmax attention of q over the reference keys and values (original basis).
  The cache's output is computed in the rotated basis from packed codes, so the two
  agree up to float32 rounding only; any drift (a lost, doubled, or misplaced group,
  a ring slot not cleared, an off-by-one at a boundary) would show as an error of
  the order of the values themselves.
* Every ``--chunk`` steps (one jitted ``lax.scan`` of appends + decodes + reference):
  max relative error max|out - ref| / max|ref| over the chunk, the cache's lengths,
  flags and number of quantized tokens, the process RSS (``/proc/self/status``) and
  the live JAX device buffers (count, bytes).

    python3 -m benchmarks.soak                      # 20,000 steps, writes out/soak.md
    python3 -m benchmarks.soak --steps 500 --out -  # quick, to stdout
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import oscar_jax as oj  # noqa: E402
from oscar_jax.cache import quantized_count  # noqa: E402

B, H, HQ, D = 2, 2, 4, 64
PREFILL = (0, 45)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def live_buffers() -> tuple[int, int]:
    arrs = jax.live_arrays()
    return len(arrs), int(sum(a.nbytes for a in arrs))


def token(key, step):
    """Random k, v [B, H, D], q [B, HQ, D] for one step (deterministic in (key, step))."""
    kk, kv, kq = jax.random.split(jax.random.fold_in(key, step), 3)
    k = jax.random.normal(kk, (B, H, D))
    k = k.at[..., 3].add(8.0).at[..., 17].add(-6.0)  # massive channels
    sink = (step % 97) == 0
    k = jnp.where(sink, k / jnp.linalg.norm(k, axis=-1, keepdims=True) * 0.5, k)
    return k, jax.random.normal(kv, (B, H, D)), jax.random.normal(kq, (B, HQ, D))


def reference_attention(q, kref, vref, n):
    """Exact f32 attention of q [B, HQ, D] over the first n[b] reference tokens [B, L, H, D]."""
    g = HQ // H
    qg = q.reshape(B, H, g, D)
    s = jnp.einsum("bhgd,blhd->bhgl", qg, kref, precision="highest") / np.sqrt(D)
    valid = (jnp.arange(kref.shape[1])[None, :] < n[:, None])[:, None, None, :]
    p = jax.nn.softmax(jnp.where(valid, s, -jnp.inf), axis=-1)
    out = jnp.einsum("bhgl,blhd->bhgd", p, vref, precision="highest")
    return out.reshape(B, HQ, D)


def make_chunk(cfg, steps: int):
    g = cfg.group_size

    def one(carry, step):
        cache, kin, vin, kref, vref, key = carry
        k, v, q = token(key, step)
        n_old = cache.lengths
        nq_old = quantized_count(n_old, cfg)
        cache = oj.append(cache, k, v)
        out = oj.decode_attention(q, cache, implementation="xla")
        rows = jnp.arange(B)
        kin = kin.at[rows, n_old].set(k)
        vin = vin.at[rows, n_old].set(v)
        kref = kref.at[rows, n_old].set(k)
        vref = vref.at[rows, n_old].set(v)
        flush = quantized_count(cache.lengths, cfg) > nq_old
        take = jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, g, axis=0))
        kg, vg = take(kin, nq_old), take(vin, nq_old)  # [B, G, H, D] original tokens
        kq, vq = oj.fake_quant_keys(kg, cfg), oj.fake_quant_values(vg, cfg)
        put = jax.vmap(lambda x, u, s, f: jax.lax.dynamic_update_slice_in_dim(
            x, jnp.where(f, u, jax.lax.dynamic_slice_in_dim(x, s, g, 0)), s, 0))  # fmt: skip
        kref, vref = put(kref, kq, nq_old, flush), put(vref, vq, nq_old, flush)
        ref = reference_attention(q, kref, vref, cache.lengths)
        err = jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref))
        return (cache, kin, vin, kref, vref, key), (err, jnp.sum(flush))

    @jax.jit
    def chunk(carry, start):
        carry, (err, flushes) = jax.lax.scan(one, carry, start + jnp.arange(steps))
        return carry, jnp.max(err), jnp.sum(flushes)

    return chunk


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--chunk", type=int, default=500)
    ap.add_argument("--out", default="out/soak.md")
    a = ap.parse_args(argv)
    cfg = oj.preset("oscar", bits=2)
    max_len = a.steps + 64
    cache = oj.init_cache(cfg, batch=B, max_len=max_len, num_kv_heads=H, head_dim=D,
                          dtype=jnp.float32)  # fmt: skip
    key = jax.random.key(0)
    t0 = max(PREFILL)
    pk = jax.random.normal(jax.random.key(1), (B, t0, H, D))
    pv = jax.random.normal(jax.random.key(2), (B, t0, H, D))
    cache = oj.prefill(cache, pk, pv, jnp.asarray(PREFILL))
    kin = jnp.zeros((B, max_len, H, D)).at[:, :t0].set(pk)
    vin = jnp.zeros((B, max_len, H, D)).at[:, :t0].set(pv)
    carry = (cache, kin, vin, kin, vin, key)  # prefill < R: every token exact in the ref
    chunk = make_chunk(cfg, a.chunk)
    rows = []
    wall0 = time.perf_counter()
    base_rss = None
    for start in range(0, a.steps, a.chunk):
        t = time.perf_counter()
        carry, err, nfl = chunk(carry, jnp.int32(start))
        err = float(err)
        dt = time.perf_counter() - t
        gc.collect()
        c = carry[0]
        nbuf, nbytes = live_buffers()
        rss = rss_mib()
        base_rss = rss if base_rss is None else base_rss
        rows.append(dict(
            step=start + a.chunk, err=err, flushes=int(nfl), lengths=c.lengths.tolist(),
            nq=[int(x) for x in c.num_quantized()], flags=c.flags.tolist(), rss=rss,
            nbuf=nbuf, nbytes=nbytes, ms=1000 * dt / a.chunk,
        ))  # fmt: skip
        r = rows[-1]
        print(f"step {r['step']:6d} err {err:.2e} flushes {r['flushes']:3d} len {r['lengths']} "
              f"flags {r['flags']} rss {rss:.1f} MiB buffers {nbuf} ({nbytes / 2**20:.1f} MiB) "
              f"{r['ms']:.2f} ms/step", flush=True)  # fmt: skip
    wall = time.perf_counter() - wall0
    errs = [r["err"] for r in rows]
    steady = rows[1:] if len(rows) > 1 else rows
    lines = [
        "# Soak: 20,000 INT2 decode steps on CPU vs the token-by-token reference",
        "",
        f"Command: `python3 -m benchmarks.soak --steps {a.steps} --chunk {a.chunk}`; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; jax {jax.__version__}, "
        f"{jax.devices()[0].platform} ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores); wall {wall:.0f} s (compile included).",
        "",
        f"Setup: `oj.preset('oscar', bits=2)` (G=32, R=128, bf16 scales/norms), cache float32, "
        f"B={B}, Hkv={H}, Hq={HQ}, D={D}, max_len={max_len}; row 0 starts empty, row 1 after a "
        f"{PREFILL[1]}-token prefill; random k/v/q per step (2 massive key channels, a sink "
        "every 97 tokens); `oj.append` + `oj.decode_attention(implementation='xla')` per "
        "step; reference = exact f32 attention over the tokens, each group replaced by "
        "`fake_quant_keys/values` of its original tokens when the cache flushes it "
        "(see the module docstring). err = max over the chunk of max|out - ref| / max|ref|.",
        "",
        "| after step | max rel err | flushes | lengths | quantized | flags | RSS MiB "
        "| live buffers | live MiB | ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['step']} | {r['err']:.2e} | {r['flushes']} | {r['lengths']} | {r['nq']} | "
            f"{r['flags']} | {r['rss']:.1f} | {r['nbuf']} | {r['nbytes'] / 2**20:.2f} "
            f"| {r['ms']:.2f} |"
        )
    lines += [
        "",
        f"Summary: max rel err over all {a.steps} steps {max(errs):.2e} (first chunk "
        f"{errs[0]:.2e}, last {errs[-1]:.2e}; tolerance for f32 is 1e-4, tests/tolerances.py); "
        f"{sum(r['flushes'] for r in rows)} flushes; final flags {rows[-1]['flags']}; "
        f"RSS after chunk 2..end: {min(r['rss'] for r in steady):.1f} .. "
        f"{max(r['rss'] for r in steady):.1f} MiB; live device buffers "
        f"{min(r['nbuf'] for r in steady)} .. {max(r['nbuf'] for r in steady)} "
        f"({min(r['nbytes'] for r in steady) / 2**20:.2f} .. "
        f"{max(r['nbytes'] for r in steady) / 2**20:.2f} MiB).",
        "",
    ]
    text = "\n".join(lines)
    if a.out == "-":
        print(text)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text)
        print(f"wrote {a.out}")
    return rows


if __name__ == "__main__":
    main()
