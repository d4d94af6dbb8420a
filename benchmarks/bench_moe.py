"""Decode speed of a Qwen3-30B-A3B-shape mixture of experts over the BF16 and OScaR INT2 caches.

Pseudo-random bf16 weights of the real shape (48 layers, 128 experts of 768, 8 routed per
token, 32 query / 4 KV heads of 128; about 61 GB: one H200), made on the device
(``benchmarks.e2e_fill``); caches filled to the context without a forward pass. The
decode program is ``models.decode_forward`` (what ``models.generate`` scans) in a device
loop (``benchmarks.e2e_common``: per-step time = (T(n2) - T(n1)) / (n2 - n1)).

Workloads (``--workloads``):

* ``lat32k`` / ``lat128k``: ms per token at batch 1, per cache, with the step split into
  attention (full - attention skipped), experts (full - router and experts skipped) and
  the rest (projections, norms, cache writes, logits); the two variants' own times are
  in the row too (the split assumes the parts add up; a negative rest says they did not);
* ``tpmax32k``: tokens/s at the largest batch whose caches fit in the device memory left
  beside the weights at 32K (``models.max_batch`` from bytes, no rounding, then shrunk
  until the compiled program's temporaries fit too: ``e2e_common.fit_batch``; 10% less
  on a run-time OOM);
* ``experts``: one layer's sparse MLP alone, ``ragged_dot`` against gathered expert
  weights (``models.moe``), at 1, 8, 64 and 512 tokens, device time (a loop on the
  device, as the decode timing; a configuration that runs out of memory is recorded so).

Which expert path a step takes is static (``models.moe``: gathered weights while
tokens x 8 <= 64, i.e. batch <= 8; ``ragged_dot`` above), and each row says which. On
NVIDIA GPUs XLA expands ``ragged_dot`` into a dense dot over a group-masked
[pairs, E, Hd] operand (``RaggedDotRewriter``: E = 128 times the FLOPs of the routed
work) unless its cuDNN grouped-GEMM fusion is on: ``--ragged-fusion`` sets
``--xla_gpu_experimental_use_ragged_dot_fusion=true`` (cuDNN >= 9.22); run ``tpmax32k``
and ``experts`` with and without it before reading large-batch MoE figures. The result
records ``XLA_FLAGS``.

Each full-size configuration compiles its 48-layer decode loop (three programs per cache
for the split, up to three batches for the fit): with a per-command time limit, run the
workloads one per command (``--workloads lat32k``; the JSON is written per row) with
``--compile-cache DIR`` so that a re-run skips the compiles.

    PYTHONUNBUFFERED=1 python3 -m benchmarks.bench_moe --out out/moe          # H200
    PYTHONUNBUFFERED=1 python3 -m benchmarks.bench_moe --ragged-fusion \
        --workloads tpmax32k,experts --out out/moe_fusion                     # cuDNN ragged dot
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

import models  # noqa: E402
from benchmarks import e2e_common as ec  # noqa: E402
from benchmarks import e2e_fill as ef  # noqa: E402
from models import moe  # noqa: E402
from models.config import qwen3_30b_a3b  # noqa: E402

FULL = dict(lat32k=(1, 32768), lat128k=(1, 131072), tpmax32k=(None, 32768))
TINY = dict(lat32k=(1, 512), lat128k=(1, 1024), tpmax32k=(None, 512))
TINY_BUDGET_GIB = 0.02  # --tiny: the caches' budget for tpmax32k (a CPU has no device limit)
RAGGED_FUSION = "--xla_gpu_experimental_use_ragged_dot_fusion=true"


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


def expert_path(cfg, batch: int) -> str:
    """The path ``models.moe.moe_mlp`` ("auto") takes for a decode step of ``batch`` rows."""
    return "gather" if 2 * batch * cfg.num_experts_per_tok <= cfg.num_experts else "ragged"


def decode_program(cfg, params, kv, impl, batch, max_len, variant="full", encode="xla"):
    """The compiled decode loop of ``variant`` at ``batch`` (shapes only: nothing allocated)
    -> (compiled, info, cache shapes)."""
    st = ec.static(cfg, kv, max_len, "bench_skip" if variant == "no_attention" else impl, encode)
    step = None
    if variant == "no_experts":
        st, step = st._replace(pad_id=st.pad_id + 1), no_experts_step
    shapes = ef.abstract_caches(cfg, kv, batch, max_len)
    params_abs = jax.tree_util.tree_map(lambda a: ec.abstract(a.shape, a.dtype, a.sharding), params)
    sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tok_abs = ec.abstract((batch,), jnp.int32, sh)
    compiled, info = ec.compile_decode(st, params_abs, shapes, tok_abs, step=step)
    return compiled, info, shapes


def time_decode(cfg, params, kv, impl, batch, ctx, steps, repeats, variant="full", program=None,
                encode="xla"):  # fmt: skip
    """ms per step of ``variant`` ("full", "no_attention", "no_experts") at batch x ctx
    (``program``: ``decode_program``'s result for these arguments, compiled already)."""
    max_len = ctx + steps[1] + 8
    compiled, info, shapes = program or decode_program(cfg, params, kv, impl, batch, max_len,
                                                       variant, encode)  # fmt: skip
    caches = ef.make_caches(shapes, ctx)
    tok = jax.device_put(jnp.zeros((batch,), jnp.int32), jax.devices()[0])
    res, args = ec.time_steps(compiled, ec.decode_args(params, caches, tok), steps, repeats)
    ef.delete(args[1])
    return dict(res, compile_s=info.get("compile_s"))


def latency(cfg, params, spec, ctx, a) -> dict:
    full = time_decode(cfg, params, spec.kv, spec.impl, 1, ctx, a.steps, a.repeats,
                       encode=a.encode_impl)  # fmt: skip
    out = dict(cache=spec.label, batch=1, ctx=ctx, ms_per_token=full["ms_per_step"])
    if a.breakdown:
        na = time_decode(cfg, params, spec.kv, spec.impl, 1, ctx, a.steps, a.repeats,
                         "no_attention", encode=a.encode_impl)["ms_per_step"]  # fmt: skip
        ne = time_decode(cfg, params, spec.kv, spec.impl, 1, ctx, a.steps, a.repeats,
                         "no_experts", encode=a.encode_impl)["ms_per_step"]  # fmt: skip
        t = full["ms_per_step"]
        out.update(attention_ms=t - na, experts_ms=t - ne, rest_ms=na + ne - t,
                   no_attention_ms=na, no_experts_ms=ne)  # fmt: skip
    return dict(out, expert_path=expert_path(cfg, 1))


def cache_budget(a) -> int:
    """Bytes the caches and the program's temporaries may take: ``--budget-gib``, else the
    device's limit less what is in use (the weights) and ``--margin-gib``."""
    if a.budget_gib is not None:
        return int(a.budget_gib * 2**30)
    st = ec.memory_stats(jax.devices()[0])
    if not st.get("bytes_limit"):
        raise ValueError(f"device {jax.devices()[0]} reports no memory limit: pass --budget-gib")
    return int(st["bytes_limit"] - st["bytes_in_use"] - a.margin_gib * 2**30)


def throughput(cfg, params, spec, batch, ctx, a) -> dict:
    """tokens/s at ``batch`` (None: the largest whose caches and temporaries fit)."""
    max_len = ctx + a.steps[1] + 8
    fit, program = None, None
    if batch is None:
        free = cache_budget(a)
        row = models.cache_nbytes(cfg, spec.kv, batch=1, max_len=max_len)

        def build(b):
            nonlocal program
            program = decode_program(cfg, params, spec.kv, spec.impl, b, max_len,
                                     encode=a.encode_impl)  # fmt: skip
            return program[:2]

        fit, compiled, _ = ec.fit_batch(build, row, free, max_batch=a.max_batch)
        batch = fit["batch"]
        if compiled is None:
            return dict(cache=spec.label, batch=0, ctx=ctx, status="no batch fits", fit=fit)
    while True:
        try:
            r = time_decode(cfg, params, spec.kv, spec.impl, batch, ctx, a.steps, a.repeats,
                            program=program, encode=a.encode_impl)  # fmt: skip
            break
        except Exception as e:  # noqa: BLE001
            if not ec.is_oom(e) or batch == 1:
                raise
            batch, program = max(1, int(batch * 0.9)), None
    ms = r["ms_per_step"]
    return dict(cache=spec.label, batch=batch, ctx=ctx, ms_per_step=ms,
                tokens_per_s=batch / (ms / 1e3), expert_path=expert_path(cfg, batch),
                fit=fit)  # fmt: skip


def mlp_loop(cfg, impl: str):
    """``n`` sparse MLPs in a device loop (output RMS-normalised into the next input, so
    the routing stays that of unit-scale tokens): (lp, x, n) -> x."""

    def run(lp, x, n):
        def body(_, x):
            y = moe.moe_mlp(cfg, lp, x, impl).astype(jnp.float32)
            y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)
            return y.astype(x.dtype)

        return jax.lax.fori_loop(0, n, body, x)

    return jax.jit(run)


