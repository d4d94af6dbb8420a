"""Find the instructions of a compiled HLO module that write a whole KV-cache array.

A decode step should read each cache byte once (the attention) and write only what
changes, by in-place ``dynamic-update-slice`` / ``scatter`` of a part. Anything else
producing a whole cache array (a ``copy``, a ``dynamic-slice`` of a layer out of stacked
caches, an in-place update whose update is a whole layer, a fusion rewriting it, a
``broadcast`` zeroing a scan's output) moves all of it again. Shapes match on dims only
(the CPU compiler computes bfloat16 in float32)::

    print(format_copies(whole_cache_copies(compiled.as_text(), cache_shapes(caches))))

The same scan finds weight copies (``weight_shapes``): a layer sliced out of stacked
[L, ...] params is a copy wherever it feeds a GEMM at larger batch (and on the CPU).
From the command line, one decode step (``models.step_program``, all layers) of a model
is compiled from abstract shapes (nothing allocated: full-size configs compile on the
CPU) for each cache / batch / params layout, and its whole-cache and whole-weight
writes are counted::

    python3 -m benchmarks.hlo_copies --model llama31_8b --batch 1,48 --caches bf16,oscar2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

import models
from benchmarks import e2e_common as ec
from models import layers, memory

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip
_INSTR = re.compile(  # [ROOT] %name = type opcode(operands), attributes
    r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+([\w\-]+)\((.*)$"
)
_COMP = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_CALLEE = re.compile(r"(?:calls|body|condition|to_apply|branch_computations)=\{?%([\w.\-]+)")
_OPERAND = re.compile(r"%([\w.\-]+)")
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
         "constant", "custom-call", "after-all", "opt-barrier", "fusion-done", "copy-done",
         "all-reduce", "all-gather", "collective-permute", "async-start", "async-done"}  # fmt: skip
_INPLACE = ("dynamic-update-slice", "scatter")


@dataclasses.dataclass(frozen=True)
class Instr:
    computation: str
    name: str
    opcode: str
    dtype: str
    dims: tuple[int, ...]
    detail: str = ""  # a fusion's root opcode

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64)) * _BYTES.get(self.dtype, 4)

    def __str__(self) -> str:
        what = f"{self.opcode}({self.detail})" if self.detail else self.opcode
        dims = ",".join(map(str, self.dims))
        return f"{self.computation}: %{self.name} = {self.dtype}[{dims}] {what}  {self.nbytes} B"


def parse(hlo_text: str) -> dict[str, list[tuple]]:
    """computation -> [(name, type text, opcode, operands and attributes, is_root)]."""
    comps: dict[str, list] = {}
    cur = None
    for line in hlo_text.splitlines():
        line = re.sub(r"/\*.*?\*/", "", line)  # /*index=5*/ comments
        m = _COMP.match(line)
        if m and "=" not in line.split("(")[0]:
            cur = comps.setdefault(m.group(1), [])
        elif (m := _INSTR.match(line)) and cur is not None:
            cur.append((m.group(2), m.group(3), m.group(4), m.group(5), bool(m.group(1))))
    return comps


def _dims(typ: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(x) for x in d.split(",") if x)) for dt, d in _ARRAY.findall(typ)]


def _roots(comps, comp: str) -> list[tuple]:
    """The instructions producing a fused computation's result(s), through bitcasts/tuples."""
    by_name = {i[0]: i for i in comps.get(comp, [])}
    todo, out = [i for i in comps.get(comp, []) if i[4]][:1], []
    while todo:
        ins = todo.pop()
        if ins[2] in ("bitcast", "tuple"):
            todo += [by_name[o] for o in _OPERAND.findall(ins[3].split("),")[0]) if o in by_name]
        else:
            out.append(ins)
    return out


