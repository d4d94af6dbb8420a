"""Where one end-to-end decode step spends its device time: GPU kernels grouped by kind.

``bench_e2e.py --breakdown`` splits a step by leaving parts out; this runs the real step
(``bench_e2e``'s decode program: random weights of a real shape, caches filled to the
context) for ``--steps`` steps under ``jax.profiler`` and sums the GPU kernels of the trace
per step, by kind (attention kernel, GEMM/GEMV, quantize kernel, collective, copy, other
XLA fusions), with launch counts and the costliest kernels by name: how many launches a
step makes, and whether the projections' GEMVs stream their weights at the copy rate.

    python3 -m benchmarks.profile_step --model llama31_8b --cache oscar2 \
        --batch 1 --context 131072 --out out/step
    python3 -m benchmarks.profile_step --tiny --out out/step_tiny  # CPU: no GPU kernels traced
"""

from __future__ import annotations

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import os
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import e2e_common as ec  # noqa: E402
from benchmarks import e2e_fill as ef  # noqa: E402
from benchmarks.profile_decode import kernel_times  # noqa: E402

KINDS = (  # (kind, pattern on the kernel name), first match wins
    ("attention", r"oscar_decode|fmha|flash|cudnn|attention"),
    ("quantize", r"oscar_quantize"),
    ("collective", r"nccl|all_?reduce|all_?gather|reduce_?scatter|collective"),
    ("gemm", r"gemm|gemv|cublas|cutlass|xmma|nvjet|matmul|dot"),
    ("copy", r"memcpy|memset|^copy|dynamic_update_slice"),
)


def kind_of(name: str) -> str:
    """The kind of a GPU kernel, from its name (``other``: XLA's remaining fusions)."""
    low = name.lower()
    for kind, pat in KINDS:
        if re.search(pat, low):
            return kind
    return "other"


def summarize(times: dict[str, list[float]], steps: int, top: int = 15) -> dict:
    """Per-step us and launches per kind, and the ``top`` costliest kernel names."""
    per_kind = collections.defaultdict(lambda: [0.0, 0])
    per_name = []
    for name, durs in times.items():
        k = kind_of(name)
        per_kind[k][0] += sum(durs) / steps
        per_kind[k][1] += len(durs) / steps
        per_name.append((sum(durs) / steps, len(durs) / steps, k, name))
    kinds = {k: dict(us=v[0], launches=v[1]) for k, v in
             sorted(per_kind.items(), key=lambda kv: -kv[1][0])}  # fmt: skip
    names = [dict(us=u, launches=n, kind=k, name=nm[:160])
             for u, n, k, nm in sorted(per_name, reverse=True)[:top]]  # fmt: skip
    return dict(kinds=kinds, top=names, kernel_us=sum(v["us"] for v in kinds.values()),
                launches=sum(v["launches"] for v in kinds.values()))  # fmt: skip


def markdown(rep: dict) -> str:
    s = rep["summary"]
    lines = [f"# One decode step: {rep['model']}, {rep['cache']}, batch {rep['batch']} x "
             f"{rep['context']} ({rep['device']}, jax {rep['jax']})", "",
             f"Kernel time {s['kernel_us']:.1f} us per step in {s['launches']:.0f} launches; "
             f"wall time per step in the traced call {rep['wall_ms_per_step']:.3f} ms.", "",
             "| kind | us per step | launches per step |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {k} | {v['us']:.1f} | {v['launches']:.1f} |" for k, v in s["kinds"].items()]
    lines += ["", "| us per step | launches | kind | kernel |", "|---|---|---|---|"]
    lines += [f"| {t['us']:.1f} | {t['launches']:.1f} | {t['kind']} | `{t['name']}` |"
              for t in s["top"]]  # fmt: skip
    if not s["kinds"]:
        lines += ["", "(No GPU kernels in the trace: a CPU run only checks that it works.)"]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama31_8b")
    ap.add_argument("--cache", default="oscar2", help="bf16 or oscarN, optionally ':impl'")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--steps", type=int, default=8, help="decode steps in the traced call")
    ap.add_argument("--encode-impl", default="xla", help="encoder of the decode-time appends")
    ap.add_argument("--fill", default="random", choices=("random", "zeros"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="2-layer model, small context (CPU)")
    ap.add_argument(
        "--dump-hlo",
        action="store_true",
        help="also write the compiled program's HLO text (out/step.hlo.txt)",
    )
    ap.add_argument("--out", default="out/step")
    a = ap.parse_args()
    if a.steps < 1:
        raise ValueError(f"steps={a.steps} must be >= 1")
    if a.tiny:
        a.context = min(a.context, 512)
    os.makedirs(a.out, exist_ok=True)
    cfg = ec.model_config(a.model, a.tiny)
    dev = jax.devices()[0]
    spec = ec.parse_caches(a.cache, "xla" if dev.platform == "cpu" else "pallas")[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    params = ef.random_params(cfg, ec.param_shardings(cfg, device=dev), a.seed)
    pabs = jax.tree_util.tree_map(lambda x: ec.abstract(x.shape, x.dtype, x.sharding), params)
    cabs = ef.abstract_caches(cfg, spec.kv, a.batch, a.context, device=dev)
    tok_abs = ec.abstract((a.batch,), jnp.int32, sh)
    st = ec.static(cfg, spec.kv, a.context, spec.impl, a.encode_impl)
    compiled, cinfo = ec.compile_decode(st, pabs, cabs, tok_abs)
    print(f"compiled in {cinfo['compile_s']:.1f} s", flush=True)
    if a.dump_hlo:  # kernel names of the trace are its fusions' names ("." -> "_")
        with open(os.path.join(a.out, "step.hlo.txt"), "w") as f:
            f.write(compiled.as_text())
    caches = ef.make_caches(cabs, a.context - 2 * a.steps - 1, a.fill, a.seed)
    tok = jax.device_put(jnp.arange(a.batch, dtype=jnp.int32) % cfg.vocab_size, sh)
    args = ec.decode_args(params, caches, tok)
    out = compiled(*args, np.int32(a.steps))  # warm-up; the caches are donated
    jax.block_until_ready(out)
    args[1] = out[0]
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t = time.perf_counter()
        out = compiled(*args, np.int32(a.steps))
        jax.block_until_ready(out)
        wall = (time.perf_counter() - t) / a.steps
        jax.profiler.stop_trace()
        times = kernel_times(d)
    rep = dict(model=a.model, cache=spec.label, batch=a.batch, context=a.context,
               steps=a.steps, device=dev.device_kind, jax=jax.__version__,
               wall_ms_per_step=wall * 1e3, compile=cinfo,
               summary=summarize(times, a.steps))  # fmt: skip
    with open(os.path.join(a.out, "profile_step.json"), "w") as f:
        json.dump(rep, f, indent=1)
    md = markdown(rep)
    with open(os.path.join(a.out, "profile_step.md"), "w") as f:
        f.write(md)
    print(md, flush=True)


if __name__ == "__main__":
    main()
