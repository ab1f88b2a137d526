"""Online distillation (`forerun serve --online-distill`): a Medusa head learns from the
positions it got wrong while the server serves, and the output never changes.

Properties (tiny float64 target, a new Medusa head whose blocks start as the identity, greedy):
- on a repetitive stream, acceptance after K updates is above acceptance before, and every
  reply equals plain greedy decoding's, before and after;
- an update swapped in between two passes of a running request leaves its output plain's;
- the ring holds at most its capacity, and the trainer's memory is the same after 1 or many
  updates;
- a checkpoint in --online-distill-dir is a --heads directory, and a restart drafts with it;
- through the server (in-process uvicorn, the openai client): the background trainer updates
  the head while requests run, every reply equals plain's, /metrics shows it;
- bad settings fail clearly.
Nothing here is timed: "updated" is read from the trainer's counters, not the clock.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from test_serve import (  # noqa: F401 (fixtures)
    NAME,
    ThreadServer,
    client,
    metric,
    model_dirs,
    reference,
    wait_until,
)

from forerun import Engine, SpecConfig
from forerun.batch_session import BatchSession
from forerun.commands.serve import online_config
from forerun.heads import TargetIO, load_heads
from forerun.models.load import open_model
from forerun.sampling import SamplingConfig
from forerun.serve.app import ServeConfig, create_app
from forerun.serve.worker import Worker
from forerun.train.loop import new_heads
from forerun.train.online import (
    DistillBuffer,
    OnlineConfig,
    OnlineDistiller,
    online_heads,
    serving_distiller,
)

PROMPTS = ["def f(x):", "The quick brown fox", "Hello there"]  # the stream repeats them
MAX_TOKENS = 24
KV_BYTES = 1 << 24
# an update memorises the stream's few positions quickly (the tiny target's ResBlock is 32 wide)
FAST = OnlineConfig(every=64, steps=50, batch=64, lr=5e-2, buffer=1024)


def tiny_engine(model_dirs):  # noqa: F811
    """The tiny target with a new 3-head Medusa head (identity blocks: it learns from zero)."""
    src = open_model(str(model_dirs[0]))
    rt = src.load(dtype="float64")
    io = TargetIO(rt.model.embed.weight.detach(), rt.model.lm_weight().detach())
    heads = new_heads("medusa", io, torch.arange(io.embed.shape[0]), "tiny", rt.config.n_layers,
                      num_heads=3)
    return Engine.from_runtimes(rt, src.tokenizer, spec=SpecConfig("medusa", 3), heads=heads), io


def run_round(engine, distiller, between=None) -> tuple[list[str], float]:
    """Every prompt of the stream through one batch, the newest update swapped in before every
    pass -> the replies and the round's acceptance. `between(n)` runs after pass n."""
    session = BatchSession(engine, KV_BYTES)
    seqs = [session.sequence(engine.tokenizer.encode_prompt(p, raw=True), SamplingConfig(),
                             MAX_TOKENS) for p in PROMPTS]
    for s in seqs:
        session.add(s)
    passes = 0
    while not session.idle:
        distiller.swap()
        session.step()
        passes += 1
        if between is not None:
            between(passes)
    drafted = sum(st.drafted for s in seqs for st in s.steps)
    accepted = sum(st.accepted for s in seqs for st in s.steps)
    texts = [engine.tokenizer.decode(s.tokens[len(s.prompt):len(s.prompt) + s.emitted])
             for s in seqs]
    return texts, accepted / drafted


def plain(reference) -> list[str]:  # noqa: F811
    return [reference(p, MAX_TOKENS).text for p in PROMPTS]


def test_acceptance_rises_after_updates_and_the_output_stays_plain(model_dirs, reference,  # noqa: F811
                                                                   one_thread):
    engine, _ = tiny_engine(model_dirs)
    distiller = OnlineDistiller(engine.heads, FAST)
    distiller.attach(engine.proposers.shared)
    rates = []
    for _ in range(6):
        texts, rate = run_round(engine, distiller)
        assert texts == plain(reference)
        rates.append((distiller.live_version, rate))
        if distiller.buffer.added - distiller.seen >= FAST.every:
            distiller.update()
    assert rates[0][0] == 0 and rates[-1][0] >= 2, rates  # K >= 2 updates drafting at the end
    assert rates[-1][1] > 1.5 * rates[0][1], rates  # seen: 0.062 -> 0.169


def test_a_swap_during_a_request_leaves_it_plain(model_dirs, reference, one_thread):  # noqa: F811
    engine, _ = tiny_engine(model_dirs)
    distiller = OnlineDistiller(engine.heads, FAST)
    distiller.attach(engine.proposers.shared)
    run_round(engine, distiller)  # positions to learn from
    before = engine.heads.blocks[0].linear.weight.clone()

    def update(n: int) -> None:
        if n == 3:  # mid-request: the next pass drafts with the new head
            distiller.update()

    texts, _ = run_round(engine, distiller, update)
    assert distiller.live_version == 1
    assert not torch.equal(engine.heads.blocks[0].linear.weight, before)  # it did change
    assert texts == plain(reference)


