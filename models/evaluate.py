"""The full evaluation (``oscar-jax eval``): perplexity, needle in a haystack, TNI, ablations.

``run_eval`` loads nothing itself: it takes a model (``models.from_pretrained``), its
tokenizer, the held-out tokens and ``Settings``, runs the tasks asked for and
writes ``results.json``, ``results.md`` and the plots (``key_norms.png``,
``niah.png``; skipped with a note when matplotlib is missing) into the output
directory. Each task's numbers are in ``models.eval_ppl``, ``models.eval_niah``
and ``models.eval_tni``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable

import jax
import numpy as np

from models import eval_ppl, eval_tni, sinks
from models.eval_common import (
    DEFAULT_METHODS,
    ablation_methods,
    make_windows,
    parse_method,
    parse_methods,
)
from models.eval_report import markdown
from models.model import CausalLM

TASKS = ("ppl", "niah", "tni", "ablations")


@dataclasses.dataclass
class Settings:
    """What to evaluate and at which sizes (the defaults are the issue's full evaluation)."""

    methods: str = ",".join(DEFAULT_METHODS)
    tasks: str = ",".join(TASKS)
    ctx: int = 4096  # perplexity context
    ppl_windows: int | None = None  # None: every window of the held-out sample
    ppl_batch: int = 1
    niah_lengths: tuple[int, ...] = (512, 1024, 2048, 4096)
    niah_depths: tuple[int, ...] = tuple(range(0, 101, 10))
    niah_trials: int = 2  # prompts per (length, depth) cell
    niah_batch: int = 11
    niah_seed: int = 918_273
    niah_new_tokens: int = 8
    tni_windows: int = 4
    ablation_base: str = "oscar2"
    residual_length: int = 128
    group_size: int = 32
    cache_dtype: str = (
        "bfloat16"  # what every cache stores full-precision K/V in (the paper's BF16)
    )
    seed: int = 0  # bootstrap
    show_progress: bool = True

    def task_list(self) -> list[str]:
        tasks = [t.strip() for t in self.tasks.split(",") if t.strip()]
        bad = [t for t in tasks if t not in TASKS]
        if bad or not tasks:
            raise ValueError(f"tasks={self.tasks!r} must be a comma-separated subset of {TASKS}")
        return tasks


def load_heldout(path: str, tokenizer=None, bos: int | None = None) -> np.ndarray:
    """Held-out ids: a .npy of token ids, or a text file (documents split at blank lines,
    each tokenized with BOS first)."""
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
    ids: list[int] = []
    for d in docs:
        ids += ([bos] if bos is not None else []) + list(tokenizer.encode(d).ids)
    return np.asarray(ids, np.int64)


def decoder(tokenizer, stop_ids) -> Callable[[list[int]], str]:
    """Generated ids -> text, cut at the first stop id."""

    def decode(ids) -> str:
        ids = [int(i) for i in ids]
        for j, i in enumerate(ids):
            if i in stop_ids:
                ids = ids[:j]
                break
        return tokenizer.decode(ids)

    return decode


def _merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """Rows of ``old`` whose method was not run again, then ``new`` (keyed by method)."""
    ran = {r["method"] for r in new}
    return [r for r in old if r["method"] not in ran] + list(new)


def _previous(out_dir: str) -> dict:
    path = os.path.join(out_dir, "results.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def run_eval(
    m: CausalLM, heldout: np.ndarray | None, out_dir: str, s: Settings, *, model_dir: str = ""
) -> dict:
    """Run the tasks of ``s`` and write results.json / results.md / PNGs to ``out_dir``.

    A results.json already in ``out_dir`` from the same model is extended, so that an
    evaluation can run as several commands (tasks, or methods, at a time): rows of the
    methods run now replace theirs, the others are kept (perplexity rows and per-window
    NLLs only when the windows and cache dtype are the same; niah rows only when the
    grid is), and the bf16 reference of a previous run serves the paired differences.
    """
    tasks = s.task_list()
    methods = parse_methods(s.methods, s.residual_length, s.group_size)
    mc = m.config
    os.makedirs(out_dir, exist_ok=True)
    prev = _previous(out_dir)
    if prev and prev.get("model_config") != json.loads(json.dumps(dataclasses.asdict(mc))):
        raise ValueError(f"{out_dir}/results.json is of another model: use another --out")
    run = {"tasks": tasks, "methods": [mt.name for mt in methods],
           "settings": dataclasses.asdict(s), "device": str(jax.devices()[0]),
           "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    res: dict = {
        k: v
        for k, v in prev.items()
        if k in ("ppl", "ppl_nll", "ppl_key", "niah", "tni", "ablations", "ppl_windows")
    }
    res.update({
        "model": model_dir, "settings": dataclasses.asdict(s), "device": run["device"],
        "jax": jax.__version__, "python": platform.python_version(),
        "model_config": dataclasses.asdict(mc), "runs": prev.get("runs", []) + [run],
        "timing_s": prev.get("timing_s", {}), "notes": [],
    })  # fmt: skip
    longest = max([s.ctx] * bool({"ppl", "tni", "ablations"} & set(tasks))
                  + list(s.niah_lengths) * ("niah" in tasks) + [0])  # fmt: skip
    if longest > mc.max_position_embeddings:
        note = (f"contexts up to {longest} tokens exceed the model's max_position_embeddings="
                f"{mc.max_position_embeddings} (its training context): beyond it every method, "
                "bf16 included, runs on extrapolated positions")  # fmt: skip
        res["notes"].append(note)
        print(f"oscar-jax eval: note: {note}", file=sys.stderr)
    bos = mc.bos_token_id
    windows = tni_windows = None
    memo: dict = {}
    if any(t in tasks for t in ("ppl", "tni", "ablations")):
        if heldout is None:
            raise ValueError("tasks ppl / tni / ablations need held-out tokens (--heldout)")
        windows = make_windows(heldout, s.ctx, s.ppl_windows, bos)
        tni_windows = windows[: s.tni_windows]
        key = {"ctx": s.ctx, "cache_dtype": s.cache_dtype, "R": s.residual_length,
               "G": s.group_size, "dtype": m.dtype.name,
               "windows_sha256": hashlib.sha256(windows.tobytes()).hexdigest()}  # fmt: skip
        if res.get("ppl_key") == key:
            memo = {n: np.asarray(v) for n, v in res.get("ppl_nll", {}).items()}
        else:  # other windows: earlier perplexities are not comparable
            for k_ in ("ppl", "ppl_nll", "ablations"):
                res.pop(k_, None)
        res["ppl_key"], res["ppl_windows"] = key, int(len(windows))
    k = None
    if "ppl" in tasks:
        t0 = time.perf_counter()
        rows = eval_ppl.perplexity(m, windows, methods, batch=s.ppl_batch, memo=memo,
                                   cache_dtype=s.cache_dtype, show_progress=s.show_progress,
                                   seed=s.seed)  # fmt: skip
        res["ppl"] = _merge_rows(res.get("ppl", []), rows)
        res["timing_s"]["ppl"] = time.perf_counter() - t0
        _save(res, out_dir, memo, run)  # after each task: a later timeout keeps it
    if "niah" in tasks:
        t0 = time.perf_counter()
        nz = run_niah(m, methods, s, out_dir)
        old = res.get("niah")
        if old and old.get("grid") == nz["grid"]:
            nz["summary"] = _merge_rows(old["summary"], nz["summary"])
            nz["cells"] = _merge_rows(old["cells"], nz["cells"])
            if nz["plot"]:
                nz["plot"] = eval_tni.plot_niah(nz["cells"], nz["plot"])
        res["niah"] = nz
        if nz["plot"] is None:
            res["notes"].append(eval_tni.NO_MPL + " (niah.png)")
        res["timing_s"]["niah"] = time.perf_counter() - t0
        _save(res, out_dir, memo, run)  # after each task: a later timeout keeps it
    if "tni" in tasks or "ablations" in tasks:
        k = eval_tni.keys(m, tni_windows)
    if "tni" in tasks:
        t0 = time.perf_counter()
        norms = eval_tni.key_norms(k)
        rows, summary = eval_tni.tni_summary(norms)
        plot = eval_tni.plot_norms(norms, os.path.join(out_dir, "key_norms.png"),
                                   title=os.path.basename(model_dir.rstrip("/")))  # fmt: skip
        if plot is None:
            res["notes"].append(eval_tni.NO_MPL + " (key_norms.png)")
        # per-layer INT2 key error of every method, at 2 bits whatever bits the list asks for
        int2 = _int2_variants(methods)
        sm = sinks.sink_metrics(m, None, tni_windows, offset=min(16, s.ctx - 2))
        summary["attn_on_sink_by_layer"] = np.round(sm["attn_first"].mean(1), 4).tolist()
        summary["sink_heads"], summary["query_heads"] = sm["sink_heads"], sm["num_heads_total"]
        res["tni"] = {
            "summary": summary, "per_head": rows, "plot": plot, "windows": len(tni_windows),
            "attn_on_sink": np.round(sm["attn_first"], 4).tolist(),  # [L, Hq]
            # [L, P, Hkv]: window-mean norms of the first positions, for ``replot``
            "norm_profile": np.round(norms.mean(0)[:, : eval_tni.PROFILE_POS], 5).tolist(),
            "key_error": eval_tni.key_mse(k, int2, s.show_progress, s.cache_dtype),
        }  # fmt: skip
        res["timing_s"]["tni"] = time.perf_counter() - t0
        _save(res, out_dir, memo, run)  # after each task: a later timeout keeps it
    if "ablations" in tasks:
        t0 = time.perf_counter()
        res["ablations"] = run_ablations(m, windows, k, s, memo)
        res["timing_s"]["ablations"] = time.perf_counter() - t0
        _save(res, out_dir, memo, run)  # after each task: a later timeout keeps it
    _save(res, out_dir, memo, run)
    return res


def _save(res: dict, out_dir: str, memo: dict, run: dict) -> None:
    """Write results.json and results.md as they stand."""
    if memo:
        res["ppl_nll"] = {n: np.asarray(v).tolist() for n, v in memo.items()}
    names = [r["method"] for r in res.get("ppl", [])]
    names += [r["method"] for r in res.get("niah", {}).get("summary", [])] + run["methods"]
    res["methods"] = list(dict.fromkeys(names))
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(res, f, indent=1, default=_json_default)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(res))


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def _int2_variants(methods):
    """Each quantized method of the list at 2 bits (names kept when already 2-bit), in order."""
    out, seen = [], set()
    for mt in methods:
        if not mt.quantized:
            continue
        name = mt.name if mt.kv.bits == 2 else mt.name.replace(f"{mt.kv.bits}", "2", 1)
        if name not in seen:
            seen.add(name)
            out.append(parse_method(name, mt.kv.residual_length, mt.kv.group_size))
    return out


