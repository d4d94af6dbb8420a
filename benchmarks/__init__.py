"""Benchmark and measurement scripts over the public API; run from the repository root as
``python3 -m benchmarks.NAME --help``. Raw outputs go to ``--out`` (by convention under
the ignored ``out/``); the curated tables and plots are in ``BENCHMARKS.md`` and
``docs/figures/``."""
