"""The full evaluation (``oscar-jax eval``): perplexity, needle in a haystack, TNI, ablations.

``run_eval`` loads nothing itself: it takes a model (``models.from_pretrained``), its
tokenizer, the held-out tokens and ``Settings``, runs the tasks asked for and
writes ``results.json``, ``results.md`` and the plots (``key_norms.png``, ``tni.png``,
``niah.png``; skipped with a note when matplotlib is missing, their data stay in
results.json for ``oscar-jax plot``) into the output directory, after every unit
of work. Each task's numbers are in ``oscar_eval.ppl``, ``oscar_eval.niah``
and ``oscar_eval.tni``; the units and saving in ``oscar_eval.tasks``;
compiling ahead and the time budget in ``oscar_eval.programs``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sys
import time

import jax
import numpy as np

from models.model import CausalLM
from oscar_eval import programs as ep
from oscar_eval import tasks as et
from oscar_eval.calibrate import calibrate_heldout
from oscar_eval.common import make_encode, make_windows, parse_methods
from oscar_eval.settings import Settings


def load_heldout(path: str, tokenizer=None, bos: int | None = None) -> np.ndarray:
    """Held-out ids: a .npy of token ids, or a text file (documents split at blank lines,
    each tokenized with BOS first).

    A text document is encoded without the tokenizer's own special tokens and gets one
    ``bos`` in front: a tokenizer whose post-processor adds BOS (a GGUF file with
    ``add_bos_token`` true) would otherwise give BOS twice, and one that adds EOS an EOS
    per document. With ``bos`` None the tokenizer's own special tokens are kept.
    """
    if not os.path.isfile(path):
        raise ValueError(f"held-out file {path!r} does not exist")
    if path.endswith(".npy"):
        tok = np.load(path)
        if not np.issubdtype(tok.dtype, np.integer):
            raise ValueError(f"{path}: dtype={tok.dtype} must be integer token ids")
        return tok.reshape(-1).astype(np.int64)
    if tokenizer is None:
        raise ValueError(f"{path}: a text file needs the model's tokenizer (tokenizer.json)")
    with open(path, encoding="utf-8") as f:
        docs = [d for d in f.read().split("\n\n") if d.strip()]
    encode = make_encode(tokenizer, bos)
    return np.asarray([i for d in docs for i in encode(d)], np.int64)


def _previous(out_dir: str) -> dict:
    path = os.path.join(out_dir, "results.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _resolve(s: Settings, n_windows: int) -> tuple[int, str]:
    """(perplexity windows per call, NIAH grouping) for this backend when left to ``auto``.

    Off-CPU all windows (up to 32) go in one call and all NIAH lengths in one group: one
    program per method, and compiling, not computing, is what costs there. On a CPU,
    one window per call and one group per length compute least.
    """
    cpu = jax.default_backend() == "cpu"
    batch = s.ppl_batch if s.ppl_batch is not None else (1 if cpu else max(1, min(n_windows, 32)))
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"ppl_batch={s.ppl_batch!r} must be a positive int or None (auto)")
    group = s.niah_group if s.niah_group != "auto" else ("length" if cpu else "all")
    if group not in ("length", "all"):
        raise ValueError(f"niah_group={s.niah_group!r} must be 'auto', 'length' or 'all'")
    return batch, group


def _note(res: dict, text: str) -> None:
    """A caveat of this run: into results.json's notes and onto stderr."""
    res["notes"].append(text)
    print(f"oscar-jax eval: note: {text}", file=sys.stderr)


