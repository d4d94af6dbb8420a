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
import oscar_eval as ev  # noqa: E402
from oscar_cli import cli  # noqa: E402
from oscar_eval import tasks as et  # noqa: E402
from oscar_eval.common import make_windows  # noqa: E402

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
    # what the user looks at: the sink verdict beside the norms, a legend, one precision
    assert "attention sinks" in text or "low-norm sink keys" in text
    assert "x: found, .: missed" in text
    ppl_part = text.split("## Perplexity")[1].split("## Passkey")[0]
    ppl_rows = [line.split("|") for line in ppl_part.splitlines()
                if line.startswith("| bf16") or line.startswith("| oscar2")]  # fmt: skip
    assert len(ppl_rows) == 2 and all(len(r[2].strip().split(".")[1]) == 2 for r in ppl_rows)
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
    assert not [n for n in res["notes"] if "windows of" in n]  # as many as asked for
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


def test_python_dash_m_oscar_cli():
    r = subprocess.run([sys.executable, "-m", "oscar_cli", "demo", "--help"], cwd=REPO,
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
    from oscar_eval import tni as eval_tni

    monkeypatch.setattr(eval_tni, "_pyplot", lambda: None)
    m = models.from_pretrained(tiny_dir)
    held = np.load(os.path.join(tiny_dir, "heldout_sample.npy"))
    out = tmp_path / "e"
    res = ev.run_eval(m, held, str(out), _small(tasks="tni,niah"), model_dir=tiny_dir)
    assert not list(out.glob("*.png"))
    assert sum(eval_tni.NO_MPL in n for n in res["notes"]) == 3  # key_norms, tni, niah
    saved = json.loads((out / "results.json").read_text())
    assert np.asarray(saved["tni"]["norm_profile"]).shape[0] == m.config.num_layers
    assert len(saved["niah"]["cells"]) == 2 * 2 and saved["skipped"] == []
    assert saved["runs"][-1]["compile"]["programs"] >= 1
    # another needle grid (the saved one would be reused, not re-run)
    s2 = _small(tasks="ppl,niah", time_budget_s=1e-9, niah_depths=(50,))
    res2 = ev.run_eval(m, held, str(out), s2, model_dir=tiny_dir)
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


def test_interrupted_eval_lists_what_finished(tiny_dir, tmp_path, monkeypatch):
    """results.md is rewritten after every unit: a run stopped in its third unit lists the
    two finished methods (their rows, not only their NLLs in results.json) and says it did
    not finish; a run that ends lists them all and its wall time."""
    m = models.from_pretrained(tiny_dir)
    held = np.load(os.path.join(tiny_dir, "heldout_sample.npy"))
    real = et._run_ppl

    def run_ppl(c, mt):
        if mt.name == "oscar2":
            raise KeyboardInterrupt  # as a Ctrl-C (or a kill) in the middle of a unit
        real(c, mt)

    monkeypatch.setattr(et, "_run_ppl", run_ppl)
    out = tmp_path / "e"
    s = _small(methods="bf16,kivi2,oscar2", tasks="ppl", ppl_batch=2)
    with pytest.raises(KeyboardInterrupt):
        ev.run_eval(m, held, str(out), s, model_dir=tiny_dir)
    md = (out / "results.md").read_text()
    rows = [line.split("|")[1].strip() for line in md.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["bf16", "kivi2"]  # header, then the finished methods
    assert "?" not in md and "not finished" in md
    saved = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in saved["ppl"]] == ["bf16", "kivi2"]
    assert saved["runs"][-1]["done"] is False and saved["runs"][-1]["wall_s"] > 0
    monkeypatch.setattr(et, "_run_ppl", real)  # the same command again completes the table
    ev.run_eval(m, held, str(out), s, model_dir=tiny_dir)
    md = (out / "results.md").read_text()
    rows = [line.split("|")[1].strip() for line in md.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["bf16", "kivi2", "oscar2"]
    assert "not finished" not in md and " s wall," in md


def test_eval_defaults_follow_the_model_and_quick_is_small():
    p = cli._parser()
    a = p.parse_args(["eval"])
    assert a.ctx is None and a.niah_lengths is None
    a.methods = "bf16"
    s = cli._settings(a, 2048)
    assert s.ctx == 2048 and max(s.niah_lengths) <= 2048
    assert cli._settings(a, 32768).ctx == 4096
    q = p.parse_args(["eval", "--quick"])
    q.methods = "bf16"
    s = cli._settings(q, 2048)
    assert s.ctx == cli.QUICK_CTX and s.ppl_windows == 2 and s.niah_lengths == (512,)


def test_plot_of_perplexity_only_says_there_is_nothing_to_plot(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"model": "m", "ppl": [{"method": "bf16", "ppl": 15.5}]}))
    assert cli.main(["plot", str(path)]) == 2
    err = capsys.readouterr().err
    assert "nothing to plot" in err and "ppl" in err and "--tasks tni,niah" in err
    assert not list(tmp_path.glob("*.png"))
    assert cli.main(["plot", str(tmp_path / "none.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_demo_writes_outside_the_current_directory(tmp_path, monkeypatch, capsys):
    from oscar_cli import demo

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert demo.default_out() == str(tmp_path / "cache" / "oscar-jax" / "demo")
    monkeypatch.delenv("XDG_CACHE_HOME")
    out = demo.default_out()
    assert os.path.isabs(out) and out != os.path.abspath("oscar-jax-demo")
    assert out.endswith(os.path.join("oscar-jax", "demo"))
    assert cli._parser().parse_args(["demo"]).out is None  # run_demo takes default_out()
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    assert out in " ".join(capsys.readouterr().out.split())
    assert "NO attention sinks" in demo.sink_note(1.2) and "ACCURACY.md" in demo.sink_note(1.2)
    assert "low-norm sink keys" in demo.sink_note(30.0)


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_texts(capsys):
    top = _help(["--help"], capsys)
    assert "``" not in top and "demo" in top and "study" in top
    study = _help(["study", "--help"], capsys)
    assert study.startswith("usage: oscar-jax study") and "--tokens" in study
    assert "``" not in study and "synthetic TNI study" in study
    ev_help = " ".join(_help(["eval", "--help"], capsys).split())
    assert "``" not in ev_help and "issue" not in ev_help
    assert "bf16, kivi2, ots_only2" in ev_help and "max_position_embeddings" in ev_help
    for q in ("eval", "demo"):
        assert "``" not in _help([q, "--help"], capsys)
    sub = {a.dest: a for a in cli._parser()._actions if a.dest == "cmd"}["cmd"].choices
    for name in ("eval", "demo", "plot"):  # every option has a help text
        missing = [a.dest for a in sub[name]._actions if not a.help]
        assert not missing, (name, missing)


def test_memory_and_models_commands(capsys, monkeypatch, tmp_path):
    assert cli.main(["memory"]) == 0
    out = capsys.readouterr().out
    assert "| Llama-3.1-8B | 128K | 16.00 GiB | 3.082 GiB | 5.19x |" in out
    assert "| Qwen3-30B-A3B | 128K |" in out and "| gemma-3-270m | 32K |" in out
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("smollm2", "qwen2.5-0.5b", "gemma3-270m"))
    got = []
    fake = tmp_path / "m.gguf"
    monkeypatch.setattr(cli.fetch, "fetch", lambda name, cache_dir=None: got.append(name) or fake)
    assert cli.main(["models", "fetch", "smollm2"]) == 0
    assert got == ["smollm2"] and capsys.readouterr().out.strip() == str(fake)
    assert cli.main(["models", "fetch"]) == 2  # no name: a clear error, not a traceback
    assert "needs a name" in capsys.readouterr().err


def test_models_without_a_sample_get_the_bundled_text(tiny_dir):
    """A model with a tokenizer but no held-out sample (a .gguf file, say) gets the bundled
    held-out documents as text, re-encoded by its own tokenizer: one BOS per document."""
    m = models.from_pretrained(tiny_dir)
    ids = cli._bundled_text_for(m)
    bos = m.config.bos_token_id
    bundled = np.load(os.path.join(cli.BUNDLED, "heldout_sample.npy")).reshape(-1)
    n_docs = int(np.sum(bundled == models.load_config(cli.BUNDLED).bos_token_id))
    assert ids[0] == bos and 0 < int(np.sum(ids == bos)) <= n_docs
    assert ids.min() >= 0 and ids.max() < m.config.vocab_size
    assert not np.any((ids[1:] == bos) & (ids[:-1] == bos))  # never two BOS in a row


def test_fewer_windows_than_asked_are_noted(tiny_dir, tmp_path, capsys):
    """--ppl-windows beyond what the held-out text holds scores what there is, and says so
    (in results.json's notes and on stderr) instead of silently scoring fewer."""
    ids = np.load(os.path.join(tiny_dir, "heldout_sample.npy"))[:2000]
    np.save(tmp_path / "h.npy", ids)
    n = len(make_windows(ids, 256, None, 0))
    assert 0 < n < 50
    rc = cli.main(["eval", "--model", tiny_dir, "--heldout", str(tmp_path / "h.npy"),
                   "--out", str(tmp_path / "o"), "--methods", "bf16", "--tasks", "ppl",
                   "--ctx", "256", "--ppl-windows", "50", "--quiet"])  # fmt: skip
    assert rc == 0
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert res["ppl_windows"] == n
    note = f"holds {n} windows of 256 tokens: perplexity is scored on those, not the 50"
    assert any(note in x for x in res["notes"])
    assert note in capsys.readouterr().err


def test_interrupted_niah_resumes_without_rerunning_finished_methods(tiny_dir, tmp_path,
                                                                      monkeypatch):  # fmt: skip
    """A needle run stopped in its second method keeps the first; the same command again
    runs only the missing method (the first is not decoded again) and pairs it with the
    saved bf16; another grid reuses nothing."""
    from oscar_eval import niah as eval_niah

    m = models.from_pretrained(tiny_dir)
    held = np.load(os.path.join(tiny_dir, "heldout_sample.npy"))
    real, ran, stop = eval_niah.niah_method, [], [True]

    def stop_at_oscar2(m_, mt, *a, **k):
        ran.append(mt.name)
        if mt.name == "oscar2" and stop:
            stop.clear()  # only the first oscar2 run is interrupted
            raise KeyboardInterrupt
        return real(m_, mt, *a, **k)

    monkeypatch.setattr(eval_niah, "niah_method", stop_at_oscar2)
    out = tmp_path / "n"
    s = _small(tasks="niah")
    with pytest.raises(KeyboardInterrupt):
        ev.run_eval(m, held, str(out), s, model_dir=tiny_dir)
    first = json.loads((out / "results.json").read_text())["niah"]
    assert [r["method"] for r in first["summary"]] == ["bf16"]
    res = ev.run_eval(m, held, str(out), s, model_dir=tiny_dir)
    assert ran == ["bf16", "oscar2", "oscar2"]  # bf16 once
    nz = res["niah"]
    assert [r["method"] for r in nz["summary"]] == ["bf16", "oscar2"]
    assert nz["ll"]["bf16"] == first["ll"]["bf16"]
    assert "ll_delta" in nz["summary"][1]
    ran.clear()
    ev.run_eval(m, held, str(out), dataclasses.replace(s, niah_depths=(50,)), model_dir=tiny_dir)
    assert ran == ["bf16", "oscar2"]  # a new grid: everything again
