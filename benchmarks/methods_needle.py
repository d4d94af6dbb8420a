"""Issue 36: the passkey answer's log-likelihood for the comparison methods.

The ``niah`` task decodes through the real cache, which refuses the comparison methods
(``oscar_jax.methods``); this teacher-forces the answer instead
(``oscar_eval.niah.answer_logprob``: the prompt prefilled at full precision, the answer's
tokens attending to the cache as when decoded; the k-bias offset reaches ``oscarb`` /
``turbob``). Prints the summed answer log-likelihood per method, its mean over prompts and
the paired difference to bf16::

    python -m benchmarks.methods_needle --model qwen2.5-0.5b --length 512 \
        --depths 10,50,90 --methods bf16,kivi2,oscar2,oscarb2
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np

import models
from models import fetch
from oscar_eval import niah as eval_niah
from oscar_eval.common import make_encode, parse_methods


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--depths", default="10,50,90")
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--methods", default="bf16,kivi2,oscar2,oscarb2")
    a = ap.parse_args(argv)
    m = models.from_pretrained(fetch.resolve_model(a.model), dtype=jnp.float32)
    enc = make_encode(m.tokenizer, m.config.bos_token_id)
    ans = lambda text: m.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    depths = [int(x) for x in a.depths.split(",")]
    prompts = eval_niah.build_prompts(enc, [a.length], depths, a.trials, answer_encode=ans)
    rows = {}
    for mt in parse_methods(a.methods, 128, 32):
        t0 = time.perf_counter()
        ll = eval_niah.answer_logprob(m, prompts, mt.kv, batch=len(prompts),
                                      cache_dtype="bfloat16")  # fmt: skip
        rows[mt.name] = np.asarray(ll)
        print(f"{mt.name}: answer log-likelihood per prompt {np.round(ll, 3).tolist()} "
              f"mean {np.mean(ll):.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    if "bf16" in rows:
        for k, v in rows.items():
            d = v - rows["bf16"]
            print(f"{k} - bf16: mean {d.mean():+.3f}, per prompt {np.round(d, 3).tolist()}")


if __name__ == "__main__":
    main()
