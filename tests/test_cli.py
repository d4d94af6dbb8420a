"""``oscar-jax demo`` / ``eval`` / ``study`` on a tiny random Hugging Face directory."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="the tiny checkpoint's tokenizer is built with tokenizers")
pytest.importorskip("safetensors")

from tiny_hf import make_tiny_hf_dir  # noqa: E402

import models  # noqa: E402
from models import cli  # noqa: E402
from models import eval_tasks as et  # noqa: E402
from models import evaluate as ev  # noqa: E402
from models.eval_common import make_windows  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny_hf"))


def _has_mpl() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_demo_then_eval(tiny_dir, tmp_path, capsys, monkeypatch):
    """``demo``, then ``eval`` at the demo's sizes (one test: the eval reuses the demo's
    compilations, which a split across pytest-xdist workers would lose)."""
    out = tmp_path / "demo"
    rc = cli.main(["demo", "--model", tiny_dir, "--out", str(out), "--methods", "bf16,oscar2",
                   "--new-tokens", "8", "--quiet"])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0
    for head in ("## Greedy continuation", "## KV cache after", "## Perplexity",
                 "## Passkey retrieval", "## Token Norm Imbalance"):  # fmt: skip
        assert head in text, head
    assert "bf16 cache:" in text and "oscar2 cache:" in text
    row = next(line for line in text.splitlines() if line.startswith("| oscar2 (INT2"))
    held, ratio = int(row.split("|")[2]), float(row.split("|")[4])
    assert held > 0 and 1.5 < ratio < 5.3  # 519 tokens: about two thirds quantized
    if _has_mpl():
        assert (out / "key_norms.png").stat().st_size > 1000
        assert f"key-norm plot: {out / 'key_norms.png'}" in text
    else:
        assert "matplotlib is not installed" in text and not (out / "key_norms.png").exists()

    # two ablation rows instead of ten (each row is a compilation); the list itself is
    # checked in tests/test_eval.py::test_method_names
    monkeypatch.setattr(et, "ablation_methods", lambda base, r, g: [
        ("residual R", "0", f"{base}_r0"), ("residual R", str(r), base)])  # fmt: skip
    out = tmp_path / "eval"
    rc = cli.main([
        "eval", "--model", tiny_dir, "--out", str(out), "--methods", "bf16,oscar2",
        "--tasks", "ppl,niah,tni,ablations", "--ctx", "1024", "--ppl-windows", "3",
        "--niah-lengths", "1024", "--niah-depths", "0,25,50,75,100", "--niah-trials", "1",
        "--niah-batch", "6", "--tni-windows", "1", "--quiet",
    ])  # fmt: skip
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert capsys.readouterr().out.strip() == md.strip()
    ppl = {r["method"]: r for r in res["ppl"]}
    assert set(ppl) == {"bf16", "oscar2"} and res["ppl_windows"] == 3
    for r in ppl.values():
        assert r["ppl_lo"] <= r["ppl"] <= r["ppl_hi"] and r["tokens"] == 3 * 1023
    # bf16 is the plain model up to the bfloat16 storage of K/V: the uncached forward's
    # perplexity over the same windows is within a percent (wrong windows would not be)
    m = models.from_pretrained(tiny_dir)
    w = make_windows(np.load(os.path.join(tiny_dir, "heldout_sample.npy")), 1024, 3, 0)
    lp = jax.nn.log_softmax(np.asarray(m.logits(w))[:, :-1], axis=-1)
    nll = -np.take_along_axis(np.asarray(lp), w[:, 1:, None], axis=-1).mean()
    assert np.isclose(ppl["bf16"]["ppl"], np.exp(nll), rtol=1e-2)
    assert ppl["oscar2"]["delta_vs_bf16"] == pytest.approx(
        ppl["oscar2"]["ppl"] - ppl["bf16"]["ppl"])  # fmt: skip
    nz = res["niah"]
    assert [r["prompts"] for r in nz["summary"]] == [5, 5]
    assert len(nz["cells"]) == 10 and all(0 <= c["rate"] <= 1 for c in nz["cells"])
    mc = m.config
    assert len(res["tni"]["per_head"]) == mc.num_layers * mc.num_kv_heads
    assert {(r["method"], r["layer"]) for r in res["tni"]["key_error"]} == {
        ("oscar2", i) for i in range(mc.num_layers)}  # fmt: skip
    abl = res["ablations"]
    assert [r["method"] for r in abl] == ["oscar2_r0", "oscar2"]
    assert abl[1]["ppl"] == ppl["oscar2"]["ppl"]  # the base row reuses the ppl run
    assert abl[0]["key_mse_layer_mean"] == pytest.approx(abl[1]["key_mse_layer_mean"])  # R only
    for head in ("## Perplexity", "## Needle in a haystack", "## Token Norm Imbalance",
                 "## Ablations"):  # fmt: skip
        assert head in md
    assert (out / "key_norms.png").exists() == _has_mpl() == (out / "niah.png").exists()
    # a later command adds a method to the same directory: the bf16 reference and the
    # other tasks' results of the first run are kept (an evaluation in several commands)
    rc = cli.main(["eval", "--model", tiny_dir, "--out", str(out), "--methods", "kivi2",
                   "--tasks", "ppl", "--ctx", "1024", "--ppl-windows", "3", "--quiet"])  # fmt: skip
    assert rc == 0
    capsys.readouterr()
    res2 = json.loads((out / "results.json").read_text())
    ppl2 = {r["method"]: r for r in res2["ppl"]}
    assert list(ppl2) == ["bf16", "oscar2", "kivi2"] and ppl2["oscar2"] == ppl["oscar2"]
    assert ppl2["kivi2"]["delta_vs_bf16"] == pytest.approx(
        ppl2["kivi2"]["ppl"] - ppl["bf16"]["ppl"])  # fmt: skip
    assert res2["niah"] == res["niah"] and res2["ablations"] == res["ablations"]
    assert [r["tasks"] for r in res2["runs"]] == [["ppl", "niah", "tni", "ablations"], ["ppl"]]
    # the plots again from results.json alone (as after a run on a machine without matplotlib)
    rc = cli.main(["plot", str(out / "results.json"), "--out", str(tmp_path / "re")])
    if _has_mpl():
        assert rc == 0 and (tmp_path / "re" / "key_norms.png").stat().st_size > 1000
        assert (tmp_path / "re" / "niah.png").exists()
    else:
        assert rc == 2 and "matplotlib is not installed" in capsys.readouterr().err


def test_errors_are_clear(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "BUNDLED", str(tmp_path / "proxy"))
    with pytest.raises(SystemExit, match="bundled model is missing"):
        cli.main(["demo"])
    with pytest.raises(SystemExit, match="no config.json"):
        cli.main(["eval", "--model", str(tmp_path)])
    assert cli.main(["eval", "--model", tiny_dir, "--methods", "bf16,oscar3x"]) == 2
    assert "method='oscar3x'" in capsys.readouterr().err
    assert cli.main(["eval", "--model", tiny_dir, "--tasks", "ppl,speed"]) == 2
    assert "tasks=" in capsys.readouterr().err
    assert cli.main(["eval", "--model", tiny_dir, "--heldout", str(tmp_path / "x.npy")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # the synthetic study stays reachable
        cli.main(["study", "--help"])
    assert e.value.code == 0 and "synthetic" in capsys.readouterr().out


def test_python_dash_m_models():
    r = subprocess.run([sys.executable, "-m", "models", "demo", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0 and "--model" in r.stdout and "proxy" in r.stdout


def _small(**kw):
    s = ev.Settings(methods="bf16,oscar2", ctx=256, ppl_windows=2, niah_lengths=(256,),
                    niah_depths=(0, 100), niah_trials=1, tni_windows=1,
                    show_progress=False)  # fmt: skip
    return dataclasses.replace(s, **kw)


def test_eval_without_matplotlib_then_over_budget(tiny_dir, tmp_path, monkeypatch):
    """Without matplotlib the data of the plots are still written; a run whose budget is
    spent skips every unit, says so, and keeps what an earlier run wrote."""
    from models import eval_tni

    monkeypatch.setattr(eval_tni, "_pyplot", lambda: None)
    m = models.from_pretrained(tiny_dir)
    held = np.load(os.path.join(tiny_dir, "heldout_sample.npy"))
    out = tmp_path / "e"
    res = ev.run_eval(m, held, str(out), _small(tasks="tni,niah"), model_dir=tiny_dir)
    assert not list(out.glob("*.png"))
    assert sum(eval_tni.NO_MPL in n for n in res["notes"]) == 2
    saved = json.loads((out / "results.json").read_text())
    assert np.asarray(saved["tni"]["norm_profile"]).shape[0] == m.config.num_layers
    assert len(saved["niah"]["cells"]) == 2 * 2 and saved["skipped"] == []
    assert saved["runs"][-1]["compile"]["programs"] >= 1
    res2 = ev.run_eval(m, held, str(out), _small(tasks="ppl,niah", time_budget_s=1e-9),
                       model_dir=tiny_dir)  # fmt: skip
    units = [(u["task"], u["unit"]) for u in res2["skipped"]]
    assert units == [("ppl", "bf16"), ("ppl", "oscar2"), ("niah", "bf16"), ("niah", "oscar2")]
    saved2 = json.loads((out / "results.json").read_text())
    assert saved2["niah"]["summary"] == saved["niah"]["summary"] and "ppl" not in saved2
    assert "Skipped by the time budget" in (out / "results.md").read_text()
    assert any("4 unit(s) skipped" in n for n in res2["notes"])
    with pytest.raises(ValueError, match="time_budget_s"):
        ev.run_eval(m, held, str(out), _small(time_budget_s=0), model_dir=tiny_dir)


def test_eval_batched_forms_equal_per_call_forms(tiny_dir, tmp_path):
    """All windows in one call and all NIAH lengths in one program (the GPU defaults) give
    the per-window / per-length results; compiling ahead in threads changes nothing."""
    m = models.from_pretrained(tiny_dir)
    held = np.load(os.path.join(tiny_dir, "heldout_sample.npy"))
    kw = dict(tasks="ppl,niah", niah_lengths=(128, 256), niah_depths=(0, 50, 100))
    sa = _small(ppl_batch=1, niah_group="length", compile_workers=0, **kw)
    sb = _small(ppl_batch=2, niah_group="all", niah_batch=4, compile_workers=2, **kw)
    a = ev.run_eval(m, held, str(tmp_path / "a"), sa)
    b = ev.run_eval(m, held, str(tmp_path / "b"), sb)
    for ra, rb in zip(a["ppl"], b["ppl"], strict=True):
        assert ra["method"] == rb["method"] and ra["ppl"] == pytest.approx(rb["ppl"], rel=1e-5)
    assert a["niah"]["cells"] == b["niah"]["cells"] and len(a["niah"]["cells"]) == 2 * 6
    assert a["runs"][-1]["compile"]["precompile_failed"] == []
    assert b["runs"][-1]["compile"]["precompile_failed"] == []
    with pytest.raises(ValueError, match="niah_group"):
        ev.run_eval(m, held, str(tmp_path / "c"), _small(niah_group="depth", **kw))
