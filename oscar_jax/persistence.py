"""Save a KVCache (or any pytree of arrays, e.g. a generation carry) and restore it bit for bit.

File format: **safetensors** (https://github.com/huggingface/safetensors), written
and read here with numpy, so ``oscar_jax`` gains no dependency::

    [8 bytes: header length n, little-endian u64][n bytes: JSON header][raw tensor bytes]

Why safetensors rather than Orbax or ``np.savez``/pickle:

* **No code execution on load**: the header is JSON and the data raw little-endian
  bytes; nothing is unpickled (``np.load(allow_pickle=False)`` would do too, but
  npz is a zip whose members are parsed lazily and cannot carry our metadata).
* **mmap-able and self-describing**: every tensor's dtype, shape and byte range are
  in the header, so any reader (this module, ``safetensors.numpy.load_file``, the
  Rust crate, ``models.loading.SafetensorsFile``) can map or slice it without
  loading the rest; one file, no directory tree or async machinery (Orbax's
  strengths, multi-host and async, are not needed for one layer's cache or a
  carry of a few MiB-GiB saved from one process).
* **A header we control**: ``__metadata__`` (string -> string) holds the static part
  of the state that is not an array: the format name and ``version``, the pytree
  structure (``tree``: dicts, lists, tuples, None, typed PRNG keys, ``KVCache``
  nodes with their ``KVQuantConfig`` fields and ``max_len``, and nodes of classes
  registered with ``register_node``, e.g. ``models``' sliding-window rings and
  decode state), each array's
  ``PartitionSpec`` when it was sharded, and a ``sha256`` of the data section.

Loading validates everything before any array is built (header JSON, format and
version, dtypes, shapes, byte ranges that tile the data section exactly, the file
size, the content hash, the tree), so a truncated or corrupted file raises a
``ValueError`` naming the file and the problem, never a half-loaded cache. Saving
writes a temporary file in the same directory and renames it over the target
(atomic on POSIX), so a crash mid-save leaves the previous file intact.

``load(path, shardings=...)`` places each array with its sharding (a pytree of
``jax.sharding.Sharding`` matching the saved tree, e.g.
``oscar_jax.sharding.cache_shardings(cache, mesh)``, or one sharding for all);
``load(path, mesh=mesh)`` re-applies the ``PartitionSpec`` each array had when saved.
Arrays are gathered to the host on save (single process).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from oscar_jax.cache import KVCache
from oscar_jax.config import KVQuantConfig
from oscar_jax.record import RECORD_VERSION, upgrade_records

FORMAT = "oscar_jax.persistence"
VERSION = 2  # 2: registered nodes (register_node); a file without them is written as 1
_READS = ("1", "2")
_RECORD_READS = (1, RECORD_VERSION)  # record layouts read (older ones converted on load)

_DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}  # fmt: skip
_CODES = {v: k for k, v in _DTYPES.items()}
_KV_FIELDS = [f.name for f in dataclasses.fields(KVCache) if f.name not in ("cfg", "max_len")]
_MAX_HEADER = 100 * 1024 * 1024
_NODES: dict[str, tuple[type, tuple[str, ...]]] = {}  # name -> (class, field names)
_BY_CLASS: dict[type, str] = {}


def register_node(cls: type, name: str | None = None) -> type:
    """Let ``save`` / ``load`` handle ``cls`` (a dataclass or NamedTuple whose fields are all
    savable: arrays, caches, pytrees) as a node named ``name`` (default: the class name).
    ``load`` builds only registered classes: import the registering module first."""
    if dataclasses.is_dataclass(cls):
        fields = tuple(f.name for f in dataclasses.fields(cls))
    elif isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields"):
        fields = tuple(cls._fields)
    else:
        raise ValueError(f"cls={cls!r} must be a dataclass or NamedTuple class")
    name = cls.__name__ if name is None else name
    if not isinstance(name, str) or name == "KVCache" or _NODES.get(name, (cls,))[0] is not cls:
        raise ValueError(f"name={name!r} must be a str naming no other node type")
    _NODES[name] = (cls, fields)
    _BY_CLASS[cls] = name
    return cls


def _spec_json(x) -> list | None:
    s = getattr(x, "sharding", None)
    if not isinstance(s, NamedSharding):
        return None
    return [list(p) if isinstance(p, tuple) else p for p in s.spec]


def _encode(node, arrays: list, specs: dict):
    """Pytree -> JSON-able structure; arrays appended to ``arrays`` (name t<i>)."""
    if isinstance(node, KVCache):
        cfg = dataclasses.asdict(node.cfg)
        out = {"type": "KVCache", "cfg": cfg, "max_len": int(node.max_len)}
        if cfg["layout"] == "planar":
            del cfg["layout"]  # the default: such a file stays readable by older readers
        else:  # the permutation's version: a reader of another version refuses the file
            out["record_layout"] = RECORD_VERSION
        out["fields"] = {f: _encode(getattr(node, f), arrays, specs) for f in _KV_FIELDS}
        return out
    if (reg := _BY_CLASS.get(type(node))) is not None:
        fields = {f: _encode(getattr(node, f), arrays, specs) for f in _NODES[reg][1]}
        return {"type": "node", "name": reg, "fields": fields}
    if node is None:
        return {"type": "none"}
    if isinstance(node, dict):
        if not all(isinstance(k, str) for k in node):
            raise ValueError(f"dict keys {list(node)} must be str to be saved")
        return {"type": "dict", "items": [[k, _encode(v, arrays, specs)] for k, v in node.items()]}
    if isinstance(node, list | tuple) and not hasattr(node, "_fields"):
        kind = "list" if isinstance(node, list) else "tuple"
        return {"type": kind, "items": [_encode(v, arrays, specs) for v in node]}
    if isinstance(node, jax.Array) and jax.dtypes.issubdtype(node.dtype, jax.dtypes.prng_key):
        name = f"t{len(arrays)}"
        arrays.append(np.asarray(jax.random.key_data(node)))
        specs[name] = _spec_json(node)
        return {"type": "key", "impl": str(jax.random.key_impl(node)), "name": name}
    if isinstance(node, jax.Array | np.ndarray | np.generic):
        name = f"t{len(arrays)}"
        a = np.asarray(node)
        if a.dtype not in _CODES:
            raise ValueError(f"array of dtype {a.dtype} cannot be saved (supported: {_CODES})")
        arrays.append(a)
        specs[name] = _spec_json(node)
        return {"type": "array", "name": name}
    raise ValueError(
        f"cannot save a {type(node).__name__}: supported are arrays, typed PRNG keys, "
        "KVCache, classes registered with register_node, dict (str keys), list, tuple and None"
    )


def _uses_nodes(structure) -> bool:
    if isinstance(structure, dict):
        return structure.get("type") == "node" or any(_uses_nodes(v) for v in structure.values())
    if isinstance(structure, list):
        return any(_uses_nodes(v) for v in structure)
    return False


def save(path, tree) -> str:
    """Write ``tree`` (a KVCache or a pytree of them and arrays) to ``path``; returns path."""
    path = os.fspath(path)
    arrays: list[np.ndarray] = []
    specs: dict = {}
    structure = _encode(tree, arrays, specs)
    header: dict = {}
    offset = 0
    h = hashlib.sha256()
    blobs = []
    for i, a in enumerate(arrays):
        raw = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[f"t{i}"] = {
            "dtype": _CODES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        offset += len(raw)
        h.update(raw)
        blobs.append(raw)
    header["__metadata__"] = {
        "format": FORMAT,
        "version": str(VERSION if _uses_nodes(structure) else 1),  # older readers read v1
        "tree": json.dumps(structure, separators=(",", ":")),
        "partition_specs": json.dumps(specs, separators=(",", ":")),
        "sha256": h.hexdigest(),
        "data_bytes": str(offset),
    }
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # safetensors aligns the data section to 8 bytes
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp_", suffix=".safetensors")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(hb).to_bytes(8, "little"))
            f.write(hb)
            for raw in blobs:
                f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _fail(path, why) -> ValueError:
    return ValueError(f"cannot restore {path!r}: {why}")


def _read(path) -> tuple[dict, dict, memoryview]:
    """Validated (metadata, tensor header, data) of a file; ValueError naming the file."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as e:
        raise _fail(path, f"{type(e).__name__}: {e}") from e
    if len(blob) < 8:
        raise _fail(path, f"file of {len(blob)} bytes is truncated (no header length)")
    n = int.from_bytes(blob[:8], "little")
    if n > _MAX_HEADER or 8 + n > len(blob):
        raise _fail(path, f"header length {n} exceeds the file ({len(blob)} bytes): truncated?")
    try:
        header = json.loads(blob[8 : 8 + n])
        meta = header.pop("__metadata__")
    except (ValueError, KeyError, UnicodeDecodeError) as e:
        raise _fail(path, f"header is not a valid {FORMAT} JSON header ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _fail(path, f"not a {FORMAT} file (metadata format={meta.get('format')!r})")
    if meta.get("version") not in _READS:
        raise _fail(path, f"format version {meta.get('version')!r}, this reader knows {_READS}")
    data = memoryview(blob)[8 + n :]
    want = int(meta.get("data_bytes", -1))
    if len(data) != want:
        raise _fail(path, f"data section has {len(data)} bytes, the header says {want}: truncated")
    spans = []
    for name, info in header.items():
        try:
            dt = _DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            a, b = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise _fail(path, f"tensor {name!r} has a bad header entry {info!r}") from e
        if b - a != dt.itemsize * int(np.prod(shape, dtype=np.int64)) or a < 0:
            raise _fail(path, f"tensor {name!r}: byte range {a}..{b} does not fit {dt} {shape}")
        spans.append((a, b, name))
    spans.sort()
    end = 0
    for a, b, name in spans:
        if a != end:
            raise _fail(path, f"tensor {name!r} starts at byte {a}, expected {end}")
        end = b
    if end != len(data):
        raise _fail(path, f"tensors cover {end} of {len(data)} data bytes")
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise _fail(path, "content hash (sha256) mismatch: the data section is corrupted")
    return meta, header, data


def _decode(node, path, header, data, take, mesh):
    t = node.get("type") if isinstance(node, dict) else None
    rec = lambda n: _decode(n, path, header, data, take, mesh)  # noqa: E731
    if t == "none":
        return None
    if t == "dict":
        return {k: rec(v) for k, v in node["items"]}
    if t in ("list", "tuple"):
        items = [rec(v) for v in node["items"]]
        return items if t == "list" else tuple(items)
    if t in ("array", "key"):
        name = node["name"]
        if name not in header:
            raise _fail(path, f"tree names tensor {name!r}, absent from the header")
        info = header[name]
        a, b = info["data_offsets"]
        arr = np.frombuffer(data[a:b], _DTYPES[info["dtype"]]).reshape(info["shape"]).copy()
        return take(name, arr, node.get("impl") if t == "key" else None)
    if t == "KVCache":
        try:
            cfg = KVQuantConfig(**{"layout": "planar", **node["cfg"]})  # absent: planar
        except (TypeError, ValueError) as e:
            raise _fail(path, f"bad KVQuantConfig in the header: {e}") from e
        got = node.get("record_layout")
        if cfg.layout == "record" and got not in _RECORD_READS:
            raise _fail(path, f"a layout='record' cache of record layout version {got!r}; "
                        f"this reader knows {_RECORD_READS}")  # fmt: skip
        take_codes = take  # the records (k_codes) of an older layout are converted as read
        if cfg.layout == "record" and got != RECORD_VERSION:
            take_codes = lambda n, a, impl: take(n, upgrade_records(a, got), impl)  # noqa: E731
        fields = {f: _decode(node["fields"][f], path, header, data,
                             take_codes if f == "k_codes" else take, mesh)
                  for f in _KV_FIELDS}  # fmt: skip
        return KVCache(**fields, cfg=cfg, max_len=int(node["max_len"]))
    if t == "node":
        name = node.get("name")
        if name not in _NODES:
            raise _fail(path, f"node type {name!r} is not registered (register_node; for "
                              "models' WindowCache / DecodeState: import models)")  # fmt: skip
        cls, want = _NODES[name]
        saved = tuple(node.get("fields") or {})
        if saved != want:
            raise _fail(path, f"{name} fields {saved} differ from this version's {want}")
        return cls(**{f: rec(node["fields"][f]) for f in want})
    raise _fail(path, f"unknown tree node {str(node)[:200]}")


def _is_sharding(x) -> bool:
    return isinstance(x, jax.sharding.Sharding)


def load(path, *, shardings=None, mesh: Mesh | None = None):
    """Restore what ``save`` wrote, bit for bit; ValueError naming the file if it is bad.

    ``shardings``: one ``jax.sharding.Sharding`` for every array, or a pytree of them with
    the saved tree's structure (e.g. ``oscar_jax.sharding.cache_shardings``).
    ``mesh``: re-apply each array's saved ``PartitionSpec`` on this mesh. Neither:
    arrays go to the default device.
    """
    path = os.fspath(path)
    meta, header, data = _read(path)
    try:
        structure = json.loads(meta["tree"])
        specs = json.loads(meta.get("partition_specs", "{}"))
    except (KeyError, ValueError) as e:
        raise _fail(path, f"bad tree metadata ({e})") from e
    host: dict[str, tuple[np.ndarray, str | None]] = {}

    def collect(name, arr, impl):
        host[name] = (arr, impl)
        return name

    names_tree = _decode(structure, path, header, data, collect, mesh)  # validates the tree
    leaves, treedef = jax.tree_util.tree_flatten(names_tree)
    if shardings is None:
        if mesh is not None:
            shard_leaves = [
                NamedSharding(
                    mesh, PartitionSpec(*[tuple(p) if isinstance(p, list) else p for p in specs[n]])
                )  # fmt: skip
                if specs.get(n) is not None
                else NamedSharding(mesh, PartitionSpec())
                for n in leaves
            ]
        else:
            shard_leaves = [None] * len(leaves)
    elif _is_sharding(shardings):
        shard_leaves = [shardings] * len(leaves)
    else:
        shard_leaves, sdef = jax.tree_util.tree_flatten(shardings, is_leaf=_is_sharding)
        if sdef != treedef:
            raise ValueError(
                f"shardings structure {sdef} does not match the saved tree {treedef} of {path!r}"
            )
    out = []
    for name, sh in zip(leaves, shard_leaves, strict=True):
        arr, impl = host[name]
        x = jax.device_put(arr, sh) if sh is not None else jax.device_put(arr)
        if impl is not None:
            x = jax.random.wrap_key_data(x, impl=impl)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


def describe(path) -> dict:
    """The validated header of a saved file: metadata (tree parsed) and tensor entries."""
    meta, header, _ = _read(os.fspath(path))
    meta = dict(meta, tree=json.loads(meta["tree"]))
    return {"metadata": meta, "tensors": header}
