"""Shared pieces of the evaluation: method names, statistics, windows, progress, tables.

Method names (``parse_method``): ``bf16`` or ``{method}{bits}`` with ``method`` one
of kivi / ots_only / rotation_only / oscar and ``bits`` in {1, 2, 3, 4, 8}, followed
by optional suffixes, in any order::

    _pertoken   one token norm over all KV heads (the official CUDA code's granularity)
    _r{R}       residual length R (default: the evaluation's, 128)
    _g{G}       group size G (default: the evaluation's, 32)
    _randorth   random orthogonal rotation instead of Hadamard
    _randhad    randomized Hadamard (random signs) instead of Hadamard
    _normfp32   float32 token norms instead of bfloat16

e.g. ``kivi2``, ``oscar2_pertoken``, ``oscar2_r0``, ``oscar2_g64_randorth``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import time
from collections.abc import Callable

import numpy as np

import oscar_jax as oj
from oscar_jax import methods as oscar_methods

QUANT_METHODS = ("kivi", "ots_only", "rotation_only", "oscar")
# The list: bf16; the four methods at 2 and 4 bits; both token-norm granularities
# (only the methods with token scaling have a norm, so only they get a _pertoken twin).
DEFAULT_METHODS = (
    "bf16", "kivi2", "ots_only2", "ots_only2_pertoken", "rotation_only2", "oscar2",
    "oscar2_pertoken", "kivi4", "ots_only4", "ots_only4_pertoken", "rotation_only4", "oscar4",
    "oscar4_pertoken",
)  # fmt: skip
_NAME = re.compile(r"^(kivi|ots_only|rotation_only|oscar)(\d+)((?:_[a-z0-9]+)*)$")


@dataclasses.dataclass(frozen=True)
class Method:
    """A named KV-cache method: its display name and its (validated) cache config."""

    name: str
    kv: oj.KVQuantConfig

    @property
    def quantized(self) -> bool:
        return self.kv.quantized


def parse_method(name: str, residual_length: int = 128, group_size: int = 32) -> Method:
    """``"oscar2_pertoken"`` -> Method; ValueError naming the problem for a bad name."""
    if not isinstance(name, str):
        raise ValueError(f"method={name!r} must be a string such as 'oscar2'")
    name = name.strip()
    if name == "bf16":
        return Method("bf16", oj.preset("bf16"))
    ext = oscar_methods.parse_name(name, residual_length, group_size)  # comparison methods
    if ext is not None:
        return Method(name, ext)
    m = _NAME.match(name)
    if m is None:
        raise ValueError(
            f"method={name!r} must be 'bf16' or <method><bits>[_suffix...] with method in "
            f"{QUANT_METHODS} (e.g. 'kivi2', 'oscar2_pertoken', 'oscar2_r32_g64')"
        )
    method, bits, rest = m.group(1), int(m.group(2)), m.group(3)
    kw: dict = dict(bits=bits, residual_length=residual_length, group_size=group_size)
    for suf in filter(None, rest.split("_")):
        if suf == "pertoken":
            kw["norm_granularity"] = "per_token"
        elif suf == "randorth":
            kw["rotation"] = "random_orthogonal"
        elif suf == "randhad":
            kw["rotation"] = "randomized_hadamard"
        elif suf == "normfp32":
            kw["norm_dtype"] = "float32"
        elif re.fullmatch(r"r\d+", suf):
            kw["residual_length"] = int(suf[1:])
        elif re.fullmatch(r"g\d+", suf):
            kw["group_size"] = int(suf[1:])
        else:
            raise ValueError(
                f"method={name!r}: unknown suffix {suf!r} (known: pertoken, r<R>, g<G>, "
                "randorth, randhad, normfp32)"
            )
    if "rotation" in kw and method in ("kivi", "ots_only"):
        raise ValueError(f"method={name!r}: {method} does not rotate, so a rotation suffix is moot")
    try:
        return Method(name, oj.preset(method, **kw))
    except ValueError as e:
        raise ValueError(f"method={name!r}: {e}") from e


def parse_methods(spec, residual_length: int = 128, group_size: int = 32) -> list[Method]:
    """Comma-separated names (or a list) -> Methods, duplicates dropped, order kept."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [n.strip() for n in names if n and n.strip()]
    if not names:
        raise ValueError(f"methods={spec!r} must name at least one method")
    out, seen = [], set()
    for n in names:
        if n not in seen:
            seen.add(n)
            out.append(parse_method(n, residual_length, group_size))
    return out


