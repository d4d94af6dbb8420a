"""Offline SASS of our Pallas-Triton kernels, without a GPU: instruction and register counts.

Lowers the fused encoder or the INT2 decode call for CUDA on the CPU (JAX lowers a
Pallas-Triton kernel to Triton IR before XLA sees it; the IR is captured there), compiles
that IR with the pip ``triton`` package for sm_90a (its bundled ``ptxas``), disassembles
it with the bundled ``nvdisasm`` and prints registers, spills, shared memory, the static
instruction count by opcode and each loop's length (the per-block / per-group figure).
With ``--live`` it also prints the peak of live registers (``nvdisasm -plr``). Files go to
OUTDIR (``kernel.ttir``, ``.ttgir``, ``.ptx``, ``.cubin``, ``.sass``). The counts are what
the H200 runs up to JAX's own Triton build (the device's jaxlib): the registers match what
Nsight Compute reports, but see below. Needs ``pip install triton`` (not a project
dependency; 3.6 was used) and reaches into JAX internals, so it is a development tool::

    python3 -m benchmarks.sass_offline quantize out/sass_q --opts '{"tokens": 32768}'
    python3 -m benchmarks.sass_offline decode out/sass_d --opts '{"L": 131072}' --live
    python3 -m benchmarks.sass_offline ncu sass.csv   # the device's own SASS, from ncu

The offline compile is not always the device's: JAX 0.11.2's Triton can allocate more
registers than Triton 3.6-3.9 for the same IR, and the device's build does not contract
multiply-adds into FFMA where pip Triton does. ``ncu`` reads the SASS the device ran,
from an Nsight Compute export (on the H200):

    ncu -k regex:oscar_quantize --launch-count 1 --section LaunchStats -o rep \
      python3 -m benchmarks.ncu_kernels quantize --tokens 32768
    ncu -i rep.ncu-rep --page source --print-source sass --csv > sass.csv

Options (JSON): quantize: ``tokens``, ``bits`` and any ``pallas_kernels.quantize.triton.encode``
knob; decode: ``B``, ``L`` and any ``decode_attention`` option (Qwen3-8B shape: 32 query
heads, 8 KV heads, head_dim 128, the oscar INT2 preset).

``mosaic``: the Mosaic GPU decode partials kernel, compiled without a GPU by XLA's deviceless
AOT path (a compile-only CUDA device from an H100 ``TargetConfig``; Mosaic dumps the PTX it
hands to ptxas), then the system's ``ptxas`` for sm_90a and ``nvdisasm``: registers and the
main loop's instruction mix (the pipeline step: ``loops``' longest). Needs jax 0.11.2 with
``jax-cuda13-plugin`` (Python 3.12; CI's lowering venv) and the CUDA tools on PATH or in the
``nvidia`` pip packages. Options: ``B``, ``L``, ``bits``, ``d``, ``g`` and any
``Int2DecodeConfig`` field (over the backend's ``default_config``)::

    python3 -m benchmarks.sass_offline mosaic out/sass_m --opts '{"kernel": "warp", "fold": "kv"}'
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp

import oscar_jax as oj
from oscar_jax import record
from pallas_kernels import register_cap
from pallas_kernels.decode import mosaic as mk
from pallas_kernels.quantize import triton as pq

OP = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def capture_triton_ir(build) -> list[tuple[str, int, int]]:
    """(Triton IR, num_warps, num_stages) of every Pallas-Triton kernel ``build()`` lowers."""
    from jax._src.pallas.triton import lowering
    from jax._src.pallas.triton import pallas_call_registration as reg

    register_cap.install()  # a kernel's max_registers shows in the captured IR
    irs, orig = [], lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        res = orig(*args, **kwargs)
        irs.append(res.module.operation.get_asm(enable_debug_info=False))
        return res

    reg.lowering.lower_jaxpr_to_triton_module = capture
    try:
        text = build().as_text()
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = orig
    params = re.findall(r"num_stages = (\d+) : i32, num_warps = (\d+) : i32", text)
    if len(params) != len(irs):  # attribute order differs: read them one by one
        warps = re.findall(r"num_warps = (\d+) : i32", text)
        stages = re.findall(r"num_stages = (\d+) : i32", text)
        params = list(zip(stages, warps, strict=True))
    return [(ir, int(w), int(s)) for ir, (s, w) in zip(irs, params, strict=True)]


def lower(what: str, opts: dict):
    if what == "quantize":
        t, bits = opts.pop("tokens", 32768), opts.pop("bits", 2)
        cfg = oj.preset("oscar", bits=bits)
        k = jax.ShapeDtypeStruct((1, 8, t, 128), jnp.bfloat16)
        f = jax.jit(lambda k, v: pq.encode(k, v, cfg, interpret=False, **opts))
        return lambda: f.trace(k, k).lower(lowering_platforms=("cuda",))
    if what == "decode":
        oj.gpu_available = lambda: True  # the compiled path, not interpret mode
        b, length = opts.pop("B", 1), opts.pop("L", 131072)
        cfg = oj.preset("oscar", bits=2)
        cache = jax.eval_shape(
            lambda: oj.init_cache(cfg, batch=b, max_len=length, num_kv_heads=8, head_dim=128)
        )
        q = jax.ShapeDtypeStruct((b, 32, 128), jnp.bfloat16)
        f = jax.jit(lambda q, c: oj.decode_attention(q, c, implementation="pallas", **opts))
        return lambda: f.trace(q, cache).lower(lowering_platforms=("cuda",))
    raise ValueError(f"{what=} must be 'quantize' or 'decode'")


# XLA's description of one H100 SXM (its TargetConfig text proto), for compile-only devices
H100_TARGET = """gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32
  shared_memory_per_block: 49152 shared_memory_per_core: 233472 threads_per_core_limit: 2048
  core_count: 132 fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536 }
