"""Needle in a haystack: passkey exact-match rate by context length and needle depth.

Prompts come from ``oscar_eval.passkey.passkey_prompt`` with one generator per cell,
``np.random.default_rng((seed, length, depth_percent, trial))``, so a cell's
prompts do not depend on which other cells run (the demo's few prompts are the
full grid's) and every method sees the same prompts. The seed defaults to one
that the training corpus does not use. Each method decodes greedily through
its real cache (``models.generate``: full-precision prefill, then every new
token appends to the quantized cache and attends to it), the prompts of one
length (or of all lengths: ``groups``) batched over depths and trials.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import models
import oscar_jax as oj
from models import bucket_length, generate, layers
from models.config import ModelConfig
from models.model import CausalLM
from oscar_eval import ppl as eval_ppl
from oscar_eval.common import Method, Progress, wilson
from oscar_eval.passkey import passkey_prompt, score_passkey

NIAH_SEED = 918_273  # not a seed of the training corpus (which draws from its own seeds)
LENGTHS = (512, 1024, 2048, 4096)
DEPTHS = tuple(range(0, 101, 10))  # percent


def build_prompts(
    encode, lengths, depths, trials: int, seed: int = NIAH_SEED, answer_encode=None
) -> list[dict]:
    """One dict per (length, depth %, trial): ids, answer, length, depth, trial, and with
    ``answer_encode`` (text -> ids without BOS) the answer's ids ``answer_ids`` (" 12345",
    what follows the prompt's "The pass key is")."""
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"{trials=} must be a positive int")
    out = []
    for n in lengths:
        for d in depths:
            if not 0 <= d <= 100:
                raise ValueError(f"depth={d} must be a percentage in [0, 100]")
            for i in range(trials):
                rng = np.random.default_rng((seed, int(n), int(d), i))
                ids, ans = passkey_prompt(encode, int(n), d / 100.0, rng)
                p = dict(ids=ids, answer=ans, length=int(n), depth=int(d), trial=i)
                if answer_encode is not None:
                    p["answer_ids"] = list(answer_encode(" " + ans))
                out.append(p)
    return out


def groups(prompts: list[dict], group: str = "length") -> list[list[dict]]:
    """Prompts run together: one group per nominal length ("length"), or one ("all").

    "all" pads every prompt to the longest bucket: one program per method instead of
    one per (method, length), at the price of computing short prompts at full length
    (the better trade on a GPU, where compiling dominates; not on a CPU).
    """
    if group not in ("length", "all"):
        raise ValueError(f"{group=} must be 'length' or 'all'")
    if group == "all":
        return [list(prompts)]
    lengths = sorted({p["length"] for p in prompts})
    return [[p for p in prompts if p["length"] == n] for n in lengths]


SCORES_BYTES = 2 << 30  # the prompt's dense [B, H, L, L] float32 scores a default batch holds


