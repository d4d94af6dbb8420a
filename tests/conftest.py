import os
import tempfile

# 8 simulated CPU devices for the sharding tests; set before JAX starts its backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

# The tests compile hundreds of small XLA programs whose run time is negligible; LLVM at
# -O0 takes about half the compile time (4 model test files, 2 workers: 500 -> 274 s on
# a 2-core machine). A level set in XLA_FLAGS by the caller is kept.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# On a GPU each pytest-xdist worker would pre-allocate 75% of the device memory: on the
# H200 `-n 4` failed 50 of 56 cache / attention tests that way and passed all without it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# One persistent XLA compilation cache for the session's processes (the xdist workers and
# the subprocesses some tests start, through JAX's own environment variables): many tests
# compile the same programs (a model's decode step, the cache ops at the same shapes) from
# fresh jit objects, and on a CPU compiling is most of a test's time. Keyed by the program,
# jax version and flags, so a hit is the same executable. OSCAR_TEST_XLA_CACHE=off turns it
# off; a path puts it there.
_xla_cache = os.environ.get(
    "OSCAR_TEST_XLA_CACHE",
    os.path.join(tempfile.gettempdir(), f"oscar-jax-test-xla-cache-{os.getuid()}"),
)
if _xla_cache != "off":
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _xla_cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

import models  # noqa: E402
from oscar_jax import gpu_available  # noqa: E402, F401  (the tests' GPU check)

jax.config.update("jax_enable_x64", False)
if _xla_cache != "off":  # also where a plugin imported jax before the variables were set
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# Hypothesis profiles (tests/test_fuzz.py): "ci" (default) is derandomized with no
# shrinking and each property's own small example count, so CI time stays bounded;
# "long" (OSCAR_HYPOTHESIS_PROFILE=long) multiplies the counts (test_fuzz.SCALE) and
# shrinks failures. Both derandomized: a run is reproduced by its command.
try:
    from hypothesis import HealthCheck, Phase, settings
except ImportError:  # hypothesis is a test extra; only test_fuzz needs it
    settings = None
if settings is not None:
    _common = dict(
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.register_profile("ci", phases=(Phase.explicit, Phase.generate), **_common)
    settings.register_profile(
        "long", phases=(Phase.explicit, Phase.generate, Phase.shrink), print_blob=True, **_common
    )
    settings.load_profile(os.environ.get("OSCAR_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop every compiled program after each test module.

    XLA:CPU maps each compiled program's code into its own memory regions (~3 for a small
    program, ~300 for an interpret-mode Pallas kernel), and jit caches keep them for the
    life of the process. A pytest-xdist worker that runs the whole suite went past the
    kernel's limit of 65,530 maps (vm.max_map_count): LLVM then fails with "Cannot
    allocate memory" and XLA segfaults inside a compile (reproduced by filling the map
    table before one kernel compile). Programs are rarely shared between modules, so
    this costs little compile time."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="module")
def tiny():
    """A random Llama with weights large enough for confident, quantization-sensitive logits
    (the evaluation tests' model)."""
    cfg = models.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                             num_heads=4, num_kv_heads=2, head_dim=32)  # fmt: skip
    m = models.CausalLM(cfg, rngs=nnx.Rngs(0))
    p = m.params()
    p["lm_head"] = p["lm_head"] * 8.0
    p["layers"] = {k: (v * 6.0 if k.startswith("w") else v) for k, v in p["layers"].items()}
    m.set_params(p)
    return m
