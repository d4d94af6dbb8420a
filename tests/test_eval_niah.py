"""Needle prompts through a chat template, and the log-likelihood of the needle's answer."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="the tiny checkpoint's tokenizer is built with tokenizers")
pytest.importorskip("safetensors")

from tiny_hf import make_tiny_hf_dir  # noqa: E402

import models  # noqa: E402
import oscar_eval as ev  # noqa: E402
from oscar_eval import chat  # noqa: E402
from oscar_eval import niah as eval_niah  # noqa: E402
from oscar_eval.common import parse_method  # noqa: E402
from oscar_eval.passkey import QUESTION  # noqa: E402

# ChatML, as SmolLM2's and Qwen2.5's GGUF files carry it (system turn shortened)
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou help.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    d = make_tiny_hf_dir(tmp_path_factory.mktemp("tiny_chat"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML}, f)
    return d


def test_render_and_chat_encode():
    text = "<|im_start|>system\nYou help.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    assert chat.render(CHATML, "hi") == text + "<|im_start|>assistant\n"

    class Tok:  # records what it is asked to encode
        def encode(self, s, add_special_tokens=True):
            assert add_special_tokens is False
            return type("E", (), {"ids": [ord(c) for c in s]})()

    enc = chat.make_chat_encode(Tok(), CHATML)
    got = "".join(map(chr, enc("The key is 1." + QUESTION)))
    assert got.endswith("user\nThe key is 1. What is the pass key?<|im_end|>\n"
                        "<|im_start|>assistant\nThe pass key is")  # fmt: skip
    assert "".join(map(chr, enc(" hi"))).endswith("user\nhi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="chat template"):
        chat.render("{% for %}", "hi")


def test_use_chat_modes(chat_dir, tmp_path):
    assert chat.chat_template(chat_dir) == CHATML
    assert chat.chat_template(str(tmp_path)) is None and chat.chat_template("") is None
    assert chat.use_chat("auto", CHATML) and not chat.use_chat("auto", None)
    assert chat.use_chat("on", CHATML) and not chat.use_chat("off", CHATML)
    with pytest.raises(ValueError, match="needs a chat template"):
        chat.use_chat("on", None)
    with pytest.raises(ValueError, match="niah_chat"):
        chat.use_chat("yes", CHATML)


def _teacher_forced(m, prompt, answer, kv):
    """Log-likelihood of ``answer`` after ``prompt`` through models.prefill + decode_step."""
    ids = np.asarray([prompt], np.int32)
    logits, caches, p = models.prefill(m, ids, kv, max_new_tokens=len(answer) + 1,
                                       max_len=len(prompt) + len(answer) + 16)  # fmt: skip
    total = 0.0
    for i, tok in enumerate(answer):
        lp = np.asarray(logits[0], np.float64)
        lp = lp - lp.max() - np.log(np.exp(lp - lp.max()).sum())
        total += lp[tok]
        logits, caches = models.decode_step(p, caches, np.asarray([tok]),
                                            np.asarray([len(prompt) + i], np.int32))  # fmt: skip
    return total


def test_answer_logprob_equals_prefill_then_decoding(chat_dir):
    """The answer log-likelihood is what generate's path gives: prefill at full precision,
    then every answer token decoded through the quantized cache."""
    m = models.from_pretrained(chat_dir)
    rng = np.random.default_rng(0)
    prompts = [{"ids": rng.integers(2, 300, n).tolist(), "answer_ids": rng.integers(2, 300, a)
                .tolist()} for n, a in ((150, 6), (131, 4), (97, 6))]  # fmt: skip
    for name in ("kivi2_r16_g16", "oscar2_pertoken_r16_g16", "bf16"):
        kv = parse_method(name).kv
        got = eval_niah.answer_logprob(m, prompts, kv, batch=2)
        want = [_teacher_forced(m, p["ids"], p["answer_ids"], kv) for p in prompts]
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3, err_msg=name)
    # the cache matters here, so the agreement is not vacuous
    plain = eval_niah.answer_logprob(m, prompts, parse_method("bf16").kv)
    quant = eval_niah.answer_logprob(m, prompts, parse_method("kivi2_r16_g16").kv)
    assert max(abs(a - b) for a, b in zip(plain, quant, strict=True)) > 0.05
    with pytest.raises(ValueError, match="answer_ids"):
        eval_niah.answer_logprob(m, [{"ids": [1, 2]}], parse_method("bf16").kv)


def test_answer_scores_greedy_flag_is_what_greedy_decoding_emits(chat_dir):
    """answer_scores' flag is True for the tokens greedy generation emits through the same
    cache, and False once one of them is changed."""
    m = models.from_pretrained(chat_dir)
    rng = np.random.default_rng(1)
    ids = [rng.integers(2, 300, n).tolist() for n in (140, 101)]
    for name in ("bf16", "kivi2_r16_g16"):
        kv = parse_method(name).kv
        prompts = []
        for p in ids:
            toks = models.generate(m, np.asarray([p], np.int32), 5, kv)
            prompts.append({"ids": p, "answer_ids": np.asarray(toks)[0, -5:].tolist()})
        wrong = [dict(p, answer_ids=p["answer_ids"][:-1] + [(p["answer_ids"][-1] + 1) % 300])
                 for p in prompts]  # fmt: skip
        got = eval_niah.answer_scores(m, prompts + wrong, kv, batch=2)
        assert [h for _, h in got] == [True, True, False, False], (name, got)
        lls = eval_niah.answer_logprob(m, prompts + wrong, kv, batch=2)
        np.testing.assert_allclose([ll for ll, _ in got], lls, rtol=0, atol=0)


def test_answer_program_compiles_what_answer_scores_runs(chat_dir):
    """The needle's teacher-forced program, compiled ahead (``answer_program``, as the
    evaluation's precompiler does), is the one ``answer_scores`` then runs: no compilation
    is left for the call."""
    from oscar_eval.programs import CompileStats

    m = models.from_pretrained(chat_dir)
    rng = np.random.default_rng(4)
    prompts = [{"ids": rng.integers(2, 300, n).tolist(), "answer_ids": [5, 6, 7]}
               for n in (170, 90)]  # fmt: skip
    kv = parse_method("ots_only2_r16_g16").kv
    stats = CompileStats()
    eval_niah.answer_program(m, prompts, kv, cache_dtype="bfloat16")()
    ahead = stats.get()["compile_s"]
    after = CompileStats()
    got = eval_niah.answer_scores(m, prompts, kv, cache_dtype="bfloat16")
    # only the staging of the three small int arrays compiles (milliseconds each)
    assert after.get()["compile_s"] < 0.2 * ahead and len(got) == 2, (ahead, after.get())


def test_paired_ll_delta():
    d, lo, hi = eval_niah.paired_ll_delta([1.0, 2.0, 3.0, 5.0], [1.0, 1.0, 1.0, 1.0])
    assert d == pytest.approx(1.75) and lo < d < hi
    assert np.isnan(eval_niah.paired_ll_delta([1.0], [0.5])[1])
    with pytest.raises(ValueError, match="equal-length"):
        eval_niah.paired_ll_delta([], [])


def test_eval_niah_with_the_chat_template(chat_dir, tmp_path):
    m = models.from_pretrained(chat_dir)
    s = ev.Settings(methods="bf16,kivi2_r16_g16", tasks="niah", niah_lengths=(256,),
                    niah_depths=(0, 100), niah_trials=2, show_progress=False,
                    compile_workers=0)  # fmt: skip
    res = ev.run_eval(m, None, str(tmp_path), s, model_dir=chat_dir)
    nz = res["niah"]
    assert nz["grid"]["chat"] is True
    start = m.tokenizer.encode("<|im_start|>system", add_special_tokens=False).ids
    assert nz["first_tokens"][: len(start)] == start[:4]  # the template first, no BOS
    by = {r["method"]: r for r in nz["summary"]}
    assert set(by) == {"bf16", "kivi2_r16_g16"} and len(nz["ll"]["bf16"]) == 4
    assert np.isfinite(by["bf16"]["answer_ll"]) and by["bf16"]["answer_ll"] < 0
    r = by["kivi2_r16_g16"]
    want = np.mean(np.subtract(nz["ll"]["kivi2_r16_g16"], nz["ll"]["bf16"]))
    assert r["ll_delta"] == pytest.approx(want) and r["ll_delta_lo"] <= want <= r["ll_delta_hi"]
    assert all("answer_ll" in c for c in nz["cells"])
    with open(tmp_path / "results.md") as f:
        md = f.read()
    assert "prompts: chat template" in md and "answer log-lik" in md
    s.niah_chat = "off"  # another grid: the chat rows are not reused
    res2 = ev.run_eval(m, None, str(tmp_path), s, model_dir=chat_dir)
    assert res2["niah"]["grid"]["chat"] is False
    assert res2["niah"]["first_tokens"][0] == m.config.bos_token_id


def test_eval_niah_scores_fake_quant_methods_teacher_forced(chat_dir, tmp_path):
    """``oscar-jax eval --tasks niah`` takes the comparison methods too: a fake-quant method
    (no real cache) gets its hits from ``answer_scores``' greedy flag and is marked so, a
    calibrated one is fitted on the held-out text first, and every method carries the
    teacher-forced rate, so the two kinds are compared on the same measure."""
    m = models.from_pretrained(chat_dir)
    s = ev.Settings(methods="bf16,kivi2_r16_g16,turbo2_r16_g16,kvquant2_r16_g16", tasks="niah",
                    ctx=128, niah_lengths=(200,), niah_depths=(0, 50, 100), niah_trials=1,
                    show_progress=False, compile_workers=0)  # fmt: skip
    heldout = np.random.default_rng(3).integers(2, 300, 128 * 3)
    res = ev.run_eval(m, heldout, str(tmp_path), s, model_dir=chat_dir)
    by = {r["method"]: r for r in res["niah"]["summary"]}
    assert by["bf16"]["hit_from"] == by["kivi2_r16_g16"]["hit_from"] == "decoded"
    fq = ("turbo2_r16_g16", "kvquant2_r16_g16")
    assert all(by[k]["hit_from"] == "teacher-forced" for k in fq)
    assert any("calibrated methods fitted" in n for n in res["notes"])
    prompts = [{"ids": p_ids, "answer_ids": a} for p_ids, a in _prompts_of(m, s, chat_dir)]
    forced = [f for _, f in eval_niah.answer_scores(m, prompts, parse_method("turbo2_r16_g16").kv)]
    assert by["turbo2_r16_g16"]["rate"] == by["turbo2_r16_g16"]["forced_rate"] == np.mean(forced)
    lls = res["niah"]["ll"]
    assert all(len(lls[k]) == 3 and np.isfinite(lls[k]).all() for k in by)
    assert max(abs(a - b) for a, b in zip(lls["turbo2_r16_g16"], lls["bf16"], strict=True)) > 1e-4
    assert all("forced_rate" in r for r in by.values())
    with open(tmp_path / "results.md") as f:
        md = f.read()
    assert "turbo2_r16_g16 (*)" in md and "teacher-forced" in md
    with pytest.raises(ValueError, match="answer_ids"):
        eval_niah.niah_method(m, parse_method("turbo2_r16_g16"), [{"ids": [1, 2, 3]}], str)


def _prompts_of(m, s, model_dir):
    """The (ids, answer_ids) of the needle prompts the evaluation builds for ``s``."""
    from oscar_eval import tasks

    ps = tasks._niah_prompts(m, s.resolve(m.config.max_position_embeddings), model_dir)
    return [(p["ids"], p["answer_ids"]) for p in ps]


def test_methods_needle_calibrates_as_the_evaluation(chat_dir, capsys):
    """``benchmarks/methods_needle.py`` fits the calibrated methods as ``oscar-jax eval``
    does (``calibrate_heldout`` on the held-out windows after the scored ones), so they
    run through the teacher-forced needle; an unfitted one is refused there."""
    from benchmarks import methods_needle

    kv = parse_method("kvquant2_r16_g16").kv
    with pytest.raises(ValueError, match="fitted first"):
        eval_niah.answer_logprob(models.from_pretrained(chat_dir),
                                 [{"ids": [0, 5, 6, 7], "answer_ids": [8]}], kv)  # fmt: skip
    rows = methods_needle.main(["--model", chat_dir, "--length", "160", "--depths", "50",
                                "--methods", "bf16,kvquant2_r16_g16",
                                "--calib-ctx", "64", "--calib-scored", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert "calibrated methods fitted on the 2 windows of 64 tokens" in out
    assert set(rows) == {"bf16", "kvquant2_r16_g16"}
    assert rows["kvquant2_r16_g16"].shape == (1,) and np.isfinite(rows["kvquant2_r16_g16"]).all()
    assert abs(rows["kvquant2_r16_g16"][0] - rows["bf16"][0]) > 1e-4  # the cache was quantized


def test_default_batch_caps_the_prompts_dense_scores(monkeypatch):
    """With no batch asked for, a group runs whole unless the prompt's float32 [B, H, L, L]
    attention scores would pass SCORES_BYTES (30 prompts of 8,000 tokens of a 9-head model:
    64 GB, which ran out of an H200's memory), and every batch keeps one shape."""

    class M:
        class config:  # noqa: N801  (a stand-in for models.CausalLM.config)
            num_heads = 9

    short = [{"ids": [1] * 1000, "length": 1024}] * 30
    long = [{"ids": [1] * 7997, "length": 8000}] * 30
    assert eval_niah.default_batch(M, short) == 30  # 1.1 GB at 30 prompts: whole
    assert eval_niah.default_batch(M, long) == 1  # 2.3 GB a prompt: one at a time
    monkeypatch.setattr(eval_niah, "SCORES_BYTES", 4 * 9 * 7997 * 7997 * 7)
    assert eval_niah.default_batch(M, long) == 7
    shapes = {ids.shape for ids, *_ in eval_niah._batches(M, long, None, 8)}
    assert shapes == {(7, 7997)}  # 5 batches, the last padded by repetition
    assert sum(k for *_, k, _ in eval_niah._batches(M, long, None, 8)) == 30
    with pytest.raises(ValueError, match="batch=0"):
        next(eval_niah._batches(M, long, 0, 8))
