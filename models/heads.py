"""Medusa heads: K residual blocks on the backbone's last hidden state, each with a projection.

Head k (0-based) predicts the token k + 2 positions after the hidden state's own token, one
more than the backbone's lm_head. A head is `n` blocks of `h + SiLU(W h + b)` followed by its
own vocabulary projection, or by the backbone's lm_head (shared, far smaller on disk).

Files: `medusa_lm_head.safetensors` with the FasterDecoding key layout `{head}.{layer}.linear.
{weight,bias}` and, for own projections, `{head}.{layers}.weight`; plus `config.json`. The
number of heads and layers is read from the tensors, never trusted from the config.

Shared-projection heads may carry `token_ids`: a vocabulary subset (the tokens the backbone
produced in the training transcripts). They are then trained and read out over those rows of
the lm_head only: 3–4× less work per proposal and per training step, and tokens the model
never writes are never proposed.

On a CPU, `pack` lays the weights out once for the matmul kernel measured fastest for drafting
on this machine (`core.backends.lean.PackedLinear`; the heads' first blocks fused into one matmul). Drafts
need not round like any other path: verification decides what is kept.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from core.backends import stepops
from core.backends.lean import PackedLinear, padded_rows, rows_of, table_of
from core.errors import UserError
from models.head_formats import read_head_tensors

WEIGHTS = "medusa_lm_head.safetensors"
CONFIG = "config.json"


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # Medusa's init: the block starts as the identity

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


TOP_FLOATS = 1 << 19  # the most logits `MedusaHeads.top` takes in one batch (2 MB of float32)


class MedusaHeads(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int = 4,
        num_layers: int = 1,
        shared_lm_head: nn.Module | None = None,
        token_ids: Tensor | None = None,
    ) -> None:
        super().__init__()
        if token_ids is not None and shared_lm_head is None:
            raise ValueError("a vocabulary subset needs the shared lm_head")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        own = shared_lm_head is None

        def head() -> nn.Sequential:
            blocks: list[nn.Module] = [ResBlock(hidden_size) for _ in range(num_layers)]
            return nn.Sequential(*blocks, *([nn.Linear(hidden_size, vocab_size, bias=False)] if own else []))

        self.heads = nn.ModuleList(head() for _ in range(num_heads))
        # Held outside the module tree so it is neither saved nor trained with the heads.
        self._shared = (shared_lm_head,) if shared_lm_head is not None else None
        self.register_buffer("token_ids", token_ids.long() if token_ids is not None else None)
        self._subset: Tensor | None = None  # (H, S) the lm_head rows of token_ids, transposed
        self._packed: Packed | None = None  # inference copies in a CPU kernel's layout (see pack)

    @classmethod
    def untrained(cls, lm_head: nn.Module, num_heads: int) -> MedusaHeads:
        """Heads at Medusa's identity init without its blocks: each head reads the hidden state
        straight through the shared `lm_head` (Medusa's zero-weight blocks add only their small
        bias). No weight of their own: 4 blocks at H = 2,048 would hold 34 MB, and a packed copy."""
        dtype, device = table_of(lm_head)
        return (
            cls(lm_head.in_features, lm_head.out_features, num_heads, 0, lm_head).to(device=device, dtype=dtype).eval()
        )

    def _subset_weight(self) -> Tensor:
        dtype, device = table_of(self._shared[0])
        sub = self._subset
        if sub is None or sub.dtype != dtype or sub.device != device:
            with torch.no_grad():
                sub = rows_of(self._shared[0], self.token_ids.to(device)).t().contiguous()
            self._subset = sub
        return sub

    @property
    def shared(self) -> bool:
        return self._shared is not None

    def pack(self, kernel: str, dtype: torch.dtype) -> None:
        """Draft from copies of the weights in `kernel`'s layout and `dtype` (weights stay as they
        are for training and saving; `train()` drops the copies)."""
        if not self.num_layers:
            return
        with torch.no_grad():
            first = [h[0].linear for h in self.heads]
            weight, bias = torch.cat([b.weight for b in first]), torch.cat([b.bias for b in first])
            fused = PackedLinear(weight.to(dtype), bias.to(dtype), kernel)
            rest = [[_packed(b.linear, dtype, kernel) for b in h[1 : self.num_layers]] for h in self.heads]
            if self._shared is None:
                readouts = [_readout(h[self.num_layers].weight, dtype, kernel) for h in self.heads]
            elif self.token_ids is not None:
                readouts = [_readout(rows_of(self._shared[0], self.token_ids), dtype, kernel)]
            else:
                readouts = []  # the backbone's own lm_head
        self._packed = Packed(kernel, dtype, fused, rest, readouts)

    def train(self, mode: bool = True) -> MedusaHeads:
        if mode:
            self._packed = None
        return super().train(mode)

    @property
    def drafting(self) -> str:
        """How the heads draft, for reports and the step-cost key: "int4 bfloat16" or "module"."""
        p = self._packed
        return "module" if p is None else f"{p.kernel} {str(p.dtype).removeprefix('torch.')}"

    def _packed_forward(self, hidden: Tensor, count: int) -> Tensor:
        p = self._packed
        x = hidden.to(p.dtype)
        states = x.unsqueeze(-2) + F.silu(p.fused(x).unflatten(-1, (self.num_heads, self.hidden_size)))
        states = states[..., :count, :]  # (…, count, H)
        if any(p.rest):
            states = torch.stack([_blocks(states[..., i, :], p.rest[i]) for i in range(count)], dim=-2)
        if not p.readouts:
            lm_head = self._shared[0]
            return lm_head(states.to(table_of(lm_head)[0]))
        if len(p.readouts) == 1:
            return p.readouts[0](states)[..., : self._width()]
        return torch.stack([p.readouts[i](states[..., i, :]) for i in range(count)], dim=-2)[..., : self._width()]

    def _width(self) -> int:
        return self.vocab_size if self.token_ids is None else len(self.token_ids)

    def forward(self, hidden: Tensor, count: int | None = None) -> Tensor:
        """(…, H) → (…, count, V) logits of the first `count` heads."""
        if self._packed is not None and not self.training:
            return self._packed_forward(hidden, count or self.num_heads)
        heads = self.heads[: count or self.num_heads]
        if self._shared is None:
            return torch.stack([h(hidden) for h in heads], dim=-2)
        states = torch.stack([h(hidden) for h in heads], dim=-2)  # (…, count, H)
        lm_head = self._shared[0]
        if self.token_ids is not None:
            sub = self._subset_weight()
            return states.to(sub.dtype) @ sub  # (…, count, S): logits over the subset
        return lm_head(states.to(table_of(lm_head)[0]))  # one matmul for all heads

    def candidates(self, hidden: Tensor, count: int, k: int) -> Tensor:
        """(count, k) token ids: each of the first `count` heads' top-k at `hidden` (H,) or (N, H)."""
        top = self(hidden, count).topk(k, dim=-1).indices
        return self.token_ids[top] if self.token_ids is not None else top

    def top(self, hidden: Tensor, count: int, k: int) -> tuple[Tensor, Tensor]:
        """`candidates` and their probabilities (count, k) under each head's softmax: by the kernel
        library's `stepops.top` where it takes the logits (no copy of a row: 0.45 → 0.07 ms for the
        embedded model's four heads, 5 → 0.3 ms and ~16 MB less at a step's peak for a 262k
        vocabulary's); else in one batch where the heads' logits are at most `TOP_FLOATS`, or a head
        at a time, its top k from its logits and their probabilities over its row's log-sum-exp
        (a row at a time is 2-3× slower on a 2-core CPU, so smaller vocabularies keep the batch)."""
        logits = self(hidden, count)
        rows, shape = logits.reshape(-1, logits.shape[-1]), (*logits.shape[:-1], k)
        if (fast := stepops.top(rows, k)) is not None:
            values, indices, norms = fast
            indices, values = indices.view(shape), (values - norms[:, None]).exp().view(shape)
        elif logits.numel() <= TOP_FLOATS:
            top = logits.float().softmax(-1).topk(k, dim=-1)
            indices, values = top.indices, top.values
        else:
            tops = [(row.topk(k), torch.logsumexp(row.float(), dim=-1)) for row in rows]
            indices = torch.stack([top.indices for top, _ in tops]).view(shape)
            values = torch.stack([(top.values.float() - norm).exp() for top, norm in tops]).view(shape)
        ids = self.token_ids[indices] if self.token_ids is not None else indices
        return ids, values

    def target_index(self, targets: Tensor) -> Tensor:
        """Token ids → positions in this head's output (-100 for tokens outside the subset)."""
        if self.token_ids is None:
            return targets
        table = torch.full((self.vocab_size,), -100, dtype=torch.long, device=targets.device)
        table[self.token_ids.to(targets.device)] = torch.arange(len(self.token_ids), device=targets.device)
        return torch.where(targets >= 0, table[targets.clamp(min=0)], targets)

    def save(self, folder: str | Path, base_model: str = "") -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k.removeprefix("heads."): v.contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, folder / WEIGHTS)
        config = {
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "shared_lm_head": self.shared,
            "vocab_subset": None if self.token_ids is None else len(self.token_ids),
            "base_model_name_or_path": base_model,
        }
        (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class Packed:
    kernel: str  # core.backends.lean.KERNELS
    dtype: torch.dtype
    fused: PackedLinear  # every head's first block in one matmul: (num_heads·H, H)
    rest: list[list[PackedLinear]]  # per head, its further blocks
    readouts: list[PackedLinear]  # one for a vocabulary subset, one per head for own projections, none: lm_head


def _readout(weight: Tensor, dtype: torch.dtype, kernel: str) -> PackedLinear:
    """A (rows, H) projection with its rows padded to what every kernel takes; callers keep the
    first `rows` outputs."""
    pad = padded_rows(weight.shape[0]) - weight.shape[0]
    return PackedLinear(F.pad(weight, (0, 0, 0, pad)).to(dtype), None, kernel)


def _packed(linear: nn.Linear, dtype: torch.dtype, kernel: str) -> PackedLinear:
    return PackedLinear(linear.weight.to(dtype), linear.bias.to(dtype), kernel)


def _blocks(x: Tensor, blocks: list[PackedLinear]) -> Tensor:
    for b in blocks:
        x = x + F.silu(b(x))
    return x


_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.weight$")
_PROJ = re.compile(r"^(\d+)\.(\d+)\.weight$")


def load_heads(folder: str | Path, lm_head: nn.Module, model_name: str = "this model") -> MedusaHeads:
    """Heads from `folder` (any published layout) for a backbone whose output projection is
    `lm_head` (V, H). Head and layer counts come from the tensors; the config is not trusted."""
    folder = Path(folder).expanduser()
    tensors, layout = read_head_tensors(folder)
    config = _read_config(folder)
    where = f"{folder} ({layout})"

    blocks = {(int(m[1]), int(m[2])): t for k, t in tensors.items() if (m := _BLOCK.match(k))}
    if not blocks:
        raise UserError(f"{where} holds no Medusa head tensors ('0.0.linear.weight' and so on).")
    num_heads = 1 + max(h for h, _ in blocks)
    num_layers = 1 + max(layer for _, layer in blocks)
    if len(blocks) != num_heads * num_layers:
        raise UserError(f"{where} has heads with different numbers of layers; it is not a Medusa heads file.")
    projections = {int(m[1]) for k in tensors if (m := _PROJ.match(k)) and int(m[2]) == num_layers}
    own = len(projections) == num_heads

    hidden = blocks[(0, 0)].shape[1]
    vocab = tensors[f"0.{num_layers}.weight"].shape[0] if own else config.get("vocab_size")
    model_vocab, model_hidden = lm_head.out_features, lm_head.in_features
    if hidden != model_hidden or (vocab is not None and vocab != model_vocab):
        raise UserError(
            f"The heads in {folder} were made for a model with hidden size {hidden} and vocabulary "
            f"{vocab}, but {model_name} has {model_hidden} and {model_vocab}; use heads trained for "
            "this model."
        )
    wanted = {
        k: v for k, v in tensors.items() if _BLOCK.match(k) or k.endswith(".linear.bias") or (own and _PROJ.match(k))
    }
    token_ids = tensors.get("token_ids") if not own else None
    if token_ids is not None and (
        token_ids.dim() != 1 or int(token_ids.max()) >= model_vocab or int(token_ids.min()) < 0
    ):
        raise UserError(f"{where} has a vocabulary subset that does not fit {model_name}; use heads trained for it.")
    heads = MedusaHeads(model_hidden, model_vocab, num_heads, num_layers, None if own else lm_head, token_ids)
    state = {f"heads.{k}": v for k, v in wanted.items()} | ({"token_ids": token_ids} if token_ids is not None else {})
    heads.load_state_dict(state, strict=True)
    dtype, device = table_of(lm_head)
    heads = heads.to(device=device, dtype=dtype).eval()
    if heads.token_ids is not None:
        heads.token_ids = heads.token_ids.long()  # .to(dtype) leaves integer buffers alone; be explicit
    return heads


def _read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{folder / CONFIG} is not readable JSON ({e}); fix or delete it.") from e
    return config if isinstance(config, dict) else {}
