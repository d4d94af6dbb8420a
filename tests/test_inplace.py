"""Decoding updates the caches in place and reads the weights in place: no compiled
instruction writes a whole cache array, nor a whole weight matrix.

``benchmarks/hlo_copies.py`` scans the optimized HLO of the decode step (and of the
generate loop) for copies / slices / rewrites of a whole cache or weight. The params
are in the per-layer form decoding runs on (``layers.unstack_layers``); slicing a layer
out of stacked [L, ...] params copies every weight matrix, every step, on the CPU at
any batch (on the H200 at larger batch, e.g. 48): checked too, so the check can fail.
The CPU programs use float32 caches and params (the CPU compiler computes bfloat16 in
float32, converting whole arrays: a CPU-only artifact) and batch 2 (at batch 1 the CPU
fusion duplicates a cache update into a bitcast consumer: CPU-only too; the H200 run is
clean at batch 1).
The early, batched flush (``oscar_jax.flush``) gives ``append``'s caches bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
import oscar_jax as oj
from benchmarks import hlo_copies as hc  # noqa: E402
from models import layers, memory
from models.config import ModelConfig
from oscar_jax import flush as ofl
from oscar_jax.ring import append_to_ring

CFG = ModelConfig(
    family="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3,
    num_heads=8, num_kv_heads=4, head_dim=32, max_position_embeddings=2048,
)  # fmt: skip
B, MAX_LEN = 2, 2048  # k_scale [B, H, Lq / G = 64, D]: no shape shared with a group
F32 = dict(param_dtype="float32", norm_dtype="float32")
KV = {
    "bf16": oj.preset("bf16"),
    "oscar": oj.preset("oscar", bits=2, rotate_values=False, **F32),  # R = 128: early flush
    "oscar_r0": oj.preset("oscar", bits=2, residual_length=0, rotate_values=False, **F32),
}


def _static(kv):
    return models.Static(
        model=CFG, kv=kv, max_len=MAX_LEN, cache_dtype="float32",
        backends=models.Backends(prompt_attention="reference"), greedy=True, top_k=None,
        use_top_p=False, stop_tokens=(), pad_id=0,
    )  # fmt: skip


def _abstract(kv, cfg=CFG, per_layer=True):
    params = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
                                    layers.param_shapes(cfg, per_layer=per_layer),
                                    is_leaf=layers.is_shape)  # fmt: skip
    one = memory.abstract_cache(cfg, kv, batch=B, max_len=MAX_LEN, dtype=jnp.float32)
    return params, (one,) * cfg.num_layers


@pytest.mark.parametrize("method", list(KV))
def test_decode_step_writes_no_whole_cache(method):
    params, caches = _abstract(KV[method])
    tok = jax.ShapeDtypeStruct((B,), jnp.int32)
    prog = models.step_program(donate=True)
    step = prog.lower(_static(KV[method]), params, caches, tok, tok).compile()
    shapes = hc.cache_shapes(caches)
    if method == "oscar_r0":  # R = 0: the ring is one group (G slots), a flush rewrites it
        shapes.discard(caches[0].k_res.shape)
    found = hc.whole_cache_copies(step.as_text(), shapes)
    assert not found, hc.format_copies(found)
    # every cache buffer is donated and reused: the step's output aliases all of them
    nbytes = memory.abstract_nbytes(caches)
    assert step.memory_analysis().alias_size_in_bytes >= nbytes


@pytest.mark.parametrize("method", ["bf16", "oscar"])
def test_decode_step_reads_weights_in_place(method):
    """Per-layer params: no instruction writes a whole weight matrix; stacked params (a
    layer sliced out per step) copy every layer's matrices."""
    tok = jax.ShapeDtypeStruct((B,), jnp.int32)
    found = {}
    for per_layer in (False, True):
        params, caches = _abstract(KV[method], per_layer=per_layer)
        step = models.step_program(donate=True).lower(_static(KV[method]), params, caches, tok, tok)
        found[per_layer] = hc.whole_cache_copies(step.compile().as_text(),
                                                 hc.weight_shapes(params))  # fmt: skip
    lay = layers.param_shapes(CFG, per_layer=True)["layers"][0]
    dims = [s.w if isinstance(s, layers.Transposed) else s for s in lay.values()]
    matrices = sum(4 * int(np.prod(s)) for s in dims if len(s) == 2)  # float32
    assert sum(i.nbytes for i in found[False]) >= CFG.num_layers * matrices  # the old layout
    assert not found[True], hc.format_copies(found[True])


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "layers"])
@pytest.mark.parametrize("method", ["bf16", "oscar"])
def test_decode_step_temp_does_not_grow_with_layers(method, per_layer):
    """Each layer's attention inputs (and, stacked, weight slices) are made when the layer
    runs: XLA cannot hoist them all to the start of the step (and hold L layers' worth)."""
    temps = []
    for n in (2, 6):
        cfg = CFG.replace(num_layers=n)
        st = _static(KV[method])._replace(model=cfg)
        params, caches = _abstract(KV[method], cfg, per_layer)
        tok = jax.ShapeDtypeStruct((B,), jnp.int32)
        step = models.step_program(donate=True).lower(st, params, caches, tok, tok).compile()
        temps.append(step.memory_analysis().temp_size_in_bytes)
    assert temps[1] <= 1.1 * temps[0] + (1 << 20), temps


