"""Shared pieces of the end-to-end decode benchmarks (``bench_e2e.py``, ``bench_sharded.py``).

* Random weights and caches of the real shapes: ``e2e_fill``.
* Timing: one jitted program runs ``n`` (a traced scalar: one compile for every ``n``)
  decode steps (``models.decode_forward``, greedy argmax) in a loop on the
  device, carrying the donated caches (one per layer, updated in place), and resets the
  lengths at the end so every call decodes at the same context. Per-step time =
  (T(n2) - T(n1)) / (n2 - n1), medians over repeats, which removes dispatch and the fixed
  costs; compile time is measured apart (``lower`` + ``compile``), with the compiled
  program's memory analysis.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import models
import oscar_jax as oj
from models import layers
from models import sharding as msh
from models.config import ModelConfig, llama31_8b, qwen3_8b
from oscar_jax import sharding as osh
from pallas_kernels.decode.mosaic import decode_attention_mosaic, default_config

GiB = 1024**3
MODELS = {"llama31_8b": llama31_8b, "qwen3_8b": qwen3_8b}


def model_config(name: str, tiny: bool = False) -> ModelConfig:
    """The full-size config, or (``tiny``) a 2-layer one of the same family for CPU tests."""
    if name not in MODELS:
        raise ValueError(f"model={name!r} must be one of {tuple(MODELS)}")
    cfg = MODELS[name]()
    if tiny:  # head_dim 64 (the Pallas kernels' minimum), 8 KV heads (8 simulated devices)
        cfg = cfg.replace(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                          num_heads=16, num_kv_heads=8, head_dim=64)  # fmt: skip
    return cfg


# -- caches: "name[:implementation]" -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """A cache type: its name ("bf16", "oscar2", "oscar4"), KV config and attention kernel."""

    name: str
    kv: oj.KVQuantConfig  # as the cache stores it (rotate_values folded away)
    impl: str

    @property
    def label(self) -> str:
        return f"{self.name}:{self.impl}"

    @property
    def quantized(self) -> bool:
        return self.kv.quantized


def parse_caches(text: str, default_impl: str) -> list[CacheSpec]:
    """``"bf16,oscar2:xla"`` -> specs; ValueError on unknown names."""
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        name, _, impl = item.partition(":")
        if name == "bf16":
            kv = oj.preset("bf16")
        elif name.startswith("oscar") and name[5:].isdigit():
            kv = oj.preset("oscar", bits=int(name[5:])).replace(rotate_values=False)
        else:
            raise ValueError(f"cache={item!r} must be bf16 or oscarN, optionally ':impl'")
        # named, not "auto": the Mosaic kernel reads the record layout, the others planar
        kv = kv.replace(layout="record" if impl.startswith("mosaic") else "planar")
        out.append(CacheSpec(name, kv, impl or default_impl))
    if not out:
        raise ValueError(f"caches={text!r} must name at least one cache")
    return out


def _skip_attention(q, cache, *, softmax_scale=None, **options):
    """Breakdown variant: no attention (the output is the query; the cache is not read)."""
    return q


def _cudnn_attention(q, cache, *, softmax_scale=None, **options):
    """cuDNN decode attention over a bf16 cache (needs a [B, S, H, D] copy of the ring)."""
    if cache.cfg.quantized:
        raise ValueError("implementation='cudnn' needs a bf16 cache")
    k, v = jnp.swapaxes(cache.k_res, 1, 2), jnp.swapaxes(cache.v_res, 1, 2)
    o = jax.nn.dot_product_attention(
        q[:, None].astype(k.dtype), k, v, scale=softmax_scale,
        key_value_seq_lengths=cache.lengths, implementation="cudnn",
    )  # fmt: skip
    return o[:, 0].astype(q.dtype)


def _mosaic_two_launches(q, cache, *, softmax_scale=None, **options):
    """The "mosaic" backend with its ring and LSE merge in a second Mosaic launch
    (``merge="mosaic"``) instead of XLA: the two merges timed side by side."""
    return decode_attention_mosaic(q, cache, softmax_scale=softmax_scale, merge="mosaic")


def _mosaic_xla_merge(q, cache, *, softmax_scale=None, **options):
    """The "mosaic" backend with its ring and LSE merge in XLA (``merge="xla"``)."""
    return decode_attention_mosaic(q, cache, softmax_scale=softmax_scale, merge="xla")


def _mosaic_ring_split(q, cache, *, softmax_scale=None, **options):
    """The "mosaic" backend with the ring as one more split of the partials kernel and the
    splits merged by a second Mosaic launch (``merge="fused_mosaic"``)."""
    return decode_attention_mosaic(q, cache, softmax_scale=softmax_scale, merge="fused_mosaic")


def _mosaic_pdl(q, cache, *, softmax_scale=None, **options):
    """The "mosaic" backend's default call with programmatic dependent launch
    (``Int2DecodeConfig.pdl``): each launch waits on the one before it in the kernel."""
    cfg = default_config(cache.quant_capacity, cache.cfg.bits, cache.head_dim,
                         q.shape[1] // cache.num_kv_heads,
                         rows=cache.batch * cache.num_kv_heads)  # fmt: skip
    return decode_attention_mosaic(q, cache, softmax_scale=softmax_scale,
                                   cfg=dataclasses.replace(cfg, pdl=True))  # fmt: skip


# attention baselines of the benchmarks, passed to the library as callables
BASELINES = {
    "bench_skip": _skip_attention,
    "cudnn": _cudnn_attention,
    "mosaic2": _mosaic_two_launches,
    "mosaic_rs": _mosaic_ring_split,
    "mosaic_x": _mosaic_xla_merge,
    "mosaic_pdl": _mosaic_pdl,
}


def attention_impl(impl):
    """A cache spec's attention: a library backend name, or one of ``BASELINES``."""
    return BASELINES.get(impl, impl)


