"""Synthetic passkey-retrieval documents: a 5-digit key hidden at a random depth in filler.

The same text format serves training (``passkey_document``, mixed into the proxy
model's corpus so that it learns long-range retrieval) and evaluation
(``passkey_prompt`` + ``score_passkey``). Everything is a pure function of the
``np.random.Generator`` it is given, so a seed fixes every document and prompt.

Text layout (pieces joined without separators; every piece after the first
starts with a space, so a byte-level BPE tokenizes the joined text exactly as the
concatenation of its pieces' tokens -- ``passkey_pieces`` exploits that)::

    PREAMBLE  filler...  " The pass key is 12345. Remember it. 12345 is the pass key."
    filler...  " What is the pass key? The pass key is 12345."
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
    "The river runs to the sea.",
    "A bird sings in the old tree.",
    "The road is long and quiet.",
    "Snow falls on the hills in winter.",
    "The clock on the wall ticks slowly.",
    "Bread is baked early in the morning.",
    "The wind moves the tall grass.",
    "A small boat rests on the lake.",
    "The stars come out at night.",
    "Rain taps on the window.",
    "The garden has many flowers.",
)
PREAMBLE = "There is a pass key hidden in the following text. Find it and remember it."
_DIGITS = "0123456789"
QUESTION = " What is the pass key? The pass key is"


def needle(key: str) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key."


def _key(rng: np.random.Generator) -> str:
    return str(int(rng.integers(10000, 100000)))


def passkey_pieces(rng: np.random.Generator, n_filler: int) -> tuple[list[str], str]:
    """The pieces of one training document (their concatenation is the text) and its key.

    Draws from ``rng`` in a fixed order: the key, the needle's depth, the filler sentences.
    """
    if isinstance(n_filler, bool) or not isinstance(n_filler, int | np.integer) or n_filler < 0:
        raise ValueError(f"{n_filler=} must be a non-negative int")
    key = _key(rng)
    depth = int(rng.integers(0, n_filler + 1))
    idx = rng.integers(0, len(FILLER), size=n_filler)
    filler = [" " + FILLER[i] for i in idx]
    pieces = [PREAMBLE, *filler[:depth], needle(key), *filler[depth:], QUESTION, f" {key}."]
    return pieces, key


def passkey_document(rng: np.random.Generator, n_filler: int) -> str:
    """A full training document: filler with the needle at a random depth, question, answer."""
    return "".join(passkey_pieces(rng, n_filler)[0])


def _prompt_text(key: str, filler: list[str], depth: float) -> str:
    at = int(round(depth * len(filler)))
    return "".join([PREAMBLE, *filler[:at], needle(key), *filler[at:], QUESTION])


def passkey_prompt(
    encode: Callable[[str], list[int]], n_tokens: int, depth: float, rng: np.random.Generator
) -> tuple[list[int], str]:
    """Prompt ids of at most ``n_tokens`` (as many filler sentences as fit) and the answer.

    The needle sits at fraction ``depth`` (0 = right after the preamble, 1 = right
    before the question) of the filler sentences; the prompt ends with
    "What is the pass key? The pass key is" and the model should continue with the
    5 digits. ``encode`` maps text to ids as the model sees them (a tokenizer that
    adds BOS should add it here). Draws from ``rng``: the key, then the filler.
    """
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int | np.integer) or n_tokens < 1:
        raise ValueError(f"{n_tokens=} must be a positive int")
    if not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"{depth=} must lie in [0, 1]")
    key = _key(rng)
    base = len(encode(_prompt_text(key, [], depth)))
    if base > n_tokens:
        raise ValueError(f"{n_tokens=} must be at least {base} (the prompt without filler)")
    # filler sentences drawn once (enough for any length), prefix used: deterministic in rng
    per = max(1, min(len(encode(" " + s)) for s in FILLER) - len(encode("")))
    pool = [" " + FILLER[i] for i in rng.integers(0, len(FILLER), size=(n_tokens - base) // per)]
    lo, hi = 0, len(pool)  # largest count whose prompt fits: token count grows with the count
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(encode(_prompt_text(key, pool[:mid], depth))) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return list(encode(_prompt_text(key, pool[:lo], depth))), key


def score_passkey(generated_text: str, answer: str) -> bool:
    """True when the first 5 digits in the generated text equal the answer."""
    if not (isinstance(answer, str) and len(answer) == 5 and set(answer) <= set(_DIGITS)):
        raise ValueError(f"{answer=} must be a 5-digit string")
    digits = [c for c in generated_text if c in _DIGITS][:5]
    return "".join(digits) == answer
