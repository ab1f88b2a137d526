"""`forerun profile` and `forerun bench curve`'s library: the modes run end to end on tiny
models and say what they measured; timings themselves are not asserted (a shared machine)."""

import json

import torch
from tiny_files import byte_tokens, random_hf_weights, write_hf_dir

from forerun import cli
from forerun.api import Engine, LoadConfig
from forerun.heads import save_heads
from forerun.models.load import open_model, target_io
from forerun.propose import SpecConfig
from forerun.train import new_heads


def test_profile_gpu_small_runs_on_the_cpu_and_every_check_is_identical(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert cli.main(["profile", "gpu", "--device", "cpu", "--small", "--max-tokens", "8",
                     "--precisions", "int8", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results == json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results["equality"] and all(r.get("identical") for r in results["equality"].values())
    assert len(results["curves"]["target"]["sizes"]) == len(results["curves"]["draft"]["seconds"])
    assert {"graphs", "eager", "graphs, spans"} == set(results["decode"])
    assert all(isinstance(v, float) for v in results["head_cost"]["eagle-int8"].values())


def test_profile_heads_times_trained_heads_against_a_target_pass(tmp_path, capsys):
    target = tmp_path / "target"
    write_hf_dir(target, random_hf_weights(len(byte_tokens()), seed=0), byte_tokens())
    engine = Engine(str(target), None, spec=SpecConfig("none"), load=LoadConfig(dtype="float32"))
    io = target_io(open_model(str(target)), engine.target)
    heads = new_heads("medusa", io, torch.arange(io.embed.shape[0]), "target",
                      engine.target.config.n_layers, num_heads=2)
    save_heads(heads, tmp_path / "heads", dtype=torch.float32)
    assert cli.main(["profile", "heads", "--target", str(target), "--heads",
                     str(tmp_path / "heads"), "--dtype", "float32", "-k", "2", "--tree", "4",
                     "--max-tokens", "8", "--prompt", "hi"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["method"] == "medusa" and report["target_fwd1_ms"] > 0
    for label in ("chain", "tree"):
        assert report[label]["calls"] > 0 and report[label]["propose_ms"] > 0
    assert cli.main(["profile", "heads", "--target", str(target)]) == 2  # no --heads
