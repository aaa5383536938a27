"""Candidate trees in the Medusa `medusa_choices` format, as frozen tensor buffers.

A tree is a list of paths of top-k ranks: `[1, 0]` means "the second choice of head 1, then
the first choice of head 2 under it". Node 0 is the root, the token the backbone itself chose;
node i > 0 is the i-th path after sorting by (depth, ranks), so a parent always precedes its
children. This module knows nothing about models or tokens: it only turns paths into indices
and masks, and loads the presets shipped in `assets/trees/`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from core.drafters.registry import DRAFTERS
from core.errors import UserError

Path_ = tuple[int, ...]


# where a node's token came from ("both": the heads and a lookup; "retrieval": the model's past
# replies; "eagle": the EAGLE draft layer; "draft": a draft model)
SOURCES = ("root", "heads", "context", "both", "retrieval", "eagle", "draft")
DRAFT_SOURCES = SOURCES[1:]  # where an accepted drafted token came from
AUTO = "auto"  # the tree name that lets the speculation policy choose each step's tree (the default)
ROOT, HEADS, CONTEXT, BOTH, RETRIEVAL, EAGLE, DRAFT = range(7)


@dataclass(frozen=True)
class TreeBuffers:
    """Everything a decode step needs to know about a tree's shape."""

    paths: tuple[Path_, ...]  # preset trees: sorted rank paths, node i + 1 takes paths[i]; () per-step trees
    depth: Tensor  # (T,) long; 0 for the root
    parent: Tensor  # (T,) long; the root is its own parent
    rank: Tensor  # (T,) long; top-k rank of the node's token at its depth, -1 for the root and lookups
    visible: Tensor  # (T, T) bool; visible[i, j] = node j is node i or one of its ancestors
    children: Tensor  # (T, C) long; child node indices, padded with -1
    top_k: int  # candidates per head the tree uses (largest rank + 1; 0 for a root-only tree)
    size: int  # number of nodes, root included: the token count of one verify forward
    max_depth: int  # how many tokens ahead of the root the tree reaches (= heads it needs)

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

    @functools.cached_property
    def parents(self) -> list[int]:
        """`parent` as a list (a step's greedy acceptance walks it faster than small tensor ops)."""
        return self.parent.tolist()

    def path_to(self, node: int) -> Tensor:
        """(d + 1,) node indices from the root down to `node` (read only), made once a node: trees
        recur from step to step, and a tensor operation right after a step's kernels, the caches
        cold, costs ~40 µs (a plain step's decoding spent 1 % of its time here)."""
        path = self._paths.get(node)
        if path is None:
            path = self._paths[node] = self.visible[node].nonzero().squeeze(1)
        return path

    @functools.cached_property
    def _paths(self) -> dict[int, Tensor]:
        return {}

    def to(self, device: torch.device | str) -> TreeBuffers:
        tensors = ("depth", "parent", "rank", "visible", "children")
        return replace(self, **{name: getattr(self, name).to(device) for name in tensors})

    def on(self, device: torch.device | str) -> TreeBuffers:
        """The tree on `device` (the model's, where its positions and mask meet the model's
        tensors): itself when it is there already, else a copy there."""
        return self if self.depth.device == torch.device(device) else self.to(device)


def from_parents(parent: list[int], rank: list[int], paths: tuple[Path_, ...] = ()) -> TreeBuffers:
    """Buffers of the tree whose node i > 0 hangs under parent[i] < i (node 0 is the root).

    Cheap enough to run every decoding step (well under a millisecond for 64 nodes)."""
    t = len(parent)
    depth = [0] * t
    visible = np.zeros((t, t), dtype=bool)
    kids: list[list[int]] = [[] for _ in range(t)]
    visible[0, 0] = True
    for i in range(1, t):
        p = parent[i]
        if not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}; parents must come first")
        depth[i] = depth[p] + 1
        visible[i] = visible[p]
        visible[i, i] = True
        kids[p].append(i)
    width = max(map(len, kids))
    children = [k + [-1] * (width - len(k)) for k in kids]
    return TreeBuffers(
        paths=paths,
        depth=torch.tensor(depth),
        parent=torch.tensor([0, *parent[1:]]),
        rank=torch.tensor(rank),
        visible=torch.from_numpy(visible),
        children=torch.tensor(children, dtype=torch.long).reshape(t, width),
        top_k=max(rank, default=-1) + 1,
        size=t,
        max_depth=max(depth),
    )


