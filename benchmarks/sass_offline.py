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
from pallas_kernels import register_cap
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
    ap.add_argument("what", choices=("quantize", "decode", "ncu"))
    ap.add_argument("outdir", help="output folder (ncu: the source export to read)")
    ap.add_argument("--opts", default="{}", help="JSON options (see the module docstring)")
    ap.add_argument("--live", action="store_true", help="peak live registers (nvdisasm -plr)")
    args = ap.parse_args(argv)
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
