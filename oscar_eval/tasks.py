"""The units of ``oscar-jax eval`` (``oscar_eval.runner.run_eval``): TNI, perplexity per
method, needle in a haystack per method, ablations per method; and saving after each.

Every unit's programs are submitted to a ``oscar_eval.programs.Precompiler`` first
(``_precompile``, in the order the units run); a unit then waits for its own, runs
if the ``Budget`` allows, and rewrites results.json / results.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable

import numpy as np

import oscar_jax as oj
from models.model import CausalLM
from oscar_eval import chat, sinks
from oscar_eval import niah as eval_niah
from oscar_eval import ppl as eval_ppl
from oscar_eval import programs as ep
from oscar_eval import tni as eval_tni
from oscar_eval.common import Progress, ablation_methods, make_encode, parse_method, parse_methods
from oscar_eval.report import markdown
from oscar_eval.settings import Settings


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


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """Rows of ``old`` whose method was not run again, then ``new`` (keyed by method)."""
    ran = {r["method"] for r in new}
    return [r for r in old if r["method"] not in ran] + list(new)


@dataclasses.dataclass
class Ctx:
    """What the task runners share."""

    m: CausalLM
    s: Settings
    out_dir: str
    res: dict
    memo: dict
    run: dict
    budget: ep.Budget
    stats: ep.CompileStats
    log: Callable[[str], None]
    windows: np.ndarray | None
    tni_windows: np.ndarray | None
    ppl_batch: int
    niah_group: str
    methods: list
    model_dir: str
    pre: ep.Precompiler | None = None
    k: np.ndarray | None = None  # TNI windows' keys [N, L, T, Hkv, D]
    prompts: list | None = None

    def save(self) -> None:
        failed = self.pre.failed if self.pre is not None else []
        self.run["compile"] = dict(self.stats.get(), precompile_failed=failed)
        self.run["wall_s"] = round(self.budget.elapsed(), 1)  # so far, until run["done"]
        save(self.res, self.out_dir, self.memo, self.run)

    def unit(self, kind: str, name: str, keys, fn) -> bool:
        """Run unit ``fn`` if the budget allows, after its programs compiled; save after."""
        if not self.budget.allows(kind, name):
            self.log(f"{kind} {name}: skipped (time budget {self.s.time_budget_s} s)")
            return False
        t0 = time.perf_counter()
        waited = sum(self.pre.wait(k) for k in keys)
        fn()
        dt = time.perf_counter() - t0
        self.budget.done(kind, dt)
        self.save()
        self.log(f"{kind} {name}: {dt:.1f} s (of which {waited:.1f} s waiting for compilation)")
        return True

    def keys(self) -> np.ndarray:
        if self.k is None:
            self.k = eval_tni.keys(self.m, self.tni_windows)
        return self.k

    def key_shape(self) -> tuple:
        mc = self.m.config
        return (len(self.tni_windows), mc.num_layers, self.s.ctx, mc.num_kv_heads, mc.head_dim)

    def ppl_todo(self, methods) -> list:
        """Methods without per-window NLLs yet, bf16 (the paired reference) first."""
        return [mt for mt in sorted(methods, key=lambda mt: mt.name != "bf16")
                if mt.name not in self.memo]  # fmt: skip


def ablation_spec(s: Settings):
    spec = ablation_methods(s.ablation_base, s.residual_length, s.group_size)
    names = ["bf16"] + list(dict.fromkeys(n for _, _, n in spec))
    return spec, parse_methods(names, s.residual_length, s.group_size)


def precompile(c: Ctx, tasks) -> None:
    """Submit every unit's programs, in the order the units run."""
    s, m, sub = c.s, c.m, c.pre.submit
    if "tni" in tasks:
        sub("keys", eval_tni.keys_program(m, s.ctx))
        for mt in int2_variants(c.methods):
            sub(("key_err", mt.kv), eval_tni.key_err_program(mt.kv, c.key_shape(), s.cache_dtype))
    nll = lambda mt: (("nll", mt.kv), eval_ppl.nll_program(m, mt.kv, c.ppl_batch, s.ctx,
                                                           s.cache_dtype))  # noqa: E731  # fmt: skip
    if "ppl" in tasks:
        for mt in c.ppl_todo(c.methods):
            sub(*nll(mt))
    if "niah" in tasks:
        c.prompts = _niah_prompts(m, s, c.model_dir)
        gs = eval_niah.groups(c.prompts, c.niah_group)
        cd = s.cache_dtype
        done = _niah_done(c)
        for mt in [mt for mt in c.methods if mt.name not in done]:
            for i, g in enumerate(gs):
                if eval_niah.decodes(mt.kv):  # fake-quant methods: teacher-forced only
                    gen = eval_niah.generate_program(m, g, mt.kv, s.niah_batch,
                                                     s.niah_new_tokens, cache_dtype=cd)  # fmt: skip
                    sub(("gen", mt.name, i), gen)
                if all(p.get("answer_ids") for p in g):
                    sub(("ll", mt.name, i), eval_niah.answer_program(m, g, mt.kv, cache_dtype=cd))
    if "ablations" in tasks:
        _, am = ablation_spec(s)
        for mt in c.ppl_todo(am):
            sub(*nll(mt))
        for mt in am:
            if mt.quantized:
                sub(("key_err", mt.kv),
                    eval_tni.key_err_program(mt.kv, c.key_shape(), s.cache_dtype))  # fmt: skip


