"""Second-half perplexity scoring, and the decode path against the parallel form
(``benchmarks.decode_vs_parallel``) on a small model."""

from __future__ import annotations

import json

import numpy as np
import pytest

import oscar_eval
from benchmarks import decode_vs_parallel as dvp
from oscar_eval import ppl as eval_ppl
from oscar_eval.common import parse_methods

SMALL = dict(residual_length=16, group_size=16)


def test_score_start():
    assert eval_ppl.score_start(64, "all") == 0
    assert eval_ppl.score_start(64, "second_half") == 31  # entry 31 scores token 32
    assert eval_ppl.score_start(65, "second_half") == 31
    assert eval_ppl.score_start(2, "second_half") == 0
    with pytest.raises(ValueError, match="score"):
        eval_ppl.score_start(64, "half")
    with pytest.raises(ValueError, match="t="):
        eval_ppl.score_start(1, "all")


def test_second_half_perplexity_scores_only_the_second_half(tiny):
    """The second-half perplexity is exp of the mean NLL of tokens T/2 .. T-1, and differs
    from the whole window's (the first half is easier or harder, not the same)."""
    ids = np.random.default_rng(3).integers(0, 256, (3, 64)).astype(np.int32)
    methods = parse_methods("bf16,kivi2", **SMALL)
    nll, _ = eval_ppl.window_nll(tiny, ids, methods[1].kv)
    half = eval_ppl.perplexity(tiny, ids, methods, score="second_half", show_progress=False)
    full = eval_ppl.perplexity(tiny, ids, methods, show_progress=False)
    assert half[1]["tokens"] == 3 * 32 and full[1]["tokens"] == 3 * 63
    assert np.isclose(half[1]["ppl"], np.exp(nll[:, 31:].mean()), rtol=1e-12)
    assert np.isclose(full[1]["ppl"], np.exp(nll.mean()), rtol=1e-12)
    assert abs(half[1]["ppl"] - full[1]["ppl"]) > 1e-3 * full[1]["ppl"]
    assert "delta_vs_bf16" in half[1] and np.isfinite(half[1]["delta_lo"])


def test_settings_reject_an_unknown_score():
    with pytest.raises(ValueError, match="ppl_score"):
        oscar_eval.Settings(ppl_score="half").resolve(2048)


def test_eval_resumes_only_with_the_same_scoring(tiny, tmp_path):
    """A results.json of whole-window scoring is not reused for second-half scoring."""
    held = np.random.default_rng(4).integers(2, 256, 400)
    s = oscar_eval.Settings(methods="bf16,kivi2", tasks="ppl", ctx=64, ppl_windows=3,
                            residual_length=16, group_size=16, show_progress=False,
                            compile_workers=0)  # fmt: skip
    out = str(tmp_path)
    full = oscar_eval.run_eval(tiny, held, out, s)
    s.ppl_score = "second_half"
    half = oscar_eval.run_eval(tiny, held, out, s)
    assert half["ppl_key"]["score"] == "second_half"
    assert [r["tokens"] for r in half["ppl"]] == [96, 96]
    assert [r["tokens"] for r in full["ppl"]] == [189, 189]
    with open(f"{out}/results.md") as f:
        assert "scored: second half of each window" in f.read()
    with open(f"{out}/results.json") as f:
        assert json.load(f)["settings"]["ppl_score"] == "second_half"


def test_decode_path_agrees_with_parallel_form(tiny):
    """benchmarks.decode_vs_parallel on a small model: the real cache, token by token,
    gives the parallel form's logits, while quantization moves them a lot."""
    ids = np.random.default_rng(1).integers(0, 256, (1, 64)).astype(np.int32)
    rows = dvp.compare(tiny, ids, parse_methods("bf16,oscar2_pertoken,kivi2", **SMALL))
    by = {r["method"]: r for r in rows}
    assert by["bf16"]["max_diff_rel"] < 1e-5 and by["bf16"]["quant_effect"] == 0.0
    for name in ("oscar2_pertoken", "kivi2"):
        r = by[name]
        assert r["quant_effect"] > 0.5  # the quantized cache matters here
        assert r["max_diff_rel"] < 1e-3 and r["argmax_agree"] == 1.0
        assert abs(r["nll_diff"]) < 1e-4
    assert all(r["backend"].endswith(")") for r in rows)  # the backend and layout, named
    assert f"| oscar2_pertoken | {by['oscar2_pertoken']['backend']} | 64 |" in dvp.markdown(rows)
    with pytest.raises(ValueError, match="ids.shape"):
        dvp.compare(tiny, ids[:, :2], parse_methods("bf16"))


def test_group_key_error_and_sink_figure(tmp_path):
    """The per-group INT2 key error puts KIVI's worst group at the planted sink's (group 0)
    and OScaR's there far lower; the sink figure is written."""
    from helpers import kv_with_sinks

    from oscar_eval import tni as eval_tni

    k, _ = kv_with_sinks(3, 2, 256, 2, 128, sinks=(0,), ratio=20.0, massive=2)
    k = np.asarray(k)[:, None]  # [N=2, L=1, T, H, D]
    rows = eval_tni.key_mse(k, parse_methods("kivi2,oscar2"), show_progress=False)
    ge = eval_tni.group_errors(rows)
    assert set(ge) == {"kivi2", "oscar2"} and len(ge["kivi2"]) == 256 // 32
    assert ge["kivi2"][0] > 1.5 * max(ge["kivi2"][1:])  # the sink's group is KIVI's worst
    # OScaR: the sink's group is no worse than the others
    assert ge["oscar2"][0] < min(1.2 * np.median(ge["oscar2"][1:]), 0.7 * ge["kivi2"][0])
    attn = np.random.default_rng(0).uniform(size=(3, 4))
    path = eval_tni.plot_tni(attn, ge, str(tmp_path / "tni.png"), "planted")
    assert path is None or (tmp_path / "tni.png").stat().st_size > 1000


def test_cli_options_reach_the_settings():
    from oscar_cli import cli

    args = cli._parser().parse_args(["eval", "--ppl-score", "second_half", "--niah-chat", "off"])
    args.methods = "bf16"
    s = cli._settings(args, 2048)
    assert (s.ppl_score, s.niah_chat) == ("second_half", "off")
    assert cli._settings(cli._parser().parse_args(["eval"]), 2048).niah_chat == "auto"
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["eval", "--ppl-score", "half"])
