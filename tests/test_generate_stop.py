"""generate stops a row on a full cache or non-finite K/V, says why, and no other row changes.

A tiny random model (untied embeddings, so a poisoned embedding row only reaches the
rows that look that token up). "No spread" is checked bit for bit: the other rows'
tokens equal those of a run of the same shapes where the bad row is replaced by a
clean one (or the model by the clean model).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import models
import oscar_jax as oj
from models import stopping

GEN = models  # trace_count, describe_stops
from models import stopping as STOP  # noqa: E402

CFG = models.ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16,
)  # fmt: skip
KV = oj.preset("oscar", bits=2, residual_length=16, group_size=16)
PAD = 63
N_NEW = 10
T, CAP = 40, 44  # prompt length (bucket 64) and a cache capacity that row 0 outgrows


def _model(poison: int | None = None) -> models.CausalLM:
    """Random weights x 3.5 (clear greedy choices); embedding row ``poison`` set to +inf."""
    m = models.CausalLM(CFG, rngs=nnx.Rngs(0))
    p = jax.tree_util.tree_map(lambda a: a * 3.5 if a.ndim >= 2 else a, m.params())
    if poison is not None:
        p["embed"] = p["embed"].at[poison].set(jnp.inf)
    m.set_params(p)
    return m


@functools.cache
def clean_model() -> models.CausalLM:
    return _model()


def _ids(seed: int, b: int = 2) -> np.ndarray:
    """Prompts of ids < 32, so ids 32..62 are free to poison."""
    return np.random.default_rng(seed).integers(0, 32, (b, T)).astype(np.int32)


def _gen(m, ids, lengths, **kw):
    out, info = models.generate(m, ids, N_NEW, kv=KV, lengths=lengths, pad_token_id=PAD,
                                return_info=True, **kw)  # fmt: skip
    return np.asarray(out), {k: np.asarray(v) for k, v in info.items()}


def test_flag_to_reason_mapping():
    """FLAG_STOP is explicit: non-finite > bad length > overflow; NaN logits are non-finite."""
    f = jnp.array([0, oj.FLAG_OVERFLOW, oj.FLAG_NONFINITE, oj.FLAG_BAD_LENGTH,
                   oj.FLAG_OVERFLOW | oj.FLAG_NONFINITE, oj.FLAG_OVERFLOW | oj.FLAG_BAD_LENGTH,
                   0, oj.FLAG_OVERFLOW])  # fmt: skip
    logits = jnp.zeros((8, 5)).at[6, 2].set(jnp.nan).at[7, 0].set(jnp.inf)
    got = np.asarray(stopping.flag_reason(f, logits)).tolist()
    S = stopping
    assert got == [0, S.STOP_CAPACITY, S.STOP_NONFINITE, S.STOP_BAD_LENGTH, S.STOP_NONFINITE,
                   S.STOP_BAD_LENGTH, S.STOP_NONFINITE, S.STOP_NONFINITE]  # fmt: skip
    assert dict(S.FLAG_STOP) == {oj.FLAG_NONFINITE: 3, oj.FLAG_BAD_LENGTH: 4, oj.FLAG_OVERFLOW: 2}
    assert S.STOP_REASONS[0] == "max_new_tokens" and S.STOP_REASONS[1] == "stop_token"
    # a row already stopped keeps its first reason; stopped rows emit the pad id
    s = S.StopState(jnp.array([True, False]), jnp.array([S.STOP_TOKEN, 0]), jnp.array([3, 4]))
    tok, s2 = S.advance(jnp.array([7, 7]), jnp.array([oj.FLAG_OVERFLOW] * 2), jnp.zeros((2, 5)),
                        s, pad_id=PAD, stop_tokens=(7,))  # fmt: skip
    assert np.asarray(tok).tolist() == [PAD, PAD]
    assert np.asarray(s2.reason).tolist() == [S.STOP_TOKEN, S.STOP_CAPACITY]
    assert np.asarray(s2.count).tolist() == [3, 4] and bool(jnp.all(s2.done))


def test_capacity_stops_the_row_and_nothing_else():
    m = clean_model()
    ids = _ids(0)
    lengths = np.array([T, 20])
    out, info = _gen(m, ids, lengths, max_len=CAP, stop_tokens=())
    # row 0: 40 prompt tokens (16 of them in the INT2 part) + 4 appends fill the 44 slots;
    # the 5th append (token 4) overflows, so token 5 would come from a cache without
    # token 4: pads from there on
    assert info["stop_reason"].tolist() == [STOP.STOP_CAPACITY, STOP.STOP_NONE]
    assert info["num_tokens"].tolist() == [5, N_NEW]
    assert info["done"].tolist() == [True, False]
    assert info["flags"].tolist() == [oj.FLAG_OVERFLOW, 0]
    assert info["cache_lengths"].tolist() == [CAP, 20 + N_NEW - 1]
    assert np.all(out[0, 5:] == PAD)
    # tokens before the stop are those of a run with room to spare
    roomy, rinfo = _gen(m, ids, lengths, stop_tokens=())
    assert rinfo["stop_reason"].tolist() == [0, 0]
    np.testing.assert_array_equal(out[0, :5], roomy[0, :5])
    assert rinfo["num_tokens"].tolist() == [N_NEW, N_NEW]  # with room, row 0 runs on
    # row 1 is unaffected: same tokens as a run where row 0 is replaced by row 1's prompt
    before = GEN.trace_count()
    out2, info2 = _gen(m, ids[[1, 1]], np.array([20, 20]), max_len=CAP, stop_tokens=())
    assert info2["stop_reason"].tolist() == [0, 0]
    np.testing.assert_array_equal(out[1], out2[1])
    np.testing.assert_array_equal(out[1], roomy[1])
    # one compilation per (shapes, max_len): other prompt values reuse it
    _gen(m, _ids(1), lengths, max_len=CAP, stop_tokens=())
    assert GEN.trace_count() == before
    # the step-by-step reference stops alike
    loop, linfo = models.generate_stepwise(
        m,
        ids,
        N_NEW,
        kv=KV,
        lengths=lengths,
        max_len=CAP,
        stop_tokens=(),
        pad_token_id=PAD,
        return_info=True,
    )
    np.testing.assert_array_equal(loop, out)
    for k in ("stop_reason", "num_tokens", "done", "flags"):
        np.testing.assert_array_equal(linfo[k], info[k])
    assert GEN.describe_stops(info) == [
        "capacity after 5 tokens (flags: FLAG_OVERFLOW)",
        "max_new_tokens after 10 tokens (flags: none)",
    ]


def test_stop_token_is_the_reason_even_if_padding_overflows_later():
    m = clean_model()
    ids = _ids(0)
    ref, _ = _gen(m, ids, np.array([T, 20]), max_len=CAP, stop_tokens=())
    j = next(i for i in range(1, 5) if ref[0, i] not in ref[0, :i])
    stop = int(ref[0, j])
    out, info = _gen(m, ids, np.array([T, 20]), max_len=CAP, stop_tokens=(stop,))
    assert info["stop_reason"][0] == STOP.STOP_TOKEN and info["num_tokens"][0] == j + 1
    assert out[0, j] == stop and np.all(out[0, j + 1 :] == PAD)
    # the pads fed after the stop still fill the cache: the flag shows, the reason does not
    assert info["flags"][0] & oj.FLAG_OVERFLOW


def _poison_choice(mid_decode: bool):
    """(ids, lengths, poisoned token, index j) from the clean run: the token is absent from
    row 1's prompt and tokens; mid_decode: row 0 first emits it at index j >= 1, else
    it is planted in row 0's prompt (j = None)."""
    m = clean_model()
    lengths = np.array([T, 30])
    for seed in range(20):
        ids = _ids(seed)
        ref, info = _gen(m, ids, lengths, stop_tokens=())
        assert info["stop_reason"].tolist() == [0, 0]
        banned = set(ids[1].tolist()) | set(ref[1].tolist()) | {PAD}
        if not mid_decode:
            tok = next(t for t in range(32, PAD) if t not in banned)
            ids = ids.copy()
            ids[0, 3] = tok
            return ids, lengths, tok, None
        banned |= set(ids[0].tolist())
        for j in range(1, N_NEW - 1):
            t = int(ref[0, j])
            if t not in banned and t not in ref[0, :j]:
                return ids, lengths, t, j
    pytest.fail("no prompt in 20 seeds gives a usable token to poison")


