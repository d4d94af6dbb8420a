"""Evaluation of KV-cache methods on a model: perplexity, needle / passkey retrieval,
Token Norm Imbalance diagnostics and ablations, with a resumable runner and reports.

    s = oscar_eval.Settings(methods="bf16,kivi2,oscar2", tasks="ppl")
    res = oscar_eval.run_eval(model, heldout_ids, "out/eval", s)  # writes results.json, .md

The command line is ``oscar-jax eval`` (``oscar_cli``).
"""

from oscar_eval.common import DEFAULT_METHODS, Method, parse_method, parse_methods
from oscar_eval.report import markdown, replot
from oscar_eval.runner import load_heldout, run_eval
from oscar_eval.settings import Settings
from oscar_eval.tasks import decoder

__all__ = [
    "DEFAULT_METHODS", "Method", "Settings", "decoder", "load_heldout", "markdown", "parse_method",
    "parse_methods", "replot", "run_eval",
]  # fmt: skip