def run_eval(
    m: CausalLM, heldout: np.ndarray | None, out_dir: str, s: Settings, *, model_dir: str = ""
) -> dict:
    """Run the tasks of ``s`` and write results.json / results.md / PNGs to ``out_dir``.

    ``s.ctx`` / ``s.niah_lengths`` of None follow the model (``Settings.resolve``).

    Tasks run in the order tni, ppl, niah, ablations, each in units (one method, or
    the whole TNI task); results.json and results.md are rewritten after every unit,
    so a run killed midway keeps what it finished. The programs of all units are
    compiled ahead in threads (``oscar_eval.programs``); with ``s.time_budget_s``
    a unit that would not finish in time is skipped and listed under ``skipped``.

    A results.json already in ``out_dir`` from the same model is extended, so that an
    evaluation can run as several commands (tasks, or methods, at a time): rows of the
    methods run now replace theirs, the others are kept (perplexity rows and per-window
    NLLs only when the windows and cache dtype are the same; niah rows only when the
    grid is), and the bf16 reference of a previous run serves the paired differences.
    """
    mc = m.config
    s = s.resolve(mc.max_position_embeddings)
    budget = ep.Budget(s.time_budget_s)
    stats = ep.CompileStats()
    tasks = s.task_list()
    methods = parse_methods(s.methods, s.residual_length, s.group_size)
    os.makedirs(out_dir, exist_ok=True)
    prev = _previous(out_dir)
    if prev and prev.get("model_config") != json.loads(json.dumps(dataclasses.asdict(mc))):
        raise ValueError(f"{out_dir}/results.json is of another model: use another --out")
    run = {"tasks": tasks, "methods": [mt.name for mt in methods],
           "settings": dataclasses.asdict(s), "device": str(jax.devices()[0]),
           "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "done": False}  # fmt: skip
    res: dict = {
        k: v
        for k, v in prev.items()
        if k in ("ppl", "ppl_nll", "ppl_key", "niah", "tni", "ablations", "ppl_windows")
    }
    res.update({
        "model": model_dir, "settings": dataclasses.asdict(s), "device": run["device"],
        "jax": jax.__version__, "python": platform.python_version(),
        "model_config": dataclasses.asdict(mc), "runs": prev.get("runs", []) + [run],
        "timing_s": prev.get("timing_s", {}), "notes": [], "skipped": budget.skipped,
    })  # fmt: skip
    longest = max([s.ctx] * bool({"ppl", "tni", "ablations"} & set(tasks))
                  + list(s.niah_lengths) * ("niah" in tasks) + [0])  # fmt: skip
    if longest > mc.max_position_embeddings:
        _note(res, f"contexts up to {longest} tokens exceed the model's max_position_embeddings="
                   f"{mc.max_position_embeddings} (its training context): beyond it every "
                   "method, bf16 included, runs on extrapolated positions")  # fmt: skip
    bos = mc.bos_token_id
    windows = tni_windows = None
    memo: dict = {}
    if any(t in tasks for t in ("ppl", "tni", "ablations")):
        if heldout is None:
            raise ValueError("tasks ppl / tni / ablations need held-out tokens (--heldout)")
        windows = make_windows(heldout, s.ctx, s.ppl_windows, bos)
        if s.ppl_windows is not None and len(windows) < s.ppl_windows:
            _note(
                res,
                f"the held-out text holds {len(windows)} windows of {s.ctx} tokens: "
                f"perplexity is scored on those, not the {s.ppl_windows} asked for",
            )
        tni_windows = windows[: s.tni_windows]
        key = {"ctx": s.ctx, "cache_dtype": s.cache_dtype, "R": s.residual_length,
               "G": s.group_size, "dtype": m.dtype.name, "score": s.ppl_score,
               "windows_sha256": hashlib.sha256(windows.tobytes()).hexdigest()}  # fmt: skip
        if res.get("ppl_key") == key:
            memo = {n: np.asarray(v) for n, v in res.get("ppl_nll", {}).items()}
        else:  # other windows: earlier perplexities are not comparable
            for k_ in ("ppl", "ppl_nll", "ablations"):
                res.pop(k_, None)
        res["ppl_key"], res["ppl_windows"] = key, int(len(windows))
    if windows is not None or ("niah" in tasks and heldout is not None):
        # calibrated methods fit on the windows after the scored ones (the needle alone: on
        # the first windows)
        methods, note = calibrate_heldout(m, methods, heldout, s.ctx,
                                          0 if windows is None else len(windows))  # fmt: skip
        if note:
            res["notes"].append(note)
    batch, group = _resolve(s, 0 if windows is None else len(windows))
    log = lambda msg: ep.say(f"[{budget.elapsed():5.0f} s] {msg}", s.show_progress)  # noqa: E731
    ctx = et.Ctx(m, s, out_dir, res, memo, run, budget, stats, log, windows, tni_windows, batch,
               group, methods, model_dir)  # fmt: skip
    workers = ep.default_workers() if s.compile_workers is None else s.compile_workers
    ctx.pre = ep.Precompiler(workers, log)
    try:
        et.precompile(ctx, tasks)
        log(f"{len(ctx.pre.futures)} programs compiling ahead in {workers} threads")
        for task in ("tni", "ppl", "niah", "ablations"):
            if task in tasks:
                t0 = time.perf_counter()
                et.RUNNERS[task](ctx)
                res["timing_s"][task] = time.perf_counter() - t0
                ctx.save()
    finally:
        ctx.pre.close()
    if budget.skipped:
        res["notes"].append(
            f"time budget {s.time_budget_s} s: {len(budget.skipped)} unit(s) skipped: "
            + ", ".join(f"{u['task']} {u['unit']}" for u in budget.skipped)
        )
    run["skipped"] = budget.skipped
    run["done"] = True
    ctx.save()
    log(f"done: {run['compile']['programs']} programs compiled "
        f"({run['compile']['compile_s']:.0f} s of compiling over threads), "
        f"{len(budget.skipped)} unit(s) skipped")  # fmt: skip
    return res
