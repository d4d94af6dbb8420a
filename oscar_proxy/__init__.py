"""The bundled proxy model: its corpus, training recipe, trainer and Hugging Face export.

``BUNDLED`` is the directory of the trained checkpoint shipped with the package (a Hugging
Face Llama layout: config.json, safetensors, tokenizer.json, plus ``heldout_sample.npy``).
Training needs the ``train`` extra (optax): ``python3 -m oscar_proxy.train --help``.
"""

import os

BUNDLED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bundled")

__all__ = ["BUNDLED"]
