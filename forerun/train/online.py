"""Online distillation: a Medusa head keeps learning from the traffic it drafts for (online
speculative decoding, OSD: Liu et al. 2024).

Owns: `DistillBuffer`, a fixed-size ring of training positions the verify pass hands over;
`OnlineDistiller`, the background trainer over it, the atomic swap of what it learned into
the head the server drafts with, and its checkpoints; `OnlineConfig`, their settings.

The flow, one arrow a thread:

  worker   verify pass -> MedusaProposer.teach -> DistillBuffer.push      (O(1), bounded)
  trainer  every `every` new positions: `steps` AdamW steps on its own copy of the head's
           blocks, over random batches of the ring -> a snapshot (version + 1) -> a checkpoint
  worker   between two passes: `swap` copies the newest snapshot into the live head in place

A position is what the drafter got wrong at one verify: the feature f_t its heads drafted
from, the index i of the first head whose token was rejected (or that proposed none), and the
target's distribution at that row (its top TEACHER_TOP, from the raw logits the verify pass
computed anyway), which is over x_{t+2+i}: exactly head i's target given f_t (the accepted
path before it is the target's own). The loss is offline training's (`losses.teacher_probs`,
cross-entropy to the target over the head's reduced vocabulary, so KL up to a constant).

Output never changes: the target verifies every token, whatever the head drafts, and a pass
reads one head version (swaps happen between passes only). What changes is acceptance.
The trainer's CPU use is bounded twice: its own intra-op threads (`threads`; torch's are
per thread) and a duty cycle (`share`: after a step that took s seconds it sleeps
s * (1 - share) / share). Memory is bounded: the ring is allocated once; the trainer holds one
copy of the blocks, AdamW's two moments and at most one snapshot waiting to be swapped in.
Medusa only (its heads read f_t alone, so a position is one row); the live head drafts in
float32 (the trained weights are copied into it, not requantized).
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from forerun.heads import CONFIG_FILE, WEIGHTS_FILE, Heads, TargetIO, load_heads
from forerun.propose.medusa import ONLINE_TEACHER
from forerun.train.collection import TEACHER_TOP
from forerun.train.loop import new_heads
from forerun.train.losses import teacher_probs, vocab_lookup

if TYPE_CHECKING:
    from forerun.api import Engine

STATE_FILE = "online_state.json"  # version, positions seen, updates: beside the head's files
POLL_S = 0.05  # the trainer's wait between looks at the ring while it has too few positions


@dataclass(frozen=True)
class OnlineConfig:
    """`forerun serve --online-distill`'s settings."""

    every: int = 256  # new positions between two updates of the head
    steps: int = 8  # AdamW steps an update
    batch: int = 64  # positions a step
    lr: float = 1e-3
    buffer: int = 4096  # positions the ring holds (the oldest go first)
    threads: int = 1  # the trainer's intra-op threads
    share: float = 0.25  # the most of the time the trainer computes (a duty cycle), in (0, 1]
    directory: str | None = None  # where checkpoints go, and where a restart reads them
    seed: int = 0

    def __post_init__(self):
        for name, value in (("every", self.every), ("steps", self.steps),
                            ("batch", self.batch), ("buffer", self.buffer),
                            ("threads", self.threads)):
            if value < 1:
                raise ValueError(f"--online-distill-{name} must be >= 1, got {value}")
        if not 0 < self.share <= 1:
            raise ValueError(f"--online-distill-share must be in (0, 1], got {self.share}")
        if self.lr <= 0:
            raise ValueError(f"--online-distill-lr must be > 0, got {self.lr}")