@pytest.mark.parametrize("mid_decode", [False, True])
def test_nonfinite_row_stops_and_does_not_spread(mid_decode):
    ids, lengths, tok, j = _poison_choice(mid_decode)
    clean, cinfo = _gen(clean_model(), ids, lengths, stop_tokens=())
    bad, info = _gen(_model(poison=tok), ids, lengths, stop_tokens=())
    assert info["stop_reason"].tolist() == [STOP.STOP_NONFINITE, STOP.STOP_NONE]
    assert info["flags"][0] & oj.FLAG_NONFINITE and info["flags"][1] == 0
    n0 = 0 if j is None else j + 1  # prompt: nothing valid; mid-decode: up to the bad token
    assert info["num_tokens"].tolist() == [n0, N_NEW]
    np.testing.assert_array_equal(bad[0, :n0], clean[0, :n0])
    assert np.all(bad[0, n0:] == PAD)
    np.testing.assert_array_equal(bad[1], clean[1])  # bit-identical tokens: no spread
    assert cinfo["stop_reason"].tolist() == [0, 0]


def test_sharded_generate_stops_alike():
    """mesh= path: same tokens, stop reasons and counts as unsharded (2 x 2 x 2 CPU mesh)."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "model", "sequence"))
    ids, _, tok, _ = _poison_choice(mid_decode=False)
    ids = np.concatenate([ids, _ids(5, 6)])
    lengths = np.array([T, 36, T, 10, 33, 15, T, 25])  # row 1: 36 + 9 appends > CAP
    m = _model(poison=tok)
    want, winfo = _gen(m, ids, lengths, max_len=CAP, stop_tokens=())
    got, info = _gen(m, ids, lengths, max_len=CAP, stop_tokens=(), mesh=mesh)
    reasons = winfo["stop_reason"].tolist()
    assert reasons[0] == STOP.STOP_NONFINITE and reasons[1] == STOP.STOP_CAPACITY
    assert STOP.STOP_NONE in reasons
    np.testing.assert_array_equal(got, want)
    for k in ("stop_reason", "num_tokens", "done", "flags", "cache_lengths"):
        np.testing.assert_array_equal(info[k], winfo[k], err_msg=k)