def build_tree(paths: list[list[int]] | tuple[Path_, ...]) -> TreeBuffers:
    """Validate paths of ranks and build the buffers. Raises UserError on a malformed tree."""
    clean = _validate(paths)
    ordered = sorted(clean, key=lambda p: (len(p), p))
    index = {(): 0} | {p: i + 1 for i, p in enumerate(ordered)}
    parent = [0] + [index[p[:-1]] for p in ordered]
    rank = [-1] + [p[-1] for p in ordered]
    return from_parents(parent, rank, tuple(ordered))


def graft(
    tree: TreeBuffers,
    tokens: list[int],
    branches: list[list[int]],
    source: int = CONTEXT,
    base_sources: list[int] | None = None,
) -> tuple[list[int], TreeBuffers, list[int]]:
    """`tree` (holding `tokens`) with token `branches` added under the root, deduplicated.

    A branch follows existing nodes while their tokens match and adds new nodes after that,
    so siblings stay distinct. Returns the merged tokens, buffers and each node's source
    (ROOT, HEADS, `source` or BOTH; the base tree's nodes count as HEADS unless `base_sources`
    says otherwise, as after an earlier graft)."""
    parent = tree.parent.tolist()
    rank = tree.rank.tolist()
    tokens = list(tokens)
    sources = list(base_sources) if base_sources is not None else [ROOT] + [HEADS] * (len(tokens) - 1)
    child: dict[tuple[int, int], int] = {(parent[i], tokens[i]): i for i in range(1, len(tokens))}
    added = False
    for branch in branches:
        node = 0
        for token in branch:
            nxt = child.get((node, token))
            if nxt is None:
                nxt = len(tokens)
                child[(node, token)] = nxt
                parent.append(node)
                rank.append(-1)
                tokens.append(token)
                sources.append(source)
                added = True
            elif sources[nxt] == HEADS:
                sources[nxt] = BOTH
            node = nxt
    return tokens, (from_parents(parent, rank) if added else tree), sources


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


@dataclass(frozen=True)
class Preset:
    """A tree file: its paths and, for calibrated trees, the drafter and lookup settings it was
    chosen with (`medusa-chat calibrate` writes all of them)."""

    name: str
    tree: TreeBuffers
    drafter: str = "medusa"  # the kind it was calibrated with (one of core.drafters.registry.DRAFTERS)
    lookup_branches: int = 2  # continuations copied from the context per step
    lookup_length: int = 4  # tokens per continuation
    top1: tuple[float, ...] = ()  # calibrated trees: how often each head's first choice was right
    top10: tuple[float, ...] = ()  # and how often one of its ten first choices was
    reliability: tuple[tuple[float, ...], ...] = ()  # per head, how often candidates of each probability bin were


def load_preset(name_or_file: str) -> Preset:
    """A preset by name, or a JSON file holding a list of paths (or {"paths": [...], …})."""
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
    if not isinstance(data, dict):
        return Preset(file.stem, build_tree(data))
    lookup = data.get("lookup") or {}
    drafter, branches, length = data.get("drafter", "medusa"), lookup.get("branches", 2), lookup.get("length", 4)
    valid = drafter in DRAFTERS and all(
        isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 16 for v in (branches, length)
    )
    if not valid:
        raise UserError(
            f"Tree file {file} has a bad drafter or lookup setting; use drafter {', '.join(DRAFTERS)} "
            "and lookup branches and length from 1 to 16."
        )
    calibration = data.get("calibration") or {}
    top1, top10 = calibration.get("top1") or (), calibration.get("top10") or ()
    if not all(isinstance(a, (int, float)) and 0 <= a <= 1 for a in (*top1, *top10)):
        top1 = top10 = ()  # figures that make no sense are not a prior
    reliability = calibration.get("reliability") or ()
    if not (isinstance(reliability, list) and all(_fractions(h) for h in reliability)):
        reliability = ()
    return Preset(
        file.stem, build_tree(data.get("paths")), drafter, branches, length, tuple(top1), tuple(top10),
        tuple(tuple(h) for h in reliability),
    )  # fmt: skip


def _fractions(values: object) -> bool:
    return (
        isinstance(values, list) and bool(values) and all(isinstance(a, (int, float)) and 0 <= a <= 1 for a in values)
    )


def load_tree(name_or_file: str) -> tuple[str, TreeBuffers]:
    preset = load_preset(name_or_file)
    return preset.name, preset.tree