class DistillBuffer:
    """A ring of `capacity` positions (feature, wrong head, the target's top-K there),
    allocated once: pushes past capacity overwrite the oldest. Pushed from the worker thread,
    sampled from the trainer's."""

    def __init__(self, capacity: int, dim: int, num_heads: int, top: int = TEACHER_TOP):
        self.capacity, self.num_heads, self.top = capacity, num_heads, top
        self.features = torch.zeros(capacity, dim)  # [C, D] f_t
        self.heads = torch.zeros(capacity, dtype=torch.long)  # [C] the head that was wrong
        self.top_ids = torch.zeros(capacity, top, dtype=torch.long)  # [C, K]
        self.top_lp = torch.zeros(capacity, top)  # [C, K] the target's log-probabilities
        self.added = 0  # positions pushed since start (the ring holds the last `capacity`)
        self._lock = threading.Lock()

    def push(self, feature: torch.Tensor, head: int, logits: torch.Tensor) -> None:
        """One position: f_t [D], the head index, the target's raw logits at that row [V]."""
        if not 0 <= head < self.num_heads:
            return  # past the last head: nothing of this head's to learn
        lp, ids = logits.detach().float().log_softmax(-1).topk(
            min(self.top, logits.shape[-1]))  # [K]
        with self._lock:
            at = self.added % self.capacity
            self.features[at] = feature.detach().float()
            self.heads[at] = head
            self.top_ids[at, :len(ids)], self.top_lp[at, :len(ids)] = ids, lp
            self.top_lp[at, len(ids):] = -float("inf")
            self.added += 1

    def __len__(self) -> int:
        return min(self.added, self.capacity)

    def sample(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """n positions drawn uniformly (with replacement) from the ring, copied out."""
        with self._lock:
            at = torch.randint(len(self), (n,), generator=generator)  # [n]
            return {"features": self.features[at], "heads": self.heads[at],
                    "top_ids": self.top_ids[at], "top_lp": self.top_lp[at]}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.features, self.heads, self.top_ids, self.top_lp))


