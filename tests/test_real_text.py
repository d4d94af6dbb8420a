"""The evaluation's text path measures what it says: one BOS per document, never two.

GGUF tokenizers (``models.gguf_tokenizer``) add BOS themselves when the file sets
``add_bos_token`` (Llama 3 files do; SmolLM2 and Qwen2.5 do not); the held-out text
loader, the NIAH prompts and the CLI's re-encoding of the bundled documents add the
model's BOS explicitly, so each must encode without the tokenizer's own special tokens.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_gguf import _DIR, write_gguf

import models
import oscar_eval
from oscar_cli import cli
from oscar_eval.common import make_encode, make_windows

DOCS = ["The cat sat on the mat. It was happy there.", "A second one, with numbers 12 and 345."]


@pytest.fixture(scope="module", params=[False, True], ids=["no_bos", "add_bos"])
def gguf_model(request):
    path = write_gguf(os.path.join(_DIR, f"text_{request.param}.gguf"), add_bos=request.param,
                      layers=1)[0]  # fmt: skip
    m = models.from_pretrained(path)
    assert (m.tokenizer.encode("x").ids[0] == m.config.bos_token_id) == request.param
    return m


def _doc_starts(ids: np.ndarray, bos: int) -> list[int]:
    return np.flatnonzero(ids == bos).tolist()


def test_heldout_text_has_one_bos_per_document(gguf_model, tmp_path):
    m, bos = gguf_model, gguf_model.config.bos_token_id
    f = tmp_path / "heldout.txt"
    f.write_text("\n\n".join(DOCS), encoding="utf-8")
    ids = oscar_eval.load_heldout(str(f), m.tokenizer, bos)
    starts = _doc_starts(ids, bos)
    assert len(starts) == len(DOCS)
    assert starts[0] == 0 and not np.any((ids[1:] == bos) & (ids[:-1] == bos))
    first = m.tokenizer.encode(DOCS[0], add_special_tokens=False).ids
    assert ids[1 : 1 + len(first)].tolist() == first


def test_niah_prompt_starts_with_one_bos(gguf_model):
    m, bos = gguf_model, gguf_model.config.bos_token_id
    enc = make_encode(m.tokenizer, bos)
    ids = enc(DOCS[0])
    assert ids[0] == bos and ids[1] != bos and ids.count(bos) == 1
    assert ids[1:] == m.tokenizer.encode(DOCS[0], add_special_tokens=False).ids


def test_bundled_text_windows_start_with_one_bos(gguf_model):
    m, bos = gguf_model, gguf_model.config.bos_token_id
    ids = cli._bundled_text_for(m)
    assert ids[0] == bos and not np.any((ids[1:] == bos) & (ids[:-1] == bos))
    win = make_windows(ids, 256, 4, bos)
    assert np.all(win[:, 0] == bos) and np.all(win[:, 1] != bos)
