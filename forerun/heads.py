"""Learned drafting heads on the target's own features: Medusa-1, Hydra, EAGLE-1/2 and EAGLE-3.

Owns: the head networks, their config, and their files (safetensors + a JSON config). A head
never has an LM head or token embedding of its own: it reads the target's (frozen, passed in as
`TargetIO`), and its logits cover a reduced draft vocabulary (the `draft_vocab` most frequent
token ids, FR-Spec / EAGLE-3) whose ids are stored in the file. Verification always runs over
the target's full vocabulary, so a smaller draft vocabulary can only lower acceptance.

Notation: f_t = the target's feature at position t (its final normed hidden state, the vector
its LM head turns into p(x_{t+1})); e(x) = the target's embedding of token x.
- Medusa-1 (Cai et al. 2024): head i is a residual block z_i = f_t + SiLU(W_i f_t + b_i) whose
  logits W_lm z_i predict x_{t+2+i}. Heads are independent of each other's choices.
- Hydra (Ankner et al. 2024): the same, made sequentially dependent: z_0 = f_t and
  z_{i+1} = z_i + SiLU(W_i [z_i; e(y_i)]), y_0 = x_{t+1} (the target's own token), y_i the
  token head i-1 chose; head i's logits W_lm z_{i+1} predict x_{t+2+i}.
- EAGLE-1 (Li et al. 2024): one decoder layer autoregressing on features: its input at position
  t is fc([f_t; e(x_{t+1})]), its output o_t regresses f_{t+1} and W_lm o_t predicts x_{t+2};
  drafting feeds its own o back in place of the target's f. EAGLE-2 is the same head drafting
  a dynamic tree (see `forerun.tree.grow_tree`).
- EAGLE-3 (Li et al. 2025): the feature is a fusion of a low, a middle and the final layer,
  g_t = fuse([h_low; h_mid; f_t]); logits are W_lm norm(o_t); trained on its own rolled-out
  predictions (training-time test) with the token loss only.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from forerun.models.catalog import ModelError
from forerun.runtime.base import ModelConfig
from forerun.runtime.torch_model import Block, CacheRows, rms_norm, rope_tables

KINDS = ("medusa", "hydra", "eagle", "eagle3")
PRECISIONS = ("float32", "bfloat16", "int8", "w8a8")  # a draft step's weights (for_drafting)
# modules whose linears read the target's features (or the feature plus a residual) directly
FEATURE_READERS = ("fc", "fuse", "blocks")
CONFIG_FILE, WEIGHTS_FILE = "head_config.json", "head.safetensors"


class HeadError(ModelError):
    """A head file that is missing, malformed, or made for another target."""


@dataclass(frozen=True)
class HeadConfig:
    kind: str  # one of KINDS
    dim: int  # the target's hidden size
    vocab_size: int  # the target's vocabulary
    target: str = ""  # the target it was trained on (its file name), checked at load
    num_heads: int = 4  # medusa/hydra: tokens one pass drafts; eagle: unused
    layers: tuple[int, ...] = (-1,)  # the target features read (eagle3: low, mid, -1)
    draft_vocab: int = 32768  # logits over this many frequent ids (0 = the full vocabulary)
    n_heads: int = 12  # eagle: attention heads of its decoder layer
    n_kv_heads: int = 2
    ffn_dim: int = 2048
    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    training: dict = field(default_factory=dict, compare=False)  # provenance, not used to run

    def __post_init__(self):
        if self.kind not in KINDS:
            raise HeadError(f"unknown head kind {self.kind!r}; choose {', '.join(KINDS)}")

    def block_config(self, context: int) -> ModelConfig:
        """The shape of an EAGLE head's single decoder layer."""
        return ModelConfig(arch="qwen2", vocab_size=0, dim=self.dim, n_layers=1,
                           n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                           ffn_dim=self.ffn_dim, rope_theta=self.rope_theta,
                           norm_eps=self.norm_eps, context_length=context, qkv_bias=True,
                           tied_embeddings=True)


@dataclass
class TargetIO:
    """The target's frozen input and output layers, as a head uses them."""

    embed: torch.Tensor  # [V, D] token embeddings
    lm_head: torch.Tensor  # [V, D] LM head rows (== embed for tied models)


