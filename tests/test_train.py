"""Proxy-model training: passkey documents, corpus files, batches, training runs
that are deterministic and resume bit-exactly, the Hugging Face export, sink metrics, and
the committed checkpoint's reference logits."""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oscar_proxy
from oscar_eval import passkey

PROXY = oscar_proxy.BUNDLED


# -- passkey ----------------------------------------------------------------------------
def test_passkey_document_is_deterministic_and_well_formed():
    a = passkey.passkey_document(np.random.default_rng(7), 30)
    assert a == passkey.passkey_document(np.random.default_rng(7), 30)
    assert a != passkey.passkey_document(np.random.default_rng(8), 30)
    pieces, key = passkey.passkey_pieces(np.random.default_rng(7), 30)
    assert "".join(pieces) == a and len(key) == 5 and key.isdigit()
    assert a.startswith(passkey.PREAMBLE)
    assert a.endswith(f"What is the pass key? The pass key is {key}.")
    assert passkey.needle(key) in a
    assert sum(a.count(s) for s in passkey.FILLER) == 30
    depths = set()
    for seed in range(40):
        text = passkey.passkey_document(np.random.default_rng(seed), 10)
        depths.add(text.index("The pass key is"))
    assert len(depths) > 5  # the needle moves
    with pytest.raises(ValueError, match="n_filler"):
        passkey.passkey_document(np.random.default_rng(0), -1)


