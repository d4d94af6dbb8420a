"""Generation over the OScaR KV cache: full-precision prefill, then ``lax.scan`` decoding.

One ``jax.jit`` covers the whole call: the prompt (right-padded to a length
bucket) runs through the layers with full-precision causal attention; its
post-RoPE keys and (rotation-folded) values fill one cache per layer (a tuple of
L ``KVCache``s); then a ``lax.scan`` over the new tokens carries (caches, last
token, its position, PRNG key, per-row stop state: a ``DecodeState``) and each step is
``step(st, params, state) -> state``: ``models.forward.decode_forward`` (the layers
unrolled over their caches, each updated in place; see ``models.step``), then the
sampler and the stop logic; ``generate_stepwise`` runs the same ``step``. The
params are ``CausalLM.decode_params``: the layers unstacked once (a tuple of per-layer
dicts, cached by the model), so prefill and every step read the weights where they lie.

Stopping: a row stops at a stop token, or as soon as its caches are flagged
(``FLAG_*`` of ``oscar_jax.cache``, OR-ed over layers) or its logits are not
finite: the token sampled from such logits is replaced by the pad id, and so is
every later one. ``STOP_*`` (``info["stop_reason"]``, ``models.stopping``) says why;
``FLAG_STOP`` maps the cache flags to reasons. Nothing raises under ``jit``.

With ``mesh=`` (a ``jax.sharding.Mesh`` with axes data / model / sequence) the
same program runs sharded in the layout of ``models.sharding``: ``prepare`` picks the
placement once (``models.placement``); it places params and inputs on the mesh, the
per-layer step calls ``oscar_jax.sharding.sharded_append`` / ``sharded_decode_attention``
through it, and the caches are pinned to their layout (``with_sharding_constraint``)
after prefill and after every step, so the ``lax.scan`` carry keeps its shardings.

Compilation is keyed by (batch, prompt bucket, max_new_tokens, cache length,
configs, sampling mode): prompts of different lengths in one bucket and
different temperatures / top_p / seeds reuse it (``trace_count`` proves it).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import oscar_jax as oj
from models import layers, memory, stopping
from models import sharding as msh
from models.config import ModelConfig
from models.forward import Static, decode_forward, prefill_forward
from models.model import CausalLM
from models.placement import placement
from models.window import WindowCache
from oscar_jax import sharding as osh
from oscar_jax.backends import Backends

_TRACES: collections.Counter = collections.Counter()


def trace_count(name: str = "generate") -> int:
    """How many times the jitted generation (``generate``) or step (``step``) was traced."""
    return _TRACES[name]


def bucket_length(t: int) -> int:
    """Prompt length bucket: powers of two from 16 up to 64, then multiples of 64."""
    if t <= 64:
        return max(16, 1 << max(0, int(t - 1).bit_length()))
    return -(-t // 64) * 64


def _sample(st: Static, logits, key, temperature, top_p):
    if st.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    lg = logits.astype(jnp.float32) / temperature
    if st.top_k is not None:
        kth = jax.lax.top_k(lg, st.top_k)[0][:, -1:]
        lg = jnp.where(lg < kth, -jnp.inf, lg)
    if st.use_top_p:
        srt = jnp.sort(lg, axis=-1)[:, ::-1]
        p = jax.nn.softmax(srt, axis=-1)
        keep = (jnp.cumsum(p, axis=-1) - p) < top_p
        n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
        thr = jnp.take_along_axis(srt, (n_keep - 1)[:, None], axis=-1)
        lg = jnp.where(lg < thr, -jnp.inf, lg)
    return jax.random.categorical(key, lg, axis=-1).astype(jnp.int32)


def _layer_flags(caches):
    return functools.reduce(jnp.bitwise_or, [c.flags for c in caches])  # [B] OR-ed over layers


def _next(st: Static, logits, key, s: stopping.StopState, flags, temperature, top_p):
    """Sample, stop flagged rows, replace stopped rows' token by the pad id."""
    tok = _sample(st, logits, key, temperature, top_p)
    return stopping.advance(tok, flags, logits, s, pad_id=st.pad_id, stop_tokens=st.stop_tokens)


