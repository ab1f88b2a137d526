"""A collection's manifest: what its folder holds, written once, and how siblings are found by
reading manifests (folder names are for people and never parsed). No model runs here."""

import json
from dataclasses import replace

import pytest

from forerun.train import (
    MANIFEST,
    TrainConfig,
    collection_key,
    manifest,
    read_manifest,
    sibling_collections,
    write_manifest,
)


def test_manifest_records_the_settings_and_names_a_readable_folder(tmp_path):
    notes = tmp_path / "notes.md"
    notes.write_text("some prose")
    cfg = TrainConfig("eagle", seq_len=32, chat=3, chat_tokens=8, self_chat=2, text=(str(notes),))
    record = manifest("m", "float32", (-1,), cfg)
    assert {k: record[k] for k in ("target", "features", "layers", "seq_len", "chat",
                                   "chat_tokens", "self_chat", "self_tasks", "questions")} == {
        "target": "m", "features": "float32", "layers": [-1], "seq_len": 32, "chat": 3,
        "chat_tokens": 8, "self_chat": 2, "self_tasks": 0, "questions": ""}
    assert len(record["text"]) == 8  # a digest of the text files' paths
    assert collection_key(record) == f"m-float32-L-1-T32-C3x8-S2-X{record['text']}"
    data = tmp_path / "data"
    data.mkdir()
    write_manifest(data, record)
    assert read_manifest(data) == record == json.loads((data / MANIFEST).read_text())
    write_manifest(data, record)  # the same settings: a resumed collection
    with pytest.raises(ValueError, match=r"\(chat_tokens differ"):
        write_manifest(data, manifest("m", "float32", (-1,), replace(cfg, chat_tokens=16)))


def test_siblings_come_from_manifests_not_folder_names(tmp_path):
    cfg = TrainConfig("eagle", seq_len=32, chat=2, chat_tokens=8)
    folders = {  # misleading names on purpose
        "m-float32-L-1-T32-C9x8": manifest("m", "float32", (-1,), cfg),  # same features
        "x": manifest("m", "llama.cpp", (-1,), TrainConfig("eagle", seq_len=32, chat=5,
                                                            chat_tokens=8)),  # other runtime
        "y": manifest("m", "float32", (-1,), TrainConfig("eagle", seq_len=32, chat_tokens=16)),
        "z": manifest("other", "float32", (-1,), cfg),  # another target
        "m-float32-L-1-T32-C2x8-old": None,  # no manifest: unknown
    }
    for name, record in folders.items():
        (tmp_path / name).mkdir()
        if record is not None:
            write_manifest(tmp_path / name, record)
    data = tmp_path / "new"
    assert sibling_collections(data, manifest("m", "float32", (-1,), cfg)) == (
        (tmp_path / "m-float32-L-1-T32-C9x8", 2, True), (tmp_path / "x", 5, False))
    (tmp_path / "stray.json").write_text("{}")  # files beside the folders are ignored
    assert sibling_collections(data, manifest("m", "float32", (0, -1), cfg)) == (
        (tmp_path / "m-float32-L-1-T32-C9x8", 2, False), (tmp_path / "x", 5, False))