def task_tni(c: Ctx) -> None:
    s = c.s
    int2 = int2_variants(c.methods)  # every method's key error at 2 bits

    def run():
        norms = eval_tni.key_norms(c.keys())
        rows, summary = eval_tni.tni_summary(norms)
        plot = eval_tni.plot_norms(norms, os.path.join(c.out_dir, "key_norms.png"),
                                   title=os.path.basename(c.model_dir.rstrip("/")))  # fmt: skip
        if plot is None:
            c.res["notes"].append(eval_tni.NO_MPL + " (key_norms.png)")
        sm = sinks.sink_metrics(c.m, None, c.tni_windows, offset=min(16, s.ctx - 2))
        summary["attn_on_sink_by_layer"] = np.round(sm["attn_first"].mean(1), 4).tolist()
        summary["sink_heads"], summary["query_heads"] = sm["sink_heads"], sm["num_heads_total"]
        c.res["tni"] = {
            "summary": summary, "per_head": rows, "plot": plot, "windows": len(c.tni_windows),
            "attn_on_sink": np.round(sm["attn_first"], 4).tolist(),  # [L, Hq]
            # [L, P, Hkv]: window-mean norms of the first positions, for ``replot``
            "norm_profile": np.round(norms.mean(0)[:, : eval_tni.PROFILE_POS], 5).tolist(),
            "key_error": eval_tni.key_mse(c.keys(), int2, s.show_progress, s.cache_dtype),
        }  # fmt: skip
        t = c.res["tni"]
        t["group_error"] = eval_tni.group_errors(t["key_error"])
        name = os.path.basename(c.model_dir.rstrip("/"))
        png = os.path.join(c.out_dir, "tni.png")
        t["sink_plot"] = eval_tni.plot_tni(sm["attn_first"], t["group_error"], png, title=name)
        if t["sink_plot"] is None:
            c.res["notes"].append(eval_tni.NO_MPL + " (tni.png)")

    c.unit("tni", "key norms, sinks, INT2 key error",
           ["keys"] + [("key_err", mt.kv) for mt in int2], run)  # fmt: skip


def _ppl_rows(c: Ctx, methods) -> list[dict]:
    """Rows of the methods that have NLLs (bootstrap only: nothing runs the model)."""
    done = [mt for mt in methods if mt.name in c.memo]
    if not done:
        return []
    return eval_ppl.perplexity(c.m, c.windows, done, memo=c.memo, cache_dtype=c.s.cache_dtype,
                               show_progress=False, seed=c.s.seed,
                               score=c.s.ppl_score)  # fmt: skip