def static(cfg, kv, max_len, impl, encode_impl="xla", mesh=None, ax=osh.AXES,
           dtype="bfloat16") -> models.Static:  # fmt: skip
    """``models.Static`` for greedy decoding without stop tokens."""
    be = models.Backends(attention=attention_impl(impl), encode=encode_impl,
                         cache_write=encode_impl, prompt_attention="reference")  # fmt: skip
    return models.Static(
        model=cfg, kv=kv, max_len=int(max_len), cache_dtype=jnp.dtype(dtype).name,
        backends=be, greedy=True, top_k=None, use_top_p=False,
        stop_tokens=(), pad_id=0, place=models.placement(mesh, ax),
    )  # fmt: skip


# -- placement -----------------------------------------------------------------------
def abstract(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


def param_shardings(cfg, mesh=None, device=None):
    """Shardings of the per-layer params (``e2e_fill.random_params``: a tuple of L dicts)."""
    if mesh is None:
        s = SingleDeviceSharding(device or jax.devices()[0])
        return jax.tree_util.tree_map(lambda _: s, layers.param_shapes(cfg, per_layer=True),
                                      is_leaf=layers.is_shape)  # fmt: skip
    return msh.param_shardings(cfg, mesh, per_layer=True)


# -- the timed decode loop ------------------------------------------------------------
HISTORY = 512  # steps of per-step (argmax, top-1, top-2 logit) kept by the decode loop


def _decode_loop(st: models.Static, params, caches, tok, forced, n_forced, n, step=None):
    """``n`` greedy decode steps (``generate``'s per-step ``_decode``); lengths reset at the end.

    Step i feeds ``forced[:, i]`` while i < n_forced (a prompt, or teacher forcing), else the
    previous step's argmax. Returns (caches, last argmax [B], history): the argmax and the two
    largest logits of the first ``HISTORY`` steps, [B, HISTORY] each (two reductions over the
    vocabulary per step: negligible next to the weights).
    """
    lf0 = [(c.lengths, c.flags) for c in caches]  # per layer [B] each
    pos0 = lf0[0][0]  # [B]
    b, s = forced.shape
    row = P(st.axes.data, None)
    hist = tuple(msh.constrain(jnp.zeros((b, s), dt), st.mesh, row)
                 for dt in (jnp.int32, jnp.float32, jnp.float32))  # fmt: skip

    def body(i, carry):
        caches, tok, hist = carry
        j = jnp.minimum(i, s - 1)
        inp = jnp.where(i < n_forced, jax.lax.dynamic_index_in_dim(forced, j, 1, False), tok)
        logits, caches = (step or models.decode_forward)(st, params, caches, inp, pos0 + i)
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # greedy, as generate's sampler
        top1 = jnp.max(logits, axis=-1)
        hot = jnp.arange(logits.shape[-1])[None, :] == nxt[:, None]
        top2 = jnp.max(jnp.where(hot, -jnp.inf, logits), axis=-1)
        hist = tuple(jax.lax.dynamic_update_index_in_dim(h, v.astype(h.dtype), j, 1)
                     for h, v in zip(hist, (nxt, top1, top2), strict=True))  # fmt: skip
        return caches, msh.constrain(nxt, st.mesh, P(st.axes.data)), hist

    caches, tok, hist = jax.lax.fori_loop(0, n, body, (caches, tok, hist))
    caches = tuple(dataclasses.replace(c, lengths=l0, flags=f0)
                   for c, (l0, f0) in zip(caches, lf0, strict=True))  # fmt: skip
    return msh.constrain_caches(caches, st.mesh, st.axes), tok, hist


def memory_info(compiled) -> dict:
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001  (not offered by every backend)
        ma = None
    if ma is None:
        return {}
    keys = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
            "alias_size_in_bytes", "generated_code_size_in_bytes")  # fmt: skip
    return {k.replace("_size_in", ""): int(getattr(ma, k, 0) or 0) for k in keys}


