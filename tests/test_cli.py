"""``oscar-jax demo`` / ``eval`` / ``study`` on a tiny random Hugging Face directory."""

from __future__ import annotations

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
    monkeypatch.setattr(ev, "ablation_methods", lambda base, r, g: [
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
