"""End-to-end decode speed and memory of the full models on one GPU.

Pseudo-random bf16 weights of the real shapes (Llama-3.1-8B, Qwen3-8B: all layers,
projections, MLPs, logits; nothing downloaded), caches selected by preset and attention
kernel (``--caches bf16,oscar2``: BF16 and OScaR INT2, with ``--impl``, default our Pallas
kernels; ``bf16:cudnn`` / ``bf16:xla`` add other BF16 attentions, the fastest BF16 one is
compared). The decode program is ``models.decode_forward``, the step ``models.generate``
runs (all layers, unrolled over per-layer caches, greedy sampling), in a device loop over
caches filled to the context (see ``e2e_fill``): no long forward pass except in
``prefill32k``. The weights are
in the per-layer form (a tuple of layer dicts, each its own buffers) that the step reads in
place; ``prefill32k``'s forward runs the layers in a Python loop over them.

Workloads (``--workloads``, run in the given order; ``--budget-s`` skips the rest):

* ``mem``: device bytes of each cache at 32K and 128K (live arrays and allocator delta)
  against the analytic count (``models.memory``) and the per-token formula (target >= 5x).
* ``lat128k`` / ``lat32k``: ms per decoded token at batch 1 (target: INT2 >= 3x at 128K).
* ``tpmax32k``: tokens/s at the largest batch that fits at 32K, per cache (analytic from
  bytes, checked on the compiled program's memory analysis, then run; target >= 4x).
* ``breakdown`` (for the workloads in ``--breakdown`` whose target was missed, or all with
  ``--breakdown-always``; INT2 caches unless ``--breakdown-caches all``): attention =
  full - (attention skipped); cache update + carry = (attention skipped) - (attention
  skipped, 256-token cache); projections + MLP = that - (final norm, logits and argmax
  alone); ``--breakdown-carry`` splits the append from carrying the caches through the
  layers (a variant with neither append nor attention).
* ``tp48x4k``: tokens/s at batch 48, context 4K.
* ``prefill32k``: a real 32K-token forward (compiled once per model) + the cache fill
  (``oscar_jax.prefill``: quantization for INT2) per cache and encoder (``--prefill-
  encode-impls``); prefill cost = forward + fill.

    PYTHONUNBUFFERED=1 python3 -m benchmarks.bench_e2e --out out/e2e --budget-s 200
    python3 -m benchmarks.bench_e2e --tiny --out out/e2e_tiny      # CPU smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")  # before JAX starts

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import models  # noqa: E402
import oscar_jax as oj  # noqa: E402
from benchmarks import e2e_common as ec  # noqa: E402
from benchmarks import e2e_fill as ef  # noqa: E402
from benchmarks.bench_decode import copy_bandwidth  # noqa: E402
from benchmarks.e2e_report import Runner, e2e_summary  # noqa: E402
from models import layers, memory  # noqa: E402

FULL = dict(lat32k=(1, 32768), lat128k=(1, 131072), tp48x4k=(48, 4096), tpmax32k=(None, 32768),
            prefill32k=(1, 32768), mem=(1, (32768, 131072)))  # fmt: skip
# tiny: shapes shared where possible (one compile each): the latencies share a program, and
# tpmax32k (4 rows "fit" without memory stats) shares tp48x4k's
TINY = dict(lat32k=(1, 512), lat128k=(1, 512), tp48x4k=(4, 512), tpmax32k=(None, 512),
            prefill32k=(1, 256), mem=(1, (512, 1024)))  # fmt: skip
ORDER = ("mem", "lat128k", "tpmax32k", "breakdown", "tp48x4k", "lat32k", "prefill32k")
TARGETS = dict(lat128k=3.0, tpmax32k=4.0)


class Bench:
    def __init__(self, args, runner: Runner):
        self.a, self.r = args, runner
        self.dev = jax.devices()[0]
        self.sizes = TINY if args.tiny else FULL
        self.programs: dict = {}

    def log(self, msg):
        self.r.log(msg)

    # -- one model ---------------------------------------------------------------------
    def model(self, name: str):
        a = self.a
        cfg = ec.model_config(name, a.tiny)
        self.cfg, self.name = cfg, name
        t = time.perf_counter()
        self.params = ef.random_params(cfg, ec.param_shardings(cfg, device=self.dev), a.seed)
        if a.params_layout == "stacked":  # stacked [L, ...] (A/B): the step slices each layer
            per, self.params = self.params["layers"], layers.stack_layers(self.params)
            ef.delete(per)  # the per-layer copies (embedding, norm, head are shared)
        jax.block_until_ready(self.params)
        self.pabs = jax.tree_util.tree_map(lambda x: ec.abstract(x.shape, x.dtype, x.sharding),
                                           self.params)  # fmt: skip
        pbytes = ef.tree_nbytes(self.params)
        self.r.data["meta"].setdefault("models", {})[name] = dict(
            config=dataclasses.asdict(cfg),
            params_bytes=pbytes, init_s=time.perf_counter() - t,
        )  # fmt: skip
        self.log(
            f"{name}: random params {pbytes / ec.GiB:.2f} GiB in {time.perf_counter() - t:.1f} s"
        )
        caches = ec.parse_caches(a.caches, a.impl)
        for w in a.workloads:
            if w == "mem":
                for c in caches:
                    self.r.unit(f"{name}/mem/{c.name}", functools.partial(self.mem_unit, c))
            elif w == "prefill32k":
                self.prefill(caches)
            elif w == "breakdown":
                for bw in a.breakdown:
                    self.maybe_breakdown(bw, caches)
            else:
                b, ctx = self.sizes[w]
                tp = w.startswith("tp")
                for c in caches:
                    fn = self.tpmax_unit if b is None else self.decode_unit
                    self.r.unit(f"{name}/{w}/{c.label}", functools.partial(fn, c, b, ctx, tp))
        ef.delete(self.params)
        self.params = None

    # -- decode programs ----------------------------------------------------------------
    def compiled(self, key, build):
        """One compiled program per shape; a reused one reports compile_s 0 (reused=True)."""
        if key in self.programs:
            compiled, info = self.programs[key]
            return compiled, dict(info, compile_s=0.0, lower_s=0.0, reused=True)
        self.programs[key] = build()
        return self.programs[key]

    def decode_unit(self, spec: ec.CacheSpec, batch: int, ctx: int, tp: bool, impl=None,
                    program=None, carry_only: bool = False):  # fmt: skip
        a, cfg = self.a, self.cfg
        steps = a.tp_steps if tp else a.steps
        impl = impl or spec.impl
        sh = jax.sharding.SingleDeviceSharding(self.dev)
        cabs = ef.abstract_caches(cfg, spec.kv, batch, ctx, device=self.dev)
        tok_abs = ec.abstract((batch,), jnp.int32, sh)
        if program is None:
            st = ec.static(cfg, spec.kv, ctx, impl, a.encode_impl)
            step = decode_carry_only if carry_only else None
            program = self.compiled(
                (self.name, spec.name, impl, batch, ctx, carry_only),
                lambda: ec.compile_decode(st, self.pabs, cabs, tok_abs, step),
            )
        compiled, cinfo = program
        n_fill = ctx - steps[1] - 1
        t = time.perf_counter()
        caches = ef.make_caches(cabs, n_fill, a.fill, a.seed)
        jax.block_until_ready(caches)
        fill_s = time.perf_counter() - t
        cache_bytes = ef.tree_nbytes(caches)
        tok = jax.device_put(jnp.arange(batch, dtype=jnp.int32) % cfg.vocab_size, sh)
        try:
            res, args = ec.time_steps(compiled, ec.decode_args(self.params, caches, tok), steps,
                                      a.tp_repeats if tp else a.repeats)  # fmt: skip
            ef.delete(args[1])
        finally:
            ef.delete(caches)
        ms = res["ms_per_step"]
        return dict(
            res, batch=batch, context=ctx, filled_tokens=n_fill, cache=spec.name, impl=impl,
            fill=a.fill, fill_s=fill_s, cache_bytes=cache_bytes, tokens_per_s=batch / (ms * 1e-3),
            temp_over_cache=cinfo.get("temp_bytes", 0) / max(cache_bytes, 1), **cinfo,
        )  # fmt: skip

    def tpmax_unit(self, spec: ec.CacheSpec, _b, ctx: int, tp: bool):
        a, cfg = self.a, self.cfg
        ms = ec.memory_stats(self.dev, a.mem_limit_gib * ec.GiB if a.mem_limit_gib else None)
        row = ef.tree_nbytes(memory.abstract_caches(cfg, spec.kv, batch=1, max_len=ctx))
        stats = bool(ms["bytes_limit"])  # no allocator stats (CPU): pretend tiny_rows rows fit
        limit = ms["bytes_limit"] or ms["bytes_in_use"] + a.tiny_rows * row
        margin = max(a.margin_gib * ec.GiB, 0.02 * limit) if stats else 0
        free = int(limit - ms["bytes_in_use"] - margin)
        # headroom per row: the temp / cache ratio of a batch-1 run of this cache (32K, else 128K)
        units = self.r.data["units"]
        lat = [units.get(f"{self.name}/{w}/{spec.label}", {}) for w in ("lat32k", "lat128k")]
        ratios = [u["temp_over_cache"] for u in lat if u.get("status") == "ok"]
        temp_row = int(ratios[0] * row) if stats and ratios else 0
        sh = jax.sharding.SingleDeviceSharding(self.dev)

        def build(b):
            st = ec.static(cfg, spec.kv, ctx, spec.impl, a.encode_impl)
            cabs = ef.abstract_caches(cfg, spec.kv, b, ctx, device=self.dev)
            tok_abs = ec.abstract((b,), jnp.int32, sh)
            key = (self.name, spec.name, spec.impl, b, ctx, False)
            return self.compiled(key, lambda: ec.compile_decode(st, self.pabs, cabs, tok_abs))

        fit, compiled, cinfo = ec.fit_batch(build, row, free, temp_row=temp_row, check=stats)
        fit.update(bytes_limit=limit, bytes_in_use=ms["bytes_in_use"], margin=margin)
        b, attempts = fit["batch"], []
        while b > 0 and len(attempts) < 3:
            try:
                program = build(b)
                res = self.decode_unit(spec, b, ctx, tp, program=program)
                if cinfo is not None and b == fit["batch"]:  # the compile done while fitting
                    res.update({k: cinfo[k] for k in ("lower_s", "compile_s") if k in cinfo},
                               reused=cinfo.get("reused", False))  # fmt: skip
                return dict(res, fit=fit, attempts=attempts, verified_batch=b)
            except Exception as e:  # noqa: BLE001
                if not ec.is_oom(e):
                    raise
                attempts.append(dict(batch=b, error=str(e)[:200]))
                self.log(f"batch {b} out of memory; retrying at {int(b * 0.9)}")
                b = int(b * 0.9)
        return dict(status="error: no batch fits", fit=fit, attempts=attempts)

    # -- breakdown ------------------------------------------------------------------------
    def maybe_breakdown(self, w: str, caches):
        a = self.a
        if w not in a.breakdown:
            return
        units = self.r.data["units"]
        done = {c.label: units.get(f"{self.name}/{w}/{c.label}", {}) for c in caches}
        ok = {k: v for k, v in done.items() if v.get("status") == "ok"}
        bf = [v["ms_per_step"] / v["batch"] for k, v in ok.items() if k.startswith("bf16")]
        q = [v["ms_per_step"] / v["batch"] for k, v in ok.items() if not k.startswith("bf16")]
        if not a.breakdown_always and bf and q and min(bf) / min(q) >= TARGETS.get(w, 0):
            self.log(f"{w}: target met, no breakdown")
            return
        for c in caches:
            v = ok.get(c.label)
            if not v or (a.breakdown_caches == "quant" and not c.quantized):
                continue
            b, ctx = v["batch"], v["context"]
            self.r.unit(f"{self.name}/{w}/{c.label}/skip_attn", functools.partial(
                self.decode_unit, c, b, ctx, w.startswith("tp"), "bench_skip"))  # fmt: skip
            if a.breakdown_carry:
                self.r.unit(f"{self.name}/{w}/{c.label}/carry_only", functools.partial(
                    self.decode_unit, c, b, ctx, w.startswith("tp"), "bench_skip",
                    carry_only=True))  # fmt: skip
            small = ec.parse_caches("bf16", "bench_skip")[0]
            self.r.unit(
                f"{self.name}/b{b}/weights_only",
                functools.partial(
                    self.decode_unit, small, b, 256 if not a.tiny else 128, w.startswith("tp")
                ),
            )
            self.r.unit(f"{self.name}/b{b}/head", functools.partial(self.head_unit, b))

    def head_unit(self, batch: int):
        cfg = self.cfg
        sh = jax.sharding.SingleDeviceSharding(self.dev)
        x_abs = ec.abstract((batch, cfg.hidden_size), jnp.bfloat16, sh)
        compiled, cinfo = self.compiled(("head", self.name, batch),
                                        lambda: compile_head(cfg, self.pabs, x_abs))  # fmt: skip
        x = jax.device_put(jnp.ones((batch, cfg.hidden_size), jnp.bfloat16), sh)
        res, _ = ec.time_steps(compiled, [self.params, x], self.a.steps, self.a.repeats, None)
        return dict(res, batch=batch, **cinfo)

    # -- memory -----------------------------------------------------------------------------
    def mem_unit(self, spec: ec.CacheSpec):
        cfg = self.cfg
        out = {}
        for ctx in self.sizes["mem"][1]:
            before = ec.memory_stats(self.dev)["bytes_in_use"]
            cabs = ef.abstract_caches(cfg, spec.kv, 1, ctx, device=self.dev)
            caches = ef.make_caches(cabs, ctx, "zeros")
            jax.block_until_ready(caches)
            after = ec.memory_stats(self.dev)["bytes_in_use"]
            live = ef.tree_nbytes(caches)
            ef.delete(caches)
            one = jax.eval_shape(functools.partial(
                oj.init_cache, spec.kv, batch=1, max_len=ctx, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim))  # fmt: skip
            per_q, per_r = oj.cache.bytes_per_token(one)
            nq = int(oj.cache.quantized_count(np.int64(ctx), spec.kv))
            stored = cfg.num_layers * (nq * per_q + (ctx - nq) * per_r)
            out[str(ctx)] = dict(
                live_bytes=live, allocator_delta_bytes=after - before,
                analytic_bytes=memory.abstract_nbytes(memory.abstract_caches(
                    cfg, spec.kv, batch=1, max_len=ctx)),
                stored_token_bytes=float(stored),
                bytes_per_token_per_head=float((per_q or per_r) / cfg.num_kv_heads),
            )  # fmt: skip
        return dict(contexts=out)

    # -- prefill ------------------------------------------------------------------------------
    def prefill(self, caches):
        a, cfg, name = self.a, self.cfg, self.name
        b, t = self.sizes["prefill32k"]
        sh = jax.sharding.SingleDeviceSharding(self.dev)
        state = {}

        def forward(attention):
            fwd = jax.jit(lambda p, ids: _forward(cfg, p, ids, attention))
            compiled, cinfo = ec.compile_timed(fwd, self.pabs, ec.abstract((b, t), jnp.int32, sh))
            ids = jax.device_put(jax.random.randint(jax.random.key(a.seed), (b, t), 0,
                                                    cfg.vocab_size, jnp.int32), sh)  # fmt: skip
            runs = []
            for _ in range(a.prefill_runs):
                ef.delete(state.pop("kv", None))
                s = time.perf_counter()
                out = compiled(self.params, ids)
                jax.block_until_ready(out)
                runs.append(time.perf_counter() - s)
                state["kv"] = out[1:]
            return dict(runs_s=runs, median_s=float(np.median(runs)), tokens=t,
                        attention=attention, **cinfo)  # fmt: skip

        for att in a.prompt_attention:  # the last one's K/V feed the fill units
            att = layers.resolve_prompt_attention(att, jnp.bfloat16)
            tag = "" if att == "reference" else f":{att}"
            self.r.unit(f"{name}/prefill32k/forward{tag}", functools.partial(forward, att))
        for c in caches:
            for enc in a.prefill_encode_impls if c.quantized else ["xla"]:
                self.r.unit(f"{name}/prefill32k/{c.name}:{enc}",
                            functools.partial(self.fill_unit, c, enc, state, b, t))  # fmt: skip
        ef.delete(state.pop("kv", None))

    def fill_unit(self, spec, enc, state, b, t):
        if "kv" not in state:
            return dict(status="not run (no forward output)")
        k, v = state["kv"]
        cfg, max_len = self.cfg, t + 512

        def fill(k, v):
            lengths = jnp.full((b,), t, jnp.int32)

            def one(k_l, v_l):
                c = oj.init_cache(spec.kv, batch=b, max_len=max_len, num_kv_heads=cfg.num_kv_heads,
                                  head_dim=cfg.head_dim, dtype=jnp.bfloat16)  # fmt: skip
                return oj.prefill(c, k_l, v_l, lengths, implementation=enc)

            return jax.vmap(one)(k, v)

        compiled, cinfo = ec.compile_timed(jax.jit(fill), k, v)
        runs = []
        for _ in range(max(2, self.a.prefill_runs)):
            s = time.perf_counter()
            out = compiled(k, v)
            jax.block_until_ready(out)
            runs.append(time.perf_counter() - s)
            nbytes = ef.tree_nbytes(out)
            ef.delete(out)
        return dict(runs_s=runs, median_s=float(np.median(runs[1:])), encode_impl=enc,
                    cache_bytes=nbytes, **cinfo)  # fmt: skip


def decode_carry_only(st: models.Static, params, caches, tok, pos):
    """Breakdown variant of ``models.decode_forward`` (no mesh): no append and no attention; the
    per-layer caches pass through the step untouched (what carrying them costs)."""
    mc = st.model
    b = tok.shape[0]
    x = layers.embed(params, tok[:, None])
    for i in range(len(caches)):
        lp = models.layer_params(params, i, after=x)
        hn = layers.rms_norm(x, lp["attn_norm"], mc.rms_norm_eps)
        q, _, _ = layers.qkv(mc, lp, hn, pos[:, None])
        x = x + layers.dense(q.reshape(b, 1, mc.q_size).astype(x.dtype), lp["wo"], lp.get("bo"))
        x = x + layers.mlp(lp, layers.rms_norm(x, lp["mlp_norm"], mc.rms_norm_eps))
    return layers.lm_head(mc, params, x[:, 0]), tuple(caches)


def _head_loop(cfg, params, x, n):
    """``n`` chained (final norm -> lm_head -> greedy argmax -> embed) steps: x [B, Hd]."""

    def body(_, x):
        tok = jnp.argmax(layers.lm_head(cfg, params, x), axis=-1)
        return layers.embed(params, tok).astype(x.dtype)

    return jax.lax.fori_loop(0, n, body, x)


def compile_head(cfg, params_abs, x_abs):
    fn = jax.jit(functools.partial(_head_loop, cfg))
    return ec.compile_timed(fn, params_abs, x_abs, ec.abstract((), jnp.int32, None))


def _forward(cfg, params, ids, attention="reference"):
    """The prefill forward: all layers over the prompt, K/V kept, logits of the last token."""
    x, (k, v) = layers.forward(cfg, params, ids, keep_kv=True, attention=attention)
    return layers.lm_head(cfg, params, x[:, -1]), k, v


def _steps(s: str) -> tuple[int, int]:
    n1, n2 = (int(x) for x in s.split(","))
    if not 0 <= n1 < n2:
        raise argparse.ArgumentTypeError(f"steps={s!r} must be 'n1,n2' with 0 <= n1 < n2")
    return n1, n2


def _list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip() and x.strip() != "none"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", type=_list, default=["llama31_8b", "qwen3_8b"])
    ap.add_argument("--workloads", type=_list, default=list(ORDER))
    ap.add_argument("--caches", default="bf16,oscar2", help="name[:impl],...")
    ap.add_argument("--impl", default=None, help="kernel of caches without one (pallas; tiny: xla)")
    ap.add_argument("--encode-impl", default=None,
                    help="decode-time cache writes: pallas (one fused launch per layer, "
                    "faster on the H200; tiny: xla) or xla")  # fmt: skip
    ap.add_argument("--prefill-encode-impls", type=_list, default=None, help="xla,pallas")
    ap.add_argument("--prompt-attention", type=_list, default=["auto"],
                    help="prefill attention(s): auto (GPU: cudnn),reference,cudnn,xla")  # fmt: skip
    ap.add_argument("--fill", default="random", choices=("random", "zeros", "encode"))
    ap.add_argument("--steps", type=_steps, default=None, help="latency loop lengths n1,n2")
    ap.add_argument("--tp-steps", type=_steps, default=None, help="throughput n1,n2")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--tp-repeats", type=int, default=None)
    ap.add_argument("--prefill-runs", type=int, default=None)
    ap.add_argument("--breakdown", type=_list, default=["lat128k"])
    ap.add_argument("--breakdown-always", action="store_true")
    ap.add_argument(
        "--breakdown-carry",
        action="store_true",
        help="also a variant with neither append nor attention (splits the cache "
        "update from carrying the caches through the layer scan)",
    )
    ap.add_argument(
        "--breakdown-caches",
        default="quant",
        choices=("quant", "all"),
        help="caches broken down (quant: the INT2 ones only, 2 compiles fewer)",
    )
    ap.add_argument("--budget-s", type=float, default=0.0, help="skip units after this (0: none)")
    ap.add_argument("--mem-limit-gib", type=float, default=0.0, help="override the device limit")
    ap.add_argument("--margin-gib", type=float, default=1.0, help="kept free when fitting")
    ap.add_argument("--tiny-rows", type=int, default=4, help="no memory stats: rows that fit")
    ap.add_argument("--copy-mib", type=int, default=None)
    ap.add_argument("--jax-cache", default="", help="persistent compilation cache directory")
    ap.add_argument("--resume", default="", help="earlier JSON: its ok units are kept, not re-run")
    ap.add_argument("--params-layout", default="layers", choices=("layers", "stacked"),
                    help="weights per layer (read in place) or stacked [L, ...] (sliced per "
                    "step, for an A/B timing)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="2-layer models, small contexts (CPU)")
    ap.add_argument("--out", default="out/e2e")
    args = ap.parse_args(argv)
    bad = [w for w in args.workloads if w not in ORDER]
    if bad:
        ap.error(f"unknown workloads {bad}; choose from {ORDER}")
    bad = [m for m in args.models if m not in ec.MODELS]
    if bad:
        ap.error(f"unknown models {bad}; choose from {tuple(ec.MODELS)}")
    # full runs: 32 steps between the two loop lengths (one INT2 flush per row, G = 32)
    dflt = dict(impl="pallas", encode_impl="pallas", steps=(4, 36), tp_steps=(1, 33), repeats=3,
                tp_repeats=2, prefill_runs=2, copy_mib=2048,
                prefill_encode_impls=["xla", "pallas"])  # fmt: skip
    if args.tiny:  # CPU smoke run: XLA attention (Pallas interpret mode is slow), few steps
        dflt.update(impl="xla", encode_impl="xla", steps=(1, 3), tp_steps=(1, 3), repeats=1,
                    tp_repeats=1, prefill_runs=1, copy_mib=16,
                    prefill_encode_impls=["xla"])  # fmt: skip
    for k, v in dflt.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    ec.parse_caches(args.caches, args.impl)
    return args


def main(argv=None):
    args = parse_args(argv)
    ec.setup_jax(args.jax_cache)
    dev = jax.devices()[0]
    meta = dict(issue=7, device=dev.device_kind, platform=dev.platform, jax=jax.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), args=vars(args),
                memory=ec.memory_stats(dev), targets=TARGETS)  # fmt: skip
    runner = Runner(args.out, "e2e", args.budget_s, meta, e2e_summary, args.resume)
    runner.log(f"jax {jax.__version__} on {dev.device_kind}; {len(jax.devices())} device(s)")
    bench = Bench(args, runner)
    t = time.perf_counter()
    meta["copy_bytes_per_s"] = copy_bandwidth(args.copy_mib << 20, reps=12, calls=3)
    runner.log(f"copy bandwidth {meta['copy_bytes_per_s'] / 1e9:.0f} GB/s "
               f"({time.perf_counter() - t:.1f} s)")  # fmt: skip
    for m in args.models:
        if runner.over_budget():
            runner.data["units"][f"{m}"] = dict(status="not run (budget)")
            continue
        try:
            bench.model(m)
        except Exception as e:  # noqa: BLE001  (e.g. params do not fit: record, go on)
            runner.data["units"][f"{m}/init"] = dict(status=f"error: {type(e).__name__}: {e}")
    runner.write()
    runner.log(f"done; results in {args.out}/e2e.json and e2e.md")
    return runner.data


if __name__ == "__main__":
    main()