def _update(ins, types: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of the update operand of an in-place op (dynamic-update-slice, scatter)."""
    ops = _OPERAND.findall(ins[3].split("),")[0])
    k = 1 if ins[2] == "dynamic-update-slice" else len(ops) - 1
    return _dims(types.get(ops[k], "")) if 0 <= k < len(ops) else []


def cache_shapes(tree, stacked: bool = False) -> set[tuple[int, ...]]:
    """Dims of the big arrays of a pytree of caches (``stacked``: also each layer's, [1:])."""
    out = {tuple(x.shape) for x in jax.tree_util.tree_leaves(tree) if np.prod(x.shape) > 1024}
    return out | {s[1:] for s in out} if stacked else out


def weight_shapes(params) -> set[tuple[int, ...]]:
    """Dims of the weight matrices of a params tree: each layer's (the leading layer axis
    dropped when stacked), the embedding and the head (vectors: norms and biases are left
    out, their dims are an activation's at batch 1)."""
    lay = params["layers"]
    stacked = not isinstance(lay, tuple | list)
    top = [x for k, x in params.items() if k != "layers"]
    out = {tuple(x.shape[1:] if stacked else x.shape) for x in jax.tree_util.tree_leaves(lay)}
    out |= {tuple(x.shape) for x in top}
    return {s for s in out if len(s) >= 2 and np.prod(s) > 1024}


def loop_computations(hlo_text: str) -> set[str]:
    """Computations that run inside a ``while`` loop (bodies and what they call)."""
    comps = parse(hlo_text)
    todo = [c for i in comps.values() for x in i if x[2] == "while"
            for c in re.findall(r"body=%([\w.\-]+)", x[3])]  # fmt: skip
    seen: set[str] = set()
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            todo += [d for x in comps.get(c, []) for d in _CALLEE.findall(x[3])]
    return seen


def whole_cache_copies(hlo_text: str, shapes, min_bytes: int = 0) -> list[Instr]:
    """Instructions (outside fused computations) that write a whole array of ``shapes``
    (dims, or with a leading 1): all but pass-through ops and in-place updates of a part."""
    want = {tuple(s) for s in shapes} | {(1, *s) for s in shapes}
    comps = parse(hlo_text)
    fused = {c for i in comps.values() for x in i if x[2] in ("fusion", "fusion-start")
             for c in _CALLEE.findall(x[3])}  # fmt: skip
    found = []

    def add(comp, name, op, arrays, detail=""):
        for dt, d in arrays[:1]:  # copy-start: the first array is the destination
            if d in want and (ins := Instr(comp, name, op, dt, d, detail)).nbytes >= min_bytes:
                found.append(ins)

    for comp, instrs in comps.items():
        if comp in fused:
            continue
        types = {i[0]: i[1] for i in instrs}
        for ins in instrs:
            name, typ, op, args, _ = ins
            callee = (_CALLEE.findall(args) or [""])[0]
            ctypes = {i[0]: i[1] for i in comps.get(callee, [])}
            fusion = op in ("fusion", "fusion-start")
            todo = [(r, ctypes) for r in _roots(comps, callee)] if fusion else [(ins, types)]
            for r, tys in todo:
                if r[2] in _INPLACE:  # a whole layer written into a bigger array counts
                    upd = _update(r, tys)
                    add(comp, name, op, upd, f"{r[2]} of a whole array" if upd else "")
                elif op not in _FREE:
                    add(comp, name, op, _dims(r[1]), r[2] if r is not ins else "")
    return found


def format_copies(found: list[Instr]) -> str:
    """One line per instruction, then the count and total bytes."""
    total = f"{len(found)} whole-cache writes, {sum(i.nbytes for i in found)} B"
    return "\n".join([*map(str, found), total])


# -- command line: copies in one compiled decode step of a full-size model -------------------
def step_copies(cfg, spec, batch: int, ctx: int, per_layer: bool, dtype: str,
                dump: str = "") -> dict:  # fmt: skip
    """Compile one donated decode step from abstract shapes -> copy counts and bytes
    (``dump``: a folder for the compiled HLO text, one file per step)."""
    st = models.Static(
        model=cfg, kv=spec.kv, max_len=ctx, cache_dtype=dtype,
        backends=models.Backends(attention=spec.impl, prompt_attention="reference"),
        greedy=True, top_k=None, use_top_p=False, stop_tokens=(), pad_id=0,
    )  # fmt: skip
    params = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s, jnp.dtype(dtype)),
                                    layers.param_shapes(cfg, per_layer=per_layer),
                                    is_leaf=layers.is_shape)  # fmt: skip
    caches = (memory.abstract_cache(cfg, spec.kv, batch=batch, max_len=ctx, dtype=dtype),)
    caches *= cfg.num_layers
    tok = jax.ShapeDtypeStruct((batch,), jnp.int32)
    t = time.perf_counter()
    text = models.step_program(donate=True).lower(st, params, caches, tok, tok).compile().as_text()
    layout = "layers" if per_layer else "stacked"
    if dump:
        os.makedirs(dump, exist_ok=True)
        name = f"{spec.label.replace(':', '_')}_b{batch}_{layout}.hlo.txt"
        with open(os.path.join(dump, name), "w") as f:
            f.write(text)
    out = dict(cache=spec.label, batch=batch, ctx=ctx, layout=layout,
               dtype=dtype, compile_s=round(time.perf_counter() - t, 1))  # fmt: skip
    for what, shapes in (("weight", weight_shapes(params)), ("cache", cache_shapes(caches))):
        found = whole_cache_copies(text, shapes)
        out[f"{what}_copies"], out[f"{what}_bytes"] = len(found), sum(i.nbytes for i in found)
        out[f"{what}_first"] = [str(i) for i in found[:3]]
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description="Whole-weight / whole-cache writes of a decode step")
    ap.add_argument("--model", default="llama31_8b", help="llama31_8b or qwen3_8b")
    ap.add_argument("--tiny", action="store_true", help="the 2-layer config of the same family")
    ap.add_argument("--batch", default="1,48", help="batch sizes, comma separated")
    ap.add_argument("--ctx", type=int, default=4096, help="cache length (max_len)")
    ap.add_argument("--caches", default="bf16,oscar2", help="name[:impl],... (e2e_common)")
    ap.add_argument("--layouts", default="stacked,layers", help="params: stacked, layers")
    ap.add_argument(
        "--dtype",
        default="float32",
        help="params and caches (bfloat16 on the CPU adds whole-array converts)",
    )
    ap.add_argument("--dump", default="", help="folder for each step's compiled HLO text")
    ap.add_argument("--out", default="out/hlo_copies.json",
                    help="JSON file for the results ('': none)")  # fmt: skip
    a = ap.parse_args(argv)
    cfg = ec.model_config(a.model, a.tiny)
    bad = [x for x in a.layouts.split(",") if x not in ("stacked", "layers")]
    if bad:
        ap.error(f"layouts {bad} must be stacked or layers")
    rows = []
    for spec in ec.parse_caches(a.caches, "xla"):
        for b in (int(x) for x in a.batch.split(",")):
            for lay in a.layouts.split(","):
                r = step_copies(cfg, spec, b, a.ctx, lay == "layers", a.dtype, a.dump)
                rows.append(r)
                print(f"{r['cache']:12s} b={b:<4d} {lay:8s} weights: {r['weight_copies']:4d} "
                      f"copies {r['weight_bytes'] / 2**30:7.3f} GiB | caches: "
                      f"{r['cache_copies']} copies {r['cache_bytes'] / 2**30:.3f} GiB  "
                      f"({r['compile_s']} s compile)", flush=True)  # fmt: skip
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(dict(model=a.model, tiny=a.tiny, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
