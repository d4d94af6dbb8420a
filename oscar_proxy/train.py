"""Train the proxy Llama decoder with our own JAX code, resumably and on a time budget.

``python3 -m oscar_proxy.train --data data/corpus --state-dir out/proxy_state --export DIR``

* The model is ``models.layers``' decoder (so the export is exactly what
  ``models.from_pretrained`` runs) with ``jax.nn.dot_product_attention``
  (cuDNN flash attention on GPU) in bfloat16; float32 master weights; AdamW
  (optax ``scale_by_adam`` + decoupled weight decay on matrices and embeddings,
  not on norms), global-norm clipping, linear warmup then cosine decay.
* Data: ``oscar_proxy.data.Batches`` (packed documents, every row starts with
  ``<s>``; passkey rows mixed in). The batch of step s depends on (seed, s) only.
* Resumable: params, optimizer state and step go to ``--state-dir`` every
  ``--save-every-s`` and at the end; a later run with the same recipe continues
  from there bit-exactly (the state is ~12 bytes per parameter: it must stay on the
  machine or be carried, it does not fit in a device call's returned files).
* ``--steps auto`` fixes the schedule's length after ``--auto-at`` steps from the
  measured step time and what is left of ``--time-budget-s`` (warmup does not
  depend on it); the value is stored in the state, so a rerun with ``--steps N``
  replays the same run.
* At the end: held-out loss, sink metrics (``oscar_eval.sinks``), teacher-forced
  passkey accuracy, and the Hugging Face directory (``oscar_proxy.hf_export``) with
  ``training.json`` (recipe, corpus hashes, loss curve, sink metrics over time,
  reference logits) and ``train.log``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import numpy as np

from oscar_proxy.corpus import BOS, EOS, load_split
from oscar_proxy.data import Batches, heldout_rows, passkey_eval_set
from oscar_proxy.evaluate import evaluate, export
from oscar_proxy.model import (
    Recipe,
    attention_impl,
    init_params,
    load_state,
    lr_at,
    make_step,
    model_config,
    optimizer,
    save_state,
)


# -- the run ----------------------------------------------------------------------------
class Log:
    """Timestamped, unbuffered progress lines to stdout and (appended) to a file."""

    def __init__(self, path: str | None, t0: float):
        self.f = open(path, "a") if path else None  # noqa: SIM115
        self.t0 = t0

    def __call__(self, msg: str) -> None:
        line = f"[{time.time() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        if self.f:
            self.f.write(line + "\n")
            self.f.flush()


def issue_constraints(cfg, r: Recipe) -> list[str]:
    """The proxy-model constraints (size, context, head_dim, GQA) that this recipe does not meet."""
    bad = []
    if cfg.head_dim != 128:
        bad.append(f"head_dim {cfg.head_dim} != 128")
    if cfg.num_heads < 2 * cfg.num_kv_heads:
        bad.append(f"{cfg.num_heads} query heads < 2 per KV head ({cfg.num_kv_heads})")
    if cfg.num_params() > 12_000_000:
        bad.append(f"{cfg.num_params():,} params > 12M")
    if r.seq_len < 2048:
        bad.append(f"context {r.seq_len} < 2048")
    return bad


BIG = 2**30  # the schedule's length before --steps auto has fixed it (warmup ignores it)
_COMPILED: dict = {}  # (cfg, recipe, impl, shapes) -> compiled step: reruns in one process


def compiled_step(cfg, r: Recipe, tx, impl: str, params, opt, rows, log):
    """The AOT-compiled train step; falls back to XLA attention if cuDNN's does not compile."""
    for attempt in (impl, "xla"):
        key = (cfg, r, attempt, rows.shape)
        if key in _COMPILED:
            return _COMPILED[key], attempt
        t = time.time()
        try:
            fn = make_step(cfg, r, tx, attempt).lower(params, opt, rows, 0, 1).compile()
        except Exception as e:  # noqa: BLE001 -- e.g. no cuDNN attention for this shape
            if attempt == "xla":
                raise
            log(f"attention {attempt!r} failed to compile ({type(e).__name__}: {e}); using xla")
            continue
        log(f"train step compiled in {time.time() - t:.1f}s (attention {attempt})")
        _COMPILED[key] = fn
        return fn, attempt
    raise AssertionError("unreachable")