def default_batch(m, prompts) -> int:
    """Prompts a generate call takes when none is asked for: the whole group, capped so that
    the prompt's dense attention scores (float32 [B, num_heads, L, L]; the prefill holds a
    few such tensors) stay within ``SCORES_BYTES``: 30 prompts of 8,000 tokens of a 9-head
    model would need 64 GB for one of them."""
    longest = max(len(p["ids"]) for p in prompts)
    per_prompt = 4 * m.config.num_heads * longest * longest
    return max(1, min(len(prompts), SCORES_BYTES // per_prompt))


def _batches(m, prompts, batch, max_new):
    """(ids [batch, longest], lengths [batch], rows, max_len) per batch of one group, the
    last padded by repetition (the same shapes for every batch: one compilation). ``batch``
    None: ``default_batch``."""
    batch = default_batch(m, prompts) if batch is None else batch
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"{batch=} must be a positive int or None (the default batch)")
    longest = max(len(p["ids"]) for p in prompts)
    max_len = bucket_length(longest) + max_new
    for i in range(0, len(prompts), batch):
        part = prompts[i : i + batch]
        k = len(part)
        part = part + [part[-1]] * (batch - k)
        ids = np.zeros((batch, longest), np.int32)
        lens = np.array([len(p["ids"]) for p in part], np.int32)
        for r, p in enumerate(part):
            ids[r, : lens[r]] = p["ids"]
        yield ids, lens, k, max_len


def generate_program(m, prompts, kv, batch, max_new, stop_tokens=None, cache_dtype=None):
    """A thunk compiling the ``generate`` program of one group (``_run_group``'s shapes)
    ahead of use (``oscar_eval.programs.Precompiler``)."""
    ids, lens, _, max_len = next(_batches(m, prompts, batch, max_new))
    p = models.prepare(m, ids, max_new_tokens=max_new, kv=kv, lengths=lens, max_len=max_len,
                       cache_dtype=cache_dtype, stop_tokens=stop_tokens)  # fmt: skip
    return lambda: models.lower_generate(p, max_new).compile()


def _run_group(m, prompts, kv, batch, max_new, decode, stop_tokens, cache_dtype):
    """Greedy answers of a group of prompts; returns [bool] exact matches."""
    hits = []
    for ids, lens, k, max_len in _batches(m, prompts, batch, max_new):
        out = np.asarray(generate(m, ids, max_new, kv=kv, lengths=lens, max_len=max_len,
                                  stop_tokens=stop_tokens, cache_dtype=cache_dtype))  # fmt: skip
        for r in range(k):
            hits.append(bool(score_passkey(decode(out[r]), prompts[len(hits)]["answer"])))
    return hits


LL_PAD = 256  # answer log-likelihood: rows padded to a multiple (eval_ppl.CHUNK: chunked scores)


def _prefill_decode_hidden(mc: ModelConfig, params, ids, plen, kv, cache_dtype):
    """Hidden states [B, T, Hd] (pre final norm) as ``generate`` computes them: positions
    < plen [B] attend at full precision (the prefill), later ones to the cache as when
    decoded (``eval_ppl.cached_attention``)."""
    b, t = ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    decoded = (positions >= plen[:, None])[:, :, None, None]  # [B, T, 1, 1]
    plain = oj.preset("bf16")

    def attend(q, k, v, mi=None):
        o_c = eval_ppl.cached_attention(q, k, v, kv, cache_dtype=cache_dtype, method_kw=mi)
        o_p = eval_ppl.cached_attention(q, k, v, plain)  # prefill: K/V in the model dtype
        return jnp.where(decoded, o_c, o_p)

    def step(x, lp):
        mi = eval_ppl.method_inputs(mc, kv, lp, positions)
        x, _ = layers.block(mc, lp, x, positions, lambda q, k, v: attend(q, k, v, mi))
        return x, None

    def local_step(x, lp):  # Gemma 3's sliding-window layers: their ring is full precision
        def local_attend(q, k, v):
            cd, w = jnp.dtype(cache_dtype or k.dtype), mc.sliding_window
            o_c = layers.causal_attention(q, k.astype(cd), v.astype(cd), window=w)
            return jnp.where(decoded, o_c, layers.causal_attention(q, k, v, window=w))

        x, _ = layers.block(mc, lp, x, positions, local_attend, local=True)
        return x, None

    x = layers.embed(params, ids, mc)
    lays = eval_ppl.with_method_state(params["layers"], kv)
    if not mc.local_layers:
        return jax.lax.scan(step, x, lays)[0]
    kinds = jnp.asarray([mc.is_local(i) for i in range(mc.num_layers)])
    either = lambda x, a: jax.lax.cond(a[1], local_step, step, x, a[0])  # noqa: E731
    return jax.lax.scan(either, x, (lays, kinds))[0]


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _answer_lp_jit(mc: ModelConfig, kv, cache_dtype, params, ids, plen, pos, tgt):
    x = _prefill_decode_hidden(mc, params, ids, plen, kv, cache_dtype)
    xs = jnp.take_along_axis(x, pos[..., None], axis=1)  # [B, A, Hd]
    lp = jax.nn.log_softmax(layers.lm_head(mc, params, xs), axis=-1)  # [B, A, V]
    top = jnp.argmax(lp, axis=-1) == tgt  # [B, A] the target is the greedy token
    return jnp.take_along_axis(lp, tgt[..., None], axis=-1)[..., 0], top  # [B, A] twice


def answer_logprob(
    m: CausalLM, prompts: list[dict], kv: oj.KVQuantConfig, *, batch: int | None = None,
    cache_dtype=None,
) -> list[float]:  # fmt: skip
    """Log-likelihood (nats, summed over tokens) of each prompt's ``answer_ids`` after its
    ``ids``: the prompt prefilled at full precision, the answer teacher-forced through the
    cache of ``kv`` (``cache_dtype``: what the cache stores K/V in; default the model's)."""
    return [ll for ll, _ in answer_scores(m, prompts, kv, batch=batch, cache_dtype=cache_dtype)]


def _ll_shape(prompts: list[dict], batch: int | None) -> tuple[int, int, int]:
    """(rows a call, padded tokens, answer tokens) of ``answer_scores``' program."""
    if not prompts or any("answer_ids" not in p or not p["answer_ids"] for p in prompts):
        raise ValueError("prompts must be non-empty, each with non-empty answer_ids")
    batch = len(prompts) if batch is None else batch
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"{batch=} must be a positive int or None (all prompts at once)")
    n_ans = max(len(p["answer_ids"]) for p in prompts)
    longest = max(len(p["ids"]) + len(p["answer_ids"]) for p in prompts)
    return batch, -(-longest // LL_PAD) * LL_PAD, n_ans


def answer_program(m: CausalLM, prompts: list[dict], kv, *, batch: int | None = None,
                   cache_dtype=None):  # fmt: skip
    """A thunk compiling ``answer_scores``' program for ``prompts`` ahead of use
    (``oscar_eval.programs.Precompiler``): at long contexts it is as costly to compile as
    the decoding one."""
    batch, t, n_ans = _ll_shape(prompts, batch)
    params, ckv = m.folded_params(kv), eval_ppl.cache_kv_config(kv)
    dt = jnp.dtype(cache_dtype or m.dtype).name
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    args = (i32(batch, t), i32(batch), i32(batch, n_ans), i32(batch, n_ans))
    return lambda: _answer_lp_jit.lower(m.config, ckv, dt, params, *args).compile()


def answer_scores(
    m: CausalLM, prompts: list[dict], kv: oj.KVQuantConfig, *, batch: int | None = None,
    cache_dtype=None,
) -> list[tuple[float, bool]]:  # fmt: skip
    """``answer_logprob`` and, per prompt, whether greedy decoding would emit exactly the
    answer's tokens: every teacher-forced answer position's argmax is its target (then each
    greedy step sees the same tokens as the forced one). It needs no decoding loop, so it
    reaches methods the real cache refuses (``oscar_jax.methods``); it is stricter than the
    ``niah`` task's hit, which matches the decoded text (another tokenization of the
    answer counts there)."""
    batch, t, n_ans = _ll_shape(prompts, batch)
    params, ckv = m.folded_params(kv), eval_ppl.cache_kv_config(kv)
    dt = jnp.dtype(cache_dtype or m.dtype).name
    out: list[tuple[float, bool]] = []
    for i in range(0, len(prompts), batch):
        part = prompts[i : i + batch]
        part = part + [part[-1]] * (batch - len(part))  # one shape for every batch
        ids = np.zeros((batch, t), np.int32)
        plen = np.zeros(batch, np.int32)
        pos = np.zeros((batch, n_ans), np.int32)
        tgt = np.zeros((batch, n_ans), np.int32)
        mask = np.zeros((batch, n_ans), bool)
        for r, p in enumerate(part):
            n, a = len(p["ids"]), len(p["answer_ids"])
            ids[r, :n], ids[r, n : n + a] = p["ids"], p["answer_ids"]
            plen[r] = n
            pos[r, :a] = np.arange(n - 1, n + a - 1)  # the logits at pos predict tgt
            tgt[r, :a], mask[r, :a] = p["answer_ids"], True
        arrays = [jnp.asarray(a) for a in (ids, plen, pos, tgt)]
        lp, top = map(np.asarray, _answer_lp_jit(m.config, ckv, dt, params, *arrays))
        out += [(float(np.where(mask[r], lp[r], 0.0).sum()), bool(np.all(top[r] | ~mask[r])))
                for r in range(len(part))]  # fmt: skip
    return out[: len(prompts)]


def decodes(kv) -> bool:
    """Whether ``kv`` has a real cache that ``models.generate`` decodes through; the
    comparison methods of ``oscar_jax.methods`` are fake-quant only, so their needle is
    scored teacher-forced (``answer_scores``)."""
    return isinstance(kv, oj.KVQuantConfig)


def niah_method(
    m: CausalLM, mt: Method, prompts: list[dict], decode: Callable, *, batch: int | None = None,
    max_new_tokens: int = 8, stop_tokens=None, cache_dtype=None, group: str = "length",
    progress: Progress | None = None, ll_batch: int | None = None,
) -> list[dict]:  # fmt: skip
    """The prompts of one method in the prompts' order, each with ``hit`` (exact match) and,
    when they carry ``answer_ids``, ``answer_ll`` and ``forced`` (``answer_scores``, batches of
    ``ll_batch``). ``hit`` is the decoded text's match for a method with a real cache and
    ``forced`` (greedy would emit exactly the answer's tokens) for a fake-quant one."""
    if not prompts:
        raise ValueError("prompts must not be empty")
    forced_only = not decodes(mt.kv)
    if forced_only and not all(p.get("answer_ids") for p in prompts):
        raise ValueError(f"method {mt.name!r} has no real cache (fake-quant only): its needle "
                         "is scored teacher-forced, so every prompt needs answer_ids")  # fmt: skip
    res = {}
    for g in groups(prompts, group):
        scores = [None] * len(g)
        if all("answer_ids" in p for p in g):
            scores = answer_scores(m, g, mt.kv, batch=ll_batch, cache_dtype=cache_dtype)
        if forced_only:
            hits = [f for _, f in scores]
        else:
            hits = _run_group(m, g, mt.kv, batch, max_new_tokens, decode, stop_tokens,
                              cache_dtype)  # fmt: skip
        for p, h, sc in zip(g, hits, scores, strict=True):
            extra = {} if sc is None else {"answer_ll": sc[0], "forced": sc[1]}
            res[id(p)] = dict(p, hit=h, **extra)
        if progress is not None:
            progress.update(len(g))
    return [res[id(p)] for p in prompts]


def summarize(mt: Method, res: list[dict]) -> tuple[dict, list[dict]]:
    """(summary row with a 95% Wilson CI and the rate per length, cells per (length, depth))."""
    lengths = sorted({r["length"] for r in res})
    k = sum(r["hit"] for r in res)
    rate, lo, hi = wilson(k, len(res))
    row = {"method": mt.name, "bits": mt.kv.bits, "rate": rate, "rate_lo": lo,
           "rate_hi": hi, "prompts": len(res),
           "hit_from": "decoded" if decodes(mt.kv) else "teacher-forced"}  # fmt: skip
    if all("forced" in r for r in res):
        row["forced_rate"] = sum(r["forced"] for r in res) / len(res)
    has_ll = all("answer_ll" in r for r in res)
    if has_ll:
        row["answer_ll"] = float(np.mean([r["answer_ll"] for r in res]))
    for n in lengths:
        hs = [r["hit"] for r in res if r["length"] == n]
        row[f"rate@{n}"] = sum(hs) / len(hs)
        if has_ll:
            row[f"ll@{n}"] = float(np.mean([r["answer_ll"] for r in res if r["length"] == n]))
    cells = []
    for n in lengths:
        for d in sorted({r["depth"] for r in res}):
            hs = [r["hit"] for r in res if r["length"] == n and r["depth"] == d]
            if hs:
                cells.append({"method": mt.name, "length": n, "depth": d,
                              "rate": sum(hs) / len(hs), "prompts": len(hs)})  # fmt: skip
                if has_ll:
                    ll = [r["answer_ll"] for r in res if r["length"] == n and r["depth"] == d]
                    cells[-1]["answer_ll"] = float(np.mean(ll))
    return row, cells


def paired_ll_delta(ll: list[float], ref: list[float], n_boot: int = 2000, seed: int = 0):
    """Mean of ll - ref over prompts (the same prompts) and its 95% bootstrap interval."""
    d = np.asarray(ll, np.float64) - np.asarray(ref, np.float64)
    if d.ndim != 1 or len(d) == 0:
        raise ValueError(f"ll and ref must be equal-length non-empty lists, got {d.shape}")
    if len(d) == 1:
        return float(d[0]), float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, len(d), (n_boot, len(d)))
    lo, hi = np.percentile(d[idx].mean(1), [2.5, 97.5])
    return float(d.mean()), float(lo), float(hi)