@pytest.mark.parametrize("method", ["bf16", "oscar"])
def test_generate_loop_writes_no_whole_cache(method):
    params, caches = _abstract(KV[method])
    scalar = lambda dt: jax.ShapeDtypeStruct((), dt)  # noqa: E731
    ids = jax.ShapeDtypeStruct((B, 128), jnp.int32)  # T = 128: no shape shared with a cache
    args = (params, ids, jax.ShapeDtypeStruct((B,), jnp.int32), scalar(jax.random.key(0).dtype),
            scalar(jnp.float32), scalar(jnp.float32))  # fmt: skip
    text = models.generate_program().lower(_static(KV[method]), 8, *args).compile().as_text()
    loops = hc.loop_computations(text)
    assert loops  # the lax.scan over new tokens
    shapes = hc.cache_shapes(caches) | hc.weight_shapes(params)
    found = [
        i for i in hc.whole_cache_copies(text, shapes) if i.computation in loops
    ]  # prefill writes each cache once, outside the loop
    assert not found, hc.format_copies(found)


def test_helper_flags_scan_over_stacked_caches():
    """The old layout: stacked caches [L, ...] as lax.scan inputs / outputs over layers."""
    L, h, s, d = 4, 4, 512, 32

    def old_step(ks, kt, pos, q):
        def layer(x, k):  # k: this layer's slice [B, H, S, D]
            k = jax.lax.dynamic_update_slice(k, kt[:, :, None], (0, 0, pos, 0))
            p = jax.nn.softmax(jnp.einsum("bhd,bhtd->bht", x, k), axis=-1)
            return jnp.einsum("bht,bhtd->bhd", p, k), k

        return jax.lax.scan(layer, q, ks)

    ks = jax.ShapeDtypeStruct((L, B, h, s, d), jnp.float32)
    kt = q = jax.ShapeDtypeStruct((B, h, d), jnp.float32)
    pos = jax.ShapeDtypeStruct((), jnp.int32)
    text = jax.jit(old_step, donate_argnums=0).lower(ks, kt, pos, q).compile().as_text()
    found = hc.whole_cache_copies(text, hc.cache_shapes(ks, stacked=True))
    assert found, "the helper should flag the scan's copies"
    assert any(i.computation in hc.loop_computations(text) for i in found)  # per layer
    assert sum(i.nbytes for i in found) >= L * B * h * s * d * 4 // L  # at least a layer


def _filled(kv, lengths, seed, max_len=192, h=2, d=32):
    k = jax.random.normal(jax.random.key(seed), (len(lengths), max_len, h, d))
    v = jax.random.normal(jax.random.key(seed + 1), (len(lengths), max_len, h, d))
    c = oj.init_cache(kv, batch=len(lengths), max_len=max_len, num_kv_heads=h, head_dim=d,
                      dtype=jnp.float32)  # fmt: skip
    return oj.prefill(c, k, v, jnp.asarray(lengths, jnp.int32))


@pytest.mark.parametrize("rotation", ["hadamard", "random_orthogonal"])
def test_flush_early_equals_append(rotation):
    kv = oj.preset("oscar", bits=2, residual_length=32, group_size=32, rotation=rotation)
    lengths = [63, 5, 190, 96]  # flush due next step; ring only; overflows soon; group edge
    caches = tuple(_filled(kv, lengths, seed) for seed in (0, 10))  # two "layers"
    assert all(ofl.can_flush_early(c) for c in caches)
    ref_step = jax.jit(lambda cs, k, v: tuple(oj.append(c, k, v) for c in cs))
    early_step = jax.jit(lambda cs, k, v: tuple(
        append_to_ring(c, k, v)[0] for c in ofl.flush_early(cs)))  # fmt: skip
    ref, got, flushes = caches, caches, 0
    for i in range(40):
        kt = jax.random.normal(jax.random.key(100 + i), (4, 2, 32))
        vt = jax.random.normal(jax.random.key(200 + i), (4, 2, 32))
        flushes += int(np.sum(np.asarray(ofl.flush_due(ref[0])[1])))
        ref, got = ref_step(ref, kt, vt), early_step(got, kt, vt)
        for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got),
                        strict=True):  # fmt: skip
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"step {i}")
    assert flushes >= 3  # groups were flushed along the way
    assert np.asarray(ref[0].flags)[2] & oj.FLAG_OVERFLOW  # the full row overflowed


def test_flush_early_needs_a_residual():
    kv = oj.preset("oscar", bits=2, residual_length=0, group_size=32)
    c = _filled(kv, [40], 0)
    assert not ofl.can_flush_early(c)
    with pytest.raises(ValueError, match="residual_length"):
        ofl.flush_early([c])
