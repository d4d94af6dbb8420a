"""Offline natural-language corpus for the proxy model: gather, clean, dedupe, split, tokenize.

Text that nobody in this project wrote and that every machine of this image
holds: GNU info manuals, the Python language reference (``pydoc_data``), the
licences of /usr/share/common-licenses, English man pages, Debian package
documentation (README/NEWS/copyright/changelog/txt/md/rst/html under
/usr/share/doc) and the descriptions and docs of installed Python packages.
Files are read in a fixed order (source priority, then path); paragraphs already
seen are dropped (licences and boilerplate repeat across packages) and so are
code-like paragraphs; documents that end up short are dropped. The split is by
file path (sha256), so a file's documents all land on one side.

``python3 -m oscar_proxy.corpus --out data/corpus`` writes ``train.npy.xz`` /
``heldout.npy.xz`` (uint16 ids, each document ``<s> ... </s>``), ``tokenizer.json``
(byte-level BPE trained on the train split) and ``manifest.json`` (every file
with its sha256, split and token count, and hashes of the whole corpus).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import sys
import time

import numpy as np

from oscar_proxy.textclean import (
    clean_text,
    docstrings_text,
    html_to_text,
    info_nodes,
    is_prose,
    man_to_text,
    pod_to_text,
)

SITE = "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages"
STDLIB = "/root/.pyenv/versions/3.11.7/lib/python3.11"
PERL_DIRS = ("/usr/share/perl", "/usr/share/perl5", "/usr/lib/x86_64-linux-gnu/perl",
             "/usr/lib/x86_64-linux-gnu/perl-base", "/usr/lib/x86_64-linux-gnu/perl5")  # fmt: skip
BOS, EOS = "<s>", "</s>"
SPECIAL = (BOS, EOS)
DOC_EXTS = (".txt", ".md", ".rst", ".html", ".htm")
DOC_NAMES = ("readme", "news", "faq", "todo", "copyright", "changelog", "history", "bugs")
MAX_DOC_CHARS = 200_000
MAX_CHANGELOG_CHARS = 24_000  # the newest entries: changelogs would otherwise dominate
MIN_DOC_CHARS = 400


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        raw = f.read()
    return gzip.decompress(raw) if path.endswith(".gz") else raw


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def _walk(root: str):
    """Regular (non-symlink) files under root, sorted."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not os.path.islink(os.path.join(d, x)))
        for f in files:
            p = os.path.join(d, f)
            if os.path.isfile(p) and not os.path.islink(p):
                out.append(p)
    return sorted(out)


def _base(path: str) -> str:
    b = os.path.basename(path).lower()
    return b[:-3] if b.endswith(".gz") else b


def _doc_kind(path: str) -> str | None:
    b = _base(path)
    if b.endswith((".html", ".htm")):
        return "html"
    if b.endswith(DOC_EXTS):
        return "text"
    if any(b.startswith(n) for n in DOC_NAMES) and not b.endswith((".json", ".png", ".gif")):
        return "changelog" if b.startswith(("changelog", "history")) else "text"
    return None


