"""How ``oscar-jax eval`` spends its time: compilations ahead of use, a time budget, counts.

Most of an evaluation of a small model is XLA compilation (one program per method
and shape: the cache config is static), not computing, on a GPU above all. So
``Precompiler`` compiles the programs of the evaluation's units ahead of their use,
in threads (XLA compiles without the GIL; ``jit(...).lower(...).compile()`` fills
the cache a later call hits), while the main thread runs the units whose programs
are ready. ``Budget`` skips units that would not finish in ``--time-budget-s``;
``CompileStats`` counts backend compilations (``jax.monitoring``).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import sys
import threading
import time
from collections.abc import Callable

import jax

_LOCK = threading.Lock()
_STATS = {"programs": 0, "compile_s": 0.0}
_REGISTERED = False


def _listener(event: str, duration: float, **_kw) -> None:
    if event.endswith("backend_compile_duration"):
        with _LOCK:
            _STATS["programs"] += 1
            _STATS["compile_s"] += float(duration)


class CompileStats:
    """Backend compilations (count, summed seconds over threads) since construction."""

    def __init__(self):
        global _REGISTERED
        with _LOCK:
            if not _REGISTERED:
                jax.monitoring.register_event_duration_secs_listener(_listener)
                _REGISTERED = True
            self.p0, self.s0 = _STATS["programs"], _STATS["compile_s"]

    def get(self) -> dict:
        with _LOCK:
            return {"programs": _STATS["programs"] - self.p0,
                    "compile_s": round(_STATS["compile_s"] - self.s0, 2)}  # fmt: skip


def default_workers() -> int:
    """Compile threads: most cores off-CPU (compiling is all the host does there); on a CPU
    backend the compilations share the cores with the computation, so at most 2."""
    n = os.cpu_count() or 1
    return max(1, min(12, n - 2)) if jax.default_backend() != "cpu" else min(2, n)


class Precompiler:
    """Compile thunks (``() -> compiled``) in a thread pool, in submission order.

    ``wait(key)`` blocks until that thunk is done; a thunk that raises only costs a
    note (the program then compiles at its first call, as without precompilation).
    ``workers=0`` compiles nothing ahead (every ``wait`` returns at once).
    """

    def __init__(self, workers: int, log: Callable[[str], None] | None = None):
        self.workers = int(workers)
        self.pool = cf.ThreadPoolExecutor(self.workers) if self.workers > 0 else None
        self.futures: dict = {}
        self.failed: list[str] = []
        self.log = log or (lambda s: None)

    def submit(self, key, thunk: Callable[[], object]) -> None:
        if self.pool is not None and key not in self.futures:
            self.futures[key] = self.pool.submit(thunk)

    def wait(self, key) -> float:
        """Seconds spent waiting for ``key``'s compilation (0 when none was submitted)."""
        f = self.futures.get(key)
        if f is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            f.result()
        except Exception as e:  # noqa: BLE001  (an optimization only: the call compiles)
            self.failed.append(f"{key}: {type(e).__name__}: {e}")
            self.log(f"precompile of {key} failed ({type(e).__name__}: {e}); compiling at use")
        return time.perf_counter() - t0

    def close(self) -> None:
        """Drop the compilations not started (e.g. of units the budget skips)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


class Budget:
    """Wall-clock budget of an evaluation: a unit runs only when it is expected to finish.

    A unit's expected duration is the longest one seen so far of its kind (its task);
    the first of a kind is expected to take ``first`` seconds.
    """

    def __init__(self, seconds: float | None, first: float = 0.0):
        if seconds is not None and not seconds > 0:
            raise ValueError(f"time_budget_s={seconds!r} must be > 0 (or None for no budget)")
        self.seconds, self.first = seconds, first
        self.t0 = time.perf_counter()
        self.seen: dict[str, float] = {}
        self.skipped: list[dict] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def allows(self, kind: str, name: str) -> bool:
        """True if unit ``name`` of ``kind`` should run; else it is recorded as skipped."""
        if self.seconds is None:
            return True
        est = self.seen.get(kind, self.first)
        if self.elapsed() + est <= self.seconds:
            return True
        self.skipped.append({"task": kind, "unit": name, "elapsed_s": round(self.elapsed(), 1),
                             "expected_s": round(est, 1)})  # fmt: skip
        return False

    def done(self, kind: str, seconds: float) -> None:
        self.seen[kind] = max(self.seen.get(kind, 0.0), seconds)


def say(msg: str, enabled: bool = True) -> None:
    """A progress line on stderr, flushed (a run killed later still shows how far it got)."""
    if enabled:
        print(f"oscar-jax eval: {msg}", file=sys.stderr, flush=True)