def experts_micro(cfg, a) -> list[dict]:
    """One layer's sparse MLP: ragged_dot vs gathered weights, per token count (device time
    per call, (T(n2) - T(n1)) / (n2 - n1) as the decode timing)."""
    one = cfg.replace(num_layers=1)
    params = ef.random_params(one, ec.param_shardings(one))["layers"][0]
    rows = []
    for n in (1, 8, 64, 512):
        x = jax.random.normal(jax.random.key(n), (n, cfg.hidden_size), jnp.bfloat16)
        for impl in ("ragged", "gather"):
            try:
                res, _ = ec.time_steps(mlp_loop(cfg, impl), [params, x], a.steps, a.repeats,
                                       donated=None)  # fmt: skip
                rows.append(dict(tokens=n, impl=impl, ms=res["ms_per_step"]))
            except Exception as e:  # noqa: BLE001  (gather at 512 tokens: 3 x 13 GB gathered)
                if not ec.is_oom(e):
                    raise
                rows.append(dict(tokens=n, impl=impl, ms=None, status="out of memory"))
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="lat32k,lat128k,tpmax32k,experts")
    ap.add_argument("--caches", default="bf16,oscar2", help="name[:impl],...")
    ap.add_argument("--impl", default=None, help="attention kernel (default triton; tiny: xla)")
    ap.add_argument("--encode-impl", default=None,
                    help="decode-time cache writes: triton (one fused launch a layer; default "
                    "on a GPU) or xla (default on the CPU)")  # fmt: skip
    ap.add_argument("--steps", default=None, help="loop lengths n1,n2 (default 4,36; tiny 2,6)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    ap.add_argument("--margin-gib", type=float, default=2.0, help="kept free when fitting")
    ap.add_argument("--budget-gib", type=float, default=None,
                    help=f"tpmax: bytes for caches + temporaries (default: the device's free "
                         f"memory; --tiny: {TINY_BUDGET_GIB})")  # fmt: skip
    ap.add_argument("--max-batch", type=int, default=4096, help="tpmax: the largest batch tried")
    ap.add_argument("--ragged-fusion", action="store_true",
                    help=f"XLA_FLAGS += {RAGGED_FUSION} (cuDNN grouped GEMMs)")  # fmt: skip
    ap.add_argument("--compile-cache", default="",
                    help="persistent compilation cache dir (re-runs skip compiles)")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 16-expert model (CPU)")
    ap.add_argument("--out", default="out/moe")
    a = ap.parse_args(argv)
    a.steps = tuple(int(s) for s in (a.steps or ("2,6" if a.tiny else "4,36")).split(","))
    if len(a.steps) != 2 or not 0 <= a.steps[0] < a.steps[1]:
        raise ValueError(f"steps={a.steps} must be 'n1,n2' with 0 <= n1 < n2")
    if a.budget_gib is None and a.tiny:
        a.budget_gib = TINY_BUDGET_GIB
    if a.budget_gib is not None and not a.budget_gib > 0:
        raise ValueError(f"budget_gib={a.budget_gib} must be > 0")
    if a.max_batch < 1:
        raise ValueError(f"max_batch={a.max_batch} must be >= 1")
    a.workloads = [w for w in a.workloads.split(",") if w]
    bad = [w for w in a.workloads if w not in (*FULL, "experts")]
    if bad:
        raise ValueError(f"workloads={bad} must be among {(*FULL, 'experts')}")
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.ragged_fusion:  # read when the backend starts (the first jax.devices() below)
        flags = os.environ.get("XLA_FLAGS", "")
        if RAGGED_FUSION not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} {RAGGED_FUSION}".strip()
    ec.setup_jax(a.compile_cache)
    cfg = model_config(a.tiny)
    specs = ec.parse_caches(a.caches, a.impl or ("xla" if a.tiny else "triton"))
    a.encode_impl = a.encode_impl or ("xla" if a.tiny else "triton")
    shapes = TINY if a.tiny else FULL
    dev = jax.devices()[0]
    result = dict(device=str(dev.device_kind), jax=jax.__version__, tiny=a.tiny,
                  xla_flags=os.environ.get("XLA_FLAGS", ""), encode_impl=a.encode_impl,
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
                ms = "out of memory" if r["ms"] is None else f"{r['ms']:.3f} ms"
                print(f"experts {r['impl']:>6} x {r['tokens']:>4} tokens: {ms}")
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
                got = f"{r['tokens_per_s']:.1f} tokens/s" if r["batch"] else r["status"]
                print(f"{w} {spec.label}: batch {r['batch']} ({r['expert_path']}), {got}")
            result["rows"].append(dict(workload=w, **r))
            save()
    return result


if __name__ == "__main__":
    main()
