"""Sharded decoding on several GPUs against one.

Llama-3.1-8B-shaped pseudo-random bf16 weights, the ``bf16`` and OScaR INT2 caches, the
mesh support of ``models.generate`` (axes data / model / sequence, ``models.sharding``).
``--impl`` (default xla) is the decode attention of every run, sharded (the per-shard
partial of ``sharded_decode_attention``) and one-GPU alike; ``--caches oscar2:pallas``
sets it per cache (the unit names then carry it: ``seq128k/oscar2:pallas/seq``).
N = all visible devices (``--devices``). Meshes: ``seq`` (1, 1, N), ``model`` (1, N, 1),
``data`` (N, 1, 1), ``1gpu`` (no mesh, device 0). Workloads (``--workloads``, in order;
``--budget-s`` skips the rest):

* ``check``: greedy tokens, sharded vs one GPU, ``--check-steps`` steps after a real
  prefill of a random 2-row prompt (2K tokens) through the random model. The one-GPU run
  picks its tokens; the sharded run is fed the same tokens (teacher forcing) and its
  argmax is compared at every step (equal at every step <=> equal free-running greedy
  sequences), then also run free. Mismatches, the logits' max |difference| and how many
  mismatches are near ties (one-GPU top-2 gap <= 2 x that step's max difference). Pallas
  caches run with aligned splits (``--check-bps``, ``sharded_check.aligned_impl``).
* ``seq128k`` / ``seq512k``: ms per token at batch 1, one GPU vs ``seq``. A run that does
  not fit (analytic bytes, then the compiled program's memory analysis) is reported so.
* ``maxctx``: the largest context per cache on 1 and N GPUs (sequence sharding), from the
  bytes per token, the weights per device and the measured temp / cache ratio; then
  decoded at that context (``--maxctx-verify``, shrunk until the compiled program fits).
* ``tp48x4k``: tokens/s at batch 48 x 4K on ``--tp-meshes`` (default 1gpu,data,model).
* ``tpmax32k``: tokens/s at the largest batch that fits at 32K on ``--tpmax-meshes``.

    NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 python3 -m benchmarks.bench_sharded --out out/sharded
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python3 -m benchmarks.bench_sharded --tiny
"""

from __future__ import annotations

import os
import sys

if os.environ.get("NCCL_NVLS_ENABLE", "0") != "0":
    sys.exit("NCCL_NVLS_ENABLE must be 0 (NVLink multicast stays off on these machines)")
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")  # before JAX starts

import argparse  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, SingleDeviceSharding  # noqa: E402

import models  # noqa: E402
from benchmarks import e2e_common as ec  # noqa: E402
from benchmarks import e2e_fill as ef  # noqa: E402
from benchmarks.e2e_report import Runner, sharded_summary  # noqa: E402
from benchmarks.sharded_check import CheckUnits  # noqa: E402
from models import layers, memory  # noqa: E402
from models import sharding as msh  # noqa: E402

ORDER = ("check", "seq128k", "seq512k", "maxctx", "tp48x4k", "tpmax32k")
FULL = dict(check=(2, 2048), seq128k=(1, 131072), seq512k=(1, 524288), tp48x4k=(48, 4096),
            tpmax32k=(None, 32768))  # fmt: skip
# tiny: shapes shared where possible (one compile each): seq512k reuses seq128k's programs,
# tpmax32k (8 rows "fit" without memory stats) tp48x4k's
TINY = dict(check=(2, 200), seq128k=(1, 1024), seq512k=(1, 1024), tp48x4k=(8, 1024),
            tpmax32k=(None, 1024))  # fmt: skip


