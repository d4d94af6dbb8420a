"""Training batches for the proxy model: packed corpus sequences plus passkey documents.

Every row is ``seq_len + 1`` tokens (inputs and shifted targets) and starts with
``<s>`` at position 0: rows begin at a document start (documents are packed one
after another, each ``<s> ... </s>``), or, inside a document longer than a row,
at a multiple of ``seq_len`` with ``<s>`` put in front. The last
``round(batch * passkey_frac)`` rows start with a passkey document
(``oscar_eval.passkey``) of uniformly random length, filled up with corpus documents.

``batch(step)`` is a pure function of (seed, step): the data position of a
resumed run is its step number, nothing else.
"""

from __future__ import annotations

import numpy as np

from oscar_eval import passkey


class Batches:
    """Deterministic batch source over a token stream (uint16) with document starts."""

    def __init__(
        self, tokens: np.ndarray, starts: np.ndarray, seq_len: int, batch: int, seed: int,
        passkey_frac: float, tokenizer, bos: int, eos: int, min_tail: int = 64,
    ):  # fmt: skip
        if seq_len < 64 or batch < 1:
            raise ValueError(f"{seq_len=} must be >= 64 and {batch=} >= 1")
        if not 0.0 <= passkey_frac <= 1.0:
            raise ValueError(f"{passkey_frac=} must lie in [0, 1]")
        if tokens.size < seq_len + 1 or starts.size == 0:
            raise ValueError(f"the stream ({tokens.size} tokens) must exceed {seq_len=}")
        self.tokens, self.starts = tokens, np.asarray(starts, np.int64)
        self.seq_len, self.batch_size, self.seed = seq_len, batch, seed
        self.tok, self.bos, self.eos = tokenizer, bos, eos
        self.n_pk = int(round(batch * passkey_frac))
        ends = np.append(self.starts[1:], tokens.size)
        pairs = zip(self.starts, ends, strict=True)
        cont = [np.arange(s + seq_len, e - min_tail, seq_len) for s, e in pairs if e - s > seq_len]
        self.points = np.sort(np.concatenate([self.starts, *cont]).astype(np.int64))
        self._perm: dict[int, np.ndarray] = {}
        self._cache: dict[str, list[int]] = {}
        fill = [self._ids(" " + s) for s in passkey.FILLER]
        self._fill_mean = float(np.mean([len(f) for f in fill]))
        self._overhead = len(self._ids("".join(passkey.passkey_pieces(
            np.random.default_rng(0), 0)[0]))) + 12  # fmt: skip

    def _ids(self, text: str) -> list[int]:
        if text in self._cache:
            return self._cache[text]
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if not any(c.isdigit() for c in text):
            self._cache[text] = ids
        return ids

    def _perm_of(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm:
            if len(self._perm) > 2:
                self._perm.pop(min(self._perm))
            rng = np.random.default_rng([self.seed, 0, epoch])
            self._perm[epoch] = rng.permutation(self.points.size)
        return self._perm[epoch]

    def _window(self, p: int, n: int) -> np.ndarray:
        return self.tokens[(p + np.arange(n)) % self.tokens.size].astype(np.int32)

    def text_rows(self, step: int, n: int) -> np.ndarray:
        """The n corpus rows [n, seq_len + 1] of ``step``."""
        g = step * (self.batch_size - self.n_pk) + np.arange(n, dtype=np.int64)
        epoch, idx = np.divmod(g, self.points.size)
        pts = np.array(
            [self._perm_of(int(e))[i] for e, i in zip(epoch, idx, strict=True)], np.int64
        )
        pts = self.points[pts] if pts.size else pts
        t = self.seq_len + 1
        rows = self.tokens[(pts[:, None] + np.arange(t)[None]) % self.tokens.size].astype(np.int32)
        mid = rows[:, 0] != self.bos
        if mid.any():  # inside a long document: <s> in front of the continuation
            rows[mid] = np.concatenate(
                [np.full((mid.sum(), 1), self.bos, np.int32), rows[mid, :-1]], axis=1
            )
        return rows

    def passkey_row(self, rng: np.random.Generator) -> np.ndarray:
        """<s> passkey document </s> followed by corpus documents, seq_len + 1 tokens."""
        t = self.seq_len + 1
        target = int(rng.integers(64, self.seq_len + 1))
        n_filler = max(0, int((target - self._overhead) / self._fill_mean))
        while True:
            state = rng.bit_generator.state
            pieces, _ = passkey.passkey_pieces(rng, n_filler)
            ids = [self.bos]
            for p in pieces:
                ids += self._ids(p)
            ids.append(self.eos)
            if len(ids) <= t or n_filler == 0:
                break
            rng.bit_generator.state = state  # same draws with fewer filler sentences
            n_filler = max(0, n_filler - (len(ids) - t) // 4 - 1)
        ids = np.asarray(ids[:t], np.int32)
        fill = self._window(int(self.starts[rng.integers(self.starts.size)]), t - ids.size)
        return np.concatenate([ids, fill])

    def batch(self, step: int) -> np.ndarray:
        """Rows [batch, seq_len + 1] int32 of training step ``step``."""
        if step < 0:
            raise ValueError(f"{step=} must be >= 0")
        rows = self.text_rows(step, self.batch_size - self.n_pk)
        if self.n_pk:
            rng = np.random.default_rng([self.seed, 1, step])
            pk = np.stack([self.passkey_row(rng) for _ in range(self.n_pk)])
            rows = np.concatenate([rows, pk])
        return rows


def heldout_rows(tokens: np.ndarray, starts: np.ndarray, n: int, seq_len: int) -> np.ndarray:
    """n rows [n, seq_len + 1] starting at the first n held-out document starts."""
    starts = np.asarray(starts, np.int64)
    if starts.size == 0 or tokens.size < seq_len + 1:
        raise ValueError(f"held-out set ({tokens.size} tokens) must exceed {seq_len=}")
    pts = starts[np.arange(n) % starts.size]
    t = seq_len + 1
    return tokens[(pts[:, None] + np.arange(t)[None]) % tokens.size].astype(np.int32)


def passkey_eval_set(tokenizer, seq_len: int, lengths, depths, per: int, seed: int):
    """Right-padded prompts + answers [N, seq_len] for teacher-forced passkey scoring.

    Returns (ids [N, seq_len] int32, answer_pos [N] (index of the first answer token),
    answer_ids [N, A] int32 padded with -1, lengths [N]).
    """
    rng = np.random.default_rng([seed, 2])

    def enc(s):  # with <s>, as a Llama tokenizer encodes a prompt
        return tokenizer.encode(s).ids

    rows, pos, ans, lens = [], [], [], []
    for n in lengths:
        for d in depths:
            for _ in range(per):
                ids, key = passkey.passkey_prompt(enc, int(n), float(d), rng)
                a = tokenizer.encode(" " + key, add_special_tokens=False).ids
                full = (ids + a)[:seq_len]
                rows.append(full + [0] * (seq_len - len(full)))
                pos.append(len(ids))
                ans.append(a)
                lens.append(int(n))
    width = max(len(a) for a in ans)
    ans_arr = np.full((len(ans), width), -1, np.int32)
    for i, a in enumerate(ans):
        ans_arr[i, : len(a)] = a
    return np.asarray(rows, np.int32), np.asarray(pos), ans_arr, np.asarray(lens)
