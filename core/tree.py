"""Candidate trees in the Medusa `medusa_choices` format, as frozen tensor buffers.

A tree is a list of paths of top-k ranks: `[1, 0]` means "the second choice of head 1, then
the first choice of head 2 under it". Node 0 is the root, the token the backbone itself chose;
node i > 0 is the i-th path after sorting by (depth, ranks), so a parent always precedes its
children. This module knows nothing about models or tokens: it only turns paths into indices
and masks, and loads the presets shipped in `assets/trees/`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from core.errors import UserError

Path_ = tuple[int, ...]


@dataclass(frozen=True)
class TreeBuffers:
    """Everything a decode step needs to know about a tree's shape."""

    paths: tuple[Path_, ...]  # sorted paths; node i + 1 takes paths[i]
    depth: Tensor  # (T,) long; 0 for the root
    parent: Tensor  # (T,) long; the root is its own parent
    rank: Tensor  # (T,) long; top-k rank of the node's token at its depth, -1 for the root
    visible: Tensor  # (T, T) bool; visible[i, j] = node j is node i or one of its ancestors
    children: Tensor  # (T, C) long; child node indices, padded with -1
    leaf_paths: Tensor  # (L, D + 1) long; node indices from the root to each leaf, padded with -1
    top_k: int  # candidates per head the tree uses (largest rank + 1; 0 for a root-only tree)

    @property
    def size(self) -> int:
        """Number of nodes, root included: the token count of one verify forward."""
        return len(self.paths) + 1

    @property
    def max_depth(self) -> int:
        """How many tokens ahead of the root the tree reaches (= heads it needs)."""
        return max((len(p) for p in self.paths), default=0)

    def candidate_index(self) -> Tensor:
        """(T - 1,) index of each non-root node's token in a flattened (heads, top_k) table."""
        return (self.depth[1:] - 1) * self.top_k + self.rank[1:]

    def attention_mask(self, past: int, dtype: torch.dtype) -> Tensor:
        """(1, 1, T, past + T) additive mask: 0 where visible, dtype-min where hidden.

        Every node sees the whole committed prefix, its ancestors and itself. A float mask is
        used because transformers applies a 4D bool mask wrongly under eager attention.
        """
        t = self.size
        mask = torch.zeros((1, 1, t, past + t), dtype=dtype, device=self.visible.device)
        mask[0, 0, :, past:].masked_fill_(~self.visible, torch.finfo(dtype).min)
        return mask

    def path_to(self, node: int) -> Tensor:
        """(d + 1,) node indices from the root down to `node`."""
        return self.visible[node].nonzero().squeeze(1)

    def to(self, device: torch.device | str) -> TreeBuffers:
        tensors = ("depth", "parent", "rank", "visible", "children", "leaf_paths")
        return replace(self, **{name: getattr(self, name).to(device) for name in tensors})


def build_tree(paths: list[list[int]] | tuple[Path_, ...]) -> TreeBuffers:
    """Validate paths of ranks and build the buffers. Raises UserError on a malformed tree."""
    clean = _validate(paths)
    ordered = sorted(clean, key=lambda p: (len(p), p))
    index = {(): 0} | {p: i + 1 for i, p in enumerate(ordered)}
    t = len(ordered) + 1

    depth = torch.tensor([0] + [len(p) for p in ordered])
    parent = torch.tensor([0] + [index[p[:-1]] for p in ordered])
    rank = torch.tensor([-1] + [p[-1] for p in ordered])

    visible = torch.eye(t, dtype=torch.bool)
    for p, i in index.items():
        for d in range(len(p)):
            visible[i, index[p[:d]]] = True

    kids: list[list[int]] = [[] for _ in range(t)]
    for p in ordered:
        kids[index[p[:-1]]].append(index[p])
    children = _pad([k for k in kids], width=max(map(len, kids)))

    is_parent = {p[:-1] for p in ordered}
    leaves = [p for p in [(), *ordered] if p not in is_parent]
    leaf_paths = _pad([[index[p[:d]] for d in range(len(p) + 1)] for p in leaves], len(max(leaves, key=len)) + 1)

    top_k = max((max(p) for p in ordered), default=-1) + 1
    return TreeBuffers(tuple(ordered), depth, parent, rank, visible, children, leaf_paths, top_k)


def _pad(rows: list[list[int]], width: int) -> Tensor:
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long).reshape(len(rows), width)


def _validate(paths: list[list[int]] | tuple[Path_, ...]) -> list[Path_]:
    if not isinstance(paths, (list, tuple)):
        raise UserError("A tree must be a list of paths such as [[0], [1], [0, 0]].")
    clean: list[Path_] = []
    for p in paths:
        ok = isinstance(p, (list, tuple)) and len(p) > 0
        if not ok or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p):
            raise UserError(f"Tree path {p!r} is not a non-empty list of ranks (integers ≥ 0).")
        clean.append(tuple(p))
    if len(set(clean)) != len(clean):
        raise UserError("The tree lists a path twice; each path must appear once.")
    present = set(clean)
    for p in clean:
        if len(p) > 1 and p[:-1] not in present:
            raise UserError(f"Tree path {list(p)} has no parent path {list(p[:-1])}; add it.")
    return clean


def check_fits(tree: TreeBuffers, num_heads: int, top_k: int, name: str = "the tree") -> None:
    """Refuse a tree the drafter cannot fill: deeper than its heads or ranks beyond its top-k."""
    if tree.max_depth > num_heads:
        raise UserError(
            f"{name} is {tree.max_depth} tokens deep but the heads predict only {num_heads} "
            f"ahead; choose a tree of depth ≤ {num_heads}."
        )
    if tree.top_k > top_k:
        raise UserError(
            f"{name} uses rank {tree.top_k - 1} but only the top {top_k} candidates per head "
            f"are taken; choose a tree with ranks < {top_k}."
        )


# -- presets --------------------------------------------------------------------------------


def _preset_dir() -> Path:
    return Path(str(resources.files("assets") / "trees"))


def preset_names() -> list[str]:
    return sorted(p.stem for p in _preset_dir().glob("*.json"))


def load_tree(name_or_file: str) -> tuple[str, TreeBuffers]:
    """A preset by name, or a JSON file holding a list of paths (or {"paths": [...]})."""
    file = _preset_dir() / f"{name_or_file}.json"
    if not file.is_file():
        file = Path(name_or_file).expanduser()
        if file.suffix != ".json" or not file.is_file():
            raise UserError(
                f"Unknown tree '{name_or_file}'; choose one of {', '.join(preset_names())} "
                "or pass a .json file of paths."
            )
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"Tree file {file} is not readable JSON ({e}); fix or replace it.") from e
    paths = data.get("paths") if isinstance(data, dict) else data
    return file.stem, build_tree(paths)
