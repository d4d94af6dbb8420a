"""Chat-template prompts for instruct models (the needle task's ``--niah-chat``).

An instruct model is asked as in chat: the passkey text (preamble, filler, needle, the
question "What is the pass key?") is the user's message, rendered with the model's own
chat template (a Jinja template: GGUF ``tokenizer.chat_template``, or ``chat_template``
of a Hugging Face directory's tokenizer_config.json) with the generation prompt, and the
assistant's turn is started with "The pass key is", so that the answer's five digits come
next in both the plain and the chat form and their log-likelihood is comparable.

The rendered text is encoded without the tokenizer's post-processor and without an extra
BOS: the template's own first token (``<|im_start|>`` for ChatML templates such as
SmolLM2's and Qwen2.5's) is what the model saw first in chat training, and so is the
sink here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from models import gguf
from oscar_eval.passkey import QUESTION

ANSWER_LEAD = " The pass key is"  # QUESTION's tail: the assistant's turn starts with it
CHAT_MODES = ("auto", "on", "off")


def chat_template(model_path: str) -> str | None:
    """The model's chat template (GGUF metadata or tokenizer_config.json), or None."""
    if not model_path:
        return None
    if os.path.isfile(model_path) and gguf.is_gguf(model_path):
        t = gguf.read_header(model_path).metadata.get("tokenizer.chat_template")
        return t if isinstance(t, str) and t.strip() else None
    cfg = os.path.join(model_path, "tokenizer_config.json")
    if os.path.isfile(cfg):
        with open(cfg, encoding="utf-8") as f:
            t = json.load(f).get("chat_template")
        return t if isinstance(t, str) and t.strip() else None
    return None


def render(template: str, user: str, **special) -> str:
    """One user message through ``template`` with the generation prompt (sandboxed Jinja)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        tpl = env.from_string(template)
        return tpl.render(messages=[{"role": "user", "content": user}],
                          add_generation_prompt=True, tools=None, **special)  # fmt: skip
    except Exception as e:  # a template error names the template, not a jinja internals trace
        raise ValueError(f"the model's chat template does not render: {e}") from e


def make_chat_encode(tokenizer, template: str) -> Callable[[str], list[int]]:
    """Passkey text -> chat ids: everything before ``ANSWER_LEAD`` is the user's message,
    the lead starts the assistant's turn. A text without the lead (``passkey_prompt``
    measures filler lengths with such texts) is the user's message alone."""
    if not QUESTION.endswith(ANSWER_LEAD):
        raise ValueError(f"{QUESTION=} must end with {ANSWER_LEAD=}")

    def encode(text: str) -> list[int]:
        lead = ""
        if text.endswith(ANSWER_LEAD):
            text, lead = text[: -len(ANSWER_LEAD)], ANSWER_LEAD.strip()
        chat = render(template, text.strip()) + lead
        return list(tokenizer.encode(chat, add_special_tokens=False).ids)

    return encode


def use_chat(mode: str, template: str | None) -> bool:
    """Whether the needle prompts go through the chat template: ``auto`` when the model
    has one (an instruct model), ``on`` (an error without one), ``off``."""
    if mode not in CHAT_MODES:
        raise ValueError(f"niah_chat={mode!r} must be one of {CHAT_MODES}")
    if mode == "on" and template is None:
        raise ValueError("niah_chat='on' needs a chat template, and the model has none")
    return mode == "on" or (mode == "auto" and template is not None)
