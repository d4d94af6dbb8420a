"""Why and when a row of ``models.generate`` stops: stop tokens, cache flags, bad logits.

A row stops at a stop token (after emitting it) or, from the step on where its
caches carry a ``FLAG_*`` (OR-ed over layers) or its logits are not finite, at
once: the token sampled from those logits is already replaced by the pad id. The
state is a per-row ``StopState`` in the ``lax.scan`` carry; ``advance`` is shared
by the scan and the step-by-step reference, so both stop alike.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import oscar_jax as oj

# info["stop_reason"] [B] int32: why a row stopped (the first reason wins).
STOP_NONE = 0  # did not stop: ran to max_new_tokens
STOP_TOKEN = 1  # emitted a stop token (eos); pad ids follow
STOP_CAPACITY = 2  # the cache was full (FLAG_OVERFLOW): the last token could not be stored
STOP_NONFINITE = 3  # a K/V of the row was NaN/Inf or overflowed (FLAG_NONFINITE), or NaN logits
STOP_BAD_LENGTH = 4  # prefill clipped the row's length (FLAG_BAD_LENGTH)
STOP_REASONS = {
    STOP_NONE: "max_new_tokens", STOP_TOKEN: "stop_token", STOP_CAPACITY: "capacity",
    STOP_NONFINITE: "non_finite", STOP_BAD_LENGTH: "bad_length",
}  # fmt: skip
# cache flag -> stop reason; when several flags appear in one step the first listed wins
FLAG_STOP = (
    (oj.FLAG_NONFINITE, STOP_NONFINITE),
    (oj.FLAG_BAD_LENGTH, STOP_BAD_LENGTH),
    (oj.FLAG_OVERFLOW, STOP_CAPACITY),
)


@oj.persistence.register_node  # saved with a DecodeState
class StopState(NamedTuple):
    """Per-row stop state [B] each: stopped, why (STOP_*), tokens emitted before the pads."""

    done: jax.Array
    reason: jax.Array
    count: jax.Array


def stop_init(b: int) -> StopState:
    return StopState(jnp.zeros((b,), bool), jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32))


def flag_reason(flags, logits):
    """flags [B] (OR over layers), logits [B, V] -> [B] STOP_* the row must stop for, or 0."""
    r = jnp.zeros(flags.shape, jnp.int32)
    for bit, code in reversed(FLAG_STOP):  # the first listed wins
        r = jnp.where((flags & bit) != 0, code, r)
    bad_logits = ~jnp.all(jnp.isfinite(logits), axis=-1)
    return jnp.where(bad_logits & (r != STOP_NONFINITE), STOP_NONFINITE, r)


def advance(tok, flags, logits, s: StopState, *, pad_id: int, stop_tokens: tuple[int, ...]):
    """Sampled tok [B] -> (emitted tok [B], new state): a row stops on a cache flag or
    non-finite logits (this token is already a pad) or on a stop token (after emitting it)."""
    fr = flag_reason(flags, logits)
    hit = ~s.done & (fr != 0)
    done = s.done | hit
    reason = jnp.where(hit, fr, s.reason)
    tok = jnp.where(done, pad_id, tok).astype(jnp.int32)
    live = ~done
    eos = live & _is_stop(tok, stop_tokens)
    reason = jnp.where(eos, STOP_TOKEN, reason)
    return tok, StopState(done | eos, reason, s.count + live.astype(jnp.int32))


def _is_stop(tok, stop_tokens):
    if not stop_tokens:
        return jnp.zeros(tok.shape, bool)
    return jnp.isin(tok, jnp.asarray(stop_tokens, jnp.int32))


def describe_stops(info) -> list[str]:
    """Host-side, per row: why it stopped and after how many tokens, with its cache flags."""
    out = []
    for r, n, f in zip(*(np.asarray(info[k]).tolist() for k in
                         ("stop_reason", "num_tokens", "flags")), strict=True):  # fmt: skip
        flags = ",".join(oj.checks.flag_names(f)) or "none"
        out.append(f"{STOP_REASONS.get(r, f'unknown({r})')} after {n} tokens (flags: {flags})")
    return out
