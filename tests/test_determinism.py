"""benchmarks/determinism.py on CPU with tiny sizes: repeated runs hash bit-identically."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    spec = importlib.util.spec_from_file_location(
        "determinism", os.path.join(ROOT, "benchmarks", "determinism.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_digest_sees_one_bit_dtype_and_shape():
    det = _load()
    x = np.arange(12, dtype=np.float32)
    y = x.copy()
    y.view(np.uint32)[5] ^= 1  # one ulp
    h = det.digest(x)
    assert h == det.digest(x.copy())
    assert len({h, det.digest(y), det.digest(x.reshape(3, 4)), det.digest(x.view(np.int32)),
                det.digest(jnp.asarray(x, jnp.bfloat16))}) == 5  # fmt: skip


def test_cache_ops_bit_identical_in_process_and_subprocess(tmp_path):
    """Both implementations in process (2 runs); the XLA prefill once more in a fresh process
    (kept to one op so the test stays short; the full run is in RELIABILITY.md)."""
    det = _load()
    out = str(tmp_path / "det")
    rc = det.main(["--sizes", "tiny", "--ops", "prefill,append,decode_attention", "--out", out])
    with open(out + ".json") as f:
        res = json.load(f)
    assert [r["label"] for r in res["runs"]] == ["in-process", "in-process, same executables"]
    assert res["ops"] == ["inputs", "prefill", "append", "decode_attention"]
    for impl in ("xla", "pallas"):
        a, b = (r["hashes"][impl] for r in res["runs"])
        assert a == b, impl
        assert len(set(a.values())) == 4  # the outputs differ from each other
    assert res["all_identical"] and rc == 0
    assert "all bit-identical" in open(out + ".md").read()
    args = argparse.Namespace(sizes="tiny", impls=("xla",), ops=("inputs", "prefill"))
    child = det.child_run(args)["hashes"]["xla"]
    assert child == {k: res["runs"][0]["hashes"]["xla"][k] for k in ("inputs", "prefill")}