def test_the_ring_and_the_trainer_memory_stay_bounded(model_dirs, one_thread):  # noqa: F811
    buffer = DistillBuffer(capacity=16, dim=8, num_heads=2, top=4)
    size = buffer.nbytes
    for i in range(100):
        buffer.push(torch.randn(8), i % 3, torch.randn(20))  # head 2: past the last, dropped
    assert len(buffer) == 16 and buffer.nbytes == size
    assert buffer.added == sum(i % 3 < 2 for i in range(100))
    engine, _ = tiny_engine(model_dirs)
    distiller = OnlineDistiller(engine.heads, OnlineConfig(every=8, steps=2, batch=8, buffer=32))
    params = sum(p.numel() * p.element_size() for p in distiller.blocks.parameters())
    for _ in range(5):
        for i in range(40):  # every head's positions: AdamW keeps moments for all of them
            distiller.buffer.push(torch.randn(32), i % 3, torch.randn(259))
        distiller.update()
        # its blocks, AdamW's two moments, one snapshot waiting (and a step counter a block)
        assert distiller.buffer.nbytes + 4 * params <= distiller.nbytes
        assert distiller.nbytes <= distiller.buffer.nbytes + 4 * params + 8 * 64
    held = distiller.nbytes
    distiller.update()
    assert distiller.nbytes == held  # one snapshot waiting, whatever the updates
    distiller.swap()
    assert distiller.nbytes < held


def test_a_restart_keeps_what_was_learned(model_dirs, tmp_path, one_thread):  # noqa: F811
    engine, io = tiny_engine(model_dirs)
    cfg = OnlineConfig(every=8, steps=3, batch=8, directory=str(tmp_path / "online"))
    distiller = OnlineDistiller(engine.heads, cfg, target="tiny")
    for _ in range(20):
        distiller.buffer.push(torch.randn(32), 0, torch.randn(259))
    distiller.update()
    distiller.update()
    distiller.swap()
    learned = engine.heads.state_dict()
    # the checkpoint is a --heads directory ...
    loaded = load_heads(tmp_path / "online", io, "tiny", precision="float32")
    for k, v in learned.items():
        assert torch.equal(loaded.state_dict()[k], v), k
    # ... and a restart with the same directory starts from it, its counters kept
    fresh_engine, _ = tiny_engine(model_dirs)
    restarted = serving_distiller(fresh_engine, cfg, io, "tiny", 3, 0)
    assert fresh_engine.heads is restarted.heads is not engine.heads
    for k, v in learned.items():
        assert torch.equal(fresh_engine.heads.state_dict()[k], v), k
    assert (restarted.version, restarted.updates) == (2, 2)
    # without a checkpoint: the loaded head (--heads), else a new one
    empty = OnlineConfig(directory=str(tmp_path / "none"))
    assert online_heads(empty, io, "tiny", 256, engine.heads, None) is engine.heads


def test_the_server_trains_in_the_background_and_answers_plain(model_dirs, reference):  # noqa: F811
    engine, _ = tiny_engine(model_dirs)
    distiller = OnlineDistiller(engine.heads, OnlineConfig(every=32, steps=20, batch=32,
                                                           lr=5e-2, share=0.5))
    worker = Worker(engine, slots=4, max_queue=8, spec_policy="always", distiller=distiller)
    with ThreadServer(create_app(worker, ServeConfig(NAME))) as server:
        c = client(server.base)
        for i in range(8):
            prompt = PROMPTS[i % len(PROMPTS)]
            reply = c.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0)
            assert reply.choices[0].text == reference(prompt, MAX_TOKENS).text
            if i == 3:  # the trainer has had its positions: wait for its first update
                wait_until(lambda: distiller.updates >= 1)
        assert metric(server.base, "forerun_online_distill_positions") > 0
        assert metric(server.base, "forerun_online_distill_head_version") >= 1  # swapped in
        assert metric(server.base, "forerun_acceptance_rate_recent") > 0
        assert metric(server.base, "forerun_online_distill_memory_bytes") > 0


def flags(**kw) -> argparse.Namespace:
    base = dict(online_distill=True, method="medusa", head_precision="auto",
                online_distill_every=256, online_distill_steps=8, online_distill_lr=1e-3,
                online_distill_buffer=4096, online_distill_threads=1, online_distill_share=0.25,
                online_distill_dir=None)
    return argparse.Namespace(**(base | kw))


@pytest.mark.parametrize(("kw", "text"), [
    ({"method": "eagle"}, "--method medusa"),
    ({"head_precision": "int8"}, "float32"),
    ({"online_distill_share": 0.0}, "--online-distill-share"),
    ({"online_distill_every": 0}, "--online-distill-every"),
])
def test_bad_settings_fail_clearly(kw, text):
    with pytest.raises(ValueError, match=text):
        online_config(flags(**kw))
    args = flags()
    assert online_config(args).every == 256 and args.head_precision == "float32"
    assert online_config(flags(online_distill=False)) is None
