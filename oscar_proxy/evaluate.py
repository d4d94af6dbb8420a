"""Evaluation and export for ``oscar_proxy.train``: held-out loss, passkey accuracy, sinks,
the Hugging Face directory."""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from models.loading import from_pretrained
from oscar_eval import sinks
from oscar_proxy import hf_export
from oscar_proxy.model import token_losses


def evaluate(cfg, r, params, impl, held, pk, log) -> dict:
    """Held-out loss, passkey accuracy (teacher-forced) and sink metrics."""
    dtype = jnp.dtype(r.compute_dtype)
    losses = []
    for i in range(0, held.shape[0], 8):
        losses.append(
            np.asarray(_eval_loss(cfg, params, jnp.asarray(held[i : i + 8]), impl, dtype))
        )
    ids, pos, ans, lens = pk
    rows = np.concatenate([ids, ids[:, -1:]], axis=1)
    ok = []
    for i in range(0, rows.shape[0], 8):
        pred = np.asarray(_eval_argmax(cfg, params, jnp.asarray(rows[i : i + 8]), impl, dtype))
        for j in range(pred.shape[0]):
            a = ans[i + j][ans[i + j] >= 0]
            p0 = pos[i + j] - 1
            ok.append(bool(np.array_equal(pred[j, p0 : p0 + a.size], a)))
    ok = np.asarray(ok)
    acc = {int(n): float(ok[lens == n].mean()) for n in np.unique(lens)}
    m = sinks.sink_metrics(params, cfg, held[:2, :-1])
    out = dict(heldout_loss=float(np.mean(losses)), passkey_acc=acc, sinks=sinks.as_json(m))
    log(f"eval: heldout loss {out['heldout_loss']:.4f}, passkey acc {acc}")
    log("sinks:\n" + sinks.format_table(m))
    return out


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _eval_loss(cfg, params, rows, impl, dtype):
    return jnp.mean(token_losses(cfg, params, rows, impl, dtype)[0])


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _eval_argmax(cfg, params, rows, impl, dtype):
    return jnp.argmax(token_losses(cfg, params, rows, impl, dtype)[1], axis=-1).astype(jnp.int32)


def export(path, cfg, params, tokenizer_json, held, ref_len, record, log) -> None:
    """HF directory + training.json (with reference logits of the exported bf16 weights)."""
    hf_export.save_hf(path, cfg, params, tokenizer_json)
    m = from_pretrained(path, dtype=jnp.float32)
    ids = held[:1, :ref_len]
    logits = np.asarray(m.logits(ids), np.float64)[0]
    mx = logits.max(-1, keepdims=True)
    lse = (np.log(np.exp(logits - mx).sum(-1)) + mx[:, 0]).round(5)
    record["reference"] = dict(
        input_ids=ids[0].tolist(), logits_head=np.round(logits[:, :64], 5).tolist(),
        argmax=logits.argmax(-1).tolist(), logsumexp=lse.tolist(),
    )  # fmt: skip
    se = sinks.sink_metrics(m, None, held[:2, :-1])
    record["sinks_export"] = sinks.as_json(se)
    log("sinks of the exported bfloat16 checkpoint:\n" + sinks.format_table(se))
    with open(os.path.join(path, "training.json"), "w") as f:
        json.dump(record, f, indent=1)
    log(f"exported to {path}: {sorted(os.listdir(path))}")