def compile_timed(fn, *args) -> tuple:
    """AOT ``lower`` + ``compile`` of a jitted fn -> (compiled, info with seconds and memory)."""
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return compiled, dict(lower_s=t1 - t0, compile_s=t2 - t1, **memory_info(compiled))


def forced_sharding(tok_sharding):
    """[B, HISTORY] arrays: rows like the tokens."""
    if isinstance(tok_sharding, NamedSharding):
        return NamedSharding(tok_sharding.mesh, P(*tok_sharding.spec, None))
    return tok_sharding


def compile_decode(st: models.Static, params_abs, caches_abs, tok_abs, step=None):
    """The decode loop, compiled; its outputs keep the input layout (fed back each call).

    Arguments: (params, caches, tok [B], forced [B, HISTORY], n_forced, n). ``step``: a
    variant of ``models.decode_forward`` (breakdown).
    """
    fs = forced_sharding(tok_abs.sharding)
    out_sh = (jax.tree_util.tree_map(lambda x: x.sharding, caches_abs), tok_abs.sharding,
              (fs, fs, fs))  # fmt: skip
    fn = jax.jit(functools.partial(_decode_loop, st, step=step), donate_argnums=1,
                 out_shardings=out_sh)  # fmt: skip
    forced = abstract((tok_abs.shape[0], HISTORY), jnp.int32, fs)
    scalar = abstract((), jnp.int32, None)
    return compile_timed(fn, params_abs, caches_abs, tok_abs, forced, scalar, scalar)


def decode_args(params, caches, tok, forced=None, n_forced: int = 0) -> list:
    """The arguments of a compiled decode loop before ``n`` (no forcing by default)."""
    if forced is None:
        forced = jnp.zeros((tok.shape[0], HISTORY), jnp.int32)
    forced = jax.device_put(forced, forced_sharding(tok.sharding))
    return [params, caches, tok, forced, np.int32(n_forced)]