class _WordTok:
    """A toy reversible tokenizer: one id per space-separated word, BOS (1) first."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [1] + [self.vocab.setdefault(w, len(self.vocab) + 2) for w in text.split(" ") if w]

    def decode(self, ids) -> str:
        inv = {v: k for k, v in self.vocab.items()}
        return " ".join(inv[i] for i in ids if i != 1)


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_passkey_prompt_length_depth_and_determinism(depth):
    tok = _WordTok()
    ids, key = passkey.passkey_prompt(tok.encode, 300, depth, np.random.default_rng(3))
    assert (ids, key) == passkey.passkey_prompt(tok.encode, 300, depth, np.random.default_rng(3))
    longest = max(len(s.split()) for s in passkey.FILLER)
    assert 300 - longest < len(ids) <= 300 and ids[0] == 1
    text = tok.decode(ids)
    assert text.startswith(passkey.PREAMBLE)
    assert text.endswith("What is the pass key? The pass key is")
    before, after = text.split(passkey.needle(key).strip())
    n_before = before.count(".") - passkey.PREAMBLE.count(".")
    n_after = after.count(".")
    assert n_before + n_after > 30
    assert abs(n_before / (n_before + n_after) - depth) <= 0.5 / (n_before + n_after) + 1e-9
    with pytest.raises(ValueError, match="depth"):
        passkey.passkey_prompt(tok.encode, 300, 1.5, np.random.default_rng(0))
    with pytest.raises(ValueError, match="n_tokens"):
        passkey.passkey_prompt(tok.encode, 5, 0.5, np.random.default_rng(0))


def test_score_passkey():
    assert passkey.score_passkey(" 12345. The pass key", "12345")
    assert passkey.score_passkey("12345678", "12345")
    assert not passkey.score_passkey(" 12344", "12345")
    assert not passkey.score_passkey(" 1234", "12345")
    assert not passkey.score_passkey("", "12345")
    with pytest.raises(ValueError, match="answer"):
        passkey.score_passkey("12345", "1234")


# -- a tiny corpus, tokenizer and training runs ------------------------------------------
WORDS = ("the data file system user value table line text page name list order time place "
         "shows reads writes keeps finds opens moves takes gives makes small large new old "
         "first last other same each every some many one two three and or but with from into "
         "when where which that this these those is are was were be has have").split()  # fmt: skip


def _texts(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        sents = []
        for _ in range(int(rng.integers(5, 40))):
            if rng.random() < 0.2:
                sents.append(passkey.FILLER[rng.integers(len(passkey.FILLER))])
            else:
                w = [WORDS[i] for i in rng.integers(0, len(WORDS), int(rng.integers(4, 12)))]
                sents.append(" ".join(w).capitalize() + ".")
        out.append(" ".join(sents))
    return out


@functools.cache
def tiny_corpus() -> str:
    import tempfile

    pytest.importorskip("tokenizers", reason="the corpus needs tokenizers (the [hf] extra)")
    from oscar_proxy import corpus

    d = tempfile.mkdtemp(prefix="proxy_corpus_")
    train, held = _texts(0, 120), _texts(1, 12)
    tok = corpus.train_tokenizer(train + [passkey.passkey_document(np.random.default_rng(0), 50)],
                                 600)  # fmt: skip
    files = [[f"/synthetic/{i}", "0" * 16, "synthetic", "train", 1, len(t)]
             for i, t in enumerate(train)]  # fmt: skip
    corpus.write_corpus(d, tok, train, held, files)
    return d


def test_corpus_files_round_trip_and_hash_check(tmp_path):
    from oscar_proxy import corpus

    d = tiny_corpus()
    ids, starts = corpus.load_split(d, "train")
    assert ids.dtype == np.uint16 and starts[0] == 0
    assert (ids[starts] == 0).all()  # <s> at every document start
    assert (ids[np.append(starts[1:], ids.size) - 1] == 1).all()  # </s> at every end
    with open(os.path.join(d, "manifest.json")) as f:
        man = json.load(f)
    assert man["splits"]["train"]["tokens"] == ids.size and man["splits"]["heldout"]["docs"] == 12
    bad = tmp_path / "c"
    bad.mkdir()
    for fn in os.listdir(d):
        (bad / fn).write_bytes(open(os.path.join(d, fn), "rb").read())
    corpus.save_xz(str(bad / "train.npy.xz"), ids[:-1])
    with pytest.raises(ValueError, match="does not match"):
        corpus.load_split(str(bad), "train")


def _tok():
    import tokenizers

    return tokenizers.Tokenizer.from_file(os.path.join(tiny_corpus(), "tokenizer.json"))


def test_passkey_pieces_tokenize_as_their_concatenation():
    tok = _tok()
    for seed in range(5):
        pieces, _ = passkey.passkey_pieces(np.random.default_rng(seed), 20)
        whole = tok.encode("".join(pieces), add_special_tokens=False).ids
        parts = [i for p in pieces for i in tok.encode(p, add_special_tokens=False).ids]
        assert whole == parts


def test_batches_deterministic_rows_start_with_bos():
    from oscar_proxy import corpus
    from oscar_proxy.data import Batches

    ids, starts = corpus.load_split(tiny_corpus(), "train")
    mk = lambda: Batches(ids, starts, 128, 8, 5, 0.25, _tok(), 0, 1)
    a, b = mk(), mk()
    for step in (0, 1, 50):
        x = a.batch(step)
        assert x.shape == (8, 129) and x.dtype == np.int32
        assert (x[:, 0] == 0).all()
        np.testing.assert_array_equal(x, b.batch(step))
    assert not np.array_equal(a.batch(0), a.batch(1))
    pk = a.batch(3)[-2:]
    text = _tok().decode(pk[0].tolist(), skip_special_tokens=False)
    assert "What is the pass key? The pass key is" in text


TINY = ["--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
        "--intermediate", "64", "--seq-len", "128", "--batch", "4", "--warmup", "3",
        "--steps", "6", "--log-every", "2", "--evals", "0", "--eval-rows", "2",
        "--passkey-lengths", "120", "--passkey-depths", "0.5", "--passkey-per", "2",
        "--time-budget-s", "600", "--reserve-s", "1", "--ref-len", "24"]  # fmt: skip


def _train(tmp, name, *extra):
    from oscar_proxy import train

    state = os.path.join(tmp, name)
    train.main(["--data", tiny_corpus(), "--state-dir", state, *TINY, *extra])
    return dict(np.load(os.path.join(state, "state.npz")))


@functools.cache
def _reference_run(tmp) -> tuple[dict, str]:
    export = os.path.join(tmp, "hf")
    return _train(tmp, "a", "--export", export), export


def test_training_is_deterministic_and_resumes_bit_exactly(tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp())
    ref, _ = _reference_run(tmp)
    again = _train(tmp, "b")
    part = _train(tmp, "c", "--stop-at", "3")
    assert int(part["__step__"]) == 3
    resumed = _train(tmp, "c")
    assert int(ref["__step__"]) == int(resumed["__step__"]) == 6
    assert set(ref) == set(again) == set(resumed)
    for k in ref:
        np.testing.assert_array_equal(ref[k], again[k], err_msg=k)
        np.testing.assert_array_equal(ref[k], resumed[k], err_msg=k)
    assert not np.array_equal(ref["[0]['embed']"], part["[0]['embed']"])  # it did train on
    with pytest.raises(ValueError, match="another recipe"):
        _train(tmp, "c", "--lr", "1e-3")


def test_export_loads_in_ours_and_transformers(tmp_path_factory):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch

    import models

    _, export = _reference_run(str(tmp_path_factory.getbasetemp()))
    shards = [f for f in os.listdir(export) if f.endswith(".safetensors")]
    assert shards and all(os.path.getsize(os.path.join(export, f)) < 16 * 2**20 for f in shards)
    with open(os.path.join(export, "training.json")) as f:
        rec = json.load(f)
    ids = np.asarray([rec["reference"]["input_ids"]], np.int32)
    m = models.from_pretrained(export, dtype=jnp.float32)
    ours = np.asarray(m.logits(ids))
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        theirs = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    np.testing.assert_allclose(ours[0, :, :64], rec["reference"]["logits_head"], atol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(export)
    text = "The grass is green."
    assert tok(text).input_ids == m.tokenizer.encode(text).ids
    assert tok(text).input_ids[0] == m.config.bos_token_id == 0
    assert rec["step"] == 6 and rec["finished"] and rec["sinks_export"]["num_heads_total"] == 4


# -- sink metrics -----------------------------------------------------------------------
def test_sink_metrics_match_a_direct_computation():
    from models import layers
    from oscar_eval.sinks import format_table, sink_metrics
    from oscar_proxy.model import Recipe, init_params, model_config

    r = Recipe(hidden=32, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=48)
    cfg = model_config(r, 64, 0, 1)
    params = init_params(cfg, 3)
    params["layers"]["wk"] = params["layers"]["wk"] * 20  # peaked attention
    ids = np.random.default_rng(0).integers(0, 64, (2, 40)).astype(np.int32)
    m = sink_metrics(params, cfg, ids, offset=4)
    assert m["attn_first"].shape == (2, 4) and m["key_norm_ratio"].shape == (2, 2)
    # layer 0 by hand (numpy softmax)
    lp = jax.tree.map(lambda a: a[0], params["layers"])
    x = layers.embed(params, jnp.asarray(ids))
    pos = jnp.broadcast_to(jnp.arange(40), (2, 40))
    q, k, _ = layers.qkv(cfg, lp, layers.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps), pos)
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    k_rep = np.repeat(k, 2, axis=2)  # query head h uses KV head h // 2
    s = np.einsum("bqhd,bkhd->bhqk", q, k_rep) / 4.0
    s = np.where(np.tril(np.ones((40, 40), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = p[:, :, 4:, 0].mean(axis=(0, 2))
    np.testing.assert_allclose(m["attn_first"][0], want, rtol=1e-4, atol=1e-6)
    kn = np.linalg.norm(k, axis=-1)
    want_k = (np.median(kn[:, 1:], axis=1) / kn[:, 0]).mean(0)
    np.testing.assert_allclose(m["key_norm_ratio"][0], want_k, rtol=1e-4)
    assert "sink heads" in format_table(m)
    with pytest.raises(ValueError, match="offset"):
        sink_metrics(params, cfg, ids, offset=40)


# -- the committed checkpoint ---------------------------------------------------------


def test_bundled_proxy_gives_the_recorded_logits():
    import models
    from models.config import ModelConfig

    m = models.from_pretrained(PROXY, dtype=jnp.float32)
    cfg: ModelConfig = m.config
    assert cfg.head_dim == 128 and cfg.num_heads >= 2 * cfg.num_kv_heads
    assert cfg.num_params() <= 12_000_000 and cfg.max_position_embeddings >= 2048
    for f in os.listdir(PROXY):
        assert os.path.getsize(os.path.join(PROXY, f)) < 16 * 2**20, f
    with open(os.path.join(PROXY, "training.json")) as f:
        ref = json.load(f)["reference"]
    logits = np.asarray(m.logits(np.asarray([ref["input_ids"]], np.int32)))[0]
    np.testing.assert_allclose(logits[:, :64], ref["logits_head"], atol=2e-3, rtol=0)
    mx = logits.max(-1)
    lse = np.log(np.exp(logits - mx[:, None]).sum(-1)) + mx
    np.testing.assert_allclose(lse, ref["logsumexp"], atol=2e-3, rtol=0)
    assert (logits.argmax(-1) == np.asarray(ref["argmax"])).mean() >= 0.95
