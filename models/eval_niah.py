"""Needle in a haystack: passkey exact-match rate by context length and needle depth.

Prompts come from ``models.passkey.passkey_prompt`` with one generator per cell,
``np.random.default_rng((seed, length, depth_percent, trial))``, so a cell's
prompts do not depend on which other cells run (the demo's few prompts are the
full grid's) and every method sees the same prompts. The seed defaults to one
that the training corpus does not use. Each method decodes greedily through
its real cache (``models.generate``: full-precision prefill, then every new
token appends to the quantized cache and attends to it), prompts of one length
batched over depths and trials.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from models.eval_common import Method, Progress, wilson
from models.generate import bucket_length, generate
from models.model import CausalLM
from models.passkey import passkey_prompt, score_passkey

NIAH_SEED = 918_273  # not a seed of the training corpus (which draws from its own seeds)
LENGTHS = (512, 1024, 2048, 4096)
DEPTHS = tuple(range(0, 101, 10))  # percent


def make_encode(tokenizer, bos: int | None) -> Callable[[str], list[int]]:
    """Text -> ids as the model saw them in training: BOS first (added if the tokenizer won't)."""

    def encode(text: str) -> list[int]:
        ids = list(tokenizer.encode(text).ids)
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    return encode


def build_prompts(encode, lengths, depths, trials: int, seed: int = NIAH_SEED) -> list[dict]:
    """One dict per (length, depth %, trial): ids, answer, length, depth."""
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"{trials=} must be a positive int")
    out = []
    for n in lengths:
        for d in depths:
            if not 0 <= d <= 100:
                raise ValueError(f"depth={d} must be a percentage in [0, 100]")
            for i in range(trials):
                rng = np.random.default_rng((seed, int(n), int(d), i))
                ids, ans = passkey_prompt(encode, int(n), d / 100.0, rng)
                out.append(dict(ids=ids, answer=ans, length=int(n), depth=int(d), trial=i))
    return out


def _run_length(m, prompts, kv, batch, max_new, decode, stop_tokens, cache_dtype):
    """Greedy answers of prompts of one nominal length; returns [bool] exact matches."""
    longest = max(len(p["ids"]) for p in prompts)
    max_len = bucket_length(longest) + max_new
    hits = []
    for i in range(0, len(prompts), batch):
        part = prompts[i : i + batch]
        k = len(part)
        part = part + [part[-1]] * (batch - k)  # same shape for every batch: one compilation
        ids = np.zeros((batch, longest), np.int32)
        lens = np.array([len(p["ids"]) for p in part], np.int32)
        for r, p in enumerate(part):
            ids[r, : lens[r]] = p["ids"]
        out = np.asarray(generate(m, ids, max_new, kv=kv, lengths=lens, max_len=max_len,
                                  stop_tokens=stop_tokens, cache_dtype=cache_dtype))  # fmt: skip
        for r in range(k):
            hits.append(bool(score_passkey(decode(out[r]), part[r]["answer"])))
    return hits


def niah(
    m: CausalLM, methods: list[Method], prompts: list[dict], decode: Callable, *,
    batch: int = 11, max_new_tokens: int = 8, stop_tokens=None, cache_dtype=None,
    show_progress: bool = True,
):  # fmt: skip
    """Exact-match rates per method: overall (with a 95% Wilson CI), per length and per cell.

    ``decode(ids) -> text`` turns generated ids into text (``score_passkey`` reads the
    first five digits; cut the text at a stop token there). ``stop_tokens`` go to
    ``generate`` (None: the model's eos ids), so does ``cache_dtype``. Returns (rows,
    cells): one summary row per method, and one row per (method, length, depth).
    """
    if not prompts:
        raise ValueError("prompts must not be empty")
    lengths = sorted({p["length"] for p in prompts})
    rows, cells = [], []
    for mt in methods:
        bar = Progress(len(prompts), f"niah {mt.name:<19}", enabled=show_progress)
        res = []
        for n in lengths:
            ps = [p for p in prompts if p["length"] == n]
            hits = _run_length(m, ps, mt.kv, batch, max_new_tokens, decode, stop_tokens,
                               cache_dtype)  # fmt: skip
            res += [dict(p, hit=h) for p, h in zip(ps, hits, strict=True)]
            bar.update(len(ps))
        k = sum(r["hit"] for r in res)
        rate, lo, hi = wilson(k, len(res))
        row = {"method": mt.name, "bits": mt.kv.bits, "rate": rate, "rate_lo": lo,
               "rate_hi": hi, "prompts": len(res)}  # fmt: skip
        for n in lengths:
            hs = [r["hit"] for r in res if r["length"] == n]
            row[f"rate@{n}"] = sum(hs) / len(hs)
        rows.append(row)
        for n in lengths:
            for d in sorted({r["depth"] for r in res}):
                hs = [r["hit"] for r in res if r["length"] == n and r["depth"] == d]
                if hs:
                    cells.append({"method": mt.name, "length": n, "depth": d,
                                  "rate": sum(hs) / len(hs), "prompts": len(hs)})  # fmt: skip
    return rows, cells