@oj.persistence.register_node  # oj.save_state(path, state) / oj.load_state(path): resumable
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """What one decode step reads and writes (a registered pytree: the ``lax.scan`` carry)."""

    caches: tuple  # L per-layer KVCaches, updated in place
    tok: jax.Array  # [B] int32: the token to feed (the last one sampled)
    pos: jax.Array  # [B] int32: its position
    key: jax.Array  # PRNG key of the next sample
    stop: stopping.StopState  # per row: done, reason, tokens emitted


def first_state(st: Static, logits, caches, lengths, key, temperature, top_p) -> DecodeState:
    """The state after the prefill: the first token sampled from the prompt's last logits."""
    key, sk = jax.random.split(key)
    s0 = stopping.stop_init(lengths.shape[0])
    tok, s = _next(st, logits, sk, s0, _layer_flags(caches), temperature, top_p)
    return DecodeState(caches, tok, lengths, key, s)


def step(st: Static, params, state: DecodeState, temperature, top_p) -> DecodeState:
    """One decode step: feed ``state.tok``, sample the next token, advance the stop state."""
    logits, caches = decode_forward(st, params, state.caches, state.tok, state.pos)
    key, sk = jax.random.split(state.key)
    tok, s = _next(st, logits, sk, state.stop, _layer_flags(caches), temperature, top_p)
    tok, s = jax.tree_util.tree_map(lambda a: st.place.constrain(a, P(st.axes.data)), (tok, s))
    return DecodeState(caches, tok, state.pos + 1, key, s)


def _info(state: DecodeState) -> dict:
    s = state.stop
    return dict(flags=_layer_flags(state.caches), cache_lengths=state.caches[0].lengths,
                done=s.done, stop_reason=s.reason, num_tokens=s.count)  # fmt: skip


@functools.partial(jax.jit, static_argnums=(0, 1))
def _generate_jit(st: Static, n_new: int, params, ids, lengths, key, temperature, top_p):
    _TRACES["generate"] += 1
    logits, caches = prefill_forward(st, params, ids, lengths)
    state = first_state(st, logits, caches, lengths, key, temperature, top_p)

    def body(state, _):
        state = step(st, params, state, temperature, top_p)
        return state, state.tok

    tok0 = state.tok
    state, toks = jax.lax.scan(body, state, None, length=n_new - 1)
    return jnp.concatenate([tok0[:, None], toks.T], axis=1), _info(state)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _state_step_jit(st: Static, params, state: DecodeState, temperature, top_p):
    _TRACES["state_step"] += 1
    return step(st, params, state, temperature, top_p)


@functools.partial(jax.jit, static_argnums=0)
def _prefill_jit(st: Static, params, ids, lengths):
    _TRACES["prefill"] += 1
    return prefill_forward(st, params, ids, lengths)


def _step(st: Static, params, caches, tok, pos):
    _TRACES["step"] += 1
    return decode_forward(st, params, caches, tok, pos)


_step_jit = jax.jit(_step, static_argnums=0)
_step_jit_donated = jax.jit(_step, static_argnums=0, donate_argnums=2)  # caches in place


def step_program(*, donate: bool = False):
    """The jitted decode step ``(st, params, caches, tok, pos) -> (logits, caches)`` that
    ``decode_step`` runs (``.lower(...)`` gives its HLO; ``donate`` updates the caches in
    place)."""
    return _step_jit_donated if donate else _step_jit


# -- host-side API ------------------------------------------------------------------
class Prepared(NamedTuple):
    """A validated call: static config, padded inputs, and where its params come from."""

    st: Static
    ids: jax.Array  # [B, T_bucket] int32, right-padded
    lengths: jax.Array  # [B] int32
    model: CausalLM
    kv: oj.KVQuantConfig  # as given (its value rotation is folded into the params)

    @property
    def decode_params(self) -> dict:
        """What the programs run on: ``CausalLM.decode_params`` (per-layer, folded, placed on
        the mesh if any; built on first use, cached by the model)."""
        return self.model.decode_params(self.kv, self.st.mesh, self.st.axes)

    @property
    def params(self) -> dict:
        """The stacked form (folded, placed): ``folded_params`` / ``sharded_params``, built on
        first use and cached by the model (a further copy of the weights: for inspection and
        programs written for stacked params; the step runs on both forms)."""
        return self.st.place.stacked_params(self.model, self.kv)