def run_niah(m: CausalLM, methods, s: Settings, out_dir: str) -> dict:
    from models import eval_niah

    if m.tokenizer is None:
        raise ValueError("task niah needs the model's tokenizer (tokenizer.json in --model)")
    mc = m.config
    enc = eval_niah.make_encode(m.tokenizer, mc.bos_token_id)
    prompts = eval_niah.build_prompts(enc, s.niah_lengths, s.niah_depths, s.niah_trials,
                                      s.niah_seed)  # fmt: skip
    dec = decoder(m.tokenizer, set(mc.eos_token_ids))
    rows, cells = eval_niah.niah(m, methods, prompts, dec, batch=s.niah_batch,
                                 max_new_tokens=s.niah_new_tokens, cache_dtype=s.cache_dtype,
                                 show_progress=s.show_progress)  # fmt: skip
    plot = eval_tni.plot_niah(cells, os.path.join(out_dir, "niah.png"))
    grid = {"lengths": list(s.niah_lengths), "depths": list(s.niah_depths),
            "trials": s.niah_trials, "seed": s.niah_seed, "new_tokens": s.niah_new_tokens,
            "cache_dtype": s.cache_dtype, "R": s.residual_length, "G": s.group_size}  # fmt: skip
    return {"summary": rows, "cells": cells, "plot": plot, "grid": grid,
            "prompt_tokens": {str(n): int(np.mean([len(p["ids"]) for p in prompts
                                                   if p["length"] == n]))
                              for n in s.niah_lengths}}  # fmt: skip


def run_ablations(m: CausalLM, windows, k, s: Settings, memo: dict) -> list[dict]:
    """Perplexity and INT2 key error of the base method with one factor changed at a time."""
    spec = ablation_methods(s.ablation_base, s.residual_length, s.group_size)
    names = ["bf16"] + list(dict.fromkeys(n for _, _, n in spec))
    methods = parse_methods(names, s.residual_length, s.group_size)
    ppl = {r["method"]: r for r in eval_ppl.perplexity(
        m, windows, methods, batch=s.ppl_batch, memo=memo, cache_dtype=s.cache_dtype,
        show_progress=s.show_progress, seed=s.seed)}  # fmt: skip
    err: dict = {}
    qm = [mt for mt in methods if mt.quantized]
    for r in eval_tni.key_mse(k, qm, s.show_progress, s.cache_dtype):
        err.setdefault(r["method"], []).append(r["key_mse"])
    return [{"factor": f, "setting": v, "method": n, **ppl[n],
             "key_mse_layer_mean": float(np.mean(err[n]))} for f, v, n in spec]  # fmt: skip
