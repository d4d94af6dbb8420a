"""Offline calibration of the comparison methods that fit per-layer state
(``MethodConfig.needs_calibration``: KVQuant-style codebooks, Fisher-weighted with
``needs_grads``, the calibrated rotation).

``layer_kv`` runs the model at full precision over calibration windows and returns every
layer's keys (post-RoPE, as the cache gets them) and values (``layer_kv_stats``: also the
per-KV-head second moments of the queries and attention outputs, for the methods with
``needs_queries``, which ``fit`` gets as ``query_cov`` / ``output_cov``); ``calibrate``
fits each such method on them. The evaluation calibrates on the windows of the held-out text that
follow the scored ones (``calibration_windows``): disjoint from what is scored;
``calibrate_heldout`` is that step, shared by the evaluation and
``benchmarks/methods_needle.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models import layers
from models.config import ModelConfig
from models.model import CausalLM
from oscar_eval.common import Method, make_windows
from oscar_eval.fisher import layer_grads
from oscar_eval.ppl import window_nll
from oscar_jax import methods as oscar_methods

CALIBRATION_WINDOWS = 2  # windows of the evaluation's ctx, after the scored ones


QUERY_SAMPLES = 256  # query positions ``layer_kv_stats(queries=True)`` keeps a window


def query_positions(t: int, n: int = QUERY_SAMPLES) -> np.ndarray:
    """[min(n, t)] int32: evenly spaced query positions of a window of t tokens, the last
    included (later queries see more of the quantized history)."""
    m = min(n, t)
    if m == 1:
        return np.array([t - 1], np.int32)
    return np.unique(np.round(np.linspace(0, t - 1, m)).astype(np.int32))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _layer_kv_jit(mc: ModelConfig, params, ids, extras: tuple = ()):
    """k, v [L, N, H, T, D], then per name in ``extras`` (in this order): "moments" (query
    and output second moments), "attention" (``key_attention_weight``), "queries" (the
    queries [L, N, Hq, S, D] at ``query_positions``)."""
    b, t = ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    qpos = jnp.asarray(query_positions(t))

    def step(x, lp, local=False):
        seen = {}

        def attend(q, k, v):
            o = layers.causal_attention(q, k, v, window=mc.sliding_window if local else None)
            seen["q"], seen["k"], seen["o"] = q, k, o
            return o

        x, (k, v) = layers.block(mc, lp, x, positions, attend, local=local)
        out = (k.astype(jnp.float32), v.astype(jnp.float32))
        if "moments" in extras:
            out += tuple(_group_second_moment(seen[n], mc.num_kv_heads) for n in "qo")
        if "attention" in extras:
            out += (key_attention_weight(seen["q"], seen["k"]),)
        if "queries" in extras:  # [B, S, Hq, D] -> [B, Hq, S, D]
            out += (jnp.swapaxes(seen["q"][:, qpos].astype(jnp.float32), 1, 2),)
        return x, out

    x0 = layers.embed(params, ids, mc)
    if mc.local_layers:  # Gemma 3: sliding-window layers attend over their window (their
        # statistics are taken as for the others; a KV preset acts on the global layers only)
        kinds = jnp.asarray([mc.is_local(i) for i in range(mc.num_layers)])
        _, outs = jax.lax.scan(
            lambda x, a: jax.lax.cond(a[1], functools.partial(step, local=True), step, x, a[0]),
            x0, (params["layers"], kinds))  # fmt: skip
    else:
        _, outs = jax.lax.scan(step, x0, params["layers"])
    kv = tuple(jnp.swapaxes(a, 2, 3) for a in outs[:2])  # [L, N, H, T, D]
    return kv + tuple(outs[2:])


def key_attention_weight(q, k, chunk: int = layers.QUERY_CHUNK):
    """[B, Hkv, T] float32: the squared causal attention each key receives, summed over
    the queries of its KV head's group (softmax scale 1 / sqrt(D), as ``causal_attention``),
    for q [B, T, Hq, D] and k [B, T, Hkv, D]; queries in blocks of ``chunk`` (``lax.map``)
    so that only [B, Hq, chunk, T] scores live at once."""
    b, t, hq, d = q.shape
    h = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, t, h, hq // h, d)
    kf = k.astype(jnp.float32)

    def block(qb, pos):  # qb [B, C, H, g, D], pos [C]
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qb, kf, precision=jax.lax.Precision.HIGHEST)
        mask = (jnp.arange(t)[None, :] <= pos[:, None])[None, None, None]
        p = jax.nn.softmax(jnp.where(mask, s / np.sqrt(d), -jnp.inf), axis=-1)
        return jnp.sum(jnp.where(mask, p, 0.0) ** 2, axis=(2, 3))  # [B, H, T]

    if t <= chunk or t % chunk:
        return block(qg, jnp.arange(t))
    n = t // chunk
    qc = jnp.moveaxis(qg.reshape(b, n, chunk, h, hq // h, d), 1, 0)
    parts = jax.lax.map(lambda a: block(a[0], a[1]), (qc, jnp.arange(t).reshape(n, chunk)))
    return jnp.sum(parts, axis=0)


def _group_second_moment(x, num_kv_heads: int):
    """[H, D, D]: E[x x^T] over batch, tokens and the query heads of each KV head's group
    of x [B, T, Hq, D] (float32)."""
    b, t, hq, d = x.shape
    xg = x.astype(jnp.float32).reshape(b, t, num_kv_heads, hq // num_kv_heads, d)
    return jnp.einsum("bthgd,bthge->hde", xg, xg, precision=jax.lax.Precision.HIGHEST) / (
        b * t * (hq // num_kv_heads)
    )


def _layer_outputs(m: CausalLM, windows, extras: tuple = ()) -> tuple[np.ndarray, ...]:
    out = _layer_kv_jit(m.config, m.params(), jnp.asarray(m.check_ids(windows)), extras)
    return tuple(np.asarray(a) for a in out)


def layer_kv(m: CausalLM, windows) -> tuple[np.ndarray, np.ndarray]:
    """Keys (post-RoPE) and values [L, N, Hkv, T, D] float32 of every layer, at full
    precision, over the windows [N, T] (Gemma 3's sliding-window layers attend over their
    window, as the model does)."""
    return _layer_outputs(m, windows)


def layer_kv_stats(m: CausalLM, windows, attention: bool = False,
                   queries: bool = False) -> tuple[np.ndarray, ...]:  # fmt: skip
    """``layer_kv``'s keys and values, and per layer and KV head the second moments
    [L, Hkv, D, D] of the queries (post-RoPE) and of the attention outputs
    ``softmax(q k^T) v`` (before W_O) of its query group, float32, taken inside the jit:
    what a method with ``needs_queries`` fits on; then with ``attention``
    ``key_attention_weight`` [L, N, Hkv, T] (``needs_attention``), with ``queries`` the
    queries [L, N, Hq, S, D] at ``query_positions`` (``needs_query_samples``)."""
    extras = ("moments",) + ("attention",) * attention + ("queries",) * queries
    return _layer_outputs(m, windows, extras)


def calibration_windows(heldout, ctx: int, scored: int, bos: int | None) -> np.ndarray:
    """The ``CALIBRATION_WINDOWS`` windows of ``heldout`` after the first ``scored`` (the
    evaluation's); ValueError when the text is too short for them."""
    w = make_windows(heldout, ctx, scored + CALIBRATION_WINDOWS, bos)
    if len(w) < scored + CALIBRATION_WINDOWS:
        raise ValueError(f"held-out text has {len(w)} windows of {ctx}: calibration needs "
                         f"{CALIBRATION_WINDOWS} beyond the {scored} scored")  # fmt: skip
    return w[scored:]


def calibrate(m: CausalLM, methods: list[Method], windows) -> list[Method]:
    """The methods, each that ``needs_calibration`` fitted on ``windows`` (the others as
    they are); the model runs once, only when some method needs it."""
    if not any(getattr(mt.kv, "needs_calibration", False) for mt in methods):
        return list(methods)
    mc = m.config
    fitted = [mt.kv for mt in methods if getattr(mt.kv, "needs_calibration", False)]
    stats = {}
    if any(kv.needs_queries for kv in fitted):
        attn = any(kv.needs_attention for kv in fitted)
        qs = any(kv.needs_query_samples for kv in fitted)
        k, v, cq, co, *more = layer_kv_stats(m, windows, attention=attn, queries=qs)
        stats = {"query_cov": cq, "output_cov": co}
        if attn:
            stats["key_weight"] = more.pop(0)
        if qs:
            stats["queries"] = more.pop(0)
            stats["query_pos"] = query_positions(k.shape[3])
    else:
        k, v = layer_kv(m, windows)
    t = k.shape[3]
    cos, sin = layers.rope_cos_sin(mc, jnp.arange(t, dtype=jnp.int32))
    off = None
    bk = m.params()["layers"].get("bk")
    if bk is not None and not mc.qk_norm:
        off = np.stack(
            [np.asarray(oscar_methods.rope_key_offset(b, cos, sin, mc.num_kv_heads)) for b in bk]
        )  # fmt: skip  [L, T, H, D]
    grads = layer_grads(m, windows) if any(kv.needs_grads for kv in fitted) else None
    out = []
    for mt in methods:
        if getattr(mt.kv, "needs_calibration", False):  # a MethodConfig: its needs_* set
            o = off if mt.kv.needs_key_bias else None
            extra = dict(stats if mt.kv.needs_queries else {})
            if not mt.kv.needs_attention:
                extra.pop("key_weight", None)
            if not mt.kv.needs_query_samples:
                extra.pop("queries", None)
                extra.pop("query_pos", None)
            if mt.kv.needs_loss:
                extra["loss"] = functools.partial(calibration_nll, m, windows)
            if mt.kv.needs_grads:
                extra["grads"] = grads
            mt = Method(mt.name, mt.kv.fit(k, v, (np.asarray(cos), np.asarray(sin)), o, **extra))
        out.append(mt)
    return out


def calibration_nll(m: CausalLM, windows, kv) -> float:
    """Mean NLL of the model with the (calibrated) method ``kv`` over the calibration
    ``windows``, every position scored, cache-exact (``oscar_eval.ppl.window_nll``): the
    loss a method with ``needs_loss`` compares its candidates by."""
    nll, _ = window_nll(m, windows, kv, batch=len(windows))
    return float(np.mean(nll))


def calibrate_heldout(
    m: CausalLM, methods: list[Method], heldout, ctx: int, scored: int
) -> tuple[list[Method], str | None]:
    """The evaluation's calibration: the methods, those that ``needs_calibration`` fitted
    on the ``calibration_windows`` of ``heldout`` (windows of ``ctx`` after the first
    ``scored``), and a note saying so (None, and nothing run, when no method needs it)."""
    if not any(getattr(mt.kv, "needs_calibration", False) for mt in methods):
        return list(methods), None
    cal = calibration_windows(heldout, ctx, scored, m.config.bos_token_id)
    note = (f"calibrated methods fitted on the {len(cal)} windows of {ctx} tokens after the "
            "scored ones")  # fmt: skip
    fitted = calibrate(m, methods, cal)
    said = [f"{mt.name}: {n}" for mt in fitted
            if (n := getattr(mt.kv, "calibration_note", lambda: None)()) is not None]  # fmt: skip
    return fitted, "; ".join([note, *said])
