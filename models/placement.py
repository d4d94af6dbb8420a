"""Where a decode runs: on one device (``Local``) or on a mesh (``Sharded``), decided once.

``placement(mesh, axes)`` is called where the decode state is built (``models.decode``'s
``prepare``); the prefill and every step then call the placement's methods, which are
the same for both, instead of branching on the mesh at each call site. ``Sharded`` runs
the cache ops of ``oscar_jax.sharding`` (per shard) in ``models.sharding``'s layout and
pins arrays to it (``with_sharding_constraint``); ``Local`` runs the plain ops.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import oscar_jax as oj
from models import sharding as msh
from oscar_jax import backends
from oscar_jax import flush as ofl
from oscar_jax import sharding as osh
from pallas_kernels import cache_write as _cache_write


@dataclasses.dataclass(frozen=True)
class Local:
    """One device: the plain cache ops."""

    mesh = None
    axes = osh.AXES

    def constrain(self, x, spec: P):
        return x

    def put_rows(self, x):
        """Host inputs split by batch row ([B, ...]): here, as they are."""
        return x

    def stacked_params(self, model, kv):
        """The model's stacked params with ``kv``'s value rotation folded in."""
        return model.folded_params(kv)

    def constrain_caches(self, caches):
        return caches

    def fused_write_ok(self, cache) -> bool:
        """Whether ``cache_write="triton"`` can write this cache's step in one launch."""
        return _cache_write.unsupported_reason(cache) is None

    def prepare_flushes(self, caches, implementation, *, clear: bool):
        return ofl.prepare_flushes(caches, implementation=implementation, clear=clear)

    def write_step(self, c, k_t, v_t, todo, cache_write: str):
        """The step's token and its early-encoded flush (``oscar_jax.flush.Flush``), by the
        ``cache_write`` backend ("triton": one launch; "xla": ``oscar_jax.flush.write_step``)."""
        return backends.resolve("cache_write", cache_write)(c, k_t, v_t, todo)

    def append(self, c, k_t, v_t, *, implementation):
        """The step's token into the ring, and the group it ages out (encoded here)."""
        return oj.append(c, k_t, v_t, implementation=implementation)

    def attention(self, q, c, implementation):
        return oj.decode_attention(q, c, implementation=implementation)


@dataclasses.dataclass(frozen=True)
class Sharded:
    """A (data, model, sequence) mesh in ``models.sharding``'s layout."""

    mesh: Mesh
    axes: osh.MeshAxes = osh.AXES

    def constrain(self, x, spec: P):
        return msh.constrain(x, self.mesh, spec)

    def put_rows(self, x):
        """Host inputs split by batch row ([B, ...]) over the data axis."""
        return jax.device_put(x, msh.rows(self.mesh, self.axes, x.ndim))

    def stacked_params(self, model, kv):
        """The folded stacked params placed in ``models.sharding``'s layout (cached)."""
        return model.sharded_params(kv, self.mesh, self.axes)

    def constrain_caches(self, caches):
        return msh.constrain_caches(caches, self.mesh, self.axes)

    def fused_write_ok(self, cache) -> bool:
        """One launch per device needs whole rows and heads there (no sequence split)."""
        if osh.mesh_sizes(self.mesh, self.axes)[2] != 1:
            return False
        return _cache_write.unsupported_reason(cache) is None

    def prepare_flushes(self, caches, implementation, *, clear: bool):
        if (backends.canonical("encode", implementation) != "xla"
                and osh.local_flush_reason(caches[0], self.mesh, self.axes) is None):  # fmt: skip
            # a kernel encoder, per device (else it would run on gathered groups)
            return osh.sharded_prepare_flushes(
                caches, self.mesh, self.axes, implementation=implementation, clear=clear
            )
        return ofl.prepare_flushes(caches, implementation=implementation, clear=clear)

    def write_step(self, c, k_t, v_t, todo, cache_write: str):
        """As ``Local.write_step``, each device on its own rows and heads."""
        if cache_write == "triton":
            return _cache_write.sharded_fused_update(c, k_t, v_t, todo, self.mesh, ax=self.axes)
        mesh, ax = self.mesh, self.axes
        return ofl.write_step(
            c, k_t, v_t, todo,
            append=lambda c, k, v: osh.sharded_append(c, k, v, mesh, ax=ax, flush=False),
            write=lambda c, f: osh.sharded_write_flush(c, f, mesh, ax),
        )  # fmt: skip

    def append(self, c, k_t, v_t, *, implementation):
        return osh.sharded_append(c, k_t, v_t, self.mesh, ax=self.axes, flush=True,
                                  implementation=implementation)  # fmt: skip

    def attention(self, q, c, implementation):
        return osh.sharded_decode_attention(q, c, self.mesh, ax=self.axes,
                                            implementation=implementation)  # fmt: skip


Placement = Local | Sharded


def placement(mesh: Mesh | None, axes: osh.MeshAxes = osh.AXES) -> Placement:
    """``Local()`` without a mesh, else ``Sharded(mesh, axes)``."""
    return Local() if mesh is None else Sharded(mesh, axes)