class DraftLinear(nn.Module):
    """A trained linear layer (or the LM-head slice) in a cheaper form for drafting. A draft
    step multiplies one to a few rows by each weight, so it is bound by the bytes of weights it
    reads: bfloat16 halves float32's, int8 (symmetric, one scale per output row, weight-only as
    in gpt-fast's int8 mode) quarters them; activations go in as bfloat16. w8a8 keeps int8's
    weights and also quantizes the activations (one scale per call, fbgemm's dynamic quantized
    linear: integer dot products, no bfloat16 anywhere), for CPUs without fast bfloat16. Outputs
    are float32; norms, attention and residuals stay float32. One row through the 16,384 x 1536
    LM slice, median ms: 2-core EPYC with AVX512-BF16: float32 6.4, bfloat16 2.3, int8 1.1;
    2-core EPYC Zen 3 (AVX2 only): float32 5.5, bfloat16 3.6, int8 1.6, w8a8 0.39."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, precision: str):
        super().__init__()
        w = weight.detach().float()  # [O, I]
        self.precision, self.out_features = precision, w.shape[0]
        bias = None if bias is None else bias.detach().float()  # [O]
        if precision in ("int8", "w8a8"):
            scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127  # [O]
            q = (w / scale[:, None]).round().to(torch.int8)  # [O, I]
            if precision == "w8a8":  # fbgemm's packed weight carries the bias
                self.packed = pack_w8a8(q, scale, bias)
                return
            self.register_buffer("weight", q)
            self.register_buffer("scale", scale.bfloat16())
        else:
            self.register_buffer("weight", w.bfloat16())
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [R, I]
        if self.precision == "w8a8":  # the bias is in the packed weight
            y = torch.ops.quantized.linear_dynamic(rows.float().contiguous(), self.packed, True)
            return y.view(*x.shape[:-1], self.out_features)
        rows = rows.bfloat16()
        if self.precision == "int8":
            y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scale)  # [R, O]
        else:
            y = rows @ self.weight.T
        y = y.float().view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def w8a8_available() -> bool:
    """Whether this torch build has fbgemm's dynamic quantized linear (x86 builds do)."""
    return ("fbgemm" in torch.backends.quantized.supported_engines
            and hasattr(torch, "_make_per_channel_quantized_tensor")
            and hasattr(torch.ops.quantized, "linear_dynamic"))


