"""Backends of the cache's ops: one explicit table per op, resolved lazily.

Every op that has more than one implementation looks its ``implementation=`` up here.
A table maps a backend name to the function itself (pure JAX, in this package) or to
``"module:function"`` of a kernel package, imported on first use, so a reader (or a
static tool) can follow a call from the public op to its kernel without running any
registration code. Names are the same for every op:

- ``"xla"``: the pure-JAX reference (any device);
- ``"triton"``: the Pallas kernels lowered through Triton (``pallas_kernels``; Pallas
  interpret mode without a GPU). ``"pallas"`` is accepted as another name for it.
- ``"mosaic"``: the Pallas Mosaic GPU INT2 / INT4 decode kernel (``decode_attention`` and the
  sequence shard's ``quantized_partial``; jax >= 0.11.2 and a Hopper GPU, else a
  ValueError on lookup); it reads a cache of ``KVQuantConfig(layout="record")`` as it is
  and refuses a planar one.

- ``"auto"`` (``decode_attention`` and ``quantized_partial``; the default): the first
  backend of ``AUTO_ORDER`` that runs on this device and covers the call, by the
  kernels' own coverage functions (``COVERAGE``): Mosaic for a record cache on a Hopper
  GPU, Triton on a GPU, XLA otherwise. ``choose`` says what it picks and why each earlier
  one was passed over.

An op can also be given a callable of the op's signature (e.g. a baseline under test).
An unknown or unavailable backend named explicitly raises a ``ValueError`` naming it and
what is available; nothing falls back silently.

``Backends`` bundles the choice for a decode step that composes several ops (attention,
encoder, one-launch cache write, prompt attention): ``Backends.of("triton")`` selects
every part, ``Backends.of("triton").replace(encode="xla")`` overrides one.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from oscar_jax.devices import gpu_available

# op -> backend -> function or "module:function" (imported on first use)
TABLES: dict[str, dict[str, Callable | str]] = {
    # fn(q [B, Hq, D], cache, *, softmax_scale=None, **options) -> [B, Hq, D]
    "decode_attention": {
        "xla": "oscar_jax.attention:decode_attention_xla",
        "triton": "pallas_kernels.decode.triton:decode_attention_triton",
        "mosaic": "pallas_kernels.decode.mosaic.backend:decode_attention",
    },
    # one sequence shard's quantized part (oscar_jax.sharding):
    # fn(q_rot [b, h, g, d], cache, scale, *, offset=0, **options) -> (acc, m, l)
    "quantized_partial": {
        "xla": "oscar_jax.attention:quantized_partial",
        "triton": "pallas_kernels.decode.triton:quantized_partial_triton",
        "mosaic": "pallas_kernels.decode.mosaic.backend:quantized_partial",
    },
    # fn(k [B, H, T, D], v, cfg, **options) -> (EncodedKeys, EncodedValues)
    "encode": {
        "xla": "oscar_jax.codec:encode_xla",
        "triton": "pallas_kernels.quantize.triton:encode",
    },
    # one layer's decode-step cache update in one launch (models' decode step):
    # fn(cache, k_t, v_t, flush) -> cache; "xla" composes append_to_ring and write_flush
    "cache_write": {
        "xla": "oscar_jax.flush:write_step",
        "triton": "pallas_kernels.cache_write:fused_update",
    },
}
ALIASES = {"pallas": "triton"}
# implementation="auto": the order tried, and each kernel's coverage function
# fn(cache, g) -> None (covered) or why not (g: query heads per KV head); XLA covers all
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "decode_attention": ("mosaic", "triton", "xla"),
    "quantized_partial": ("mosaic", "triton", "xla"),
}
COVERAGE: dict[tuple[str, str], str] = {
    ("decode_attention", "mosaic"): "pallas_kernels.decode.mosaic:unsupported_reason",
    ("decode_attention", "triton"): "pallas_kernels.decode.triton:unsupported_reason",
    ("quantized_partial", "triton"): "pallas_kernels.decode.triton:unsupported_reason",
    ("quantized_partial", "mosaic"): "pallas_kernels.decode.mosaic:unsupported_reason",
}
# decode_attention backends that return NaN for FLAG_NONFINITE rows themselves
POISONING = frozenset({("decode_attention", "triton"), ("decode_attention", "mosaic")})
_RESOLVED: dict[tuple[str, str], Callable] = {}


def canonical(op: str, implementation) -> str | Callable:
    """The table name of ``implementation`` for ``op`` (aliases resolved), or the callable.

    ValueError naming the value unless it is a backend of ``op`` or a callable.
    """
    if op not in TABLES:
        raise ValueError(f"op={op!r} must be one of {sorted(TABLES)}")
    if callable(implementation):
        return implementation
    if implementation == "auto" and op in AUTO_ORDER:
        return "auto"
    if not isinstance(implementation, str):
        raise ValueError(
            f"implementation={implementation!r} must be a str, one of {available(op)}, "
            "or a callable"
        )
    name = ALIASES.get(implementation, implementation)
    if name not in TABLES[op]:
        raise ValueError(
            f"implementation={implementation!r} must be one of {available(op)} for {op} "
            f"(or a callable)"
        )
    return name


def resolve(op: str, implementation) -> Callable:
    """The function of ``implementation`` for ``op`` (imported on first use)."""
    name = canonical(op, implementation)
    if callable(name):
        return name
    if name == "auto":
        return _AUTO[op]
    key = (op, name)
    if key not in _RESOLVED:
        entry = TABLES[op][name]
        _RESOLVED[key] = _load(entry, f"implementation={name!r} of {op}")
    return _RESOLVED[key]


def _load(entry: Callable | str, what: str) -> Callable:
    """A table entry: the function, or ``"module:function"`` imported (ValueError naming
    ``what`` when the import fails)."""
    if not isinstance(entry, str):
        return entry
    module, _, attr = entry.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ValueError(f"{what} is not available here: importing {module} failed ({e})") from e


def available(op: str) -> tuple[str, ...]:
    """The backend names of ``op`` (aliases and "auto" included), sorted."""
    names = {*TABLES[op], *(a for a, n in ALIASES.items() if n in TABLES[op])}
    return tuple(sorted(names | ({"auto"} if op in AUTO_ORDER else set())))


def choose(op: str, cache, g: int) -> tuple[str, dict[str, str]]:
    """The backend ``implementation="auto"`` runs for ``op`` over ``cache`` with ``g``
    query heads per KV head, and why each backend before it in ``AUTO_ORDER`` was not.

    Triton counts only on a GPU (without one it runs in interpret mode, for tests); a
    kernel that cannot be imported here (e.g. Mosaic without a Hopper GPU) is passed over
    with the import's reason. Decided at trace time from static shapes and config."""
    skipped: dict[str, str] = {}
    for name in AUTO_ORDER[op]:
        why = None
        if name != "xla":
            if not gpu_available():
                why = "no GPU"
            else:
                try:
                    resolve(op, name)
                    why = _load(COVERAGE[op, name], f"coverage of {name!r}")(cache, g)
                except ValueError as e:
                    why = str(e)
        if why is None:
            return name, skipped
        skipped[name] = why
    raise AssertionError(f"AUTO_ORDER[{op!r}] must end with 'xla'")  # internal invariant