def run(a: argparse.Namespace) -> dict:
    """Train (or resume) until done, --stop-at or the time budget; evaluate; export."""
    import tokenizers

    t0 = time.time()
    if a.export:
        os.makedirs(a.export, exist_ok=True)
    log = Log(os.path.join(a.export, "train.log") if a.export else None, t0)
    tok = tokenizers.Tokenizer.from_file(os.path.join(a.data, "tokenizer.json"))
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    with open(os.path.join(a.data, "manifest.json")) as f:
        man = json.load(f)
    fields = [f.name for f in dataclasses.fields(Recipe) if f.name != "corpus_sha256"]
    r = Recipe(**{k: getattr(a, k) for k in fields}, corpus_sha256=man["text_sha256"])
    cfg = model_config(r, tok.get_vocab_size(), bos, eos)
    log(f"devices {jax.devices()}; jax {jax.__version__}")
    meets = issue_constraints(cfg, r)
    log(f"{cfg}\nparams {cfg.num_params():,}; {r}\nconstraints: {meets or 'all met'}")
    tokens, starts = load_split(a.data, "train")
    htok, hstarts = load_split(a.data, "heldout")
    log(f"corpus: train {tokens.size:,} tokens / {starts.size} docs, "
        f"held-out {htok.size:,} / {hstarts.size}")  # fmt: skip
    batches = Batches(tokens, starts, r.seq_len, r.batch, r.seed, r.passkey_frac, tok, bos, eos)
    held = heldout_rows(htok, hstarts, a.eval_rows, r.seq_len)
    lengths = [n for n in a.passkey_lengths if n + 8 <= r.seq_len]
    pk = passkey_eval_set(tok, r.seq_len, lengths, a.passkey_depths, a.passkey_per, r.seed)
    params = init_params(cfg, r.seed)
    tx = optimizer(r, params)
    opt = tx.init(params)
    step, total = 0, (None if a.steps == "auto" else int(a.steps))
    rec: dict = dict(history=[], evals=[], calls=[])
    if a.state_dir and os.path.isfile(os.path.join(a.state_dir, "meta.json")):
        params, opt, meta = load_state(a.state_dir, params, opt)
        if meta["recipe"] != dataclasses.asdict(r):
            diff = {k: (v, meta["recipe"].get(k)) for k, v in dataclasses.asdict(r).items()
                    if meta["recipe"].get(k) != v}  # fmt: skip
            raise ValueError(f"--state-dir {a.state_dir} holds another recipe: {diff}")
        if total is not None and meta["total"] not in (None, total):
            raise ValueError(f"--steps {total} but the saved run has total {meta['total']}")
        step, total, rec = meta["step"], meta["total"] or total, meta["record"]
        log(f"resumed from {a.state_dir} at step {step} (total {total})")
    rows = batches.batch(step)
    fn, impl = compiled_step(cfg, r, tx, attention_impl(r.compute_dtype), params, opt, rows, log)

    def do_eval():
        t = time.time()
        ev = evaluate(cfg, r, params, impl, held, pk, log)
        rec["evals"].append(dict(step=step, tokens=step * r.batch * r.seq_len, **ev))
        return time.time() - t

    def save():
        meta = dict(recipe=dataclasses.asdict(r), total=total, record=rec)
        save_state(a.state_dir, params, opt, step, meta)

    eval_s = 0.0
    if step == 0 and a.evals:
        eval_s = do_eval()
        if total is None:  # the cost of a later eval, without its compilation
            eval_s = do_eval()
            rec["evals"].pop()
    call = dict(start_step=step, start_time=time.strftime("%Y-%m-%d %H:%M:%S"))
    pending, stop = [], "done"
    t_log, s_log, t_save, t_auto = time.time(), step, time.time(), 0.0
    half = a.auto_at // 2
    while step < (total or BIG):
        if time.time() - t0 > a.time_budget_s - a.reserve_s:
            stop = "time budget"
            break
        if a.stop_at and step >= a.stop_at:
            stop = "--stop-at"
            break
        params, opt, loss, gnorm = fn(params, opt, rows, step, total or BIG)
        pending.append((loss, gnorm))
        step += 1
        rows = batches.batch(step)  # the host builds the next batch while the device runs
        if total is None and step in (half, a.auto_at):
            loss.block_until_ready()
            if step == half:
                t_auto = time.time()
            else:
                dt = (time.time() - t_auto) / (a.auto_at - half)
                left = a.time_budget_s - a.reserve_s - (time.time() - t0) - a.evals * eval_s
                total = step + max(1, int(left / dt))
                log(f"--steps auto: {dt * 1e3:.1f} ms/step -> total {total} steps")
        if step % a.log_every == 0 or step == total:
            vals = np.asarray(jax.device_get(pending), np.float64)
            pending = []
            now = time.time()
            tps = (step - s_log) * r.batch * r.seq_len / (now - t_log)
            lr = float(lr_at(r, step - 1, total or BIG))
            loss_m, gn = float(vals[:, 0].mean()), float(vals[-1, 1])
            rec["history"].append([step, round(loss_m, 4), round(gn, 3), lr, round(tps)])
            log(f"step {step}/{total} loss {loss_m:.4f} gnorm {gn:.3f} lr {lr:.2e} "
                f"{tps / 1e6:.3f} M tok/s")  # fmt: skip
            t_log, s_log = now, step
        if total and a.evals and step < total and step % max(1, total // a.evals) == 0:
            do_eval()
        if a.state_dir and time.time() - t_save > a.save_every_s:
            save()
            t_save = time.time()
    jax.block_until_ready(params)
    call.update(end_step=step, stop=stop, seconds=round(time.time() - t0, 1))
    rec["calls"].append(call)
    if a.state_dir:
        save()
        log(f"state saved to {a.state_dir} at step {step}")
    if (a.evals or a.export) and (not rec["evals"] or rec["evals"][-1]["step"] != step):
        do_eval()
    record = dict(
        recipe=dataclasses.asdict(r), config=dataclasses.asdict(cfg), params=cfg.num_params(),
        step=step, total=total, finished=step == total, stop=stop, unmet_constraints=meets,
        tokens_seen=step * r.batch * r.seq_len, attention=impl,
        corpus={k: man[k] for k in ("files_sha256", "text_sha256", "tokenizer_sha256", "splits")},
        **rec,
    )  # fmt: skip
    if a.export:
        export(a.export, cfg, params, os.path.join(a.data, "tokenizer.json"), held, a.ref_len,
               record, log)  # fmt: skip
    log(f"finished: step {step}/{total} ({stop}), {record['tokens_seen'] / 1e6:.1f} M tokens")
    return record


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="data/corpus", help="oscar_proxy.corpus output directory")
    ap.add_argument("--state-dir", default="", help="resumable state (params + optimizer)")
    ap.add_argument("--export", default="", help="Hugging Face directory to write at the end")
    ap.add_argument("--time-budget-s", type=float, default=480.0)
    ap.add_argument("--reserve-s", type=float, default=45.0, help="kept for final eval + export")
    ap.add_argument("--steps", default="auto", help="schedule length, or 'auto' (time budget)")
    ap.add_argument("--auto-at", type=int, default=60, help="step at which 'auto' decides")
    ap.add_argument("--save-every-s", type=float, default=120.0)
    ap.add_argument(
        "--stop-at", type=int, default=0, help="end this call at that step (resume later)"
    )
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--evals", type=int, default=8, help="evaluations spread over the run")
    ap.add_argument("--eval-rows", type=int, default=16)
    ap.add_argument("--ref-len", type=int, default=64, help="tokens of the reference input")
    ap.add_argument("--passkey-lengths", type=_ints, default=[256, 1024, 2000])
    ap.add_argument("--passkey-depths", type=_floats, default=[0.1, 0.5, 0.9])
    ap.add_argument("--passkey-per", type=int, default=4)
    for f in dataclasses.fields(Recipe):
        if f.name != "corpus_sha256":
            ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default),
                            default=f.default)  # fmt: skip
    return ap


def main(argv=None) -> None:
    a = parser().parse_args(argv)
    if a.steps != "auto" and not (a.steps.isdigit() and int(a.steps) > 0):
        raise ValueError(f"--steps {a.steps!r} must be a positive int or 'auto'")
    if a.steps == "auto" and a.auto_at < 4:
        raise ValueError(f"--auto-at {a.auto_at} must be >= 4")
    if a.time_budget_s <= a.reserve_s:
        raise ValueError(f"--time-budget-s {a.time_budget_s} must exceed --reserve-s")
    run(a)


if __name__ == "__main__":
    sys.exit(main())
