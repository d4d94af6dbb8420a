"""Smoke tests of the end-to-end benchmarks (bench_e2e.py, bench_sharded.py) in --tiny mode.

Both scripts run once, side by side, as subprocesses on CPU (2-layer models, small
contexts; the sharded one on 2 of 8 simulated devices, like the 2-GPU machine, in float32
so that float rounding cannot flip a greedy token); the tests read their JSON and Markdown.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(script, out, args, env_extra=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    env.pop("NCCL_NVLS_ENABLE", None)
    module = "benchmarks." + script.removesuffix(".py")
    cmd = [sys.executable, "-m", module, "--tiny", "--out", str(out), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _finish(proc, out, stem):
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-4000:]
    with open(os.path.join(out, f"{stem}.json")) as f:
        data = json.load(f)
    with open(os.path.join(out, f"{stem}.md")) as f:
        return data, f.read(), log


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    e2e_out, sh_out = tmp_path_factory.mktemp("e2e"), tmp_path_factory.mktemp("sharded")
    e2e = _start("bench_e2e.py", e2e_out, ["--models", "llama31_8b", "--breakdown-always",
                                           "--breakdown-carry",
                                           "--prompt-attention", "reference,xla"])  # fmt: skip
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    sh = _start("bench_sharded.py", sh_out, ["--devices", "2", "--workloads",
                                             "check,seq128k,maxctx,tpmax32k",
                                             "--tpmax-meshes", "data"],
                {"XLA_FLAGS": flags.strip()})  # fmt: skip
    return dict(e2e=_finish(e2e, e2e_out, "e2e") + (e2e_out,),
                sharded=_finish(sh, sh_out, "sharded") + (sh_out,))  # fmt: skip


def test_e2e_units_and_fields(runs):
    data, md, log, _ = runs["e2e"]
    units = data["units"]
    bad = {k: u["status"] for k, u in units.items() if u["status"] != "ok"}
    assert not bad, bad
    for w in ("lat32k", "lat128k", "tp48x4k", "tpmax32k"):
        for c in ("bf16:xla", "oscar2:xla"):
            u = units[f"llama31_8b/{w}/{c}"]
            for k in ("ms_per_step", "tokens_per_s", "compile_s", "cache_bytes", "temp_bytes"):
                assert isinstance(u[k], int | float), (w, c, k)
            assert u["cache_bytes"] > 0 and u["batch"] >= 1 and u["context"] > u["filled_tokens"]
            assert len(u["t_n1_s"]) == len(u["t_n2_s"]) == u["repeats"]
    for c in ("bf16:xla", "oscar2:xla"):
        u = units[f"llama31_8b/tpmax32k/{c}"]
        assert u["fit"]["analytic_batch"] >= 1 and u["verified_batch"] == u["batch"] >= 1
    assert "[" in log and "done" in log  # timestamped progress lines


def test_e2e_memory_measured_equals_analytic(runs):
    data, *_ = runs["e2e"]
    b = data["units"]["llama31_8b/mem/bf16"]["contexts"]
    q = data["units"]["llama31_8b/mem/oscar2"]["contexts"]
    for ctx in b:
        assert b[ctx]["live_bytes"] == b[ctx]["analytic_bytes"] > q[ctx]["analytic_bytes"]
        assert q[ctx]["live_bytes"] == q[ctx]["analytic_bytes"]
        assert q[ctx]["stored_token_bytes"] < b[ctx]["stored_token_bytes"]


def test_e2e_summary_and_breakdown(runs):
    data, md, _, _ = runs["e2e"]
    s = data["summary"]["llama31_8b"]
    for w in ("lat32k", "lat128k", "tp48x4k", "tpmax32k"):
        assert s[w]["ratio"] is not None and s[w]["status"] == "ok"
    assert s["lat128k"]["target"] == 3.0 and isinstance(s["lat128k"]["met"], bool)
    assert any(k.startswith("mem") and v["ratio"] > 1 for k, v in s.items())
    bd = s["breakdown"]["lat128k/oscar2:xla"]
    for k in ("attention", "cache update + carry", "projections + MLP", "logits + sampling",
              "of which append", "of which carry", "largest"):  # fmt: skip
        assert k in bd
    assert any(k.startswith("prefill_oscar2") for k in s)
    assert s["prefill_forward_s"] > 0 and s["prefill_forward:xla_s"] > 0  # both prompt paths
    assert data["units"]["llama31_8b/prefill32k/forward:xla"]["attention"] == "xla"
    assert "attention xla" in md and "## llama31_8b" in md and "Next bottleneck" in md


def test_e2e_budget_skips_and_still_writes(tmp_path):
    proc = _start("bench_e2e.py", tmp_path, ["--models", "llama31_8b", "--budget-s", "0.001"])
    data, md, _ = _finish(proc, tmp_path, "e2e")
    assert data["units"] and all(u["status"] == "not run (budget)" for u in data["units"].values())


def test_sharded_tokens_equal(runs):
    data, md, _, _ = runs["sharded"]
    units = data["units"]
    bad = {k: u["status"] for k, u in units.items() if u["status"] != "ok"}
    assert not bad, bad
    for c in ("bf16", "oscar2"):
        u = units[f"check/{c}/seq"]  # 2 devices: (data, model, sequence) = (1, 1, 2)
        assert u["mesh"] == "(1, 1, 2)" and u["steps"] == 16
        assert u["tokens_equal"] is True and u["mismatches"] == 0
        assert u["logits_max_abs_diff"] < 1e-3 * max(u["logits_max_abs"], 1.0)
    assert data["summary"]["tokens_equal"] is True
    assert data["meta"]["num_devices"] == 2 and data["meta"]["nccl_nvls_enable"] == "0"


def test_sharded_check_under_gspmd(tmp_path):
    """--partitioner gspmd (the workaround for Shardy's GPU segfault on the bf16 cache)
    gives the same greedy tokens as one device."""
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    proc = _start("bench_sharded.py", tmp_path, ["--devices", "2", "--workloads", "check",
                                                 "--caches", "bf16", "--partitioner", "gspmd"],
                  {"XLA_FLAGS": flags.strip()})  # fmt: skip
    data, _, _ = _finish(proc, tmp_path, "sharded")
    u = data["units"]["check/bf16/seq"]
    assert u["status"] == "ok" and u["tokens_equal"] is True and u["mismatches"] == 0
    assert data["meta"]["partitioner"] == "gspmd"


def test_sharded_maxctx_verified(tmp_path):
    """maxctx decodes at the largest context it computes, shrinking to what the compiled
    program's memory analysis allows (a pretend 0.1 GiB device)."""
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    proc = _start("bench_sharded.py", tmp_path, ["--devices", "2", "--workloads", "maxctx",
                                                 "--caches", "oscar2", "--mem-limit-gib", "0.1",
                                                 "--margin-gib", "0"],
                  {"XLA_FLAGS": flags.strip()})  # fmt: skip
    data, md, _ = _finish(proc, tmp_path, "sharded")
    u = data["units"]["maxctx/oscar2/2"]
    v = u["verified"]["seq"]
    assert u["status"] == "ok" and 0 < v["context"] <= u["analytic_context"]
    assert v["context"] % 512 == 0 and v["ms_per_step"] > 0
    assert all(t["status"].startswith("does not fit") for t in v["tries"])
    assert f"seq: {v['context']:,} decoded" in md


def test_sharded_timings_and_capacity(runs):
    data, md, _, _ = runs["sharded"]
    units = data["units"]
    for c in ("bf16", "oscar2"):
        seq, one = units[f"seq128k/{c}/seq"], units[f"seq128k/{c}/1gpu"]
        assert seq["mesh"] == "(1, 1, 2)" and one["mesh"] == "1 device"
        assert seq["compile_s"] == 0 and seq["reused"]  # the check's program, reused
        # the sequence mesh splits the cache: bf16 exactly in half, INT2 all but the ring
        if c == "bf16":
            # (all but the per-row lengths and flags [L, B] int32, which are replicated)
            assert 2 * seq["cache_bytes_per_device"] - one["cache_bytes_per_device"] == 2 * 2 * 4
        else:
            assert seq["cache_bytes_per_device"] < one["cache_bytes_per_device"]
        tp = units[f"tpmax32k/{c}/data"]
        assert tp["batch"] % 2 == 0 and tp["verified_batch"] == tp["batch"]
    mx = units["maxctx/oscar2/2"]["per_devices"]
    assert mx["2"]["analytic_context"] > mx["1"]["analytic_context"] > 0
    assert "seq128k" in md and "| check |" in md


def test_plot_from_jsons(runs, tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import plot_e2e

    plot_e2e.main(["--e2e", os.path.join(runs["e2e"][3], "e2e.json"),
                   "--sharded", os.path.join(runs["sharded"][3], "sharded.json"),
                   "--out", str(tmp_path)])  # fmt: skip
    for name in ("e2e.png", "sharded.png", "e2e.md", "sharded.md"):
        assert os.path.getsize(tmp_path / name) > 1000, name


def test_e2e_resume_keeps_done_units(runs, tmp_path):
    first = os.path.join(runs["e2e"][3], "e2e.json")
    proc = _start("bench_e2e.py", tmp_path, ["--models", "llama31_8b", "--workloads",
                                             "mem,lat128k", "--resume", first])  # fmt: skip
    data, md, log = _finish(proc, tmp_path, "e2e")
    done = {k: u for k, u in data["units"].items() if "/mem/" in k or "/lat128k/" in k}
    assert done and all(u["status"] == "ok" and u.get("resumed") for u in done.values())
    assert ": start" not in log  # nothing was run again


def test_cache_specs_pick_layout_by_implementation():
    """The Mosaic entries ("mosaic": the backend's call, "mosaic2": the second launch,
    "mosaic_pdl": programmatic dependent launch) read a record cache; the others a planar
    one; an unknown cache name is a ValueError."""
    from benchmarks import e2e_common as ec

    specs = ec.parse_caches("bf16,oscar2:mosaic,oscar2:mosaic2,oscar2:mosaic_pdl,oscar4",
                            "triton")  # fmt: skip
    assert [(s.label, s.kv.layout) for s in specs] == [
        ("bf16:triton", "planar"),
        ("oscar2:mosaic", "record"),
        ("oscar2:mosaic2", "record"),
        ("oscar2:mosaic_pdl", "record"),
        ("oscar4:triton", "planar"),
    ]
    assert ec.attention_impl("mosaic2") is ec.BASELINES["mosaic2"]
    assert ec.attention_impl("mosaic_pdl") is ec.BASELINES["mosaic_pdl"]
    assert ec.attention_impl("triton") == "triton"
    with pytest.raises(ValueError, match="cache="):
        ec.parse_caches("kivi2", "xla")
