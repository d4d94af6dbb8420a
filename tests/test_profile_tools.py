"""Profiling drivers: benchmarks/ncu_kernels.py (one kernel for Nsight Compute),
benchmarks/profile_step.py (a decode step's GPU kernels grouped by kind) and
benchmarks/sass_offline.py (SASS counts without a GPU)."""

import sys

import pytest

from benchmarks import ncu_kernels  # noqa: E402


@pytest.mark.parametrize(
    "argv",
    [
        ["quantize", "--tokens", "64", "--options", '{"num_warps": 4}'],
        ["decode", "--tokens", "384", "--options", '{"blocks_per_split": 2}'],
    ],
)
def test_runs_each_kernel(argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ncu_kernels.py", *argv])
    ncu_kernels.main()
    out = capsys.readouterr().out
    assert f"{argv[0]} call 0 done" in out and f"{argv[0]} call 1 done" in out


def test_rejects_unknown_options(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ncu_kernels.py", "quantize", "--tokens", "64",
                                      "--options", '{"num_warps": 3}'])  # fmt: skip
    with pytest.raises(ValueError, match="num_warps"):
        ncu_kernels.main()


def test_profile_step_kinds_and_summary():
    """profile_step groups GPU kernels by kind and reports per-step time and launches."""
    from benchmarks import profile_step as ps

    assert ps.kind_of("oscar_decode_int2") == "attention"
    assert ps.kind_of("oscar_quantize_int2") == "quantize"
    assert ps.kind_of("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert ps.kind_of("gemv2T_kernel_val") == "gemm"
    assert ps.kind_of("ncclDevKernel_AllReduce_Sum_bf16") == "collective"
    assert ps.kind_of("loop_add_fusion") == "other"
    times = {"oscar_decode_int2": [10.0, 12.0], "gemv2T_kernel_val": [3.0] * 4,
             "loop_add_fusion": [1.0] * 6}  # fmt: skip
    s = ps.summarize(times, steps=2, top=2)
    assert s["kinds"]["attention"] == dict(us=11.0, launches=1.0)
    assert s["kinds"]["gemm"] == dict(us=6.0, launches=2.0)
    assert s["launches"] == 6.0 and s["kernel_us"] == 20.0
    assert [t["name"] for t in s["top"]] == ["oscar_decode_int2", "gemv2T_kernel_val"]


def test_profile_step_runs_tiny(tmp_path, monkeypatch, capsys):
    """The whole driver on CPU (2-layer model): compiles, runs, writes JSON and Markdown."""
    import json

    from benchmarks import profile_step as ps

    monkeypatch.setattr(sys, "argv", ["profile_step.py", "--tiny", "--steps", "2", "--context",
                                      "256", "--out", str(tmp_path)])  # fmt: skip
    ps.main()
    rep = json.loads((tmp_path / "profile_step.json").read_text())
    assert rep["steps"] == 2 and rep["context"] == 256 and rep["wall_ms_per_step"] > 0
    assert "One decode step" in (tmp_path / "profile_step.md").read_text()


def test_decode_bench_rerenders_saved_runs(tmp_path, monkeypatch, capsys):
    """bench_decode --from-json merges earlier runs per shape (later files win)."""
    import json

    from benchmarks import bench_decode

    def run(ms_int2, shape):
        peers = {n: dict(ms=0.2, bytes=4e8) for n in ("bf16 pallas (ours)", "cudnn bf16")}
        return {shape: dict(int2=dict(ms=ms_int2, bytes=1e8), **peers)}

    paths = []
    for i, res in enumerate([{**run(0.5, "1x4096"), **run(0.3, "8x32768")}, run(0.1, "8x32768")]):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(dict(copy_bytes_per_s=4e12, results=res, device="d", jax="j")))
        paths.append(str(p))
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--from-json", ",".join(paths),
                                      "--out", str(out)])  # fmt: skip
    bench_decode.main()
    md = (out / "decode_bench.md").read_text()
    assert "| 1x4096 | 0.5000 ms |" in md and "| 8x32768 | 0.1000 ms |" in md
    assert "0.3000" not in md and "| 8x32768 | 0.1000 ms | 0.2000 ms | n/a | 0.2000 ms |" in md
    assert "2.00x" in md and "0.40x" in md  # fastest BF16 / INT2 per shape