def pack_w8a8(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """int8 rows q [O, I] with per-row scales [O] -> fbgemm's packed weight (its own layout)."""
    if not w8a8_available():
        raise HeadError("head precision w8a8 needs torch's fbgemm kernels (x86 builds); "
                        "use int8 or float32")
    with warnings.catch_warnings():  # torch flags its quantized-tensor API as legacy
        warnings.simplefilter("ignore")
        zero = torch.zeros(q.shape[0], dtype=torch.long)
        qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
        return torch.ops.quantized.linear_prepack(qw, bias)


class ResBlock(nn.Module):
    """x + SiLU(W x + b), initialised to the identity (Medusa's head block)."""

    def __init__(self, dim_in: int, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim_in, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor, inp: torch.Tensor | None = None) -> torch.Tensor:
        return x + F.silu(self.linear(x if inp is None else inp))


class Heads(nn.Module):
    """Every head kind's parameters, plus the reduced vocabulary and the target's I/O rows."""

    def __init__(self, cfg: HeadConfig, vocab_ids: torch.Tensor, io: TargetIO, context: int = 4096):
        super().__init__()
        self.cfg = cfg
        D = cfg.dim
        # the target's rows are buffers (moved by .to(device), not saved), frozen
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=False)  # [N]
        self.register_buffer("embed", io.embed, persistent=False)  # [V, D]
        self.register_buffer("lm_rows", io.lm_head[vocab_ids.to(io.lm_head.device)].float()
                             .contiguous(), persistent=False)  # [N, D]
        self.lm_draft: DraftLinear | None = None  # the rows in a drafting precision
        if cfg.kind == "medusa":
            self.blocks = nn.ModuleList(ResBlock(D, D) for _ in range(cfg.num_heads))
        elif cfg.kind == "hydra":
            self.blocks = nn.ModuleList(ResBlock(2 * D, D) for _ in range(cfg.num_heads))
        else:
            if cfg.kind == "eagle3":
                self.fuse = nn.Linear(len(cfg.layers) * D, D, bias=False)
            self.fc = nn.Linear(2 * D, D, bias=False)
            self.layer = Block(cfg.block_config(context))
            self.out_norm = nn.Parameter(torch.ones(D))
            cos, sin = rope_tables(cfg.block_config(context), context, torch.float32, "cpu")
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    @property
    def device(self) -> torch.device:
        """Where the head drafts: the target's device for the torch runtime, else the CPU."""
        return self.vocab_ids.device

    # --- the three head kinds' forward steps (training and drafting share them) ---------------

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """[..., D] -> [..., N] over the reduced vocabulary."""
        if self.cfg.kind == "eagle3":
            z = rms_norm(z, self.out_norm, self.cfg.norm_eps)
        if self.lm_draft is not None:
            return self.lm_draft(z)
        return (z.to(self.lm_rows.dtype) @ self.lm_rows.T).float()

    def for_drafting(self, precision: str) -> Heads:
        """Make every matmul of a draft step (the head's linears and its LM-head slice) read
        `precision` weights: see DraftLinear. Drafts may change; the output cannot. For
        drafting only: the result does not train."""
        if precision not in PRECISIONS:
            raise HeadError(f"unknown head precision {precision!r}; choose "
                            f"{', '.join(PRECISIONS)}")
        if precision == "w8a8" and self.device.type != "cpu":
            raise HeadError(f"head precision w8a8 runs on the CPU only (fbgemm); heads on "
                            f"{self.device} draft in bfloat16 or int8")
        if precision == "float32":
            return self
        linears = [(parent, (prefix or name).split(".")[0], name, child)
                   for prefix, parent in self.named_modules()
                   for name, child in parent.named_children() if isinstance(child, nn.Linear)]
        for parent, top, name, child in linears:
            # w8a8 quantizes a row by its largest entry; the target's features have a few
            # channels far above the rest, so the linears that read them keep int8 weights with
            # bfloat16 inputs (EAGLE's fc alone in w8a8 cost 3-6 points of held-out top-1)
            raw = precision == "w8a8" and top in FEATURE_READERS
            setattr(parent, name, DraftLinear(child.weight, child.bias,
                                              "int8" if raw else precision))
        self.lm_draft = DraftLinear(self.lm_rows, None, precision)
        self.lm_rows = self.lm_rows[:0]  # the float32 rows live on in lm_draft's form only
        return self.requires_grad_(False)

    def medusa(self, f: torch.Tensor) -> torch.Tensor:
        """f [T, D] -> z [K, T, D]: head i's state, predicting x_{t+2+i}."""
        return torch.stack([block(f) for block in self.blocks])

    def hydra_step(self, i: int, z: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Head i: z [T, D] and the token y_i [T] it follows -> the next state [T, D]."""
        return self.blocks[i](z, torch.cat([z, self.embed_of(token)], dim=-1))

    def embed_of(self, token: torch.Tensor) -> torch.Tensor:
        return self.embed[token].float()  # [T, D]

    def feature(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target's features (layer -> [T, D]) -> the EAGLE input feature [T, D]."""
        if self.cfg.kind == "eagle3":
            return self.fuse(torch.cat([hidden[i].to(self.device).float()
                                        for i in self.cfg.layers], dim=-1))
        return hidden[-1].to(self.device).float()

    def eagle_step(self, feature: torch.Tensor, token: torch.Tensor, positions: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
                   mask: torch.Tensor | None) -> torch.Tensor:
        """One pass of the decoder layer: input fc([feature; e(token)]) at `positions`, cache
        slots start..; mask [T, start+T] (None = causal for T = 1). -> o [T, D]."""
        return self.eagle_steps(feature, token, positions,
                                [(k_cache, v_cache, start, feature.shape[0], mask)])

    def eagle_steps(self, feature: torch.Tensor, token: torch.Tensor, positions: torch.Tensor,
                    parts: list[CacheRows]) -> torch.Tensor:
        """`eagle_step` over several sequences' rows at once (feature [R, D], token and
        positions [R]): each part's rows in its own cache (see `Block.forward_parts`), the
        linears over all R rows in one call. -> o [R, D]."""
        x = self.fc(torch.cat([feature, self.embed_of(token)], dim=-1))  # [R, D]
        cos, sin = self.cos[positions], self.sin[positions]
        return self.layer.forward_parts(x, cos, sin, parts)

    def new_cache(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        shape = (cfg.n_kv_heads, capacity, cfg.dim // cfg.n_heads)
        return torch.zeros(shape, device=self.device), torch.zeros(shape, device=self.device)


def save_heads(heads: Heads, directory: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write head.safetensors (weights in `dtype`, the reduced vocabulary's ids) and
    head_config.json into `directory`."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in heads.state_dict().items()}
    tensors["vocab_ids"] = heads.vocab_ids.to(torch.int64).contiguous()
    save_file(tensors, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(asdict(heads.cfg), indent=2) + "\n")
    return directory


def load_heads(path: str | Path, io: TargetIO, target_name: str = "",
               context: int = 4096, precision: str = "float32") -> Heads:
    """Heads from a directory (or its head.safetensors / head_config.json), checked against
    the target's shape, ready to draft with `precision` weights (see Heads.for_drafting) on
    the device of the target's rows in `io` (a torch target's device; the CPU for others)."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    directory = path if path.is_dir() else path.parent
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise HeadError(f"{path}: no heads here (expected {CONFIG_FILE} and {WEIGHTS_FILE}; "
                        "make them with `forerun train`)")
    try:
        raw = json.loads(config_file.read_text())
        raw["layers"] = tuple(raw.get("layers", (-1,)))
        cfg = HeadConfig(**raw)
    except (json.JSONDecodeError, TypeError) as e:
        raise HeadError(f"{config_file}: not a head config ({e})") from e
    V, D = io.embed.shape
    if (cfg.vocab_size, cfg.dim) != (V, D):
        raise HeadError(f"{path}: heads for a target of vocabulary {cfg.vocab_size} and width "
                        f"{cfg.dim}, this target has {V} and {D}")
    if cfg.target and target_name and cfg.target != target_name:
        # same shape, other weights (e.g. another quantization): it runs, acceptance may drop
        import warnings

        warnings.warn(f"{path} was trained on {cfg.target}, running on {target_name}",
                      stacklevel=2)
    tensors = load_file(str(weights_file))
    heads = Heads(cfg, tensors.pop("vocab_ids"), io, context)
    missing, unexpected = heads.load_state_dict(
        {k: v.float() for k, v in tensors.items()}, strict=False)
    if missing or unexpected:
        raise HeadError(f"{weights_file}: missing {missing}, unexpected {unexpected}")
    return heads.eval().to(io.embed.device).for_drafting(precision)