def candidates() -> list[tuple[str, str, str]]:
    """(source, path, kind) of every file to read, in the corpus order."""
    out = []
    topics = os.path.join(STDLIB, "pydoc_data", "topics.py")
    if os.path.isfile(topics):
        out.append(("python-reference", topics, "pydoc"))
    for p in _walk("/usr/share/common-licenses"):
        out.append(("licenses", p, "text"))
    for p in _walk("/usr/share/info"):
        if p.endswith(".gz"):
            out.append(("info", p, "info"))
    for sec in range(1, 9):
        for p in _walk(f"/usr/share/man/man{sec}"):
            if not os.path.basename(p).startswith("gcloud"):
                out.append(("man", p, "man"))
    for root in PERL_DIRS:
        for p in _walk(root):
            if p.endswith((".pm", ".pod")):
                out.append(("perl-pod", p, "pod"))
    for p in _walk("/usr/share/doc"):
        kind = _doc_kind(p)
        if kind:
            out.append(("debian-doc", p, kind))
    if os.path.isdir(SITE):
        for p in _walk(SITE):
            rel = os.path.relpath(p, SITE)
            if rel.endswith(".dist-info/METADATA"):
                out.append(("python-packages", p, "metadata"))
            elif ".dist-info" not in rel and rel.lower().endswith((".md", ".rst", ".txt")):
                out.append(("python-packages", p, "text"))
    for root in (STDLIB, SITE):
        for p in _walk(root):
            rel = os.path.relpath(p, root)
            parts = rel.split(os.sep)
            if (p.endswith(".py") and not {"test", "tests", "site-packages"} & set(parts[:-1])
                    and not parts[-1].startswith("test_")):  # fmt: skip
                out.append(("python-docstrings", p, "docstrings"))
    # last: 16k generated Google Cloud CLI pages (boilerplate paragraphs are deduplicated)
    for p in _walk("/usr/share/man/man1"):
        if os.path.basename(p).startswith("gcloud"):
            out.append(("gcloud-man", p, "man"))
    return out


def _metadata_body(text: str) -> str:
    """The long description of a dist-info METADATA file (after the header block)."""
    head, sep, body = text.partition("\n\n")
    return body if sep else ""


def read_documents(source: str, path: str, kind: str) -> list[str]:
    """The raw documents (before paragraph filtering) of one file."""
    raw = _read(path)
    if b"\x00" in raw[:4096]:
        return []
    text = _decode(raw)
    if kind == "pydoc":
        ns: dict = {}
        exec(compile(text, path, "exec"), ns)  # a dict literal of the stdlib's help topics
        return [ns["topics"][k] for k in sorted(ns["topics"])]
    if kind == "pod":
        return [pod_to_text(text)]
    if kind == "docstrings":
        return [docstrings_text(text)]
    if kind == "info":
        return info_nodes(text)
    if kind == "man":
        return [man_to_text(text)]
    if kind == "html":
        return [html_to_text(text)]
    if kind == "metadata":
        return [_metadata_body(text)]
    if kind == "changelog":
        return [text[:MAX_CHANGELOG_CHARS]]
    return [text]


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def gather(min_chars: int = MIN_DOC_CHARS, log=print) -> tuple[list[dict], list[str]]:
    """-> (file records, documents); each record lists the indices of its documents."""
    seen: set[bytes] = set()
    records, docs = [], []
    cands = candidates()
    t0 = time.time()
    for n, (source, path, kind) in enumerate(cands):
        if n % 2000 == 0:
            log(f"  {n}/{len(cands)} files, {len(docs)} docs, {time.time() - t0:.0f}s")
        try:
            raw_docs = read_documents(source, path, kind)
        except (OSError, EOFError, ValueError, SyntaxError, KeyError, RecursionError):
            continue
        ids = []
        for doc in raw_docs:
            keep = []
            for para in _paragraphs(clean_text(doc)[:MAX_DOC_CHARS]):
                key = hashlib.sha256(" ".join(para.split()).lower().encode()).digest()[:16]
                if len(para) >= 40 and key in seen:
                    continue
                seen.add(key)
                if is_prose(para):
                    keep.append(para.strip("\n"))
            text = "\n\n".join(keep)
            if len(text) >= min_chars:
                ids.append(len(docs))
                docs.append(text)
        if ids:
            with open(path, "rb") as f:
                sha = hashlib.sha256(f.read()).hexdigest()
            records.append(dict(path=path, source=source, sha256=sha[:16], docs=ids))
    return records, docs


def heldout_of(path: str, frac: float) -> bool:
    h = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "little")
    return h / 2**64 < frac