def niah(
    m: CausalLM, methods: list[Method], prompts: list[dict], decode: Callable, *,
    batch: int | None = None, max_new_tokens: int = 8, stop_tokens=None, cache_dtype=None,
    group: str = "length", show_progress: bool = True,
):  # fmt: skip
    """Exact-match rates per method: overall (with a 95% Wilson CI), per length and per cell.

    ``decode(ids) -> text`` turns generated ids into text (``score_passkey`` reads the
    first five digits; cut the text at a stop token there). ``stop_tokens`` go to
    ``generate`` (None: the model's eos ids), so does ``cache_dtype``. ``batch``:
    prompts per ``generate`` call (None: a whole group); ``group``: see ``groups``.
    Returns (rows, cells): one summary row per method, one row per (method, length, depth).
    """
    if not prompts:
        raise ValueError("prompts must not be empty")
    rows, cells = [], []
    for mt in methods:
        bar = Progress(len(prompts), f"niah {mt.name:<19}", enabled=show_progress)
        res = niah_method(m, mt, prompts, decode, batch=batch, max_new_tokens=max_new_tokens,
                          stop_tokens=stop_tokens, cache_dtype=cache_dtype, group=group,
                          progress=bar)  # fmt: skip
        row, cs = summarize(mt, res)
        rows.append(row)
        cells += cs
    return rows, cells
