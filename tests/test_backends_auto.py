"""implementation="auto": which backend runs where, and why the others were passed over."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import pytest
from helpers import kv_with_sinks

import oscar_jax as oj
from oscar_jax import backends
from pallas_kernels.decode import triton as dtriton

D = 128


def _cache(layout="planar", bits=2, head_dim=D, lengths=(700, 130)):
    cfg = oj.preset("oscar", bits=bits, rotate_values=False)
    c = oj.init_cache(cfg, batch=len(lengths), max_len=1024, num_kv_heads=2, head_dim=head_dim)
    k, v = kv_with_sinks(3, len(lengths), max(lengths), 2, head_dim, jnp.float32, sinks=(0,))
    c = oj.prefill(c, k, v, jnp.asarray(lengths, jnp.int32))
    return oj.convert_layout(c, layout) if layout != "planar" else c


def _q(g=4, head_dim=D):
    return jax.random.normal(jax.random.key(1), (2, 2 * g, head_dim), jnp.float32)


@pytest.mark.parametrize("layout", ["planar", "record"])
def test_without_a_gpu_auto_is_xla_exactly(layout):
    c = _cache(layout)
    name, why = backends.choose("decode_attention", c, 4)
    assert name == "xla" and why == {"mosaic": "no GPU", "triton": "no GPU"}
    got = oj.decode_attention(_q(), c)  # the default
    chex.assert_trees_all_equal(got, oj.decode_attention(_q(), c, implementation="xla"))


def test_on_a_gpu_each_kernel_is_passed_over_by_name(monkeypatch):
    """With a GPU pretended (nothing runs): a kernel that cannot be imported here and a
    cache a kernel does not cover each fall to the next backend, with the reason."""
    monkeypatch.setattr(backends, "gpu_available", lambda: True)
    monkeypatch.setitem(backends._RESOLVED, ("decode_attention", "mosaic"), lambda *a, **k: 0)
    monkeypatch.setitem(backends._RESOLVED, ("decode_attention", "triton"), lambda *a, **k: 0)
    planar, record = _cache(), _cache("record")
    name, why = backends.choose("decode_attention", planar, 4)
    assert name == "triton" and "layout='record'" in why["mosaic"]
    name, why = backends.choose("decode_attention", record, 4)
    assert name == "mosaic" and why == {}
    name, why = backends.choose("decode_attention", _cache(bits=4), 4)
    assert name == "triton" and "layout='record'" in why["mosaic"]  # INT4 is covered, as record
    assert backends.choose("decode_attention", _cache("record", bits=4), 4) == ("mosaic", {})
    name, why = backends.choose("decode_attention", _cache(bits=3), 4)
    assert name == "xla" and "bits=3" in why["mosaic"] and "bits=3" in why["triton"]
    name, why = backends.choose("decode_attention", planar, 17)
    assert name == "xla" and "g=17" in why["mosaic"] and "17" in why["triton"]
    name, why = backends.choose("decode_attention", _cache(head_dim=96), 2)
    assert name == "xla" and "head_dim=96" in why["triton"]
    bf32 = oj.init_cache(oj.preset("bf16"), batch=1, max_len=256, num_kv_heads=2, head_dim=D,
                         dtype=jnp.float32)  # fmt: skip
    name, why = backends.choose("decode_attention", bf32, 4)  # the bf16 kernel reads 16 bits
    assert name == "xla" and "dtype float32" in why["triton"]
    assert backends.choose("quantized_partial", record, 4)[0] == "xla"  # mosaic unimportable
    monkeypatch.setitem(backends._RESOLVED, ("quantized_partial", "mosaic"), lambda *a, **k: 0)
    monkeypatch.setitem(backends._RESOLVED, ("quantized_partial", "triton"), lambda *a, **k: 0)
    assert backends.choose("quantized_partial", record, 4)[0] == "mosaic"
    assert backends.choose("quantized_partial", planar, 4)[0] == "triton"


def test_triton_coverage_names_what_it_lacks():
    assert dtriton.unsupported_reason(_cache(), 16) is None
    assert dtriton.unsupported_reason(_cache(bits=4), 1) is None
    assert "layout='planar'" in dtriton.unsupported_reason(_cache("record"), 4)
    assert "<= 16" in dtriton.unsupported_reason(_cache(), 17)
    with pytest.raises(ValueError, match="head_dim=96"):
        oj.decode_attention(_q(2, 96), _cache(head_dim=96), implementation="triton")


def test_auto_takes_no_tuning_options_and_is_listed():
    with pytest.raises(ValueError, match="tune one backend"):
        oj.decode_attention(_q(), _cache(), block_tokens=64)
    assert "auto" in backends.available("decode_attention")
    assert oj.Backends().attention == "auto"
    assert oj.Backends.of("auto").encode == "xla"
    with pytest.raises(ValueError, match="must be one of"):
        backends.canonical("encode", "auto")


def test_an_auto_layout_is_record_where_auto_attention_would_run_mosaic(monkeypatch):
    """layout="auto" (the default) becomes "record" only where the decode attention reads
    the cache with the Mosaic kernel; everywhere else "planar", and a cache names it."""
    kv = oj.preset("oscar", bits=2)
    assert kv.layout == "auto" and oj.KVQuantConfig().layout == "auto"

    def lay(cfg=kv, head_dim=D, **kw):
        return oj.storage_layout(cfg, head_dim=head_dim, num_kv_heads=2, **kw).layout

    # no GPU (as in CI): planar unless Mosaic is named
    assert lay() == "planar" and lay(attention="triton") == "planar"
    assert lay(attention="mosaic") == "record"
    shape = dict(batch=1, max_len=256, num_kv_heads=2, head_dim=D)
    assert oj.init_cache(kv, **shape).cfg.layout == "planar"  # attention=None: planar
    assert oj.init_cache(kv, **shape, attention="auto").cfg.layout == "planar"
    assert oj.init_cache(kv, **shape, attention="mosaic").cfg.layout == "record"
    with pytest.raises(ValueError, match="layout='auto' must be decided"):
        dataclasses.replace(oj.init_cache(kv, **shape), cfg=kv)  # a cache names its layout
    # a Hopper GPU pretended (Mosaic importable): record where Mosaic covers the cache
    monkeypatch.setattr(backends, "gpu_available", lambda: True)
    monkeypatch.setitem(backends._RESOLVED, ("decode_attention", "mosaic"), lambda *a, **k: 0)
    assert lay() == "record" and lay(group=16) == "record"
    assert oj.init_cache(kv, **shape, attention="auto").cfg.layout == "record"
    assert lay(group=17) == "planar"  # the kernel's GQA limit
    assert lay(sharded=True) == "planar"
    assert lay(attention="pallas") == "planar" and lay(attention="xla") == "planar"
    assert lay(oj.preset("oscar", bits=4)) == "record"  # INT2 and INT4
    assert lay(oj.preset("oscar", bits=3)) == "planar"
    assert lay(head_dim=64) == "record" and lay(head_dim=256) == "record"  # the kernel's sizes
    assert lay(head_dim=96) == "planar" and lay(oj.preset("bf16")) == "planar"
    assert lay(kv.replace(layout="planar")) == "planar"  # a named layout is kept
    assert lay(oj.preset("kivi", bits=2, param_dtype="float32")) == "planar"