platform_name: "CUDA" dnn_version_info { major: 9 minor: 7 }
runtime_version { major: 13 minor: 0 patch: 0 } device_description_str: "NVIDIA H100 80GB HBM3"
"""


def _tool(name: str) -> str:
    import glob
    import shutil

    site = os.path.dirname(os.path.dirname(jax.__file__))
    found = shutil.which(name) or next(
        iter(glob.glob(os.path.join(site, "nvidia", "*", "bin", name))), None
    )
    if found is None:
        raise SystemExit(f"{name} not found (PATH or the nvidia pip packages)")
    return found


def mosaic(outdir: str, opts: dict) -> None:
    """Compile the Mosaic decode partials kernel for a compile-only H100 and report its SASS."""
    import dataclasses
    import glob

    from jax.experimental import topologies

    os.makedirs(outdir, exist_ok=True)
    for old in glob.glob(os.path.join(outdir, "*")):
        os.remove(old)
    os.environ.update(MOSAIC_GPU_DUMP_TO=os.path.abspath(outdir), MOSAIC_GPU_DUMP_PTX="1")
    b, length = opts.pop("B", 1), opts.pop("L", 131072)
    bits, d, g = opts.pop("bits", 2), opts.pop("d", 128), opts.pop("g", 4)
    cfg = dataclasses.replace(mk.default_config(length, bits, d, g), **opts)
    topo = topologies.get_topology_desc(platform="cuda", target_config=H100_TARGET,
                                        topology="1x1x1")  # fmt: skip
    sh = jax.sharding.SingleDeviceSharding(topo.devices[0])
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    args = (s((b, 8, g, d), jnp.float32), s((b, 8, length // 64, record.record_words(bits, d)),
            jnp.uint32), s((b, 8, length), jnp.float32), s((b,), jnp.int32))  # fmt: skip
    f = jax.jit(lambda q, r, n, nq: mk.int2_decode_partials(q, r, n, nq, cfg=cfg))
    f.trace(*args).lower(lowering_platforms=("cuda",)).compile()
    ptx = [p for p in glob.glob(os.path.join(outdir, "*.ptx")) if "partials" in p]
    if len(ptx) != 1:
        raise SystemExit(f"expected one partials kernel's PTX in {outdir}, found {ptx}")
    cubin = ptx[0][:-4] + ".cubin"
    run = lambda *cmd: subprocess.run(cmd, capture_output=True, text=True, check=True)  # noqa: E731
    info = run(_tool("ptxas"), "-arch=sm_90a", "-O3", "-v", ptx[0], "-o", cubin).stderr
    sass = run(_tool("nvdisasm"), "-c", cubin).stdout
    with open(cubin[:-6] + ".sass", "w") as fh:
        fh.write(sass)
    print(f"{cfg}\n" + " ".join(ln.split(":", 1)[-1].strip() for ln in info.splitlines()
                                 if "registers" in ln or "spill" in ln))  # fmt: skip
    report(sass)
    lines, bodies = sass.splitlines(), []
    for i, ln in enumerate(lines):  # every loop's opcodes
        m = re.search(r"BRA\s+`\(\.(L_x_\d+)\)", ln)
        start = next((k for k, x in enumerate(lines) if m and x.strip() == f".{m.group(1)}:"), i)
        if start < i:
            ops = collections.Counter(
                OP.match(x).group(2).split(".")[0] for x in lines[start : i + 1] if OP.match(x)
            )
            bodies.append((-ops["HMMA"], sum(ops.values()), ops))
    _, n, ops = min(bodies, key=lambda x: x[:2])  # the pipeline step: all the mma, shortest
    print(f"pipeline step {n} instructions: {ops.most_common(20)}")


def loops(sass: str) -> list[int]:
    """Instructions of each loop (a label reached by a backward branch), in SASS order."""
    lines = sass.splitlines()
    labels = {
        m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"\s*\.(L_x_\d+):", ln))
    }
    out = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s+`\(\.(L_x_\d+)\)", ln)
        if m and labels.get(m.group(1), i) < i:
            out.append(sum(1 for x in lines[labels[m.group(1)] : i + 1] if OP.match(x)))
    return out


def from_ncu_csv(text: str) -> str:
    """The kernel SASS of an Nsight Compute source export (``ncu -i REP --page source
    --print-source sass --csv``: the code the device's own toolchain built) as nvdisasm-
    style lines, labels at branch targets, so that ``loops`` and the counts read it."""
    rows = [r for r in csv.reader(io.StringIO(text)) if len(r) == 2 and r[0].startswith("0x")]
    bra = re.compile(r"BRA\s+0x([0-9a-f]+)")
    targets = {int(m.group(1), 16) for _, src in rows if (m := bra.search(src))}
    lines = []
    for addr, src in rows:
        if int(addr, 16) in targets:
            lines.append(f".L_x_{int(addr, 16)}:")
        src = bra.sub(lambda m: f"BRA `(.L_x_{int(m.group(1), 16)})", src.strip())
        lines.append(f"        /*{addr[2:]}*/ {src} ;")
    return "\n".join(lines)


def report(sass: str) -> collections.Counter:
    """Print the static instruction count, each loop's length and the commonest opcodes."""
    ops = collections.Counter(
        m.group(2).split(".")[0] for ln in sass.splitlines() if (m := OP.match(ln))
    )
    print(f"static instructions {sum(ops.values())}; loops {loops(sass)}")
    print(ops.most_common(30))
    return ops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("quantize", "decode", "ncu", "mosaic"))
    ap.add_argument("outdir", help="output folder (ncu: the source export to read)")
    ap.add_argument("--opts", default="{}", help="JSON options (see the module docstring)")
    ap.add_argument("--live", action="store_true", help="peak live registers (nvdisasm -plr)")
    args = ap.parse_args(argv)
    if args.what == "mosaic":
        jax.config.update("jax_platforms", "cpu")
        mosaic(args.outdir, json.loads(args.opts))
        return 0
    if args.what == "ncu":
        with open(args.outdir) as fh:
            report(from_ncu_csv(fh.read()))
        return 0
    try:
        import triton
        import triton.backends.nvidia as nv
        from triton.backends.compiler import GPUTarget
    except ImportError:
        print("needs the pip triton package (pip install triton)")
        return 2
    irs = capture_triton_ir(lower(args.what, json.loads(args.opts)))
    ir, warps, stages = max(irs, key=lambda x: len(x[0]))  # the main kernel: the largest IR
    os.makedirs(args.outdir, exist_ok=True)
    path = lambda ext: os.path.join(args.outdir, f"kernel.{ext}")  # noqa: E731
    with open(path("ttir"), "w") as fh:
        fh.write(ir)
    ck = triton.compile(path("ttir"), target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=warps, num_stages=stages))  # fmt: skip
    for ext in ("ttgir", "ptx"):
        with open(path(ext), "w") as fh:
            fh.write(ck.asm[ext])
    with open(path("cubin"), "wb") as fh:
        fh.write(ck.asm["cubin"])
    tools = os.path.join(os.path.dirname(nv.__file__), "bin")
    run = lambda *cmd: subprocess.run(cmd, capture_output=True, text=True, check=True).stdout  # noqa: E731
    sass = run(os.path.join(tools, "nvdisasm"), "-c", path("cubin"))
    with open(path("sass"), "w") as fh:
        fh.write(sass)
    usage = run(os.path.join(tools, "cuobjdump"), "--dump-resource-usage", path("cubin"))
    print(f"{len(irs)} Pallas kernel(s); the largest at num_warps={warps}, num_stages={stages}")
    print(" ".join(ln.strip() for ln in usage.splitlines() if "REG" in ln))
    print(f"dynamic shared memory {ck.metadata.shared} B a program")
    report(sass)
    if args.live:
        plr = run(os.path.join(tools, "nvdisasm"), "-plr", "-c", path("cubin"))
        live = [
            int(m.group(1))
            for ln in plr.splitlines()
            if (m := re.search(r";\s*//\s*\|\s*(\d+)", ln))
        ]
        print(f"peak live registers {max(live)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