def ablation_methods(
    base: str = "oscar2", residual_length: int = 128, group_size: int = 32,
    r_values=(0, 32, 128), g_values=(32, 64, 128),
) -> list[tuple[str, str, str]]:  # fmt: skip
    """(factor, setting, method name) of the ablations the paper leaves open, around ``base``.

    The base runs at the evaluation's R and G with Hadamard rotation, bf16 norms and one
    norm per (token, KV head); each row changes one factor (a row at the base's own
    setting is the base): R, G, the rotation's kind, the norms' dtype and their
    granularity (per head, or one per token over all KV heads as the official code).
    """
    rows = [("residual R", str(r), base if r == residual_length else f"{base}_r{r}")
            for r in r_values]  # fmt: skip
    rows += [("group G", str(g), base if g == group_size else f"{base}_g{g}") for g in g_values]
    rows += [
        ("rotation", "hadamard", base),
        ("rotation", "randomized_hadamard", f"{base}_randhad"),
        ("rotation", "random_orthogonal", f"{base}_randorth"),
        ("token norm dtype", "bfloat16", base),
        ("token norm dtype", "float32", f"{base}_normfp32"),
        ("token norm granularity", "per_head", base),
        ("token norm granularity", "per_token (one over all KV heads)", f"{base}_pertoken"),
    ]
    return rows


# -- statistics ---------------------------------------------------------------------
def bootstrap_ppl(
    nll_sum: np.ndarray, count: np.ndarray, ref_nll_sum=None, n_boot: int = 2000, seed: int = 0
) -> dict:
    """Perplexity exp(sum nll / sum count) over windows, with a 95% bootstrap CI over windows.

    With ``ref_nll_sum`` (the same windows under the reference method) also the paired
    difference ppl - ppl_ref and its CI (the same resampled windows for both). A CI
    needs at least two windows; with one it is NaN.
    """
    nll_sum, count = np.asarray(nll_sum, np.float64), np.asarray(count, np.float64)
    n = len(nll_sum)
    if n == 0 or nll_sum.shape != count.shape:
        raise ValueError(f"nll_sum.shape={nll_sum.shape} must be non-empty and equal count's")
    ppl = float(np.exp(nll_sum.sum() / count.sum()))
    out = {"ppl": ppl, "ppl_lo": math.nan, "ppl_hi": math.nan, "windows": n,
           "tokens": int(count.sum())}  # fmt: skip
    idx = np.random.default_rng(seed).integers(0, n, (n_boot, n)) if n > 1 else None
    if idx is not None:
        b = np.exp(nll_sum[idx].sum(1) / count[idx].sum(1))
        out["ppl_lo"], out["ppl_hi"] = (float(x) for x in np.percentile(b, [2.5, 97.5]))
    if ref_nll_sum is not None:
        ref = np.asarray(ref_nll_sum, np.float64)
        out["delta_vs_bf16"] = ppl - float(np.exp(ref.sum() / count.sum()))
        out["delta_lo"] = out["delta_hi"] = math.nan
        if idx is not None:
            c = count[idx].sum(1)
            d = np.exp(nll_sum[idx].sum(1) / c) - np.exp(ref[idx].sum(1) / c)
            out["delta_lo"], out["delta_hi"] = (float(x) for x in np.percentile(d, [2.5, 97.5]))
    return out


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float, float]:
    """Rate k/n and its 95% Wilson score interval (NaNs for n = 0)."""
    if n == 0:
        return math.nan, math.nan, math.nan
    p = k / n
    den = 1 + z * z / n
    c = (p + z * z / (2 * n)) / den
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return p, max(0.0, c - h), min(1.0, c + h)