def time_steps(compiled, args, steps=(4, 36), repeats: int = 3, donated: int | None = 1):
    """Per-step seconds of a looped program: (median T(n2) - median T(n1)) / (n2 - n1).

    ``args`` are the program's arguments before ``n``; with ``donated`` the argument at that
    index is donated and replaced by the program's first output after each call.
    Returns (result dict, final args).
    """
    n1, n2 = steps
    if not 0 <= n1 < n2:
        raise ValueError(f"steps={steps} must satisfy 0 <= n1 < n2")
    args = list(args)

    def call(n):
        t = time.perf_counter()
        out = compiled(*args, np.int32(n))
        jax.block_until_ready(out)
        dt = time.perf_counter() - t
        if donated is not None:
            args[donated] = out[0]
        return dt

    warm = call(n1)
    t1, t2 = [], []
    for _ in range(repeats):
        t1.append(call(n1))
        t2.append(call(n2))
    per = (float(np.median(t2)) - float(np.median(t1))) / (n2 - n1)
    res = dict(ms_per_step=per * 1e3, steps=[n1, n2], repeats=repeats, warmup_s=warm,
               t_n1_s=t1, t_n2_s=t2)  # fmt: skip
    return res, args


# -- device memory ----------------------------------------------------------------------
def memory_stats(device, limit_override: float | None = None) -> dict:
    """bytes_limit / bytes_in_use of a device (GPU allocator stats; live arrays elsewhere)."""
    st = {}
    try:
        st = device.memory_stats() or {}
    except Exception:  # noqa: BLE001
        st = {}
    live = int(sum(s.data.nbytes for x in jax.live_arrays()
                   for s in x.addressable_shards if s.device == device))  # fmt: skip
    out = dict(bytes_limit=st.get("bytes_limit"), bytes_in_use=st.get("bytes_in_use", live),
               peak_bytes_in_use=st.get("peak_bytes_in_use"), live_array_bytes=live)  # fmt: skip
    if limit_override:
        out["bytes_limit"] = int(limit_override)
    return out


def is_oom(e: BaseException) -> bool:
    s = str(e)
    return "RESOURCE_EXHAUSTED" in s or "Out of memory" in s or "out of memory" in s


def fit_batch(build, row_bytes: int, free_bytes: int, multiple: int = 1, temp_row: int = 0,
              max_batch: int = 4096, tries: int = 3, check: bool = True):  # fmt: skip
    """Largest batch whose cache + the compiled program's temporaries fit in ``free_bytes``.

    Analytic first (``row_bytes`` per row plus ``temp_row`` headroom per row), then
    ``build(batch) -> (compiled, info)`` and the compiled memory analysis, shrinking until
    cache + temp + (output - alias) fits (``check=False``: the analytic batch as is).
    Returns (dict, compiled, info).
    """
    per = row_bytes + temp_row
    b = min(max_batch, free_bytes // max(per, 1)) // multiple * multiple
    out = dict(analytic_batch=int(b), free_bytes=int(free_bytes), row_bytes=int(row_bytes),
               temp_row_guess=int(temp_row), checks=[])  # fmt: skip
    if b < multiple:
        return dict(out, batch=0), None, None
    compiled = info = None
    for _ in range(tries):
        compiled, info = build(int(b))
        extra = info.get("temp_bytes", 0) + info.get("output_bytes", 0) - info.get("alias_bytes", 0)
        need = b * row_bytes + max(0, extra)
        out["checks"].append(
            dict(batch=int(b), need_bytes=int(need), temp_bytes=info.get("temp_bytes"))
        )
        if need <= free_bytes or not check:
            break
        b = int(b * free_bytes / need) // multiple * multiple
        compiled = None
        if b < multiple:
            return dict(out, batch=0), None, None
    return dict(out, batch=int(b) if compiled is not None else 0), compiled, info


def setup_jax(cache_dir: str = "") -> None:
    """Persistent compilation cache (re-runs on a warm machine skip the compiles)."""
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