def _run_ppl(c: Ctx, mt) -> None:
    eval_ppl.perplexity(c.m, c.windows, [mt], batch=c.ppl_batch, memo=c.memo,
                        cache_dtype=c.s.cache_dtype, show_progress=c.s.show_progress,
                        seed=c.s.seed, score=c.s.ppl_score)  # fmt: skip


def task_ppl(c: Ctx) -> None:
    old = c.res.get("ppl", [])

    def run(mt):  # the rows so far go into res before the unit saves (results.md lists them)
        _run_ppl(c, mt)
        c.res["ppl"] = merge_rows(old, _ppl_rows(c, c.methods))

    for mt in c.ppl_todo(c.methods):
        c.unit("ppl", mt.name, [("nll", mt.kv)], lambda mt=mt: run(mt))
    rows = merge_rows(old, _ppl_rows(c, c.methods))
    if rows:
        c.res["ppl"] = rows


def _niah_prompts(m: CausalLM, s: Settings, model_dir: str) -> list[dict]:
    """The needle prompts: plain text after one BOS, or a chat turn (``oscar_eval.chat``)."""
    if m.tokenizer is None:
        raise ValueError("task niah needs the model's tokenizer (tokenizer.json in --model)")
    template = chat.chat_template(model_dir)
    if chat.use_chat(s.niah_chat, template):
        enc = chat.make_chat_encode(m.tokenizer, template)
    else:
        enc = make_encode(m.tokenizer, m.config.bos_token_id)
    ans = lambda text: m.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    return eval_niah.build_prompts(enc, s.niah_lengths, s.niah_depths, s.niah_trials,
                                   s.niah_seed, answer_encode=ans)  # fmt: skip


def _niah_grid(c: Ctx) -> dict:
    """What a needle result depends on besides its method: results of another grid are
    not reused."""
    s = c.s
    chat_on = chat.use_chat(s.niah_chat, chat.chat_template(c.model_dir))
    return {"lengths": list(s.niah_lengths), "depths": list(s.niah_depths),
            "trials": s.niah_trials, "seed": s.niah_seed, "new_tokens": s.niah_new_tokens,
            "cache_dtype": s.cache_dtype, "R": s.residual_length, "G": s.group_size,
            "chat": chat_on}  # fmt: skip


def _niah_done(c: Ctx) -> set[str]:
    """Methods whose needle results an earlier run of the same grid left in results.json
    (a summary row and per-prompt log-likelihoods): a rerun of the command skips them,
    as the perplexity task skips methods with saved NLLs."""
    old = c.res.get("niah")
    if not old or old.get("grid") != _niah_grid(c):
        return set()
    rows = {r["method"] for r in old.get("summary", [])}
    return rows & set(old.get("ll", {}))


