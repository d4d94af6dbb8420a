"""The greedy-token checks of ``bench_sharded.py``: sharded vs one GPU.

``CheckUnits`` is mixed into ``bench_sharded.Bench`` (it uses its meshes, params and
compiled programs). ``aligned_impl`` is the Triton kernel with a fixed split, passed as
the attention backend (a callable), so that both runs split at the shard boundaries.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import models
from benchmarks import e2e_common as ec
from benchmarks import e2e_fill as ef
from models import sharding as msh
from pallas_kernels.decode import triton as pd


def _check_prog(st, n, params, ids, lengths, forced, use_forced):
    """Prefill, then n steps: tokens [B, n] (argmax, or ``forced`` when use_forced) and logits."""
    logits, caches = models.prefill_forward(st, params, ids, lengths)

    def step(carry, i):
        caches, logits = carry
        tok = jnp.where(use_forced, forced[:, i], jnp.argmax(logits, -1).astype(jnp.int32))
        tok = msh.constrain(tok, st.mesh, P(st.axes.data))
        new, caches = models.decode_forward(st, params, caches, tok, lengths + i)
        return (caches, new), (tok, logits)

    _, (toks, lg) = jax.lax.scan(step, (caches, logits), jnp.arange(n, dtype=jnp.int32))
    return toks.T, jnp.swapaxes(lg, 0, 1)


@dataclasses.dataclass(frozen=True)
class AlignedKernel:
    """The Triton kernel with ``bps`` blocks per split, as the backend of a decode: called as
    ``decode_attention`` (one GPU) or, with ``offset``, as a shard's ``quantized_partial``."""

    bps: int

    def __call__(self, q, cache, scale=None, *, offset=None, softmax_scale=None, **options):
        if offset is None:  # one GPU: rotate the query in XLA, as the shards do (the
            # in-kernel rotation rounds the rotated query to float16 once more)
            return pd.decode_attention_triton(q, cache, softmax_scale=softmax_scale,
                                              blocks_per_split=self.bps,
                                              rotate_in_kernel=False, **options)  # fmt: skip
        lq, g = cache.quant_capacity, cache.cfg.group_size
        cfg = pd.choose_config(1, 1, lq, g, blocks_per_split=self.bps, **options)
        if lq % (cfg.block_tokens * self.bps):
            raise ValueError(f"shard capacity {lq} must be a multiple of {self.bps} x "
                             f"{cfg.block_tokens} tokens for aligned splits")  # fmt: skip
        return pd.quantized_partial_triton(q, cache, scale, offset=offset,
                                           blocks_per_split=self.bps, **options)  # fmt: skip


def aligned_impl(impl: str, bps: int) -> AlignedKernel:
    """The backend of ``impl`` ("triton" or "pallas") with ``blocks_per_split=bps``.

    Every split of the one-GPU kernel then covers the same tokens as a split of a shard
    (shard capacities are multiples of the split), so sharded and one-GPU runs differ
    only in the float32 order of the split merge: the greedy check tests the sharding,
    not the kernel's 16-bit rounding against a different running max.
    """
    if impl not in ("pallas", "triton"):
        raise ValueError(f"impl={impl!r} must be 'triton' for aligned splits")
    return AlignedKernel(bps)


