"""Lower-precision copies of GGUF files, made with llama.cpp's own quantizer and kept in the model
cache: the qspec method's draft of a llama.cpp target is its own file requantized.

Owns: where a copy lives (`$FORERUN_HOME/requantized/<stem>-<path digest>-<type>.gguf`), its
record beside it (`.json`: the source's path, size, mtime and SHA-256, the type, the copy's
SHA-256), and when it is (re)built. Invariants: a copy is built once per source content and
type; every use hashes the copy and checks it against its record (a damaged copy is rebuilt);
a source whose SHA-256 differs from the record's (the file changed) gets a new copy. The source
is hashed only when its size or mtime differ from the record's (as the catalog's stamps do).
Building writes `<copy>.<pid>.partial` and renames it after hashing, under the copy's lock, so
concurrent users see the old copy or the new one.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from forerun.models.catalog import ModelError, forerun_home, locked, sha256_file

REQUANTIZED_DIR = "requantized"  # under forerun_home()
# forerun's name -> llama.cpp's file type (llama.h's LLAMA_FTYPE_MOSTLY_*): Q3_K is llama.cpp's
# Q3_K_M mix (its `quantize` tool's default Q3_K), Q2_K its Q2_K mix
QTYPES = {"Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q3_K": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
          "Q2_K": "LLAMA_FTYPE_MOSTLY_Q2_K"}
PATH_DIGEST = 12  # hex digits of the source path's SHA-256 in the copy's name

Quantizer = Callable[[Path, Path, str], None]  # (source, destination, type): writes the copy


def copy_path(source: Path, qtype: str) -> Path:
    """Where the `qtype` copy of `source` is kept."""
    digest = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:PATH_DIGEST]
    return forerun_home() / REQUANTIZED_DIR / f"{source.stem}-{digest}-{qtype}.gguf"


def llama_quantize(source: Path, destination: Path, qtype: str) -> None:
    """llama.cpp's quantizer (`llama_model_quantize`): `source` requantized to `qtype`, tensors
    whose rows do not fit the type's blocks in llama.cpp's fallback type."""
    try:
        from llama_cpp import llama_cpp as C

        from forerun.runtime.llama_cpp import init_backend, physical_cores
    except (ImportError, OSError) as e:
        raise ModelError(f"requantizing a GGUF file needs llama-cpp-python ({e}): pip install "
                         "'forerun[llama]'") from e
    init_backend()  # its log filter: only error lines
    params = C.llama_model_quantize_default_params()
    params.ftype = {"Q4_0": C.LLAMA_FTYPE_MOSTLY_Q4_0, "Q3_K": C.LLAMA_FTYPE_MOSTLY_Q3_K_M,
                    "Q2_K": C.LLAMA_FTYPE_MOSTLY_Q2_K}[qtype]  # (QTYPES' names)
    params.allow_requantize = True  # the source may be quantized already (Q4_K_M)
    params.nthread = physical_cores()
    if C.llama_model_quantize(str(source).encode(), str(destination).encode(),
                              ctypes.byref(params)) != 0:
        raise ModelError(f"llama.cpp could not requantize {source} to {qtype}")


def requantized(source: Path, qtype: str, quantize: Quantizer = llama_quantize) -> Path:
    """The `qtype` copy of the GGUF file `source`: the kept one if it matches the source and
    its own SHA-256, else built now (`quantize`) and recorded. -> its path."""
    if qtype not in QTYPES:
        raise ValueError(f"requantize type must be one of {', '.join(QTYPES)}, got {qtype!r}")
    source = Path(source)
    if not source.is_file():
        raise ModelError(f"no such GGUF file to requantize: {source}")
    path = copy_path(source, qtype)
    record_file = path.with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    with locked(path):
        record = _read(record_file)
        stat = source.stat()
        same_stat = (record.get("source_size"), record.get("source_mtime_ns")) == (
            stat.st_size, stat.st_mtime_ns)
        source_sha = record["source_sha256"] if same_stat else sha256_file(source)
        if (record.get("source_sha256") == source_sha and path.is_file()
                and sha256_file(path) == record.get("sha256")):
            if not same_stat:  # touched, not changed: remember its new stamp
                _write(record_file, {**record, "source_size": stat.st_size,
                                     "source_mtime_ns": stat.st_mtime_ns})
            return path
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        try:
            quantize(source, partial, qtype)
            digest = sha256_file(partial)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        _write(record_file, {"source": str(source.resolve()), "source_size": stat.st_size,
                             "source_mtime_ns": stat.st_mtime_ns, "source_sha256": source_sha,
                             "type": qtype, "sha256": digest})
        return path


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write(path: Path, record: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
