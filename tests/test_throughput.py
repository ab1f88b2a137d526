"""`forerun bench throughput` on tiny models: every mode at every batch size, the files it
writes, and every cell's greedy output identical to plain batching's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tiny_files import byte_tokens, random_hf_weights, write_hf_dir

from forerun.bench.throughput import ThroughputCell, markdown, peer_cells, rows, spec_of


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root, tokens = tmp_path_factory.mktemp("throughput_models"), byte_tokens()
    for name in ("target", "draft"):
        write_hf_dir(root / name, random_hf_weights(len(tokens), 0), tokens)
    return root


def test_throughput_bench_writes_every_cell_and_stays_identical(tiny_dirs, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "forerun.cli", "bench", "throughput", "--target",
         str(tiny_dirs / "target"), "--draft", str(tiny_dirs / "draft"), "--dtype", "float32",
         "--draft-dtype", "float32", "--workload", "spec_bench:1", "--limit", "1",
         "--batches", "1,3", "--modes", "off,fixed,cost", "--methods", "draft", "--ks", "3",
         "--max-tokens", "6", "--out", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.splitlines()[-1])
    assert [(c["mode"], c["batch"]) for c in summary["cells"]] == [
        ("off", 1), ("fixed", 1), ("cost", 1), ("off", 3), ("fixed", 3), ("cost", 3)]
    saved = json.loads((tmp_path / "throughput.json").read_text())
    assert all(c["identical"] == c["solo"] == 1.0 for c in saved["cells"])
    assert all(c["total_tok_s"] > 0 and c["peak_kv_bytes"] > 0 for c in saved["cells"])
    fixed = [c for c in saved["cells"] if c["mode"] == "fixed"]
    assert all(c["chosen_k"] > 0 for c in fixed)
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert "| forerun | cost | 3 |" in (tmp_path / "throughput.md").read_text()


def test_modes_and_rows():
    assert spec_of("off", "draft", 4).method == "none"
    assert spec_of("cost", "ngram", 4).policy == "cost"
    with pytest.raises(ValueError, match="unknown mode"):
        spec_of("turbo", "draft", 4)
    cell = ThroughputCell("forerun", "fixed", 8, 40.0, 5.0, 2.0, 80, 2.5, 3 << 20, 1 << 30,
                          1.5, 1.0, 0.75)
    assert rows([cell]) == [("forerun", "fixed", "8", "40.0", "5.00", "1.50x", "2.50", "3",
                             "1.00", "0.75")]
    assert "| forerun | fixed | 8 |" in markdown([cell], "t")


class FakePeer:
    """A `BatchPeer`: every batch size in one call, `fail_at` noted as an error, `down` raising."""

    def __init__(self, fail_at=(), down=False):
        self.fail_at, self.down, self.calls = fail_at, down, []

    def label(self, batch):
        return f"llama-server -np {batch} -md k=4"

    def run_batches(self, prompts_by_batch, max_tokens):
        self.calls.append(dict(prompts_by_batch))
        if self.down:
            raise RuntimeError("no such binary")
        return {b: {"error": "out of memory"} if b in self.fail_at else
                {"tok_s": 10.0 * len(p), "per_seq_tok_s": 10.0, "wall_s": 1.0,
                 "total_tokens": 10 * len(p), "draft_n": 5} for b, p in prompts_by_batch.items()}


def test_peer_cells_run_each_peer_once_priced_against_plain_failures_skipped(capsys):
    whole, patchy, down = FakePeer(), FakePeer(fail_at=(2,)), FakePeer(down=True)
    cells = peer_cells([whole, patchy, down], ["a", "b"], (1, 2, 3), 10,
                       {1: 5.0, 2: 40.0, 3: 15.0})
    assert whole.calls == patchy.calls == down.calls == [
        {1: ["a"], 2: ["a", "b"], 3: ["a", "b", "a"]}]  # one call for every size, prompts cycled
    assert [(c.system, c.mode, c.batch, c.speedup) for c in cells] == [
        ("llama-server", "-np 1 -md k=4", 1, 2.0), ("llama-server", "-np 1 -md k=4", 1, 2.0),
        ("llama-server", "-np 2 -md k=4", 2, 0.5),
        ("llama-server", "-np 3 -md k=4", 3, 2.0), ("llama-server", "-np 3 -md k=4", 3, 2.0)]
    assert cells[0].chosen_k == 0.5 and cells[0].total_tok_s == 10.0
    err = capsys.readouterr().err
    assert "peer llama-server -np 1 -md k=4 failed: no such binary" in err
    assert "peer llama-server -np 2 -md k=4 at batch 2 failed: out of memory" in err


def test_throughput_peers_make_one_vllm_peer_per_variant(monkeypatch, tmp_path):
    from argparse import Namespace

    from forerun.bench import throughput_peers as tp
    from forerun.commands.bench import _throughput_peers

    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setenv(tp.VLLM_VAR, str(python))
    args = Namespace(throughput_peers="vllm", vllm_model=str(tmp_path / "hf"),
                     vllm_draft=str(tmp_path / "hf-draft"))
    plain, spec = _throughput_peers(args, 3)
    assert isinstance(plain, tp.VllmOffline) and isinstance(spec, tp.VllmOffline)
    assert (plain.label(8), spec.label(8)) == ("vllm", "vllm draft k=3")
    assert spec.draft_dir == tmp_path / "hf-draft" and plain.draft_dir is None