def task_niah(c: Ctx) -> None:
    s, m = c.s, c.m
    prompts = c.prompts or _niah_prompts(m, s, c.model_dir)
    dec = decoder(m.tokenizer, set(m.config.eos_token_ids))
    grid = _niah_grid(c)
    old = c.res.get("niah")
    old = old if old and old.get("grid") == grid else {"summary": [], "cells": [], "ll": {}}
    done = _niah_done(c)
    nz = {"summary": list(old["summary"]), "cells": list(old["cells"]), "plot": None,
          "ll": dict(old.get("ll", {})), "first_tokens": [int(i) for i in prompts[0]["ids"][:4]],
          "grid": grid, "prompt_tokens": {str(n): int(np.mean([len(p["ids"]) for p in prompts
                                                               if p["length"] == n]))
                                          for n in s.niah_lengths}}  # fmt: skip
    ngroups = len(eval_niah.groups(prompts, c.niah_group))

    def run(mt):
        bar = Progress(len(prompts), f"niah {mt.name:<19}", enabled=s.show_progress)
        hits = eval_niah.niah_method(m, mt, prompts, dec, batch=s.niah_batch,
                                     max_new_tokens=s.niah_new_tokens, cache_dtype=s.cache_dtype,
                                     group=c.niah_group, progress=bar)  # fmt: skip
        row, cells = eval_niah.summarize(mt, hits)
        nz["ll"][mt.name] = [h["answer_ll"] for h in hits]  # per prompt, for paired deltas
        nz["summary"] = merge_rows(nz["summary"], [row])
        _ll_deltas(nz)
        nz["cells"] = merge_rows([x for x in nz["cells"] if x["method"] != mt.name], cells)
        c.res["niah"] = nz

    for mt in c.methods:
        if mt.name in done:
            c.log(f"niah {mt.name}: in {c.out_dir}/results.json from an earlier run (same grid)")
            continue
        gens = ngroups if eval_niah.decodes(mt.kv) else 0  # fake-quant: teacher-forced only
        keys = [(kind, mt.name, i) for kind, n in (("gen", gens), ("ll", ngroups))
                for i in range(n)]  # fmt: skip
        c.unit("niah", mt.name, keys, lambda mt=mt: run(mt))
    if nz["summary"]:
        nz["plot"] = eval_tni.plot_niah(nz["cells"], os.path.join(c.out_dir, "niah.png"))
        if nz["plot"] is None:
            c.res["notes"].append(eval_tni.NO_MPL + " (niah.png)")
        c.res["niah"] = nz


def _ll_deltas(nz: dict) -> None:
    """Each summary row's answer log-likelihood minus bf16's on the same prompts (paired)."""
    ref = nz["ll"].get("bf16")
    for row in nz["summary"]:
        ll = nz["ll"].get(row["method"])
        if ref is None or ll is None or row["method"] == "bf16" or len(ll) != len(ref):
            continue
        d, lo, hi = eval_niah.paired_ll_delta(ll, ref)
        row["ll_delta"], row["ll_delta_lo"], row["ll_delta_hi"] = d, lo, hi


def task_ablations(c: Ctx) -> None:
    """Perplexity and INT2 key error of the base method with one factor changed at a time."""
    s = c.s
    spec, am = ablation_spec(s)
    err: dict = {}

    def run(mt):
        if mt.name not in c.memo:
            _run_ppl(c, mt)
        if mt.quantized:
            for r in eval_tni.key_mse(c.keys(), [mt], False, s.cache_dtype):
                err.setdefault(r["method"], []).append(r["key_mse"])
        ppl = {r["method"]: r for r in _ppl_rows(c, am)}
        c.res["ablations"] = [
            {"factor": f, "setting": v, "method": n, **ppl[n],
             "key_mse_layer_mean": float(np.mean(err[n]))}
            for f, v, n in spec if n in ppl and n in err]  # fmt: skip

    for mt in am:
        keys = ([("nll", mt.kv)] if mt.name not in c.memo else []) + (
            [("key_err", mt.kv)] if mt.quantized else [])  # fmt: skip
        c.unit("ablations", mt.name, keys, lambda mt=mt: run(mt))


RUNNERS = {"tni": task_tni, "ppl": task_ppl, "niah": task_niah, "ablations": task_ablations}


def save(res: dict, out_dir: str, memo: dict, run: dict) -> None:
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


def int2_variants(methods):
    """Each quantized method of the list at 2 bits (names kept when already 2-bit), in order.

    Only the library's own quantizers (a ``KVQuantConfig``): the key error is measured with
    ``oscar_jax.fake_quant_keys``; the comparison methods (``oscar_eval.methods``) quantize
    keys in their own ways and are measured by the perplexity and needle tasks."""
    out, seen = [], set()
    for mt in methods:
        if not mt.quantized or not isinstance(mt.kv, oj.KVQuantConfig):
            continue
        name = mt.name if mt.kv.bits == 2 else mt.name.replace(f"{mt.kv.bits}", "2", 1)
        if name not in seen:
            seen.add(name)
            out.append(parse_method(name, mt.kv.residual_length, mt.kv.group_size))
    return out