class CheckUnits:
    """The ``check`` workload: methods of ``bench_sharded.Bench``."""

    def check_decode_unit(self, spec: ec.CacheSpec, layout: str):
        """Greedy equality through the timing programs (no extra compile): the prompt is fed
        token by token into an empty cache of the seq128k shape (same math as a prefill:
        appends and prefill give bit-identical caches), then ``check_steps`` greedy steps."""
        a, cfg = self.a, self.cfg
        spec = self.check_spec(spec)
        _, ctx = self.sizes["seq128k"]
        k = a.check_steps
        p_len = min(a.check_prompt, ec.HISTORY - k)  # > R = 128: the prompt fills INT2 groups
        prompt = np.random.default_rng(a.seed).integers(0, cfg.vocab_size, (1, p_len))

        def run(where, forced, n_forced):
            params = self.params(where)
            compiled, info = self.program(spec, where, 1, ctx, params)
            mesh, rows = self.shardings(where, 1)
            cabs = ef.abstract_caches(
                cfg, spec.kv, 1, ctx, mesh=mesh, device=self.dev0, dtype=self.dtype
            )
            caches = ef.make_caches(cabs, 0, "zeros")
            buf = np.zeros((1, ec.HISTORY), np.int32)
            buf[:, : forced.shape[1]] = forced
            tok = jax.device_put(jnp.zeros((1,), jnp.int32), rows)
            args = ec.decode_args(params, caches, tok, buf, n_forced)
            res = compiled(*args, np.int32(p_len + k - 1))
            ef.delete(res[0])
            return info["compile_s"], [np.asarray(h)[0, p_len - 1 : p_len - 1 + k] for h in res[2]]

        c1, (tok1, top1, top2) = run("1gpu", prompt, p_len)
        forced = np.concatenate([prompt, tok1[None, : k - 1]], axis=1)
        c2, (tokf, topf, _) = run(layout, forced, p_len + k - 1)
        _, (tokn, _, _) = run(layout, prompt, p_len)
        compile_s = c1 + c2
        mism = tokf != tok1
        diff = np.abs(topf - top1)  # the top logit's value, sharded vs one GPU
        gap = top1 - top2
        return dict(
            mode="decode", mesh=str(tuple(self.mesh(layout).shape.values())), steps=k, batch=1,
            prompt=p_len, max_len=ctx, impl=spec.impl, mismatches=int(mism.sum()),
            first_mismatch=[int(np.argmax(mism)) if mism.any() else None],
            tokens_equal=bool((tokn == tok1).all()), logits_max_abs_diff=float(diff.max()),
            logits_diff_kind="top-1 logit", logits_max_abs=float(np.abs(top1).max()),
            near_ties=int((mism & (gap <= 2 * diff.max())).sum()), min_top2_gap=float(gap.min()),
            tokens_1gpu=tok1.tolist(), compile_s=compile_s,
        )  # fmt: skip

    def check_spec(self, spec: ec.CacheSpec) -> ec.CacheSpec:
        """The check's cache spec: a Pallas kernel with aligned splits (``--check-bps``)."""
        if spec.impl == "xla" or not spec.quantized or not self.a.check_bps:
            return spec
        return dataclasses.replace(spec, impl=aligned_impl(spec.impl, self.a.check_bps))

    def check_unit(self, spec: ec.CacheSpec, layout: str):
        a, cfg = self.a, self.cfg
        spec = self.check_spec(spec)
        b, t = self.sizes["check"]
        n = a.check_steps
        max_len = -(-(models.bucket_length(t) + n + 128) // (256 * self.n)) * (256 * self.n)
        rng = np.random.default_rng(a.seed)
        ids = rng.integers(0, cfg.vocab_size, (b, models.bucket_length(t))).astype(np.int32)
        lengths = np.array([t] + [t * 3 // 4] * (b - 1), np.int32)
        out = {}
        for where in ("1gpu", layout):
            mesh, rows = self.shardings(where, b)
            st = ec.static(cfg, spec.kv, max_len, spec.impl, a.encode_impl, mesh=mesh,
                           dtype=self.dtype)  # fmt: skip
            if mesh is not None:
                models.check_mesh(cfg, spec.kv, mesh, st.axes, b, max_len, spec.impl)
            params = self.params(where)
            fn = jax.jit(functools.partial(_check_prog, st, n))
            args = [jax.device_put(x, rows if x.ndim == 1 else
                                   jax.sharding.NamedSharding(mesh, P("data", None))
                                   if mesh else rows) for x in (ids, lengths)]  # fmt: skip
            forced = out["1gpu"]["toks"] if where != "1gpu" else np.zeros((b, n), np.int32)
            args.append(jax.device_put(forced, args[0].sharding))
            ab = [ec.abstract(x.shape, x.dtype, x.sharding) for x in args]
            compiled, cinfo = ec.compile_timed(fn, self.pabs(params), *ab,
                                               ec.abstract((), jnp.bool_, None))  # fmt: skip
            forced_run = where != "1gpu"
            toks, lg = compiled(params, *args, np.bool_(forced_run))
            free, _ = compiled(params, *args, np.bool_(False)) if forced_run else (toks, None)
            out[where] = dict(toks=np.asarray(free), forced_argmax=np.asarray(jnp.argmax(lg, -1)),
                              logits=np.asarray(lg), compile_s=cinfo["compile_s"])  # fmt: skip
        one, sh = out["1gpu"], out[layout]
        diff = np.abs(sh["logits"] - one["logits"])  # [B, n, V]
        step_diff = diff.max(-1)
        top2 = np.sort(one["logits"], -1)[..., -2:]
        gap = top2[..., 1] - top2[..., 0]
        mism = sh["forced_argmax"] != one["toks"]
        return dict(
            mesh=str(tuple(self.mesh(layout).shape.values())), steps=n, batch=b, prompt=t,
            max_len=max_len, impl=spec.impl, mismatches=int(mism.sum()),
            first_mismatch=[int(np.argmax(r)) if r.any() else None for r in mism],
            tokens_equal=bool((sh["toks"] == one["toks"]).all()),
            logits_max_abs_diff=float(diff.max()),
            logits_max_abs=float(np.abs(one["logits"]).max()),
            near_ties=int((mism & (gap <= 2 * step_diff)).sum()), min_top2_gap=float(gap.min()),
            tokens_1gpu=one["toks"].tolist(), compile_s=one["compile_s"] + sh["compile_s"],
        )  # fmt: skip
