"""Decode speed of a Qwen3-30B-A3B-shape mixture of experts over the BF16 and OScaR INT2 caches.

Pseudo-random bf16 weights of the real shape (48 layers, 128 experts of 768, 8 routed per
token, 32 query / 4 KV heads of 128; about 61 GB: one H200), made on the device
(``benchmarks.e2e_fill``); caches filled to the context without a forward pass. The
decode program is ``models.decode_forward`` (what ``models.generate`` scans) in a device
loop (``benchmarks.e2e_common``: per-step time = (T(n2) - T(n1)) / (n2 - n1)).

Workloads (``--workloads``):

* ``lat32k`` / ``lat128k``: ms per token at batch 1, per cache, with the step split into
  attention (full - attention skipped), experts (full - router and experts skipped) and
  the rest (projections, norms, cache writes, logits);
* ``tpmax32k``: tokens/s at the largest batch whose caches fit next to the weights at 32K
  (analytic from bytes, halved on OOM);
* ``experts``: one layer's sparse MLP alone, ``ragged_dot`` against gathered expert
  weights (``models.moe``), at 1, 8, 64 and 512 tokens.

    PYTHONUNBUFFERED=1 python3 -m benchmarks.bench_moe --out out/moe          # H200
    python3 -m benchmarks.bench_moe --tiny --out out/moe_tiny                 # CPU smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")  # before JAX starts

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import models  # noqa: E402
from benchmarks import e2e_common as ec  # noqa: E402
from benchmarks import e2e_fill as ef  # noqa: E402
from models import moe  # noqa: E402
from models.config import qwen3_30b_a3b  # noqa: E402

FULL = dict(lat32k=(1, 32768), lat128k=(1, 131072), tpmax32k=(None, 32768))
TINY = dict(lat32k=(1, 512), lat128k=(1, 1024), tpmax32k=(4, 512))


def model_config(tiny: bool) -> models.ModelConfig:
    cfg = qwen3_30b_a3b()
    if tiny:  # head_dim 64 (the Pallas kernels' minimum)
        cfg = cfg.replace(vocab_size=512, hidden_size=256, num_layers=2, num_heads=8,
                          num_kv_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4,
                          moe_intermediate_size=64)  # fmt: skip
    return cfg


def _no_experts(cfg, lp, x, implementation="auto"):
    """Breakdown variant: no router, no experts (the MLP adds nothing)."""
    return jnp.zeros_like(x)


def no_experts_step(st: models.Static, params, caches, tok, pos):
    """``models.decode_forward`` with the sparse MLP skipped (``st`` must differ from the full
    step's, so that the jitted layers are traced again with the patch in place)."""
    real = moe.moe_mlp
    moe.moe_mlp = _no_experts
    try:
        return models.decode_forward(st, params, caches, tok, pos)
    finally:
        moe.moe_mlp = real


def time_decode(cfg, params, kv, impl, batch, ctx, steps, repeats, variant="full"):
    """ms per step of ``variant`` ("full", "no_attention", "no_experts") at batch x ctx."""
    max_len = ctx + steps[1] + 8
    st = ec.static(cfg, kv, max_len, "bench_skip" if variant == "no_attention" else impl)
    step = None
    if variant == "no_experts":
        st, step = st._replace(pad_id=st.pad_id + 1), no_experts_step
    shapes = ef.abstract_caches(cfg, kv, batch, max_len)
    caches = ef.make_caches(shapes, ctx)
    tok = jax.device_put(jnp.zeros((batch,), jnp.int32), jax.devices()[0])
    params_abs = jax.tree_util.tree_map(lambda a: ec.abstract(a.shape, a.dtype, a.sharding), params)
    tok_abs = ec.abstract(tok.shape, tok.dtype, tok.sharding)
    compiled, info = ec.compile_decode(st, params_abs, shapes, tok_abs, step=step)
    res, args = ec.time_steps(compiled, ec.decode_args(params, caches, tok), steps, repeats)
    ef.delete(args[1])
    return dict(res, compile_s=info.get("compile_s"))


def latency(cfg, params, spec, ctx, a) -> dict:
    full = time_decode(cfg, params, spec.kv, spec.impl, 1, ctx, a.steps, a.repeats)
    out = dict(cache=spec.label, batch=1, ctx=ctx, ms_per_token=full["ms_per_step"])
    if a.breakdown:
        na = time_decode(cfg, params, spec.kv, spec.impl, 1, ctx, a.steps, a.repeats,
                         "no_attention")["ms_per_step"]  # fmt: skip
        ne = time_decode(cfg, params, spec.kv, spec.impl, 1, ctx, a.steps, a.repeats,
                         "no_experts")["ms_per_step"]  # fmt: skip
        t = full["ms_per_step"]
        out.update(attention_ms=t - na, experts_ms=t - ne, rest_ms=na + ne - t)
    return out


def throughput(cfg, params, spec, batch, ctx, a) -> dict:
    """tokens/s at ``batch`` (None: the largest that fits, halved on OOM)."""
    if batch is None:
        row = ef.tree_nbytes(ef.abstract_caches(cfg, spec.kv, 1, ctx + a.steps[1] + 8))
        free = ec.memory_stats(jax.devices()[0]).get("bytes_limit", 0)
        free -= ef.tree_nbytes(params) + int(a.margin_gib * 2**30)
        batch = max(1, int(free // row) // 8 * 8)
    while True:
        try:
            r = time_decode(cfg, params, spec.kv, spec.impl, batch, ctx, a.steps, a.repeats)
            break
        except Exception as e:  # noqa: BLE001
            if not ec.is_oom(e) or batch == 1:
                raise
            batch //= 2
    ms = r["ms_per_step"]
    return dict(cache=spec.label, batch=batch, ctx=ctx, ms_per_step=ms,
                tokens_per_s=batch / (ms / 1e3))  # fmt: skip


def experts_micro(cfg, a) -> list[dict]:
    """One layer's sparse MLP: ragged_dot vs gathered weights, per token count."""
    params = ef.random_params(cfg.replace(num_layers=1), ec.param_shardings(cfg.replace(
        num_layers=1)))["layers"][0]  # fmt: skip
    rows = []
    for n in (1, 8, 64, 512):
        x = jax.random.normal(jax.random.key(n), (n, cfg.hidden_size), jnp.bfloat16)
        for impl in ("ragged", "gather"):
            fn = jax.jit(lambda lp, x, impl=impl: moe.moe_mlp(cfg, lp, x, impl))
            jax.block_until_ready(fn(params, x))
            ts = []
            for _ in range(max(3, a.repeats)):
                t = time.perf_counter()
                jax.block_until_ready(fn(params, x))
                ts.append(time.perf_counter() - t)
            rows.append(dict(tokens=n, impl=impl, ms=1e3 * float(np.median(ts))))
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="lat32k,lat128k,tpmax32k,experts")
    ap.add_argument("--caches", default="bf16,oscar2", help="name[:impl],...")
    ap.add_argument("--impl", default=None, help="attention kernel (default triton; tiny: xla)")
    ap.add_argument("--steps", default=None, help="loop lengths n1,n2 (default 4,36; tiny 2,6)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    ap.add_argument("--margin-gib", type=float, default=2.0, help="kept free when fitting")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 16-expert model (CPU)")
    ap.add_argument("--out", default="out/moe")
    a = ap.parse_args(argv)
    a.steps = tuple(int(s) for s in (a.steps or ("2,6" if a.tiny else "4,36")).split(","))
    if len(a.steps) != 2 or not 0 <= a.steps[0] < a.steps[1]:
        raise ValueError(f"steps={a.steps} must be 'n1,n2' with 0 <= n1 < n2")
    a.workloads = [w for w in a.workloads.split(",") if w]
    bad = [w for w in a.workloads if w not in (*FULL, "experts")]
    if bad:
        raise ValueError(f"workloads={bad} must be among {(*FULL, 'experts')}")
    return a


def main(argv=None):
    a = parse_args(argv)
    cfg = model_config(a.tiny)
    specs = ec.parse_caches(a.caches, a.impl or ("xla" if a.tiny else "triton"))
    shapes = TINY if a.tiny else FULL
    dev = jax.devices()[0]
    result = dict(device=str(dev.device_kind), jax=jax.__version__, tiny=a.tiny,
                  config=dict(layers=cfg.num_layers, experts=cfg.num_experts,
                              top_k=cfg.num_experts_per_tok, hidden=cfg.hidden_size),
                  date=time.strftime("%Y-%m-%d"), rows=[])  # fmt: skip
    os.makedirs(a.out, exist_ok=True)

    def save():
        with open(os.path.join(a.out, "bench_moe.json"), "w") as f:
            json.dump(result, f, indent=1)

    if any(w != "experts" for w in a.workloads):
        t = time.perf_counter()
        params = ef.random_params(cfg, ec.param_shardings(cfg))
        jax.block_until_ready(params)
        print(f"weights: {ef.tree_nbytes(params) / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s")
    for w in a.workloads:
        if w == "experts":
            for r in experts_micro(cfg, a):
                print(f"experts {r['impl']:>6} x {r['tokens']:>4} tokens: {r['ms']:.3f} ms")
                result["rows"].append(dict(workload=w, **r))
            save()
            continue
        batch, ctx = shapes[w]
        for spec in specs:
            if w.startswith("lat"):
                r = latency(cfg, params, spec, ctx, a)
                parts = [k for k in ("attention_ms", "experts_ms", "rest_ms") if k in r]
                split = "".join(f", {k[:-3]} {r[k]:.3f}" for k in parts)
                print(f"{w} {spec.label}: {r['ms_per_token']:.3f} ms/token{split}")
            else:
                r = throughput(cfg, params, spec, batch, ctx, a)
                print(f"{w} {spec.label}: batch {r['batch']}, {r['tokens_per_s']:.1f} tokens/s")
            result["rows"].append(dict(workload=w, **r))
            save()
    return result


if __name__ == "__main__":
    main()
