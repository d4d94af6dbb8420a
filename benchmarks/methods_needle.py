"""Issue 36: the passkey answer's log-likelihood for the comparison methods.

The ``niah`` task of ``oscar-jax eval`` scores these methods teacher-forced as well, on
its own length x depth grid; this script is the quick form for one length, with its
calibration windows chosen freely. It teacher-forces the answer
(``oscar_eval.niah.answer_logprob``: the prompt prefilled at full precision, the answer's
tokens attending to the cache as when decoded; the k-bias offset reaches ``oscarb`` /
``turbob``). The methods that need calibration (``kvquant``, ``oscarp``, ``oscaro``,
``oscarbo_nuq1``) are fitted as ``oscar-jax eval`` fits them for its perplexity
(``oscar_eval.calibrate.calibrate_heldout``): on the held-out text ``oscar-jax eval`` would
use (``--heldout``, else the model's ``heldout_sample.npy``, else the bundled documents as
text), the windows of ``--calib-ctx`` tokens after the first ``--calib-scored`` (defaults:
the comparison table's 4 scored windows of 1,024), so with the same fitted state as that
table; the needle prompts (passkey filler) share no text with them. Prints the summed
answer log-likelihood per method, its mean over prompts, whether greedy decoding would emit
exactly the answer's tokens (``answer_scores``: every teacher-forced position's argmax is
its target) and the paired difference to bf16::

    python -m benchmarks.methods_needle --model qwen2.5-0.5b --length 512 \
        --depths 10,50,90 --methods bf16,kivi2,oscar2,oscarb2,kvquant2
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np

import models
from models import fetch
from oscar_cli.cli import _heldout
from oscar_eval import niah as eval_niah
from oscar_eval.calibrate import calibrate_heldout
from oscar_eval.common import make_encode, parse_methods


def main(argv=None) -> dict[str, np.ndarray]:
    """Prints the table; returns the answer log-likelihoods per prompt by method name."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--depths", default="10,50,90")
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--methods", default="bf16,kivi2,oscar2,oscarb2")
    ap.add_argument(
        "--heldout",
        default=None,
        help="calibration text as oscar-jax eval's --heldout (.npy ids or text)",
    )
    ap.add_argument("--calib-ctx", type=int, default=1024)
    ap.add_argument(
        "--calib-scored",
        type=int,
        default=4,
        help="windows the perplexity run scores; calibration takes the next ones",
    )
    a = ap.parse_args(argv)
    path = fetch.resolve_model(a.model)
    m = models.from_pretrained(path, dtype=jnp.float32)
    enc = make_encode(m.tokenizer, m.config.bos_token_id)
    ans = lambda text: m.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    depths = [int(x) for x in a.depths.split(",")]
    prompts = eval_niah.build_prompts(enc, [a.length], depths, a.trials, answer_encode=ans)
    methods = parse_methods(a.methods, 128, 32)
    if any(getattr(mt.kv, "needs_calibration", False) for mt in methods):
        t0 = time.perf_counter()
        heldout, src = _heldout(a, m, path)
        if heldout is None:
            raise SystemExit(f"calibrated methods need held-out text: {src!r} does not exist")
        methods, note = calibrate_heldout(m, methods, heldout, a.calib_ctx, a.calib_scored)
        print(f"{note} of {src} ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = {}
    for mt in methods:
        t0 = time.perf_counter()
        sc = eval_niah.answer_scores(m, prompts, mt.kv, batch=len(prompts),
                                     cache_dtype="bfloat16")  # fmt: skip
        ll, hit = np.asarray([s[0] for s in sc]), [s[1] for s in sc]
        rows[mt.name] = ll
        print(f"{mt.name}: answer log-likelihood per prompt {np.round(ll, 3).tolist()} "
              f"mean {np.mean(ll):.3f}; greedy emits the answer {sum(hit)}/{len(hit)} "
              f"{''.join('x' if h else '.' for h in hit)} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    if "bf16" in rows:
        for k, v in rows.items():
            d = v - rows["bf16"]
            print(f"{k} - bf16: mean {d.mean():+.3f}, per prompt {np.round(d, 3).tolist()}")
    return rows


if __name__ == "__main__":
    main()