class Bench(CheckUnits):
    def __init__(self, args, runner: Runner):
        self.a, self.r = args, runner
        self.devs = jax.devices()[: args.devices or None]
        self.n = len(self.devs)
        self.dev0 = self.devs[0]
        self.sizes = TINY if args.tiny else FULL
        self.cfg = ec.model_config("llama31_8b", args.tiny)
        self.caches = ec.parse_caches(args.caches, args.impl)
        self.dtype = jnp.dtype(args.dtype)
        self._params: dict = {}
        self.programs: dict = {}

    def mesh(self, name: str):
        shape = dict(seq=(1, 1, self.n), model=(1, self.n, 1), data=(self.n, 1, 1))
        if name == "1gpu":
            return None
        if name == "hybrid":  # model x sequence, for 4 or more devices
            shape["hybrid"] = (1, 2, self.n // 2)
        return Mesh(np.array(self.devs).reshape(shape[name]), ("data", "model", "sequence"))

    def params(self, layout: str, exclusive: bool = False):
        """Weights in one layout (the same values in every layout: index-hashed init)."""
        if exclusive:
            for k in [k for k in self._params if k != layout]:
                ef.delete(self._params.pop(k))
        if layout not in self._params:
            mesh = self.mesh(layout)
            sh = ec.param_shardings(self.cfg, mesh, self.dev0)
            self._params[layout] = p = ef.random_params(self.cfg, sh, self.a.seed, self.dtype)
            jax.block_until_ready(p)
        return self._params[layout]

    def shardings(self, layout, batch):
        mesh = self.mesh(layout)
        return mesh, (SingleDeviceSharding(self.dev0) if mesh is None else msh.rows(mesh))

    def pabs(self, params):
        return jax.tree_util.tree_map(lambda x: ec.abstract(x.shape, x.dtype, x.sharding), params)

    # -- correctness -------------------------------------------------------------------
    def program(self, spec, layout, batch, ctx, params):
        """The compiled decode loop of (cache, layout, batch, context): one compile each."""
        key = (spec.label, layout, batch, ctx)
        if key in self.programs:
            compiled, info = self.programs[key]
            return compiled, dict(info, compile_s=0.0, lower_s=0.0, reused=True)
        mesh, rows = self.shardings(layout, batch)
        st = ec.static(self.cfg, spec.kv, ctx, spec.impl, self.a.encode_impl, mesh=mesh,
                       dtype=self.dtype)  # fmt: skip
        if mesh is not None:
            models.check_mesh(self.cfg, spec.kv, mesh, st.axes, batch, ctx, spec.impl)
        cabs = ef.abstract_caches(
            self.cfg, spec.kv, batch, ctx, mesh=mesh, device=self.dev0, dtype=self.dtype
        )
        tok_abs = ec.abstract((batch,), jnp.int32, rows)
        self.programs[key] = ec.compile_decode(st, self.pabs(params), cabs, tok_abs)
        return self.programs[key]

    # -- timed decoding ------------------------------------------------------------------
    def decode_unit(self, spec, layout, batch, ctx, steps, repeats, exclusive=False):
        a, cfg = self.a, self.cfg
        mesh, rows = self.shardings(layout, batch)
        params = self.params(layout, exclusive)
        cabs = ef.abstract_caches(
            cfg, spec.kv, batch, ctx, mesh=mesh, device=self.dev0, dtype=self.dtype
        )
        per_dev = self.cache_bytes_per_device(cabs)
        ms = ec.memory_stats(self.dev0, a.mem_limit_gib * ec.GiB if a.mem_limit_gib else None)
        limit = ms["bytes_limit"]
        fit = self.fits(spec, layout, per_dev, ms)
        if fit is False:
            return dict(status="does not fit (analytic)", cache_bytes_per_device=per_dev,
                        bytes_limit=limit, bytes_in_use=ms["bytes_in_use"])  # fmt: skip
        compiled, cinfo = self.program(spec, layout, batch, ctx, params)
        need = per_dev + cinfo.get("temp_bytes", 0)
        if limit and ms["bytes_in_use"] + need > limit:
            return dict(status="does not fit (compiled memory analysis)", need_bytes=need,
                        bytes_limit=limit, bytes_in_use=ms["bytes_in_use"], **cinfo)  # fmt: skip
        n_fill = ctx - steps[1] - 1
        t = time.perf_counter()
        caches = ef.make_caches(cabs, n_fill, a.fill, a.seed)
        jax.block_until_ready(caches)
        fill_s = time.perf_counter() - t
        tok = jax.device_put(jnp.arange(batch, dtype=jnp.int32) % cfg.vocab_size, rows)
        try:
            res, args = ec.time_steps(compiled, ec.decode_args(params, caches, tok), steps, repeats)
            ef.delete(args[1])
        finally:
            ef.delete(caches)
        return dict(res, mesh=str(tuple(mesh.shape.values())) if mesh else "1 device",
                    batch=batch, context=ctx, filled_tokens=n_fill, cache=spec.name, impl=spec.impl,
                    tokens_per_s=batch / (res["ms_per_step"] * 1e-3), fill_s=fill_s,
                    cache_bytes_per_device=per_dev,
                    temp_over_cache=cinfo.get("temp_bytes", 0) / max(per_dev, 1),
                    **cinfo)  # fmt: skip

    def cache_bytes_per_device(self, cabs) -> int:
        """Bytes of the caches on device 0 (from the shardings' shard shapes)."""
        tot = 0
        for x in jax.tree_util.tree_leaves(cabs):
            shp = x.sharding.shard_shape(x.shape)
            tot += int(np.prod(shp)) * x.dtype.itemsize
        return tot

    def fits(self, spec, layout, per_dev, ms):
        """False when the cache plus the measured temp ratio (from a smaller run) cannot fit."""
        limit = ms["bytes_limit"]
        if not limit:
            return None
        ratio = self.temp_ratio(spec.name, layout)
        return ms["bytes_in_use"] + per_dev * (1 + ratio) <= limit

    def temp_ratio(self, cache, layout) -> float:
        rs = [u["temp_over_cache"] for k, u in self.r.data["units"].items()
              if u.get("status") == "ok" and u.get("cache") == cache and "temp_over_cache" in u
              and k.split("/")[2] == layout]  # fmt: skip
        return max(rs) if rs else 0.0

    def maxctx_unit(self, spec):
        """Largest context per cache on 1 and N devices (sequence mesh): analytic, then
        decoded at (``verify_context``) on the meshes of ``--maxctx-verify``."""
        a, cfg = self.a, self.cfg
        ms = ec.memory_stats(self.dev0, a.mem_limit_gib * ec.GiB if a.mem_limit_gib else None)
        shapes = layers.param_shapes(cfg)
        weights = self.dtype.itemsize * sum(
            int(np.prod(v))
            for v in jax.tree_util.tree_leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
        )  # replicated over sequence
        limit = ms["bytes_limit"] or weights + a.tiny_rows * (1 << 20)  # tiny: pretend
        nbytes = lambda n: ef.tree_nbytes(
            memory.abstract_caches(  # noqa: E731
                cfg, spec.kv, batch=1, max_len=n, dtype=self.dtype
            )
        )
        lo, hi = 1 << 18, 1 << 19
        per_tok = (nbytes(hi) - nbytes(lo)) / (hi - lo)
        margin = max(a.margin_gib * ec.GiB, 0.02 * limit) if ms["bytes_limit"] else 0
        out = {}
        for n, layout in ((1, "1gpu"), (self.n, "seq")):
            ratio = self.temp_ratio(spec.name, layout)
            ctx = int((limit - weights - margin) / (per_tok / n * (1 + ratio)))
            out[str(n)] = dict(analytic_context=ctx // (256 * n) * (256 * n), temp_ratio=ratio,
                               bytes_per_token_per_device=per_tok / n)  # fmt: skip
        res = dict(analytic_context=out[str(self.n)]["analytic_context"], per_devices=out,
                   weights_bytes_per_device=weights, bytes_limit=limit, margin=margin)  # fmt: skip
        layouts = {"none": (), "seq": ("seq",), "all": ("seq", "1gpu")}[a.maxctx_verify]
        if not ms["bytes_limit"]:
            layouts = ()  # no memory statistics (CPU): nothing to verify against
        res["verified"] = {
            lay: self.verify_context(spec, lay, out[str(1 if lay == "1gpu" else self.n)])
            for lay in layouts
        } or "not run"
        return res

    def verify_context(self, spec, layout, est):
        """Decode at the analytic largest context; less after each failure (3 tries): 5%, or
        what the compiled program's memory analysis says is missing."""
        mult = 256 * (1 if layout == "1gpu" else self.n)
        ctx, tries = est["analytic_context"], []
        while ctx >= mult and len(tries) < 3:
            try:
                res = self.decode_unit(spec, layout, 1, ctx, self.a.maxctx_steps, 1, exclusive=True)
            except Exception as e:  # noqa: BLE001
                if not ec.is_oom(e):
                    raise
                res = dict(status="error: " + str(e)[:200])
            if res.get("status", "ok") == "ok":
                keep = ("ms_per_step", "tokens_per_s", "cache_bytes_per_device", "filled_tokens")
                return dict(context=ctx, tries=tries, **{k: res[k] for k in keep if k in res})
            tries.append(dict(context=ctx, status=res["status"]))
            shrink = 0.95
            if res.get("need_bytes"):  # the compiled program's own count: scale to fit
                free = res["bytes_limit"] - res["bytes_in_use"]
                shrink = min(shrink, 0.99 * free / res["need_bytes"])
            ctx = int(ctx * shrink) // mult * mult
        return dict(context=None, tries=tries)

    def tpmax_unit(self, spec, layout, ctx, steps, repeats):
        a, cfg = self.a, self.cfg
        mesh, rows = self.shardings(layout, 1)
        params = self.params(layout, exclusive=True)
        ms = ec.memory_stats(self.dev0, a.mem_limit_gib * ec.GiB if a.mem_limit_gib else None)
        nd = mesh.shape["data"] if mesh else 1  # rows are split over the data axis
        one = ef.abstract_caches(
            cfg, spec.kv, nd, ctx, mesh=mesh, device=self.dev0, dtype=self.dtype
        )
        row = self.cache_bytes_per_device(one) // nd  # device-0 bytes per row of the batch
        stats = bool(ms["bytes_limit"])
        limit = ms["bytes_limit"] or ms["bytes_in_use"] + a.tiny_rows * row
        margin = max(a.margin_gib * ec.GiB, 0.02 * limit) if stats else 0
        free = int(limit - ms["bytes_in_use"] - margin)

        def build(b):
            return self.program(spec, layout, b, ctx, params)

        fit, compiled, cinfo = ec.fit_batch(build, row, free, multiple=nd, check=stats)
        fit.update(bytes_limit=limit, bytes_in_use=ms["bytes_in_use"], margin=margin)
        b, attempts = fit["batch"], []
        while b >= nd and len(attempts) < 3:
            try:
                res = self.decode_unit(spec, layout, b, ctx, steps, repeats, exclusive=True)
                return dict(res, fit=fit, attempts=attempts, verified_batch=b)
            except Exception as e:  # noqa: BLE001
                if not ec.is_oom(e):
                    raise
                attempts.append(dict(batch=b, error=str(e)[:200]))
                b = int(b * 0.9) // nd * nd
        return dict(status="error: no batch fits", fit=fit, attempts=attempts)

    # -- driver ---------------------------------------------------------------------------
    def run(self):
        a = self.a
        work = list(a.workloads)
        if a.check_prefill == "decode" and "check" in work and "seq128k" in work:
            work.remove("seq128k")  # run with the check, cache by cache: they share programs
        for w in work:
            for c in self.caches:
                self.units(w, c)
                if w == "check" and "seq128k" in a.workloads and "seq128k" not in work:
                    self.units("seq128k", c)

    def units(self, w: str, c: ec.CacheSpec):
        a, r, part = self.a, self.r, functools.partial
        name = c.name if c.impl == "xla" else c.label  # unit names: xla runs keep theirs
        if w == "check":
            layout = a.check_mesh if a.check_mesh != "auto" else "seq" if self.n < 4 else "hybrid"
            fn = self.check_unit if a.check_prefill == "real" else self.check_decode_unit
            r.unit(f"check/{name}/{layout}", part(fn, c, layout))
        elif w in ("seq128k", "seq512k"):
            b, ctx = self.sizes[w]
            steps, reps = (a.steps, a.repeats) if w == "seq128k" else (a.tp_steps, 1)
            for layout in ("seq", "1gpu"):
                fn = part(self.decode_unit, c, layout, b, ctx, steps, reps, w == "seq512k")
                compiled = (c.label, layout, b, ctx) in self.programs  # e.g. by the check
                r.unit(f"{w}/{name}/{layout}", fn, grace_s=a.grace_s if compiled else 0.0)
        elif w == "maxctx":
            r.unit(f"maxctx/{name}/{self.n}", part(self.maxctx_unit, c), grace_s=1e9)  # analytic
        elif w == "tp48x4k":
            b, ctx = self.sizes[w]
            for layout in a.tp_meshes:
                fn = part(self.decode_unit, c, layout, b, ctx, a.tp_steps, a.tp_repeats)
                r.unit(f"{w}/{name}/{layout}", fn)
        elif w == "tpmax32k":
            for layout in a.tpmax_meshes:
                fn = part(self.tpmax_unit, c, layout, self.sizes[w][1], a.tp_steps, a.tp_repeats)
                r.unit(f"{w}/{name}/{layout}", fn)


def _list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip() and x.strip() != "none"]