class KeyBiasWarning(UserWarning):
    """A rotated-key INT2 cache on a model whose k projection has a bias (``prepare``)."""


KEY_BIAS_WARNING = (
    "kv method {method!r} rotates the keys of a model with k-projection biases (Qwen2 style): "
    "on Qwen2.5-0.5B that made INT2 perplexity +219% to +468% over bf16 at 8K-32K windows "
    "where 'ots_only' (no rotation) and 'kivi' gave +3.4% to +8.2% (ACCURACY.md); check this "
    "model with python3 -m "
    "benchmarks.real_model_keys, or use oj.preset('ots_only', bits=2)"
)


def prepare(
    m: CausalLM,
    input_ids,
    *,
    max_new_tokens: int,
    kv: oj.KVQuantConfig,
    lengths=None,
    max_len: int | None = None,
    cache_dtype=None,
    implementation: str | Backends = "auto",
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens=None,
    pad_token_id: int | None = None,
    mesh: Mesh | None = None,
    mesh_axes: osh.MeshAxes = osh.AXES,
) -> Prepared:
    """Validate the inputs (ValueError on bad ids / lengths / sizes) and build the static config.

    The params are the model's ``decode_params`` (``Prepared.decode_params``), made on
    first use and cached by the model.
    """
    if not isinstance(kv, oj.KVQuantConfig):
        raise ValueError(f"kv={kv!r} must be a KVQuantConfig (see oscar_jax.preset)")
    ids = m.check_ids(input_ids)
    b, t = ids.shape
    if b < 1 or t < 1:
        raise ValueError(f"input_ids.shape={ids.shape} must be non-empty")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer) \
            or max_new_tokens < 1:  # fmt: skip
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    if lengths is None:
        lens = np.full((b,), t, np.int64)
    else:
        lens = np.asarray(lengths)
        if lens.shape != (b,) or not np.issubdtype(lens.dtype, np.integer):
            raise ValueError(f"lengths.shape={lens.shape} must be ({b},) integers")
        if lens.min() < 1 or lens.max() > t:
            raise ValueError(f"lengths={lens.tolist()} must lie in [1, T={t}]")
    tb = bucket_length(t)
    if max_len is None:
        max_len = tb + int(max_new_tokens)
    if int(lens.max()) > max_len:
        raise ValueError(
            f"prompt length {int(lens.max())} is longer than the cache (max_len={max_len})"
        )
    tb = min(tb, max_len)
    pad = np.zeros((b, tb), np.int32)
    n = min(t, tb)
    pad[:, :n] = ids[:, :n]
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    greedy = temperature == 0.0
    if top_k is not None and not (1 <= top_k <= m.config.vocab_size):
        raise ValueError(f"top_k={top_k} must be in [1, vocab_size]")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    stops = m.config.eos_token_ids if stop_tokens is None else tuple(int(s) for s in stop_tokens)
    if pad_token_id is None:
        pad_token_id = m.config.pad_token_id
    if pad_token_id is None:
        pad_token_id = stops[0] if stops else 0
    if kv.rotate_keys and kv.quantized and kv.bits <= 2 and m.config.qkv_bias:
        warnings.warn(KEY_BIAS_WARNING.format(method=kv.method), KeyBiasWarning, stacklevel=3)
    be = Backends.of(implementation)
    be = be.replace(prompt_attention=_check_prompt_attention(be.prompt_attention, m.dtype, mesh))
    cache_kv = memory.cache_config(m.config, kv, attention=be.attention, sharded=mesh is not None)
    if mesh is not None:
        check_mesh(m.config, cache_kv, mesh, mesh_axes, b, int(max_len), be.attention)
    st = Static(
        model=m.config, kv=cache_kv, max_len=int(max_len),
        cache_dtype=jnp.dtype(cache_dtype or m.dtype).name, backends=be,
        greedy=greedy, top_k=None if greedy else top_k,
        use_top_p=(not greedy) and top_p is not None and top_p < 1.0,
        stop_tokens=stops, pad_id=int(pad_token_id), place=placement(mesh, mesh_axes),
    )  # fmt: skip
    ids_j, lens_j = (
        st.place.put_rows(jnp.asarray(pad)),
        st.place.put_rows(jnp.asarray(lens, jnp.int32)),
    )
    return Prepared(st, ids_j, lens_j, m, kv)