def train_tokenizer(texts, vocab_size: int):
    """Byte-level BPE (GPT-2 pre-tokenization) with <s>/</s>; encode() prepends <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def encode_docs(tok, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """-> (uint16 stream of <s> doc </s> ..., int64 start offset of each document)."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    if tok.get_vocab_size() > 65535:
        raise ValueError(f"vocab_size={tok.get_vocab_size()} must fit uint16")
    enc = tok.encode_batch(texts, add_special_tokens=False)
    lens = np.array([len(e.ids) + 2 for e in enc], np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    out = np.empty(int(lens.sum()), np.uint16)
    for s, e in zip(starts, enc, strict=True):
        out[s] = bos
        out[s + 1 : s + 1 + len(e.ids)] = e.ids
        out[s + 1 + len(e.ids)] = eos
    return out, starts


def save_xz(path: str, arr: np.ndarray) -> str:
    """np.save into an xz file; returns the sha256 of the uncompressed .npy bytes."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    raw = buf.getvalue()
    with open(path, "wb") as f:
        f.write(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME))
    return hashlib.sha256(raw).hexdigest()


def load_xz(path: str) -> np.ndarray:
    with open(path, "rb") as f:
        return np.load(io.BytesIO(lzma.decompress(f.read())), allow_pickle=False)


def load_split(data_dir: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(uint16 token stream, document start offsets) of 'train' or 'heldout'; hash-checked."""
    if split not in ("train", "heldout"):
        raise ValueError(f"{split=} must be 'train' or 'heldout'")
    with open(os.path.join(data_dir, "manifest.json")) as f:
        man = json.load(f)
    arr = load_xz(os.path.join(data_dir, f"{split}.npy.xz"))
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    got = hashlib.sha256(buf.getvalue()).hexdigest()
    if got != man["splits"][split]["npy_sha256"]:
        raise ValueError(f"{data_dir}/{split}.npy.xz does not match manifest.json ({got})")
    starts = load_xz(os.path.join(data_dir, f"{split}_starts.npy.xz"))
    return arr, starts


def write_corpus(
    out: str, tok, train: list[str], heldout: list[str], files: list, extra: dict | None = None
) -> dict:
    """Tokenize both splits, write the arrays, tokenizer.json and manifest.json; -> manifest."""
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    splits = {}
    text_hash = hashlib.sha256()
    for name, texts in (("train", train), ("heldout", heldout)):
        ids, starts = encode_docs(tok, texts)
        sha = save_xz(os.path.join(out, f"{name}.npy.xz"), ids)
        save_xz(os.path.join(out, f"{name}_starts.npy.xz"), starts)
        for t in texts:
            text_hash.update(t.encode() + b"\x00")
        xz_bytes = os.path.getsize(os.path.join(out, f"{name}.npy.xz"))
        splits[name] = dict(docs=len(texts), bytes=sum(len(t.encode()) for t in texts),
                            tokens=int(ids.size), npy_sha256=sha, xz_bytes=xz_bytes)  # fmt: skip
    listing = "".join(f"{f[0]}\t{f[1]}\n" for f in files).encode()
    with open(os.path.join(out, "tokenizer.json"), "rb") as f:
        tok_sha = hashlib.sha256(f.read()).hexdigest()
    manifest = dict(
        description="oscar_proxy.corpus: offline documentation text; files: [path, sha256 "
        "(first 16 "
        "hex digits), source, split, documents, characters]",
        **(extra or {}), vocab_size=tok.get_vocab_size(),
        files_sha256=hashlib.sha256(listing).hexdigest(), text_sha256=text_hash.hexdigest(),
        tokenizer_sha256=tok_sha, splits=splits,
        sources={s: dict(files=sum(1 for f in files if f[2] == s),
                         docs=sum(f[4] for f in files if f[2] == s),
                         chars=sum(f[5] for f in files if f[2] == s))
                 for s in sorted({f[2] for f in files})},  # fmt: skip
        files=files,
    )  # fmt: skip
    write_manifest(os.path.join(out, "manifest.json"), manifest)
    return manifest


def write_manifest(path: str, manifest: dict) -> None:
    """JSON with one line per file (the file list is most of it)."""
    head = {k: v for k, v in manifest.items() if k != "files"}
    body = json.dumps(head, indent=1)[:-2]
    lines = ",\n".join(json.dumps(f, separators=(",", ":")) for f in manifest["files"])
    text = f'{body},\n "files": [\n{lines}\n]\n}}\n'.encode()
    with open(path, "wb") as f:  # .gz: gzip without a timestamp (same bytes every build)
        f.write(gzip.compress(text, 9, mtime=0) if path.endswith(".gz") else text)


def build(out: str, vocab_size: int, heldout_frac: float, max_chars: int, log=print) -> dict:
    """Gather, split, train the tokenizer, tokenize and write everything to ``out``."""
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    records, docs = gather(log=log)
    # a character budget, in corpus order (priority sources first): bounds the carried size
    total, kept = 0, []
    for r in records:
        n = sum(len(docs[i]) for i in r["docs"])
        if total + n > max_chars:
            break
        total += n
        kept.append(r)
    records = kept
    log(f"gathered {len(records)} files, {sum(len(r['docs']) for r in records)} docs, "
        f"{total / 1e6:.1f} M chars in {time.time() - t0:.0f}s")  # fmt: skip
    split_docs: dict[str, list[str]] = {"train": [], "heldout": []}
    for r in records:
        r["split"] = "heldout" if heldout_of(r["path"], heldout_frac) else "train"
        split_docs[r["split"]].extend(docs[i] for i in r["docs"])
    tok = train_tokenizer(split_docs["train"], vocab_size)
    log(f"tokenizer: vocab {tok.get_vocab_size()} ({time.time() - t0:.0f}s)")
    files = [[r["path"], r["sha256"], r["source"], r["split"], len(r["docs"]),
              sum(len(docs[i]) for i in r["docs"])] for r in records]  # fmt: skip
    extra = dict(python=sys.version.split()[0], heldout_frac=heldout_frac, max_chars=max_chars,
                 min_doc_chars=MIN_DOC_CHARS)  # fmt: skip
    manifest = write_corpus(out, tok, split_docs["train"], split_docs["heldout"], files, extra)
    for name, sp in manifest["splits"].items():
        log(f"{name}: {sp['docs']} docs, {sp['bytes'] / 1e6:.1f} MB, {sp['tokens'] / 1e6:.2f} M "
            f"tokens, xz {sp['xz_bytes'] / 2**20:.1f} MiB")  # fmt: skip
    log(f"done in {time.time() - t0:.0f}s")
    return manifest


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="data/corpus")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--heldout-frac", type=float, default=0.03)
    ap.add_argument("--max-chars", type=int, default=200_000_000)
    ap.add_argument("--manifest-copy", default="oscar_proxy/bundled/corpus_manifest.json.gz",
                    help="where to copy manifest.json (committed); '' for none")  # fmt: skip
    ap.add_argument(
        "--sample-copy",
        default="oscar_proxy/bundled/heldout_sample.npy",
        help="a held-out sample (uint16, <= 256K tokens) to commit; '' for none",
    )
    a = ap.parse_args(argv)
    if not 0.0 < a.heldout_frac < 0.5:
        raise ValueError(f"heldout_frac={a.heldout_frac} must lie in (0, 0.5)")
    if not 256 + len(SPECIAL) < a.vocab_size <= 65535:
        raise ValueError(f"vocab_size={a.vocab_size} must lie in (258, 65535]")
    man = build(a.out, a.vocab_size, a.heldout_frac, a.max_chars)
    if a.manifest_copy:
        os.makedirs(os.path.dirname(a.manifest_copy) or ".", exist_ok=True)
        write_manifest(a.manifest_copy, man)
    if a.sample_copy:
        ids, starts = load_split(a.out, "heldout")
        end = int(starts[np.searchsorted(starts, 1 << 18, side="right") - 1]) or ids.size
        os.makedirs(os.path.dirname(a.sample_copy) or ".", exist_ok=True)
        np.save(a.sample_copy, ids[: min(end, 1 << 18)])


if __name__ == "__main__":
    main()