def _steps(s: str) -> tuple[int, int]:
    n1, n2 = (int(x) for x in s.split(","))
    if not 0 <= n1 < n2:
        raise argparse.ArgumentTypeError(f"steps={s!r} must be 'n1,n2' with 0 <= n1 < n2")
    return n1, n2


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", type=_list, default=list(ORDER))
    ap.add_argument("--caches", default="bf16,oscar2")
    ap.add_argument("--impl", default="xla", choices=("xla", "pallas"), help="decode attention")
    ap.add_argument("--devices", type=int, default=0, help="use the first N devices (0: all)")
    ap.add_argument("--encode-impl", default="xla", choices=("xla", "pallas"),
                    help="decode-time cache writes and flush encoder (pallas: one fused "
                    "write per layer, unsharded or without a sequence axis)")  # fmt: skip
    ap.add_argument("--check-mesh", default="auto", choices=("auto", "seq", "model", "data",
                                                             "hybrid"))  # fmt: skip
    ap.add_argument("--check-steps", type=int, default=None)
    ap.add_argument("--check-prompt", type=int, default=192, help="prompt tokens, decode mode")
    ap.add_argument(
        "--check-prefill",
        default="decode",
        choices=("decode", "real"),
        help="decode: the prompt token by token through the seq128k programs (no "
        "extra compile); real: generate's prefill + scan (2 compiles a cache)",
    )
    ap.add_argument(
        "--maxctx-verify", default="seq", choices=("none", "seq", "all"),
        help="maxctx: decode at the analytic context on these meshes (all: also one GPU)",
    )  # fmt: skip
    ap.add_argument("--maxctx-steps", type=_steps, default=(1, 3), help="maxctx verify steps")
    ap.add_argument(
        "--check-bps", type=int, default=1,
        help="check, Pallas caches: blocks per split of both runs (0: the heuristic); 1 aligns "
        "the splits with the shard boundaries, so the runs differ only by float32 merge order",
    )  # fmt: skip
    ap.add_argument("--tp-meshes", type=_list, default=["1gpu", "data", "model"])
    ap.add_argument("--tpmax-meshes", type=_list, default=["model", "1gpu"])
    ap.add_argument("--fill", default="random", choices=("random", "zeros", "encode"))
    ap.add_argument(
        "--dtype",
        default=None,
        help="weights and cache (bfloat16; tiny: float32, "
        "where float rounding cannot flip a greedy token)",
    )
    ap.add_argument("--steps", type=_steps, default=None)
    ap.add_argument("--tp-steps", type=_steps, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--tp-repeats", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=0.0, help="skip units after this (0: none)")
    ap.add_argument(
        "--grace-s",
        type=float,
        default=45.0,
        help="extra budget for timing units whose program is already compiled",
    )
    ap.add_argument("--mem-limit-gib", type=float, default=0.0)
    ap.add_argument("--margin-gib", type=float, default=1.0)
    ap.add_argument("--tiny-rows", type=int, default=8, help="no memory stats: rows that fit")
    ap.add_argument("--jax-cache", default="")
    ap.add_argument("--resume", default="", help="earlier JSON: its ok units are kept, not re-run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--partitioner", default=None, choices=("shardy", "gspmd"),
        help="XLA's SPMD partitioner (default: JAX's setting); gspmd avoids a Shardy segfault "
        "(jax 0.11.2, GPU, bf16 cache)",
    )  # fmt: skip
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="out/sharded")
    a = ap.parse_args(argv)
    bad = [w for w in a.workloads if w not in ORDER]
    if bad:
        ap.error(f"unknown workloads {bad}; choose from {ORDER}")
    meshes = ("1gpu", "seq", "model", "data", "hybrid")
    bad = [m for m in a.tp_meshes + a.tpmax_meshes if m not in meshes]
    if bad:
        ap.error(f"unknown meshes {bad}; choose from {meshes}")
    dflt = dict(check_steps=64, steps=(4, 36), tp_steps=(1, 33), repeats=3, tp_repeats=2,
                dtype="bfloat16")  # fmt: skip
    if a.tiny:
        dflt.update(check_steps=16, steps=(1, 3), tp_steps=(1, 3), repeats=1, tp_repeats=1,
                    dtype="float32")  # fmt: skip
    for k, v in dflt.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    ec.parse_caches(a.caches, a.impl)
    return a


def main(argv=None):
    a = parse_args(argv)
    ec.setup_jax(a.jax_cache)
    if a.partitioner:  # else JAX's own setting (e.g. JAX_USE_SHARDY_PARTITIONER) stands
        jax.config.update("jax_use_shardy_partitioner", a.partitioner == "shardy")
    devs = jax.devices()[: a.devices or None]
    if len(devs) < 2:
        sys.exit(f"bench_sharded needs >= 2 devices, found {len(devs)}")
    shardy = jax.config.jax_use_shardy_partitioner
    meta = dict(issue=10, device=devs[0].device_kind, platform=devs[0].platform,
                num_devices=len(devs), jax=jax.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), args=vars(a),
                memory=ec.memory_stats(devs[0]),
                nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"), impl=a.impl,
                partitioner="shardy" if shardy else "gspmd")  # fmt: skip
    r = Runner(a.out, "sharded", a.budget_s, meta, sharded_summary, a.resume)
    r.log(f"jax {jax.__version__}: {len(devs)} x {devs[0].device_kind}")
    Bench(a, r).run()
    r.write()
    r.log(f"done; results in {a.out}/sharded.json and sharded.md")
    return r.data


if __name__ == "__main__":
    main()