def test_gemv_bench_variants_agree():
    """bench_gemv's variants compute the same x @ W (the transposed one on W.T)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import bench_gemv

    kx, kw = jax.random.split(jax.random.PRNGKey(3))
    x = jax.random.normal(kx, (3, 64), jnp.float32)
    w = jax.random.normal(kw, (64, 40), jnp.float32)
    want = np.asarray(x @ w)
    for name in ("einsum", "default", "transposed", "split4", "split16"):
        ww = w.T if name == "transposed" else w
        got = np.asarray(bench_gemv.variant(name)(x, ww))
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2, err_msg=name)
    with pytest.raises(ValueError, match="variant="):
        bench_gemv.variant("nope")


def test_sass_offline_counts_loops():
    """benchmarks/sass_offline.py: a loop is a label reached by a later branch; its length
    counts the instructions from the label to the branch (runs without triton)."""
    from benchmarks import sass_offline

    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        ".L_x_1:",
        "        /*0010*/                   FADD R2, R2, R3 ;",
        "        /*0020*/                   FMUL R2, R2, R3 ;",
        "        /*0030*/               @P0 BRA `(.L_x_1) ;",
        "        /*0040*/               @P1 BRA `(.L_x_2) ;",
        ".L_x_2:",
        "        /*0050*/                   EXIT ;",
    ])  # fmt: skip
    assert sass_offline.loops(sass) == [3]  # the forward branch to .L_x_2 is no loop


def test_sass_offline_reads_an_ncu_source_export(capsys):
    """An Nsight Compute source export (absolute branch targets) reads as the same loops
    and opcode counts as nvdisasm's text."""
    from benchmarks import sass_offline

    csv_text = "\n".join([
        '"Kernel Name","oscar_quantize_int2"',
        '"Address","Source"',
        '"0x7f0000000d00","      MOV R1, c[0x0][0x28]"',
        '"0x7f0000000d10","      FADD R2, R2, R3"',
        '"0x7f0000000d20","      FMUL R2, R2, R3"',
        '"0x7f0000000d30","@P0   BRA 0x7f0000000d10"',
        '"0x7f0000000d40","@P1   BRA 0x7f0000000d50"',
        '"0x7f0000000d50","      EXIT"',
    ])  # fmt: skip
    sass = sass_offline.from_ncu_csv(csv_text)
    assert sass_offline.loops(sass) == [3]
    ops = sass_offline.report(sass)
    assert ops == {"MOV": 1, "FADD": 1, "FMUL": 1, "BRA": 2, "EXIT": 1}
    assert "loops [3]" in capsys.readouterr().out


def test_sass_offline_rejects_unknown_kernel():
    from benchmarks import sass_offline

    with pytest.raises(ValueError, match="what='merge'"):
        sass_offline.lower("merge", {})


def _trace_file(tmp_path, ctas):
    """A Mosaic profiler trace as its dump writes it: ts = (global-timer start in ns +
    cycles since the CTA's first event) / 1e3, one tid a CTA, pid = 1 + SM."""
    import json

    ev = []
    for tid, (sm, start_ns, phases) in enumerate(ctas):
        marks = []
        for name, b, e in phases:
            marks += [(b, 1, 0, "B", name), (e, 0, -b, "E", name)]  # inner regions end first
        for cyc, _, _, ph, name in sorted(marks, key=lambda m: m[:3]):
            ev.append(dict(name=name, ph=ph, ts=(start_ns + cyc) / 1e3, pid=1 + sm, tid=1 + tid))
    path = tmp_path / "k-1-trace.json"
    path.write_text(json.dumps({"displayTimeUnit": "ns", "traceEvents": ev}))
    return str(path)


def test_mosaic_timeline_splits_a_cta_into_phases(tmp_path):
    """benchmarks/mosaic_timeline.py: phases, waits between steps and CTA ends, from a trace
    whose numbers are known (cycles at 2 GHz: 2,000 cycles = 1 us)."""
    from benchmarks import mosaic_timeline as tl

    one = [("query", 0, 2000), ("pipeline", 2000, 20000), ("step", 6000, 10000),
           ("step", 12000, 16000), ("finish", 20000, 22000), ("store", 22000, 24000)]  # fmt: skip
    two = [("query", 0, 2000), ("pipeline", 2000, 8000), ("step", 4000, 8000),
           ("finish", 8000, 9000), ("store", 9000, 10000)]  # fmt: skip
    path = _trace_file(tmp_path, [(0, 1_000_000, one), (0, 1_003_000, two)])
    ctas = tl.read_trace(path)
    assert [len(c["phases"]) for c in ctas] == [6, 5]
    s = tl.summarise(ctas, 2.0)
    assert s["ctas"] == 2 and s["ctas_per_sm"] == {2: 1}
    assert s["start"]["max"] == 3.0  # us after the first CTA
    assert s["fill"]["max"] == 2.0 and s["fill"]["min"] == 1.0  # pipeline start -> first step
    assert s["step"]["med"] == 2.0 and s["gap"]["max"] == 1.0  # one wait of 2,000 cycles
    assert s["drain"]["max"] == 2.0 and s["span"]["max"] == 12.0
    assert s["span_us"] == 12.0  # CTA one ends at 12 us, CTA two at 3 + 5 = 8 us
    assert s["step_by_index"] == [2.0, 2.0]


def test_mosaic_timeline_unwraps_the_global_timer(tmp_path):
    """The dump keeps the low 32 bits of the global timer: a CTA that starts after a wrap
    reads as ~4.3 s early, and is put back after the others."""
    from benchmarks import mosaic_timeline as tl

    ph = [("query", 0, 100), ("pipeline", 100, 200), ("step", 100, 200)]
    path = _trace_file(tmp_path, [(1, 2**32 - 500, ph), (2, 2**32 - 400, ph), (3, 300, ph)])
    s = tl.summarise(tl.read_trace(path), 1.0)
    assert s["start"]["max"] == 0.8  # 300 + 2**32 - (2**32 - 500) ns
