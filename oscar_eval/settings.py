"""What an evaluation runs: the tasks, methods and sizes (``oscar-jax eval``'s options)."""

from __future__ import annotations

import dataclasses

from oscar_eval.common import DEFAULT_METHODS

TASKS = ("ppl", "niah", "tni", "ablations")
PPL_SCORES = ("all", "second_half")  # oscar_eval.ppl.score_start
MAX_DEFAULT_CTX = 4096  # the default context: the model's training context, capped here
NIAH_LENGTHS = (512, 1024, 2048, 4096)  # the default needle lengths, those within the context


@dataclasses.dataclass
class Settings:
    """What to evaluate and at which sizes (the defaults are the issue's full evaluation).

    ``ctx`` and ``niah_lengths`` left at None follow the model (``resolve``): the context
    is its ``max_position_embeddings`` (the context it was trained for) capped at 4096,
    the needle lengths those of 512, 1024, 2048, 4096 within it, so that no method,
    bf16 included, runs on positions the model never saw.
    """

    methods: str = ",".join(DEFAULT_METHODS)
    tasks: str = ",".join(TASKS)
    ctx: int | None = None  # perplexity / TNI context; None: the model's (see resolve)
    ppl_windows: int | None = None  # None: every window of the held-out sample
    ppl_batch: int | None = None  # windows per call; None: all (<= 32) off-CPU, 1 on a CPU
    ppl_score: str = "all"  # scored tokens of a window: "all" or "second_half" (ppl, ablations)
    niah_lengths: tuple[int, ...] | None = None  # None: NIAH_LENGTHS within the context
    niah_depths: tuple[int, ...] = tuple(range(0, 101, 10))
    niah_trials: int = 2  # prompts per (length, depth) cell
    niah_batch: int | None = None  # prompts per generate call; None: a whole group, capped by
    # the prompt's attention scores' memory (oscar_eval.niah.default_batch)
    niah_group: str = "auto"  # "length" / "all" (see eval_niah.groups); auto: all off-CPU
    niah_seed: int = 918_273
    niah_new_tokens: int = 8
    niah_chat: str = "auto"  # prompts as a chat turn: "auto" (if the model has a template), on, off
    tni_windows: int = 4
    ablation_base: str = "oscar2"
    residual_length: int = 128
    group_size: int = 32
    cache_dtype: str = (
        "bfloat16"  # what every cache stores full-precision K/V in (the paper's BF16)
    )
    seed: int = 0  # bootstrap
    show_progress: bool = True
    time_budget_s: float | None = None  # skip units that would end later (None: no limit)
    compile_workers: int | None = None  # threads compiling ahead (None: by backend; 0: none)

    def task_list(self) -> list[str]:
        tasks = [t.strip() for t in self.tasks.split(",") if t.strip()]
        bad = [t for t in tasks if t not in TASKS]
        if bad or not tasks:
            raise ValueError(f"tasks={self.tasks!r} must be a comma-separated subset of {TASKS}")
        return tasks

    def resolve(self, max_position_embeddings: int) -> Settings:
        """These settings with ``ctx`` / ``niah_lengths`` of None set for a model trained
        on ``max_position_embeddings`` tokens (see the class doc)."""
        ctx = self.ctx
        if ctx is None:
            ctx = min(int(max_position_embeddings), MAX_DEFAULT_CTX)
        if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 2:
            raise ValueError(f"ctx={self.ctx!r} must be an int >= 2 or None (the model's)")
        if self.ppl_score not in PPL_SCORES:
            raise ValueError(f"ppl_score={self.ppl_score!r} must be one of {PPL_SCORES}")
        lengths = self.niah_lengths
        if lengths is None:
            lengths = tuple(n for n in NIAH_LENGTHS if n <= max_position_embeddings)
            lengths = lengths or (min(NIAH_LENGTHS[0], int(max_position_embeddings)),)
        return dataclasses.replace(self, ctx=ctx, niah_lengths=tuple(lengths))
