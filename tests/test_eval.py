"""The evaluation's pieces: cache-exact perplexity, passkey prompts, statistics, TNI, methods."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import kv_with_sinks

import models
import oscar_jax as oj
from oscar_eval import ppl as eval_ppl
from oscar_eval import tni as eval_tni
from oscar_eval.common import (
    DEFAULT_METHODS,
    ablation_methods,
    bootstrap_ppl,
    make_windows,
    parse_method,
    parse_methods,
    wilson,
)
from oscar_eval.tasks import int2_variants

T = 64  # three flushes of G = 16 with R = 16: the quantized part is well used
SMALL = dict(residual_length=16, group_size=16)


def _stepwise_logits(m, ids, kv, cache_dtype=None):
    """Teacher-forced token-by-token decoding through the real cache: logits [B, T, V]."""
    b, t = ids.shape
    logits, caches, p = models.prefill(m, ids[:, :1], kv, max_new_tokens=t, max_len=t + 16,
                                       cache_dtype=cache_dtype)  # fmt: skip
    out = [np.asarray(logits)]
    for i in range(1, t):
        logits, caches = models.decode_step(p, caches, ids[:, i], np.full(b, i, np.int32))
        out.append(np.asarray(logits))
    caches = models.stack_caches(caches)  # [L, ...]
    assert int(np.asarray(caches.lengths).max()) == t
    return np.stack(out, axis=1), caches


METHODS = {
    "kivi2": dict(method="kivi"),
    "oscar2_pertoken": dict(method="oscar", norm_granularity="per_token"),
    "oscar2_randorth": dict(method="oscar", rotation="random_orthogonal"),
    # R = 0: an append that completes a group quantizes the current token before it attends
    "oscar2_pertoken_r0": dict(method="oscar", norm_granularity="per_token", residual_length=0),
}


def _kv(name):
    kw = {**SMALL, **METHODS[name]}
    return oj.preset(kw.pop("method"), bits=2, **kw)


@pytest.mark.parametrize(
    "name,dtype",
    [("kivi2", "float32"), ("oscar2_randorth", "float32"), ("oscar2_pertoken_r0", "bfloat16")],
)
def test_cached_attention_equals_append_and_decode_attention(name, dtype):
    """The parallel form against the real cache, token by token, on identical q/k/v."""
    kv = _kv(name)  # rotate_values=True here: the cache rotates values itself
    b, h, hq, d = 2, 2, 4, 32
    k, v = kv_with_sinks(5, b, T, h, d, sinks=(0, 1), ratio=20.0)
    q = jax.random.normal(jax.random.PRNGKey(9), (b, T, hq, d))
    step = jax.jit(lambda c, q_t, k_t, v_t: (lambda c: (c, oj.decode_attention(q_t, c)))(
        oj.append(c, k_t, v_t)))  # fmt: skip
    cache = oj.init_cache(kv, batch=b, max_len=T, num_kv_heads=h, head_dim=d, dtype=dtype)
    outs = []
    for t in range(T):
        cache, o = step(cache, q[:, t], k[:, t], v[:, t])
        outs.append(o)
    ref = np.stack([np.asarray(o) for o in outs], axis=1)  # [B, T, Hq, D]
    assert int(np.asarray(cache.num_quantized()).min()) >= T - 16
    got = np.asarray(eval_ppl.cached_attention(q, k, v, kv, chunk=32, cache_dtype=dtype))
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6)
    plain = np.asarray(eval_ppl.cached_attention(q, k, v, oj.preset("bf16"), chunk=32))
    assert np.max(np.abs(plain - ref)) > 0.05  # quantization matters here


def test_parallel_form_equals_token_by_token_decoding(tiny):
    """Whole model: cache-exact logits against models.prefill + decode_step, token by token.

    The decode program computes each token's K/V with [B, 1] matmuls, the parallel
    form with [B, T] ones; they differ by float32 ulps (as prefill and decoding do),
    and such a difference can move a value across a rounding boundary of the
    quantizer (one code, rarely). The bound allows that and no more: it is far below
    the quantization's own effect on the logits, checked alongside. The other methods,
    per-head norms and a bfloat16 cache are covered exactly by the attention-level test
    above (a bfloat16 cache cannot be compared here: the reference's first token goes
    through ``prefill``, whose attention reads K/V before they are stored in bfloat16).
    """
    name, cache_dtype = "oscar2_pertoken", None
    kv = _kv(name)
    ids = np.random.default_rng(1).integers(0, 256, (2, T)).astype(np.int32)
    ref, caches = _stepwise_logits(tiny, ids, kv, cache_dtype)
    assert caches.k_res.dtype == jnp.dtype(cache_dtype or "float32")
    assert int(np.asarray(caches.num_quantized()).min()) == T - 16  # most tokens quantized
    par = np.asarray(eval_ppl.cached_logits(tiny, ids, kv, cache_dtype))
    full = np.asarray(tiny.logits(ids))
    err = float(np.max(np.abs(par - ref)))
    effect = float(np.max(np.abs(full - ref)))
    print(
        f"{name}: parallel vs decoding {err:.2e}, median {np.median(np.abs(par - ref)):.1e}; "
        f"quantization moves logits by {effect:.2f} (max |logit| {np.abs(ref).max():.1f})"
    )
    assert effect > 0.5  # the quantized cache matters, so the agreement is not vacuous
    assert err <= 3e-3 and np.median(np.abs(par - ref)) <= 1e-5
    # the perplexity path (NLL of the next token) agrees with the decoded logits too
    nll, _ = eval_ppl.window_nll(tiny, ids, kv, batch=2, cache_dtype=cache_dtype)
    lp = jax.nn.log_softmax(ref[:, :-1], axis=-1)
    want = -np.take_along_axis(np.asarray(lp), ids[:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(nll, want, rtol=0, atol=3e-3)
    assert abs(nll.mean() - want.mean()) < 1e-4


def test_parallel_form_bf16_is_plain_causal_attention(tiny):
    ids = np.random.default_rng(2).integers(0, 256, (1, 64)).astype(np.int32)
    got = np.asarray(eval_ppl.cached_logits(tiny, ids, oj.preset("bf16")))
    np.testing.assert_allclose(got, np.asarray(tiny.logits(ids)), rtol=0, atol=2e-5)


def test_passkey_prompts_and_scorer_are_deterministic():
    from oscar_eval import niah as eval_niah
    from oscar_eval.passkey import QUESTION, score_passkey

    enc = lambda s: [1] + list(s.encode("utf-8"))  # byte-level ids with a BOS of 1
    a = eval_niah.build_prompts(enc, (300, 500), (0, 50, 100), 2, seed=7)
    b = eval_niah.build_prompts(enc, (300, 500), (0, 50, 100), 2, seed=7)
    c = eval_niah.build_prompts(enc, (300, 500), (0, 50, 100), 2, seed=8)
    assert [p["ids"] for p in a] == [p["ids"] for p in b]
    assert [p["answer"] for p in a] == [p["answer"] for p in b]
    assert [p["answer"] for p in a] != [p["answer"] for p in c]
    for p in a:
        assert len(p["ids"]) <= p["length"] and len(p["ids"]) > p["length"] - 40
        assert p["ids"][0] == 1 and bytes(p["ids"][1:]).decode().endswith(QUESTION)
        assert p["answer"] in bytes(p["ids"][1:]).decode()
    # a cell's prompts do not depend on the rest of the grid (the demo's are the full grid's)
    one = eval_niah.build_prompts(enc, (500,), (50,), 2, seed=7)
    assert [p["ids"] for p in one] == [
        p["ids"] for p in a if (p["length"], p["depth"]) == (500, 50)
    ]
    ans = a[0]["answer"]
    assert score_passkey(f" {ans}. Remember it.", ans)
    wrong = str((int(ans) + 1) % 90000 + 10000)
    assert not score_passkey(f" {wrong}.", ans) and not score_passkey(" no digits", ans)
    assert score_passkey(f" {ans}.", ans) == score_passkey(f" {ans}.", ans)


def test_make_encode_adds_bos_once():
    from oscar_eval.common import make_encode

    class Tok:
        def __init__(self, bos, eos=None):
            self.bos, self.eos = bos, eos

        def encode(self, text, add_special_tokens=True):
            ids = [ord(c) for c in text]
            if add_special_tokens:
                ids = ([self.bos] if self.bos is not None else []) + ids
                ids += [self.eos] if self.eos is not None else []
            return type("E", (), {"ids": ids})()

    assert make_encode(Tok(None), 0)("ab") == [0, 97, 98]
    assert make_encode(Tok(0), 0)("ab") == [0, 97, 98]  # one BOS, not the tokenizer's too
    assert make_encode(Tok(5), 0)("ab") == [0, 97, 98]  # the model's BOS, not a second one
    assert make_encode(Tok(0, eos=1), 0)("ab") == [0, 97, 98]  # no EOS ends the prompt
    assert make_encode(Tok(None), None)("ab") == [97, 98]
    assert make_encode(Tok(3), None)("ab") == [3, 97, 98]  # no model BOS: the tokenizer's


def test_method_names():
    m = parse_method("oscar2_pertoken_r64_g64_randorth_normfp32")
    kv = m.kv
    assert (kv.method, kv.bits, kv.norm_granularity, kv.residual_length, kv.group_size,
            kv.rotation, kv.norm_dtype) == ("oscar", 2, "per_token", 64, 64, "random_orthogonal",
                                            "float32")  # fmt: skip
    assert parse_method("kivi4").kv == oj.preset("kivi", bits=4, residual_length=128, group_size=32)
    assert parse_method("bf16").kv == oj.preset("bf16")
    assert [x.name for x in parse_methods("bf16, oscar2,bf16")] == ["bf16", "oscar2"]
    assert len(parse_methods(",".join(DEFAULT_METHODS))) == 13
    for bad in ("oscar", "oscar2_foo", "kivi2_randorth", "oscar5", "oscar2_r20", "", "fp8"):
        with pytest.raises(ValueError, match="method"):
            parse_methods(bad)
    rows = ablation_methods("oscar2", 128, 32)
    kvs = {name: parse_method(name).kv for _, _, name in rows}
    assert {kv.residual_length for kv in kvs.values()} == {0, 32, 128}
    assert {kv.group_size for kv in kvs.values()} == {32, 64, 128}
    assert {kv.rotation for kv in kvs.values()} == {
        "hadamard", "randomized_hadamard", "random_orthogonal"}  # fmt: skip
    assert {kv.norm_dtype for kv in kvs.values()} == {"bfloat16", "float32"}
    assert {kv.norm_granularity for kv in kvs.values()} == {"per_head", "per_token"}
    for factor in {f for f, _, _ in rows}:  # one factor at a time: the rest is the base's
        other = [n for f, _, n in rows if f == factor and n != "oscar2"]
        assert all(
            sum(
                a != b
                for a, b in zip(
                    dataclasses.astuple(kvs[n]), dataclasses.astuple(kvs["oscar2"]), strict=True
                )
            )
            == 1
            for n in other
        ), factor


def test_statistics():
    rng = np.random.default_rng(0)
    nll = rng.normal(3.0, 0.3, 20) * 100
    cnt = np.full(20, 100.0)
    r = bootstrap_ppl(nll, cnt, nll, seed=1)
    assert np.isclose(r["ppl"], np.exp(nll.sum() / 2000))
    assert r["ppl_lo"] < r["ppl"] < r["ppl_hi"]
    assert r["delta_vs_bf16"] == 0 and r["delta_lo"] == 0 == r["delta_hi"]
    worse = bootstrap_ppl(nll + 5.0, cnt, nll, seed=1)  # +0.05 nats per token, every window
    assert worse["delta_lo"] > 0 and np.isclose(
        worse["delta_vs_bf16"], np.exp(nll.sum() / 2000) * (np.exp(0.05) - 1)
    )
    assert np.isnan(bootstrap_ppl(nll[:1], cnt[:1])["ppl_lo"])  # one window: no interval
    p, lo, hi = wilson(10, 10)
    assert p == 1 and np.isclose(hi, 1) and 0.65 < lo < 0.75
    p, lo, hi = wilson(0, 4)
    assert p == 0 and lo == 0 and 0.4 < hi < 0.6


def test_windows_start_at_bos():
    tok = np.array([5, 0, 7, 8, 9, 0, 3, 0, 1, 2, 4, 6, 0, 9])
    w = make_windows(tok, 4, bos=0)
    np.testing.assert_array_equal(w, [[0, 7, 8, 9], [0, 3, 0, 1]])  # [0, 9] is too short
    np.testing.assert_array_equal(make_windows(tok, 5, 2), [[5, 0, 7, 8, 9], [0, 3, 0, 1, 2]])
    with pytest.raises(ValueError, match="no window"):
        make_windows(tok, 50)


def test_tni_summary_and_int2_key_error_on_planted_sinks():
    k, _ = kv_with_sinks(3, 2, 256, 2, 128, sinks=(0,), ratio=20.0, massive=2)
    k = np.asarray(k)[:, None]  # [N=2, L=1, T, H, D]
    rows, sm = eval_tni.tni_summary(eval_tni.key_norms(k))
    for r in rows:
        assert 15 < r["median_over_sink"] < 25 and r["argmin_position"] == 0
    assert sm["layers_heads_ratio_ge_10"] == 2
    errs = eval_tni.key_mse(k, parse_methods("kivi2,oscar2,bf16"), show_progress=False)
    by = {r["method"]: r for r in errs}
    assert set(by) == {"kivi2", "oscar2"}  # bf16 has no quantization error to report
    # KIVI crushes the low-norm sink's key; OScaR keeps it (the paper's point)
    assert by["kivi2"]["sink_key_rel_err"] > 0.5 > 0.3 > by["oscar2"]["sink_key_rel_err"]


def test_key_error_task_names_only_the_librarys_quantizers():
    """The tni task's key error runs ``fake_quant_keys``; a comparison method (its own
    quantizer) is left to the perplexity and needle tasks instead of failing the run."""
    got = [mt.name for mt in int2_variants(parse_methods("bf16,kivi4,oscarb2,oscar2,kivi2"))]
    assert got == ["kivi2", "oscar2"]


def test_programs_compiled_ahead_are_the_ones_called(tiny, caplog):
    """``nll_program`` / ``generate_program`` / ``key_err_program`` compile what the later
    calls run: those calls compile nothing more (else the evaluation compiles twice)."""
    from models import trace_count
    from oscar_eval import niah as eval_niah
    from oscar_eval import programs as eval_programs

    kv = _kv("oscar2_pertoken")
    ids = np.random.default_rng(3).integers(0, 256, (3, T)).astype(np.int32)
    eval_ppl.nll_program(tiny, kv, 2, T, "bfloat16")()
    k = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (1, 2, T, 2, 32)))
    eval_tni.key_err_program(kv, k.shape, "bfloat16")()
    enc = lambda s: [1] + list(s.encode("utf-8"))  # noqa: E731
    prompts = eval_niah.build_prompts(enc, (200, 240), (0, 100), 1, seed=3)
    n0 = trace_count("generate")
    eval_niah.generate_program(tiny, prompts, kv, None, 6, cache_dtype="bfloat16")()
    assert trace_count("generate") == n0 + 1
    stats = eval_programs.CompileStats()
    jax.config.update("jax_log_compiles", True)
    caplog.set_level(logging.WARNING)
    nll, _ = eval_ppl.window_nll(tiny, ids, kv, batch=2, cache_dtype="bfloat16")
    eval_tni.key_mse(k, [parse_method("oscar2_pertoken_r16_g16")], False, "bfloat16")
    hits = eval_niah.niah_method(tiny, parse_method("oscar2_pertoken_r16_g16"), prompts,
                                 lambda ids: "", max_new_tokens=6, cache_dtype="bfloat16",
                                 group="all")  # fmt: skip
    jax.config.update("jax_log_compiles", False)
    compiled = [r.getMessage() for r in caplog.records if "Finished XLA compilation" in r.message]
    assert len(compiled) == stats.get()["programs"] <= 3  # small helpers only (dtype casts)
    assert not [c for c in compiled if any(f in c for f in ("_nll", "_key_err", "_generate"))]
    assert trace_count("generate") == n0 + 1
    assert nll.shape == (3, T - 1) and np.isfinite(nll).all() and len(hits) == 4


def test_budget_skips_what_would_not_finish():
    from oscar_eval.programs import Budget

    b = Budget(None)
    assert b.allows("ppl", "x") and not b.skipped
    b = Budget(100.0)
    assert b.allows("ppl", "bf16")  # nothing seen yet: expected to take `first` = 0 s
    b.done("ppl", 60.0)
    assert b.allows("ppl", "kivi2")  # ~0 s elapsed + 60 s expected <= 100 s
    b.done("ppl", 150.0)  # the longest unit seen is what the next one is expected to take
    assert b.allows("niah", "bf16")  # another kind
    assert not b.allows("ppl", "oscar2")
    assert [(u["task"], u["unit"], u["expected_s"]) for u in b.skipped] == [
        ("ppl", "oscar2", 150.0)]  # fmt: skip
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="time_budget_s"):
            Budget(bad)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_resolve_without_perplexity_windows(monkeypatch, backend):
    """--tasks niah (no windows) must not fail the perplexity batch check (it did on the GPU)."""
    from oscar_eval import runner as evaluate

    monkeypatch.setattr(evaluate.jax, "default_backend", lambda: backend)
    batch, group = evaluate._resolve(evaluate.Settings(), 0)
    assert batch == 1
    assert group == ("length" if backend == "cpu" else "all")
    assert evaluate._resolve(evaluate.Settings(), 31)[0] == (1 if backend == "cpu" else 31)
    with pytest.raises(ValueError, match="ppl_batch"):
        evaluate._resolve(evaluate.Settings(ppl_batch=0), 31)


def test_default_context_is_the_models_capped_at_4096():
    """ctx / niah_lengths of None follow max_position_embeddings (no extrapolated positions)."""
    from oscar_eval.settings import Settings

    s = Settings().resolve(2048)  # the bundled proxy's training context
    assert s.ctx == 2048 and s.niah_lengths == (512, 1024, 2048)
    s = Settings().resolve(131072)
    assert s.ctx == 4096 and s.niah_lengths == (512, 1024, 2048, 4096)
    assert Settings().resolve(300).niah_lengths == (300,)
    s = Settings(ctx=8192, niah_lengths=(8192,)).resolve(2048)  # asked for: kept (and noted)
    assert s.ctx == 8192 and s.niah_lengths == (8192,)
    with pytest.raises(ValueError, match="ctx="):
        Settings(ctx=1).resolve(2048)
