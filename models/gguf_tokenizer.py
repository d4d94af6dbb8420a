"""The ``tokenizers.Tokenizer`` that a GGUF file's tokenizer metadata describes.

Supported: ``tokenizer.ggml.model = "gpt2"``, byte-level BPE with merges (SmolLM2,
Qwen2/2.5, Qwen3, Llama 3 files). The ids equal those of transformers' conversion of
the same file (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``; checked in
``tests/test_gguf.py`` and ``benchmarks/gguf_parity.py``):

* vocabulary: ``tokenizer.ggml.tokens`` in id order; a token with a character outside
  the byte-level alphabet (GPT-2's printable stand-ins for the 256 bytes) is spelled
  in it from its UTF-8 bytes;
* merges: ``tokenizer.ggml.merges``, ``"a b"`` each, in rank order;
* pre-tokenizer by ``tokenizer.ggml.pre``: Qwen2's split for the qwen2 family, Llama 3's
  for llama-bpe and its kin, else GPT-2's (``smollm``: llama.cpp splits digits one by
  one there, which gives the same ids as long as the merges join no digits; SmolLM2's
  join none);
* tokens of type CONTROL (3) whole and special; USER_DEFINED (4) whole, not special;
* ``tokenizer.ggml.add_bos_token`` / ``add_eos_token``: a post-processor that adds
  them (none for SmolLM2 and Qwen2.5, whose files set add_bos_token false).

``tokenizer.ggml.model = "llama"`` (sentencepiece: Gemma 3) is converted by transformers
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``) when it is installed. Any other
``tokenizer.ggml.model`` or ``pre`` is a ValueError naming the file and field.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.processors import TemplateProcessing

CONTROL, USER_DEFINED = 3, 4

_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex (None: GPT-2's, built into ByteLevel)
PRE_TOKENIZERS = {
    "default": None, "gpt2": None, "smollm": None,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3, "falcon3": _LLAMA3,
}  # fmt: skip


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes stand for themselves, the
    other 68 bytes take U+0100, U+0101, ... in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in out):
        out[b] = chr(0x100 + n)
    return out


def _sentencepiece(h):
    """A sentencepiece vocabulary (``tokenizer.ggml.model = "llama"``: Gemma 3's) through
    transformers' GGUF converter, the ids transformers gives; None (with a warning) when
    transformers is not installed."""
    import os
    import warnings

    try:
        import transformers
    except ImportError:
        warnings.warn(f"{h.path}: a sentencepiece tokenizer needs transformers; model.tokenizer "
                      "is None", stacklevel=3)  # fmt: skip
        return None
    d, f = os.path.split(os.path.abspath(h.path))
    return transformers.AutoTokenizer.from_pretrained(d, gguf_file=f).backend_tokenizer


def tokenizer_from_header(h):
    """A ``tokenizers.Tokenizer`` for the file's tokenizer metadata (``h``: a
    ``models.gguf.GGUFHeader``), or None when the file has no tokenizer."""

    meta, path = h.metadata, h.path
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind == "llama":  # sentencepiece (Gemma 3): transformers' converter, if installed
        return _sentencepiece(h)
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model={kind!r} must be 'gpt2' (byte-level "
                         "BPE) or 'llama' (sentencepiece, through transformers)")  # fmt: skip
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{path}: tokenizer.ggml.pre={pre!r} must be one of "
                         f"{sorted(PRE_TOKENIZERS)}")  # fmt: skip
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
    for key, val in (("tokens", tokens), ("merges", merges)):
        if not isinstance(val, list) or not all(isinstance(t, str) for t in val[:1]):
            raise ValueError(f"{path}: tokenizer.ggml.{key} must be an array of strings "
                             f"for a gpt2 tokenizer (got {type(val).__name__})")  # fmt: skip
    types = meta.get("tokenizer.ggml.token_type")
    types = [1] * len(tokens) if types is None else [int(t) for t in types]
    if len(types) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries, must "
                         f"have one per token ({len(tokens)})")  # fmt: skip
    spell = byte_alphabet()
    chars = set(spell.values())
    vocab = {}
    for i, t in enumerate(tokens):
        vocab[t if set(t) <= chars else "".join(spell[b] for b in t.encode("utf-8"))] = i
    pairs = []
    for j, m in enumerate(merges):
        a, sep, b = m.partition(" ")
        if not (sep and a and b) or " " in b:
            raise ValueError(f"{path}: tokenizer.ggml.merges[{j}]={m!r} must be two tokens "
                             "separated by one space")  # fmt: skip
        pairs.append((a, b))
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    except Exception as e:  # tokenizers raises its own exception types
        raise ValueError(f"{path}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens "
                         f"({e})") from None  # fmt: skip
    split = PRE_TOKENIZERS[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=True) if ty == CONTROL and set(t) <= chars
    ])  # fmt: skip
    tok.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=True) if ty == USER_DEFINED and t in vocab
    ])  # fmt: skip
    ends = []
    for which in ("bos", "eos"):
        i = meta.get(f"tokenizer.ggml.{which}_token_id")
        if meta.get(f"tokenizer.ggml.add_{which}_token") is True:
            if not isinstance(i, int) or not 0 <= i < len(tokens):
                raise ValueError(f"{path}: tokenizer.ggml.{which}_token_id={i!r} must be a "
                                 f"token id, as add_{which}_token is true")  # fmt: skip
            ends.append((which, tokens[i], i))
    if ends:
        bos = [f"{t}:0" for w, t, _ in ends if w == "bos"]
        eos = [f"{t}:0" for w, t, _ in ends if w == "eos"]
        tok.post_processor = TemplateProcessing(
            single=[*bos, "$A:0", *eos],
            pair=[*bos, "$A:0", *eos, *(b[:-1] + "1" for b in bos), "$B:1",
                  *(e[:-1] + "1" for e in eos)],
            special_tokens=[(t, i) for _, t, i in dict.fromkeys(ends)],
        )  # fmt: skip
    return tok