# -- data ---------------------------------------------------------------------------
def make_encode(tokenizer, bos: int | None) -> Callable[[str], list[int]]:
    """Text -> ids as the model saw them in training: one ``bos`` first, then the text
    without the tokenizer's own special tokens (a post-processor's BOS would come twice
    if it differed from ``bos``, and its EOS would end the prompt). With ``bos`` None the
    tokenizer's own special tokens are kept."""

    def encode(text: str) -> list[int]:
        if bos is None:
            return list(tokenizer.encode(text).ids)
        return [bos, *tokenizer.encode(text, add_special_tokens=False).ids]

    return encode


def make_windows(tokens, ctx: int, max_windows: int | None = None, bos: int | None = None):
    """Non-overlapping windows [N, ctx] of a token stream, each starting at a BOS when possible.

    Documents in the held-out sample start with BOS: a window starts at the first BOS at
    or after the previous window's end (so that position 0 is a document start, as in
    training), or right at that end when ``bos`` is None or absent.
    """
    tok = np.asarray(tokens).reshape(-1).astype(np.int64)
    if ctx < 2:
        raise ValueError(f"{ctx=} must be >= 2")
    starts = np.flatnonzero(tok == bos) if bos is not None else np.zeros(0, np.int64)
    out, pos = [], 0
    while pos + ctx <= len(tok) and (max_windows is None or len(out) < max_windows):
        if len(starts):
            nxt = starts[np.searchsorted(starts, pos) :]
            if len(nxt) == 0 or nxt[0] + ctx > len(tok):
                break
            pos = int(nxt[0])
        out.append(tok[pos : pos + ctx])
        pos += ctx
    if not out:
        raise ValueError(
            f"the held-out sample ({len(tok)} tokens) holds no window of {ctx} tokens"
            + (f" starting with BOS={bos}" if bos is not None and len(starts) else "")
        )
    return np.stack(out).astype(np.int32)


# -- progress and tables ---------------------------------------------------------------
class Progress:
    """A plain-text progress bar on stderr (redrawn in place on a terminal, else line by line)."""

    def __init__(self, total: int, desc: str, enabled: bool = True, stream=None):
        self.total, self.desc, self.n = max(int(total), 1), desc, 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = self.last = time.perf_counter()
        self._draw(force=self.tty)

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not (force or self.tty or now - self.last >= 10 or self.n == self.total):
            return
        self.last = now
        el = now - self.t0
        eta = f"{el / self.n * (self.total - self.n):4.0f}s" if self.n else "   ?"
        bar = "#" * int(24 * self.n / self.total)
        line = f"{self.desc} [{bar:<24}] {self.n}/{self.total} {el:5.0f}s eta {eta}"
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and self.n == self.total:
            self.stream.write("\n")
        self.stream.flush()

    def update(self, k: int = 1) -> None:
        self.n = min(self.total, self.n + k)
        self._draw()


def fmt(x, digits: int = 4) -> str:
    if isinstance(x, float | np.floating):
        return "nan" if math.isnan(x) else f"{x:.{digits}g}"
    return str(x)


def md_table(
    rows: list[dict], cols: list[str], headers: list[str] | None = None,
    formats: dict[str, str] | None = None,
) -> str:  # fmt: skip
    """A Markdown table of ``rows`` (dicts) over ``cols``.

    ``formats``: a format spec per column (e.g. ``{"ppl": ".2f"}``) for the floats of that
    column, so that a column has one precision; other columns get 4 significant digits.
    """
    formats = formats or {}

    def cell(r, c):
        x = r.get(c, "")
        if c in formats and isinstance(x, float | np.floating) and not math.isnan(x):
            return f"{x:{formats[c]}}"
        return fmt(x)

    out = ["| " + " | ".join(headers or cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(cell(r, c) for c in cols) + " |")
    return "\n".join(out)


def ci(lo, hi, digits: int = 4, spec: str | None = None) -> str:
    """'[lo, hi]' (``digits`` significant digits, or format ``spec`` such as ".2f") or
    'n/a' when the interval is undefined."""
    if lo is None or (isinstance(lo, float) and math.isnan(lo)):
        return "n/a"
    spec = spec or f".{digits}g"
    return f"[{lo:{spec}}, {hi:{spec}}]"