def medusa_loss(blocks: nn.ModuleList, heads: Heads, batch: dict[str, torch.Tensor],
                lookup: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy to the target's distribution of each position's wrong head, its
    state from `blocks` (the trainer's copy) and its logits from the live head's LM rows."""
    n, losses = heads.vocab_ids.shape[0], []
    for i in batch["heads"].unique().tolist():
        at = batch["heads"] == i  # [B] positions of head i
        z = blocks[i](batch["features"][at])  # [b, D]
        target = teacher_probs(batch, at, lookup, n)  # [b, N]
        losses.append(-(target * heads.logits(z).log_softmax(-1)).sum(-1))  # [b]
    return torch.cat(losses).mean()


class OnlineDistiller:
    """The background trainer of a live Medusa head (see the module's docstring). `swap` is
    the worker's; `start`/`stop` the server's; `update` runs one update now (tests)."""

    def __init__(self, heads: Heads, cfg: OnlineConfig, target: str = ""):
        if heads.cfg.kind != "medusa":
            raise ValueError(f"--online-distill trains Medusa heads; these are "
                             f"{heads.cfg.kind} (use --method medusa)")
        if heads.lm_draft is not None:
            raise ValueError("--online-distill drafts with float32 heads (--head-precision "
                             "float32): trained weights are copied into them as they are")
        self.heads, self.cfg, self.target = heads, cfg, target  # the live head
        self.buffer = DistillBuffer(cfg.buffer, heads.cfg.dim, heads.cfg.num_heads)
        self.blocks = copy.deepcopy(heads.blocks).float().train().requires_grad_(True)
        self.opt = torch.optim.AdamW(self.blocks.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.lookup = vocab_lookup(heads).to(heads.device)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.version = self.live_version = 0  # the newest trained; the one drafting
        self.updates, self.seen = 0, 0  # updates run; buffer.added at the last update
        self.train_seconds = 0.0  # compute time of every update so far
        self.last_loss = float("nan")
        self._pending: tuple[int, dict[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.read_state()

    # --- the worker's ---------------------------------------------------------------------

    def attach(self, shared: dict) -> None:
        """Make every Medusa proposer built from `shared` (an engine's ProposerContext.shared)
        hand its wrong positions to this buffer."""
        shared[ONLINE_TEACHER] = self.buffer

    def swap(self) -> int:
        """Between passes: the newest trained blocks into the live head, in place (all or
        none: the worker drafts nothing while it copies). -> the live version."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            with torch.no_grad():
                self.heads.blocks.load_state_dict(pending[1])
            self.live_version = pending[0]
        return self.live_version

    # --- the trainer's --------------------------------------------------------------------

    def update(self, pause: bool = False) -> float:
        """`steps` AdamW steps over the ring, then a snapshot for `swap` and a checkpoint;
        `pause`: keep to the duty cycle between steps. -> the last step's loss."""
        self.seen = self.buffer.added
        for _ in range(self.cfg.steps):
            started = time.perf_counter()
            loss = medusa_loss(self.blocks, self.heads,
                               self.buffer.sample(self.cfg.batch, self.generator), self.lookup)
            self.opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.blocks.parameters(), 1.0)
            self.opt.step()
            spent = time.perf_counter() - started
            self.train_seconds += spent
            if pause and self._stop.wait(spent * (1 - self.cfg.share) / self.cfg.share):
                break
        self.last_loss = loss.item()
        snapshot = {k: v.detach().clone() for k, v in self.blocks.state_dict().items()}
        self.updates += 1
        with self._lock:
            self.version += 1
            self._pending = (self.version, snapshot)
        if self.cfg.directory:
            self.save(snapshot)
        return self.last_loss

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="forerun-online-distill",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        torch.set_num_threads(self.cfg.threads)  # this thread's own intra-op pool
        while not self._stop.is_set():
            if self.buffer.added - self.seen >= self.cfg.every:
                self.update(pause=True)
            else:
                self._stop.wait(POLL_S)

    @property
    def nbytes(self) -> int:
        """What the trainer holds beyond the live head: the ring, its blocks, AdamW's
        moments, a snapshot waiting."""
        tensors = [*self.blocks.parameters(),
                   *(t for s in self.opt.state.values() for t in s.values()
                     if isinstance(t, torch.Tensor))]
        with self._lock:
            if self._pending is not None:
                tensors += list(self._pending[1].values())
        return self.buffer.nbytes + sum(t.numel() * t.element_size() for t in tensors)

    # --- checkpoints ----------------------------------------------------------------------

    def save(self, snapshot: dict[str, torch.Tensor]) -> None:
        """The head with `snapshot`'s blocks, as `forerun.heads.save_heads` writes one (so
        --heads loads it), float32, each file replaced whole; and the trainer's counters."""
        from safetensors.torch import save_file

        out = Path(self.cfg.directory).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        tensors = {f"blocks.{k}": v.float().contiguous() for k, v in snapshot.items()}
        tensors["vocab_ids"] = self.heads.vocab_ids.cpu().to(torch.int64).contiguous()
        config = asdict(self.heads.cfg) | {"target": self.target or self.heads.cfg.target}
        state = {"version": self.version, "updates": self.updates, "positions": self.seen}
        for name, write in ((WEIGHTS_FILE, lambda p: save_file(tensors, str(p))),
                            (CONFIG_FILE, lambda p: p.write_text(json.dumps(config, indent=2))),
                            (STATE_FILE, lambda p: p.write_text(json.dumps(state)))):
            tmp = out / f".{name}.tmp"
            write(tmp)
            os.replace(tmp, out / name)

    def read_state(self) -> None:
        """A restart's counters, where the directory has them (the head itself is loaded by
        `online_heads`)."""
        path = Path(self.cfg.directory or "").expanduser() / STATE_FILE
        if self.cfg.directory and path.is_file():
            state = json.loads(path.read_text())
            self.version = self.live_version = int(state["version"])
            self.updates = int(state["updates"])


def online_heads(cfg: OnlineConfig, io: TargetIO, target: str, context: int,
                 loaded: Heads | None, fresh: Callable[[], Heads]) -> Heads:
    """The head to serve and train: the checkpoint in cfg.directory where there is one (a
    restart keeps what was learned), else `loaded` (--heads), else `fresh()` (a new one)."""
    directory = Path(cfg.directory or "").expanduser()
    if cfg.directory and (directory / WEIGHTS_FILE).is_file():
        return load_heads(directory, io, target, context, precision="float32")
    return loaded if loaded is not None else fresh()


def serving_distiller(engine: Engine, cfg: OnlineConfig, io: TargetIO, target: str,
                      num_heads: int, vocab: int) -> OnlineDistiller:
    """`forerun serve --online-distill`: the engine's Medusa head (from cfg.directory, else
    --heads, else a new one of `num_heads` heads over the `vocab` most frequent ids, its
    blocks the identity: it learns from zero) set to draft, and its trainer."""
    V = io.embed.shape[0]

    def fresh() -> Heads:
        ids = (torch.tensor(engine.tokenizer.frequent_ids(vocab)) if vocab
               else torch.arange(V))  # [N]
        return new_heads("medusa", io, ids[ids < V], target, engine.target.config.n_layers,
                         num_heads=num_heads).to(io.embed.device)

    heads = online_heads(cfg, io, target, engine.target.capacity, engine.heads, fresh)
    engine.use_heads(heads)
    return OnlineDistiller(heads, cfg, target)
