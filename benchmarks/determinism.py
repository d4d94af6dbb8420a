"""Determinism: the same inputs give bit-identical outputs on repeated runs, per implementation.

For each implementation ("xla" and "pallas": Pallas interpret mode on CPU, compiled
Triton kernels on a GPU) this hashes (sha256 of dtype, shape and bytes of every
output array) the results of:

* ``prefill``: ``oj.prefill`` of a ragged bf16 prompt into an INT2 OScaR cache (the
  whole cache pytree: codes, scales, zeros, norms, ring, lengths, flags);
* ``append``: ``oj.append`` token by token from there, past a flush of every row
  (the final cache);
* ``decode_attention``: ``oj.decode_attention`` after the prefill and after every
  append (all outputs);
* ``generate``: ``models.generate`` (greedy, ``implementation`` and
  the encoder and cache write with it) on a tiny random model: tokens and the info;
* ``step_logits``: ``models.prefill`` + ``models.decode_step`` logits (float32),
  which would show a last-bit difference that greedy tokens hide.

Runs: 1 and 2 in this process with the same compiled executables; with
``--recompile`` one more in this process after ``jax.clear_caches()`` (everything
recompiled: catches compile-time choices such as autotuning); with ``--subprocess``
one in a fresh Python process (fresh compile too). The inputs are rebuilt from
fixed seeds in every run and hashed too (``inputs``), so a difference is in the
computation, not the data. ``--ops`` picks a subset of the outputs. Exit status 1
if any hash differs.

    python3 -m benchmarks.determinism --recompile --subprocess --out out/determinism_cpu
    python3 -m benchmarks.determinism --gpu-sizes --recompile --out out/determinism_h200

Sizes: ``cpu`` (default, < 60 s on 2 CPU cores), ``tiny`` (the test), ``gpu`` (batch 4,
4096-token prompts, 8 KV heads, 32 query heads, head_dim 128; a 4-layer model).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import models
import oscar_jax as oj

SIZES = {
    "tiny": dict(batch=2, prompt=70, appends=30, kv_heads=1, q_heads=2, head_dim=64,
                 residual=32, model=(64, 64, 128, 1, 2, 1, 64), gen_prompt=70, gen_new=4),
    "cpu": dict(batch=2, prompt=200, appends=32, kv_heads=2, q_heads=8, head_dim=64,
                residual=64, model=(128, 64, 128, 2, 4, 2, 64), gen_prompt=100, gen_new=8),
    "gpu": dict(batch=4, prompt=4096, appends=48, kv_heads=8, q_heads=32, head_dim=128,
                residual=128, model=(1024, 512, 1024, 4, 8, 4, 128), gen_prompt=1024,
                gen_new=32),
}  # fmt: skip
# model = (vocab, hidden, intermediate, layers, heads, kv_heads, head_dim); the model's
# cache: INT2 OScaR with G = R = 32, so its prompts reach the INT2 part
OPS = ("inputs", "prefill", "append", "decode_attention", "generate", "step_logits")
IMPLS = ("xla", "pallas")


def digest(tree) -> str:
    """sha256 over (dtype, shape, bytes) of every leaf, in pytree order."""
    import numpy as np

    h = hashlib.sha256()
    for x in jax.tree_util.tree_leaves(tree):
        a = np.asarray(x)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


class Workload:
    """The jitted functions of one implementation (built once: runs 1 and 2 share them)."""

    def __init__(self, sz: dict, impl: str):

        self.sz, self.impl = sz, impl
        self.cfg = oj.preset("oscar", bits=2, group_size=32, residual_length=sz["residual"])
        self.gen_kv = oj.preset("oscar", bits=2, group_size=32, residual_length=32)
        max_len = sz["prompt"] + sz["appends"] + 8

        def start(k, v, n):
            c = oj.init_cache(self.cfg, batch=sz["batch"], max_len=max_len,
                              num_kv_heads=sz["kv_heads"], head_dim=sz["head_dim"],
                              dtype=jnp.bfloat16)  # fmt: skip
            return oj.prefill(c, k, v, n, implementation=impl)

        self.start = jax.jit(start)
        self.step = jax.jit(lambda c, k, v: oj.append(c, k, v, implementation=impl))
        self.dec = jax.jit(lambda q, c: oj.decode_attention(q, c, implementation=impl))

    def inputs(self, model: bool = True):
        import numpy as np

        sz = self.sz
        b, t, h, d = sz["batch"], sz["prompt"] + sz["appends"], sz["kv_heads"], sz["head_dim"]
        kk, kv, kq = jax.random.split(jax.random.key(0), 3)
        k = jax.random.normal(kk, (b, t, h, d)).at[..., :2].add(6.0)  # two massive channels
        v = jax.random.normal(kv, (b, t, h, d))
        q = jax.random.normal(kq, (b, sz["q_heads"], d))
        lengths = jnp.asarray(sz["prompt"] - 37 * (np.arange(b) % 2), jnp.int32)  # ragged
        data = dict(k=k.astype(jnp.bfloat16), v=v.astype(jnp.bfloat16), q=q.astype(jnp.bfloat16),
                    lengths=lengths)  # fmt: skip
        if not model:
            return data, None
        vocab, hidden, inter, layers, heads, kvh, hd = sz["model"]
        mc = models.ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                num_layers=layers, num_heads=heads, num_kv_heads=kvh,
                                head_dim=hd, max_position_embeddings=8192)  # fmt: skip
        m = models.CausalLM(mc, rngs=nnx.Rngs(0))
        m.set_params(jax.tree_util.tree_map(lambda a: a * 3.5 if a.ndim >= 2 else a, m.params()))
        rng = np.random.default_rng(0)
        ids = rng.integers(0, vocab, (b, sz["gen_prompt"])).astype(np.int32)
        gl = (sz["gen_prompt"] - 5 * (np.arange(b) % 2)).astype(np.int32)
        return dict(data, ids=ids, gen_lengths=gl), m

    def run(self, ops=OPS) -> dict[str, str]:

        out = self._cache_ops(ops)
        if "generate" not in ops and "step_logits" not in ops:
            return out
        data, m = self.inputs()
        out["inputs"] = digest((data, m.params()))
        kw = dict(kv=self.gen_kv, lengths=data["gen_lengths"], implementation=self.impl,
                  stop_tokens=())  # fmt: skip
        if "generate" in ops:
            toks, info = models.generate(m, data["ids"], self.sz["gen_new"], return_info=True, **kw)
            out["generate"] = digest((toks, info))
        if "step_logits" not in ops:
            return out
        kw.pop("lengths")
        logits, caches, prep = models.prefill(m, data["ids"], lengths=data["gen_lengths"],
                                              max_new_tokens=4, **kw)  # fmt: skip
        seq = [logits]
        tok = np.asarray(logits.argmax(-1), np.int32)
        for i in range(3):
            logits, caches = models.decode_step(prep, caches, tok, data["gen_lengths"] + i)
            seq.append(logits)
            tok = np.asarray(logits.argmax(-1), np.int32)
        out["step_logits"] = digest(seq)
        return out

    def _cache_ops(self, ops) -> dict[str, str]:

        data, _ = self.inputs(model=False)
        k, v, q, n = data["k"], data["v"], data["q"], data["lengths"]
        p = self.sz["prompt"]
        out = {"inputs": digest(data)}
        if not {"prefill", "append", "decode_attention"} & set(ops):
            return out
        c = self.start(k[:, :p], v[:, :p], n)
        out["prefill"] = digest(c)
        att = [self.dec(q, c)] if "decode_attention" in ops else []
        for i in range(self.sz["appends"] if {"append", "decode_attention"} & set(ops) else 0):
            c = self.step(c, k[:, p + i], v[:, p + i])
            if "decode_attention" in ops:
                att.append(self.dec(q, c))
        assert not np.any(np.asarray(c.flags)), "clean inputs must not flag"
        out["append"] = digest(c)
        out["decode_attention"] = digest(att)
        return {op: h for op, h in out.items() if op in ops}


def run_all(sizes: str, impls, ops=OPS, recompile: bool = False) -> list[dict]:
    """[{label, seconds, hashes: {impl: {op: sha256}}}] for the runs in this process."""

    work = {i: Workload(SIZES[sizes], i) for i in impls}
    labels = ["in-process", "in-process, same executables"]
    runs = []
    for r, label in enumerate(labels + ["in-process, recompiled"] * recompile):
        if r == 2:
            jax.clear_caches()
            work = {i: Workload(SIZES[sizes], i) for i in impls}
        t0 = time.perf_counter()
        hashes = {i: w.run(ops) for i, w in work.items()}
        runs.append(dict(label=label, seconds=round(time.perf_counter() - t0, 1), hashes=hashes))
    return runs


def child_run(args) -> dict:
    """One run in a fresh interpreter (the same script with --child)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "child.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--sizes", args.sizes, "--impls",
               ",".join(args.impls), "--ops", ",".join(args.ops), "--child", path]  # fmt: skip
        t0 = time.perf_counter()
        # a fresh compile too: not executables a persistent compilation cache would hand back
        subprocess.run(cmd, check=True, env=dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false"))
        with open(path) as f:
            hashes = json.load(f)
    return dict(label="fresh subprocess", seconds=round(time.perf_counter() - t0, 1), hashes=hashes)


def summarize(runs: list[dict], impls, ops) -> dict:
    ident = {i: {op: len({r["hashes"][i][op] for r in runs}) == 1 for op in ops} for i in impls}
    return dict(identical=ident, all_identical=all(all(d.values()) for d in ident.values()))


def markdown(res: dict) -> str:
    runs = res["runs"]
    lines = [
        f"# Determinism ({res['platform']})", "",
        f"Command: `{res['command']}`; {res['date']}; jax {res['jax']}, {res['device']}.", "",
        "Same inputs (rebuilt from fixed seeds in every run), sha256 of the output bytes. "
        f"Sizes `{res['sizes']}`: {json.dumps(SIZES[res['sizes']])}.", "",
        "Runs: " + "; ".join(f"{k + 1}: {r['label']} ({r['seconds']} s)" for k, r in
                             enumerate(runs)) + ".", "",  # fmt: skip
        "| implementation | output | sha256 (first 16 hex, run 1) | runs | bit-identical |",
        "|---|---|---|---|---|",
    ]  # fmt: skip
    for i in res["impls"]:
        for op in res["ops"]:
            same = res["identical"][i][op]
            lines.append(f"| {i} | {op} | `{runs[0]['hashes'][i][op][:16]}` | {len(runs)} | "
                         f"{'yes' if same else '**NO**'} |")  # fmt: skip
    verdict = "all bit-identical" if res["all_identical"] else "**DIFFERENCES FOUND**"
    lines += ["", f"Result: {verdict} ({len(runs)} runs x {len(res['impls'])} implementations "
              f"x {len(res['ops'])} outputs)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", choices=sorted(SIZES), default="cpu")
    ap.add_argument("--gpu-sizes", action="store_true", help="same as --sizes gpu")
    ap.add_argument("--impls", default=",".join(IMPLS), type=lambda s: tuple(s.split(",")))
    ap.add_argument("--ops", default=",".join(OPS), type=lambda s: tuple(s.split(",")))
    ap.add_argument("--recompile", action="store_true", help="add a run after clear_caches")
    ap.add_argument("--subprocess", action="store_true", help="add a run in a fresh process")
    ap.add_argument("--out", default="out/determinism",
                    help="path prefix for .json and .md ('-': stdout only)")  # fmt: skip
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.gpu_sizes:
        args.sizes = "gpu"
    bad = [i for i in args.impls if i not in IMPLS] + [o for o in args.ops if o not in OPS]
    if bad:
        ap.error(f"{bad} must be among --impls {IMPLS} / --ops {OPS}")
    args.ops = tuple(o for o in OPS if o in ("inputs", *args.ops))

    if args.child:
        hashes = {i: Workload(SIZES[args.sizes], i).run(args.ops) for i in args.impls}
        with open(args.child, "w") as f:
            json.dump(hashes, f)
        return 0
    runs = run_all(args.sizes, args.impls, args.ops, args.recompile)
    if args.subprocess:
        runs.append(child_run(args))
    dev = jax.devices()[0]
    res = dict(
        command=" ".join(["python3 -m benchmarks.determinism", *sys.argv[1:]]),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), jax=jax.__version__,
        platform=dev.platform, device=f"{dev.device_kind} ({platform.machine()})",
        sizes=args.sizes, impls=list(args.impls), ops=list(args.ops), runs=runs,
        **summarize(runs, args.impls, args.ops),
    )  # fmt: skip
    md = markdown(res)
    if args.out == "-":
        print(md)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(res, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(md)
        print(md)
    return 0 if res["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
