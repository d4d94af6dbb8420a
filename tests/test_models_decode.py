"""Decoding over the OScaR cache: quantized vs bf16 logits, folding, compilation, scan vs loop."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch", reason="the tiny checkpoints are built with transformers")
pytest.importorskip("transformers")

from test_models_common import checkpoint, ours, random_ids  # noqa: E402

import models  # noqa: E402
import oscar_jax as oj  # noqa: E402

# small R and G so that short test prompts reach the quantized part of the cache
SMALL = dict(residual_length=32, group_size=32)


def _decode_logits(m, kv, ids, tok):
    logits0, caches, p = models.prefill(m, ids, kv, max_new_tokens=4)
    assert len(caches) == m.config.num_layers  # one cache per layer
    assert int(np.max(np.asarray(models.stack_caches(caches).lengths))) == ids.shape[1]
    logits1, caches = models.decode_step(p, caches, tok, np.asarray(p.lengths))
    return np.asarray(logits1), caches


@pytest.mark.parametrize("name", ["llama3_q", "qwen3_q"])
def test_int8_oscar_decode_logits_close_to_bf16_cache(name):
    m = ours(name)
    ids = random_ids(2, 100, seed=3)
    tok = np.array([5, 77], np.int32)
    ref, _ = _decode_logits(m, oj.preset("bf16"), ids, tok)
    got, caches = _decode_logits(m, oj.preset("oscar", bits=8, **SMALL), ids, tok)
    nq = np.asarray(models.stack_caches(caches).num_quantized())
    assert int(nq.min()) == 64  # the quantized part is used
    diff = float(np.max(np.abs(got - ref)))
    print(f"{name}: INT8 OScaR vs bf16 cache decode logits: max |diff| = {diff:.2e}")
    assert diff <= 1e-2
    int2, _ = _decode_logits(m, oj.preset("oscar", bits=2, **SMALL), ids, tok)
    print(
        f"{name}: INT2 OScaR vs bf16 cache: max |diff| = {np.max(np.abs(int2 - ref)):.2e} "
        f"(max |logit| {np.max(np.abs(ref)):.2f})"
    )
    # and the full-precision prefill logits agree with the uncached forward
    full = np.asarray(m.logits(np.concatenate([ids, tok[:, None]], axis=1)))[:, -1]
    assert np.max(np.abs(ref - full)) <= 1e-4


@pytest.mark.parametrize("rotation", ["hadamard", "random_orthogonal"])
@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_value_rotation_folding_is_exact(name, rotation):
    m = ours(name)
    ids = random_ids(2, 24, seed=4)
    kv = oj.preset("oscar", rotation=rotation)
    plain = np.asarray(m.logits(ids))
    folded = np.asarray(m.logits(ids, kv=kv))
    p, f = m.params()["layers"], m.folded_params(kv)["layers"]
    assert not np.allclose(p["wv"], f["wv"]) and not np.allclose(p["wo"], f["wo"])
    assert m.folded_params(kv) is m.folded_params(kv)  # cached per rotation
    diff = float(np.max(np.abs(plain - folded)))
    print(f"{name} {rotation}: folded vs unfolded logits max |diff| = {diff:.2e}")
    assert diff <= 2e-5


def test_generate_compiles_once_per_bucket_and_sampling():
    m = ours("llama3")
    kv = oj.preset("oscar", bits=2, **SMALL)
    greedy = np.asarray(models.generate(m, random_ids(2, 12, 5), 8, kv=kv, stop_tokens=()))
    before = models.trace_count()
    outs = []
    for t, seed, temp in [(10, 0, 0.7), (13, 1, 1.3), (16, 2, 1.0)]:  # one bucket (16)
        ids = random_ids(2, t, 5)
        lengths = np.array([t, t - 3], np.int32)
        outs.append(np.asarray(models.generate(
            m, ids, 8, kv=kv, lengths=lengths, temperature=temp, seed=seed, top_k=1,
            stop_tokens=(),
        )))  # fmt: skip
    assert models.trace_count() - before == 1
    # top_k=1 sampling is greedy
    ids = random_ids(2, 12, 5)
    g2 = np.asarray(models.generate(m, ids, 8, kv=kv, temperature=1.0, top_k=1, stop_tokens=()))
    np.testing.assert_array_equal(g2, greedy)
    # tiny top_p is greedy too; full sampling depends on the seed only
    g3 = np.asarray(models.generate(m, ids, 8, kv=kv, temperature=1.0, top_p=1e-6,
                                    stop_tokens=()))  # fmt: skip
    np.testing.assert_array_equal(g3, greedy)
    s1 = np.asarray(models.generate(m, ids, 8, kv=kv, temperature=5.0, seed=1, stop_tokens=()))
    s1b = np.asarray(models.generate(m, ids, 8, kv=kv, temperature=5.0, seed=1, stop_tokens=()))
    s2 = np.asarray(models.generate(m, ids, 8, kv=kv, temperature=5.0, seed=2, stop_tokens=()))
    np.testing.assert_array_equal(s1, s1b)
    assert not np.array_equal(s1, s2)


@pytest.mark.parametrize("name", ["qwen2"])
def test_scan_equals_stepwise_int2(name):
    m = ours(name)
    kv = oj.preset("oscar", bits=2, **SMALL)
    ids = random_ids(2, 40, seed=6)
    lengths = np.array([40, 29], np.int32)
    n = 40  # rows cross several flushes of the residual ring into the INT2 part
    scan, info = models.generate(m, ids, n, kv=kv, lengths=lengths, stop_tokens=(),
                                 return_info=True)  # fmt: skip
    loop = models.generate_stepwise(m, ids, n, kv=kv, lengths=lengths, stop_tokens=())
    np.testing.assert_array_equal(np.asarray(scan), loop)
    np.testing.assert_array_equal(np.asarray(info["cache_lengths"]), lengths + n - 1)
    assert not np.any(np.asarray(info["flags"]))
    bf = np.asarray(models.generate(m, ids, n, kv=oj.preset("bf16"), lengths=lengths,
                                    stop_tokens=()))  # fmt: skip
    print(f"{name}: INT2 OScaR (R=G=32) vs bf16 greedy token agreement "
          f"{np.mean(np.asarray(scan) == bf):.3f}")  # fmt: skip


def test_stop_tokens_and_overflow_flag():
    m = ours("qwen3")
    kv = oj.preset("bf16")
    ids = random_ids(2, 9, seed=7)
    ref = np.asarray(models.generate(m, ids, 12, kv=kv, stop_tokens=()))
    stop = int(ref[0, 5])
    first = [int(np.argmax(r == stop)) if np.any(r == stop) else None for r in ref]
    out, info = models.generate(m, ids, 12, kv=kv, stop_tokens=(stop,), pad_token_id=255,
                                return_info=True)  # fmt: skip
    out = np.asarray(out)
    for i, f in enumerate(first):
        if f is None:
            np.testing.assert_array_equal(out[i], ref[i])
            assert not bool(info["done"][i])
        else:
            np.testing.assert_array_equal(out[i, : f + 1], ref[i, : f + 1])
            assert np.all(out[i, f + 1 :] == 255) and bool(info["done"][i])
    # a cache two tokens too short overflows and says so in the per-row flags
    out, info = models.generate(m, ids, 12, kv=kv, stop_tokens=(), max_len=9 + 9,
                                return_info=True)  # fmt: skip
    assert np.all(np.asarray(info["flags"]) & oj.FLAG_OVERFLOW)
    np.testing.assert_array_equal(np.asarray(out)[:, :10], ref[:, :10])


def test_bucketing():
    assert [models.bucket_length(t) for t in (1, 16, 17, 64, 65, 128, 129)] == [
        16, 16, 32, 64, 128, 128, 192,
    ]  # fmt: skip


def test_bf16_model_generates():
    m = ours("llama3")
    import models.model as mm

    mb = mm.CausalLM(m.config, dtype=jnp.bfloat16)
    mb.set_params({k: (jnp.asarray(v, jnp.bfloat16) if not isinstance(v, dict) else
                       {n: jnp.asarray(a, jnp.bfloat16) for n, a in v.items()})
                   for k, v in m.params().items()})  # fmt: skip
    out = np.asarray(models.generate(mb, random_ids(1, 12, 8), 4, stop_tokens=()))
    assert out.shape == (1, 4) and out.min() >= 0 and out.max() < m.config.vocab_size


def test_chunked_prefill_attention_matches_unchunked():
    from models import layers

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 64, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 64, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 64, 2, 16)), jnp.float32)
    valid = jnp.arange(64)[None] < jnp.array([64, 40])[:, None]
    full = layers.causal_attention(q, k, v, valid, chunk=64)
    chunked = layers.causal_attention(q, k, v, valid, chunk=16)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(full), atol=1e-6)


def test_prompt_attention_xla_matches_reference():
    """jax.nn.dot_product_attention (the fast prefill path) = the float32 reference on
    every row's valid prefix (GQA, ragged lengths)."""
    from models import layers

    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((3, 48, 8, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((3, 48, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, 48, 2, 16)), jnp.float32)
    lens = np.array([48, 29, 1])
    valid = jnp.arange(48)[None] < jnp.asarray(lens)[:, None]
    ref = np.asarray(layers.causal_attention(q, k, v, valid, chunk=16))
    fast = np.asarray(layers.causal_attention(q, k, v, valid, implementation="xla"))
    for i, n in enumerate(lens):
        np.testing.assert_allclose(fast[i, :n], ref[i, :n], rtol=1e-5, atol=1e-5)


def test_generate_with_fast_prompt_attention():
    m = ours("llama3")
    ids, lens = random_ids(2, 20, 3), np.array([20, 13])
    kw = dict(lengths=lens, stop_tokens=(), kv=oj.preset("oscar", bits=2, **SMALL))
    ref = np.asarray(models.generate(m, ids, 6, **kw))
    be = models.Backends(prompt_attention="xla")
    fast = np.asarray(models.generate(m, ids, 6, implementation=be, **kw))
    np.testing.assert_array_equal(fast, ref)
    with pytest.raises(ValueError, match="prompt_attention"):
        models.generate(m, ids, 2, implementation=models.Backends(prompt_attention="flash"), **kw)
    if not oj.gpu_available():
        with pytest.raises(ValueError, match="needs a GPU"):
            be = models.Backends(prompt_attention="cudnn")
            models.generate(m, ids, 2, implementation=be, **kw)


def test_auto_prompt_attention_resolves():
    """ "auto" is cuDNN only for a 16-bit unsharded model on a GPU; everything else keeps
    the float32 reference; unknown names raise."""
    from models import layers

    fast = "cudnn" if oj.gpu_available() else "reference"
    assert layers.resolve_prompt_attention("auto", jnp.bfloat16) == fast
    assert layers.resolve_prompt_attention("auto", jnp.float16) == fast
    assert layers.resolve_prompt_attention("auto", jnp.float32) == "reference"
    assert layers.resolve_prompt_attention("auto", jnp.bfloat16, sharded=True) == "reference"
    assert layers.resolve_prompt_attention("xla", jnp.float32) == "xla"
    with pytest.raises(ValueError, match="implementation='flash'"):
        layers.resolve_prompt_attention("flash", jnp.bfloat16)


def test_cudnn_prompt_attention_matches_reference():
    """GPU only: cuDNN's flash attention (the "auto" prompt attention of a bf16 model)
    against the float32 reference on each row's valid prefix (GQA 4, ragged lengths),
    and a bf16 model generates through it."""
    if not oj.gpu_available():
        pytest.skip("cuDNN attention needs a GPU")
    from models import layers

    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((2, 256, 8, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, 256, 2, 64)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, 256, 2, 64)), jnp.bfloat16)
    lens = np.array([256, 97])
    valid = jnp.arange(256)[None] < jnp.asarray(lens)[:, None]
    ref = np.asarray(layers.causal_attention(q, k, v, valid, chunk=64), np.float32)
    fast = np.asarray(layers.causal_attention(q, k, v, valid, implementation="auto"), np.float32)
    for i, n in enumerate(lens):
        np.testing.assert_allclose(fast[i, :n], ref[i, :n], rtol=2e-2, atol=2e-2)
    m = models.from_pretrained(checkpoint("llama3")[0], dtype=jnp.bfloat16)
    ids, lens = random_ids(2, 20, 3), np.array([20, 13])
    kw = dict(lengths=lens, stop_tokens=(), kv=oj.preset("oscar", bits=2, **SMALL))
    out = np.asarray(models.generate(m, ids, 4, **kw))  # "auto": cuDNN prompt attention
    assert out.shape == (2, 4)