def pick(op: str, implementation, cache, g: int, options: dict | None = None) -> str | Callable:
    """``implementation`` with "auto" replaced by ``choose``'s backend (else canonical);
    ValueError for tuning ``options`` with "auto" (they tune one named backend)."""
    name = canonical(op, implementation)
    if name != "auto":
        return name
    _no_options(options or {})
    return choose(op, cache, g)[0]


def _no_options(options: dict) -> None:
    if options:
        raise ValueError(
            f"options {sorted(options)} tune one backend: pass its name as implementation=, "
            "not 'auto'"
        )


def _auto_decode_attention(q, cache, *, softmax_scale=None, **options):
    name = pick("decode_attention", "auto", cache, q.shape[1] // cache.num_kv_heads, options)
    return resolve("decode_attention", name)(q, cache, softmax_scale=softmax_scale)


def _auto_quantized_partial(q_rot, cache, scale, *, offset=0, **options):
    name = pick("quantized_partial", "auto", cache, q_rot.shape[2], options)
    return resolve("quantized_partial", name)(q_rot, cache, scale, offset=offset)


_AUTO: dict[str, Callable] = {
    "decode_attention": _auto_decode_attention,
    "quantized_partial": _auto_quantized_partial,
}


def poisons(op: str, implementation) -> bool:
    """Whether ``implementation`` makes FLAG_NONFINITE rows NaN itself."""
    name = canonical(op, implementation)
    return not callable(name) and (op, name) in POISONING


PROMPT_ATTENTION = ("auto", "reference", "cudnn", "xla")


@dataclasses.dataclass(frozen=True)
class Backends:
    """The backends of one decode step, part by part (names of ``TABLES``' ops).

    ``attention``: ``decode_attention`` (or, sharded over sequence, its
    ``quantized_partial``); ``encode``: the quantizer of flushes and of the prefill;
    ``cache_write``: "triton" writes a layer's step (ring slot, flushed group) in one
    launch where it can, "xla" with separate ops; ``prompt_attention``: the prefill's
    full-precision attention (``models.layers.causal_attention``: "reference", "cudnn",
    "xla", or "auto").
    """

    attention: str | Callable = "auto"
    encode: str | Callable = "xla"
    cache_write: str = "xla"
    prompt_attention: str = "auto"

    def __post_init__(self):
        for field, op in (("attention", "decode_attention"), ("encode", "encode"),
                          ("cache_write", "cache_write")):  # fmt: skip
            value = getattr(self, field)
            try:
                name = canonical(op, value)
            except ValueError as e:
                raise ValueError(f"Backends.{field}={value!r}: {e}") from None
            object.__setattr__(self, field, name)
        if callable(self.cache_write):
            raise ValueError(f"Backends.cache_write={self.cache_write!r} must be a name")
        if self.prompt_attention not in PROMPT_ATTENTION:
            raise ValueError(
                f"Backends.prompt_attention={self.prompt_attention!r} must be one of "
                f"{PROMPT_ATTENTION}"
            )

    @classmethod
    def of(cls, spec: str | Backends) -> Backends:
        """``spec`` as Backends: a name selects it for every part that has it ("xla" for
        the others: "mosaic" is an attention backend only)."""
        if isinstance(spec, Backends):
            return spec
        if not isinstance(spec, str):
            raise ValueError(
                f"implementation={spec!r} must be a backend name "
                f"{available('decode_attention')} or a Backends"
            )
        name = canonical("decode_attention", spec)
        part = {op: name if name in TABLES[op] else "xla" for op in ("encode", "cache_write")}
        return cls(attention=name, encode=part["encode"], cache_write=part["cache_write"])

    def replace(self, **changes) -> Backends:
        return dataclasses.replace(self, **changes)