def _check_prompt_attention(impl, dtype, mesh) -> str:
    """The concrete implementation of ``impl`` (see ``layers.resolve_prompt_attention``);
    ValueError unless ``layers.causal_attention`` can run it here."""
    if impl not in layers.PROMPT_ATTENTION:
        raise ValueError(f"prompt_attention={impl!r} must be one of {layers.PROMPT_ATTENTION}")
    impl = layers.resolve_prompt_attention(impl, dtype, sharded=mesh is not None)
    if impl == "reference":
        return impl
    if mesh is not None:
        raise ValueError(f"prompt_attention={impl!r}: sharded runs (mesh=...) use 'reference'")
    if impl == "cudnn":
        if not oj.gpu_available():
            raise ValueError("prompt_attention='cudnn' needs a GPU; use 'reference' or 'xla'")
        if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
            raise ValueError(
                f"prompt_attention='cudnn' needs a bfloat16/float16 model, got {jnp.dtype(dtype)}"
            )
    return impl


def check_mesh(mc: ModelConfig, kv, mesh, ax, batch: int, max_len: int, implementation="xla"):
    """ValueError unless the model, batch and cache divide over the mesh (see models.sharding)
    and ``implementation`` has a per-shard attention partial."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh={mesh!r} must be a jax.sharding.Mesh")
    oj.backends.resolve("quantized_partial", implementation)
    msh.check_model_mesh(mc, mesh, ax, batch=batch)
    msh.warn_known_crash(kv, mesh)
    shape = jax.eval_shape(lambda: oj.init_cache(
        kv, batch=batch, max_len=max_len, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
    ))  # fmt: skip
    osh.check_mesh(shape, mesh, ax)


def generate(
    m: CausalLM,
    input_ids,
    max_new_tokens: int,
    kv: oj.KVQuantConfig | None = None,
    lengths=None,
    temperature: float = 0.0,
    seed: int = 0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens=None,
    implementation: str | Backends = "auto",
    *,
    max_len: int | None = None,
    cache_dtype=None,
    pad_token_id: int | None = None,
    return_info: bool = False,
    mesh: Mesh | None = None,
    mesh_axes: osh.MeshAxes = osh.AXES,
):
    """Generate ``max_new_tokens`` tokens per row -> [B, N] int32 (and info with ``return_info``).

    ``input_ids`` [B, T] right-padded, row i's prompt is its first ``lengths[i]`` tokens.
    ``kv`` defaults to ``oj.preset("oscar", bits=2)``. ``temperature=0`` is greedy;
    otherwise softmax sampling with optional ``top_k`` / ``top_p``. ``stop_tokens``
    (default: the config's eos ids; ``()`` for none) end a row: it emits the stop
    token, then ``pad_token_id``. ``max_len`` is the cache capacity per row (default:
    prompt bucket + max_new_tokens). ``cache_dtype`` defaults to the model's dtype.
    ``implementation``: the backends of the call (``oscar_jax.Backends``): "auto" (the
    default) picks the decode attention per device and cache (``oscar_jax.backends.choose``:
    Mosaic for a layout='record' cache on a Hopper GPU, Triton on a GPU, XLA on the CPU)
    with the XLA encoder and cache write; a name ("xla", "triton") selects it for the
    attention (with ``mesh``: the per-shard partial of ``sharded_decode_attention``), the
    encoder of ``oj.prefill`` / ``oj.append``, and the one-launch cache write;
    ``Backends(attention=..., encode=..., cache_write=..., prompt_attention=...)`` sets each
    part.
    info [B] each: ``stop_reason`` (``STOP_*``: 0 ran to max_new_tokens, 1 stop token,
    2 cache full, 3 non-finite K/V or logits, 4 clipped length; the first reason wins),
    ``num_tokens`` (tokens before the pads: ``out[i, num_tokens[i]:]`` are all
    ``pad_token_id``; a stop token counts, a token whose K/V overflowed the cache
    counts, the token sampled from flagged caches does not), ``done``, ``flags``
    (``oj.FLAG_*`` OR-ed over layers at the end: a row that stopped keeps being fed pad
    ids, so it can collect flags after its stop; ``stop_reason`` is the cause) and
    ``cache_lengths``. A row stops, i.e. emits pad ids only, from the step its caches
    get a flag: ``FLAG_OVERFLOW`` (``max_len`` reached: the next logits would lack the
    dropped token), ``FLAG_NONFINITE`` or NaN/Inf logits (the row's attention is NaN,
    ``oscar_jax.attention.poison_flagged_rows``); the other rows go on unaffected.
    ``describe_stops(info)`` spells it out on the host.
    ``mesh``: run sharded on a ``jax.sharding.Mesh`` with axes ``mesh_axes`` (default
    ("data", "model", "sequence"); layout and requirements in ``models.sharding``);
    the tokens are the same as unsharded (logits equal up to float summation order).
    ``Backends.prompt_attention``: the prefill's attention (``layers.causal_attention``): "auto"
    (default: "cudnn" for a 16-bit model on a GPU without ``mesh``, else "reference"),
    "reference" (float32, exact, slow on long prompts), "cudnn" (GPU flash attention in
    the model's 16-bit dtype) or "xla".
    """
    kv = oj.preset("oscar", bits=2) if kv is None else kv
    p = prepare(
        m, input_ids, max_new_tokens=max_new_tokens, kv=kv, lengths=lengths, max_len=max_len,
        cache_dtype=cache_dtype, implementation=implementation, temperature=temperature,
        top_k=top_k, top_p=top_p, stop_tokens=stop_tokens, pad_token_id=pad_token_id,
        mesh=mesh, mesh_axes=mesh_axes,
    )  # fmt: skip
    key = jax.random.key(seed)
    out, info = _generate_jit(
        p.st, int(max_new_tokens), p.decode_params, p.ids, p.lengths, key,
        jnp.float32(max(temperature, 1e-6)), jnp.float32(top_p or 1.0),
    )  # fmt: skip
    return (out, info) if return_info else out


def generate_program():
    """The jitted program of ``generate``: ``(st, n_new, params, ids, lengths, key,
    temperature, top_p) -> (tokens, info)`` (static st and n_new; ``.lower(...)`` works
    on ShapeDtypeStructs, for inspecting a full-size model's program)."""
    return _generate_jit


def lower_generate(
    p: Prepared,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float | None = None,
    seed: int = 0,
):
    """``generate``'s program for the prepared call, lowered (``.compile()`` builds it ahead
    of use; the call then finds it in jit's cache)."""
    return _generate_jit.lower(
        p.st, int(max_new_tokens), p.decode_params, p.ids, p.lengths, jax.random.key(seed),
        jnp.float32(max(temperature, 1e-6)), jnp.float32(top_p or 1.0),
    )  # fmt: skip


def prefill(m: CausalLM, input_ids, kv: oj.KVQuantConfig, *, max_new_tokens: int = 1, **kw):
    """Step-by-step API: -> (logits at each row's last prompt token [B, V], caches, prepared).

    ``caches``: a tuple of L per-layer ``KVCache``s (``stack_caches`` stacks them).
    """
    p = prepare(m, input_ids, max_new_tokens=max_new_tokens, kv=kv, **kw)
    logits, caches = _prefill_jit(p.st, p.decode_params, p.ids, p.lengths)
    return logits, caches, p


def decode_step(p: Prepared, caches, tok, pos, *, donate: bool = False):
    """Step-by-step API: feed tok [B] at positions pos [B] -> (logits [B, V], caches).

    ``caches``: the tuple of per-layer caches. ``donate=True`` updates them in place
    (the step writes only the new slots; the caches passed in are invalidated);
    without it the step writes fresh caches (a copy of every cache per step).
    """
    tok, pos = (p.st.place.put_rows(jnp.asarray(a, jnp.int32)) for a in (tok, pos))
    fn = _step_jit_donated if donate else _step_jit
    return fn(p.st, p.decode_params, tuple(caches), tok, pos)


def generate_stepwise(m: CausalLM, input_ids, max_new_tokens: int, kv=None, lengths=None,
                      stop_tokens=None, return_info: bool = False, **kw):  # fmt: skip
    """Greedy generation by a Python loop over the jitted ``step`` (a reference for the scan:
    the same state and stop logic, one program per step, the caches donated).

    -> tokens [B, N] numpy (and info: stop_reason, num_tokens, done, flags, as generate).
    """
    kv = oj.preset("oscar", bits=2) if kv is None else kv
    logits, caches, p = prefill(m, input_ids, kv, max_new_tokens=max_new_tokens,
                                lengths=lengths, stop_tokens=stop_tokens, **kw)  # fmt: skip
    t, top_p = jnp.float32(1e-6), jnp.float32(1.0)  # greedy (as generate passes them)
    state = first_state(p.st, logits, caches, p.lengths, jax.random.key(0), t, top_p)
    out = [np.asarray(state.tok)]
    for _ in range(max_new_tokens - 1):
        state = _state_step_jit(p.st, p.decode_params, state, t, top_p)
        out.append(np.asarray(state.tok))
    toks = np.stack(out, axis=1)
    if not return_info:
        return toks
    info = _info(state)
    info.pop("cache_lengths")
    return toks, {k: np.asarray(v) for k, v in info.items()}


def decode_step_hlo(
    cfg: ModelConfig, kv, mesh: Mesh, *, batch: int, max_len: int, dtype="bfloat16",
    ax: osh.MeshAxes = osh.AXES,
) -> str:  # fmt: skip
    """Compiled HLO text of one sharded decode step (all layers) of model ``cfg`` on ``mesh``.

    Lowered from shapes only (``ShapeDtypeStruct``s carrying the default shardings), so
    it works for full-size configs without allocating params or caches. The params are
    in the per-layer form (``CausalLM.decode_params``), as decoding runs them.
    """
    kv = memory.cache_config(cfg, kv, sharded=True)
    check_mesh(cfg, kv, mesh, ax, batch, max_len, "xla")
    st = Static(
        model=cfg, kv=kv, max_len=max_len, cache_dtype=jnp.dtype(dtype).name,
        backends=Backends(prompt_attention="reference"), greedy=True, top_k=None,
        use_top_p=False, stop_tokens=(), pad_id=0, place=placement(mesh, ax),
    )  # fmt: skip
    put = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    shapes = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.dtype(dtype)),
        layers.param_shapes(cfg, per_layer=True), is_leaf=layers.is_shape,
    )  # fmt: skip
    params = jax.tree_util.tree_map(put, shapes, msh.param_shardings(cfg, mesh, ax, per_layer=True))

    def placed(c):  # Gemma 3's sliding-window layers hold rings (models.window)
        sh = (msh.window_shardings(c, mesh, ax) if isinstance(c, WindowCache)
              else osh.cache_shardings(c, mesh, ax))  # fmt: skip
        return jax.tree_util.tree_map(put, c, sh)

    abstract = memory.abstract_decode_caches(cfg, kv, batch=batch, max_len=max_len, dtype=dtype)
    caches = tuple(placed(c) for c in abstract)
    tok = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=msh.rows(mesh, ax))
    return _step_jit.lower(st, params, caches, tok, tok).compile().as_text()
