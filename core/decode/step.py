"""One decode step: propose → verify → accept → commit, each a named function.

`verify` runs one forward of every tree node through the model's own attention, with
position ids = prefix length + depth and a 4D float mask, and returns the backbone's logits
and last hidden states at every node. The only state mutated is the cache passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor
from transformers import PreTrainedModel

from core.backends import cache as kv
from core.backends import lean as fast
from core.backends import q4
from core.decode.acceptance import Acceptance, accept_greedy, accept_greedy_walk, accept_sampling, accept_typical
from core.decode.sampling import probabilities
from core.decode.settings import DecodeSettings
from core.decode.tree import HEADS, ROOT, TreeBuffers, build_tree


@dataclass(frozen=True)
class Draft:
    tokens: Tensor  # (T,) token of each tree node; tokens[0] is the root
    tree: TreeBuffers
    sources: tuple[int, ...] = ()  # per node: tree.ROOT, HEADS, CONTEXT or BOTH (empty: the root, then heads)

    def source(self, node: int) -> int:
        return self.sources[node] if self.sources else (ROOT if node == 0 else HEADS)


class Drafter(Protocol):
    """Anything that turns the backbone's state into a tree of candidate tokens."""

    def propose(self, hidden: Tensor, root: Tensor, history: Sequence[int]) -> Draft:
        """hidden: (H,) last hidden state at the last committed position; root: () the
        backbone's next token (the tree's root); history: prompt and reply so far, root last."""
        ...

    # A drafter that adapts also has `observe(draft, emitted, seconds)`, called after the step
    # that verified `draft` with the tokens it emitted (accepted drafts, then the backbone's own)
    # and its wall time. A drafter that reads the backbone's features (EAGLE) also has
    # `feed(features, next_ids, position)`: the (n, H) hidden states of the positions committed
    # from `position` on (the prompt after the prefill, the accepted path after a step) and the
    # token after each, the last one the next root; and `rewind(prompt_ids, reused) -> int`, told
    # before a reply's prefill that the backbone's kept cache holds the prompt's first `reused`
    # positions: it keeps its own state for as many of them as it can and says how many (the
    # prefill then reads and feeds the prompt from there; without `rewind`, from position 0).


class NoDrafter:
    """Plain decoding: a tree of the root alone, one token per step."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.tree = build_tree([]).to(device)

    def propose(self, hidden: Tensor, root: Tensor, history: Sequence[int] = ()) -> Draft:
        self.tree = self.tree.on(root.device)
        return Draft(root.view(1), self.tree)


class RowLogits:
    """Next-token logits computed one node at a time, the first time `[node]` asks: where the
    lm_head's cost grows with every row (`core.backends.lean.row_head`), a walk down the tree pays only
    for the nodes on its path, and each row rounds exactly as a one-token step's does."""

    def __init__(self, model: PreTrainedModel, hidden: Tensor) -> None:
        self.model, self.hidden = model, hidden
        self._rows: dict[int, Tensor] = {}

    def __getitem__(self, node: int) -> Tensor:
        node = int(node)
        if node not in self._rows:
            self._rows[node] = project(self.model, self.hidden[node : node + 1])[0]  # (V,)
        return self._rows[node]

    def full(self) -> Tensor:
        """(T, V) every node's logits, for rules that read them all."""
        return torch.stack([self[n] for n in range(self.hidden.shape[0])])


@dataclass(frozen=True)
class Forward:
    logits: Tensor | RowLogits  # (T, V) the backbone's next-token logits at each input position
    hidden: Tensor  # (T, H) last hidden state (after the final norm) at each position
    features: Tensor | None = None  # prefill: (n, H) the hidden state at every prompt position
    taps: Tensor | None = None  # (T or n, taps·H) the streams a drafter asked for, at the same positions

    def backbone_features(self, rows: Tensor | None = None) -> Tensor:
        """What a feature-reading drafter (EAGLE) is fed at `rows` (None: every prompt position
        of a prefill): the tapped streams, then the last hidden state."""
        last = self.features if rows is None else self.hidden[rows]
        if self.taps is None:
            return last
        return torch.cat([self.taps if rows is None else self.taps[rows], last], dim=-1)


def project(model: PreTrainedModel, hidden: Tensor) -> Tensor:
    """(T, H) last hidden states → (T, V) next-token logits (the lm_head, soft-capped where the model does)."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def prefill(model: PreTrainedModel, cache: kv.Cache, ids: Tensor, taps: tuple[int, ...] = ()) -> Forward:
    """Run the prompt (n,) into the cache; logits and hidden state of its last position (and
    with `taps`, the streams after that many layers at every position)."""
    if isinstance(cache, fast.StaticKV):
        every, tapped = _lean_prefill(fast.forward_of(model), cache, ids, taps)
    else:
        base = model.base_model
        out = base(
            input_ids=ids.view(1, -1), **kv.argument(base, cache), use_cache=True, output_hidden_states=bool(taps)
        )
        every, tapped = out.last_hidden_state[0], _tapped(out, taps)  # (n, H)
    hidden = every[-1:]
    return Forward(project(model, hidden), hidden, every, tapped)


def _lean_prefill(forward: fast.FastForward, cache: fast.StaticKV, ids: Tensor, taps: tuple[int, ...]):
    """The prompt through the lean forward. Where the library's decoder runs the steps, the prompt
    goes through it too, in causal blocks of as many rows as it takes: a position's keys and values
    are then the same bits whether a prefill or a step computed them, so a reply that reuses a kept
    cache (steps' entries) reads exactly as one that reads its whole prompt."""
    library = forward.native is not None
    chunk = q4.Ops.MAX_ROWS if library else ids.numel()
    every, tapped = [], []
    for start in range(0, ids.numel(), chunk):
        part, past = ids[start : start + chunk], cache.length
        positions = torch.arange(past, past + part.numel(), device=ids.device)
        # an explicit causal mask: a causal block without one is left to torch's attention
        mask = fast.causal_mask(part.numel(), past, forward.dtype, ids.device) if library and part.numel() > 1 else None
        hidden, streams = forward.run(part, positions, mask, cache, taps)
        every.append(hidden)
        tapped.append(streams)
    return torch.cat(every), torch.cat(tapped) if taps else None


def verify(model: PreTrainedModel, cache: kv.Cache, draft: Draft, taps: tuple[int, ...] = ()) -> Forward:
    """One forward over every tree node on top of the committed prefix in `cache`."""
    past = kv.length(cache)
    hidden, tapped = decoder_layers(model, cache, draft, tree_mask(model, draft, past), past, taps)
    by_row = draft.tree.size > 1 and fast.row_head(model)
    return Forward(RowLogits(model, hidden) if by_row else project(model, hidden), hidden, taps=tapped)


def tree_mask(model: PreTrainedModel, draft: Draft, past: int) -> Tensor | None:
    """The 4D tree mask after `past` cached positions; None for a lone root, where plain causal
    attention is the same and faster."""
    return None if draft.tree.size == 1 else draft.tree.attention_mask(past, model.dtype)


def decoder_layers(
    model: PreTrainedModel, cache: kv.Cache, draft: Draft, mask: Tensor | None, past: int, taps: tuple[int, ...] = ()
) -> tuple[Tensor, Tensor | None]:
    """(T, H) last hidden states of the tree nodes (embedding, decoder layers, final norm),
    at positions prefix length + depth, and (T, taps·H) the streams at `taps` (None without);
    the nodes are appended to `cache`."""
    if isinstance(cache, fast.StaticKV):
        return fast.forward_of(model).run(draft.tokens, draft.tree.depth + past, mask, cache, taps)
    base = model.base_model
    out = base(
        input_ids=draft.tokens.view(1, -1),
        attention_mask=mask,
        position_ids=(draft.tree.depth + past).view(1, -1),
        **kv.argument(base, cache),
        use_cache=True,
        output_hidden_states=bool(taps),
    )
    return out.last_hidden_state[0], _tapped(out, taps)


def _tapped(out, taps: tuple[int, ...]) -> Tensor | None:
    """(T, taps·H) a transformers output's hidden states at `taps`, side by side."""
    return torch.cat([out.hidden_states[t][0] for t in taps], dim=-1) if taps else None


def accept(forward: Forward, draft: Draft, settings: DecodeSettings, generator: torch.Generator | None) -> Acceptance:
    """Apply the configured acceptance rule to a verified draft."""
    logits = forward.logits
    if settings.acceptance == "typical":
        return accept_typical(
            logits.full() if isinstance(logits, RowLogits) else logits,
            draft.tokens,
            draft.tree,
            settings.temperature,
            settings.epsilon,
            settings.delta,
        )
    if settings.temperature == 0:
        greedy = accept_greedy_walk if isinstance(logits, RowLogits) else accept_greedy
        return greedy(logits, draft.tokens, draft.tree)
    return accept_sampling(logits, draft.tokens, draft.tree, sampler(settings), generator)


def sampler(settings: DecodeSettings) -> Callable[[Tensor], Tensor]:
    return lambda logits: probabilities(logits, settings.temperature, settings.top_k, settings.top_p)


def first_token(forward: Forward, settings: DecodeSettings, generator: torch.Generator | None) -> Tensor:
    """The backbone's token after the prompt, chosen by the same rule as every later one."""
    root_only = NoDrafter(forward.hidden.device).propose(
        forward.hidden[-1], forward.hidden.new_zeros((), dtype=torch.long)
    )
    return accept(forward, root_only, settings, generator).next_token


def commit(cache: kv.Cache, prefix_len: int, result: Acceptance) -> None:
    """Keep only the accepted path's entries after the prefix."""
    kv.keep_path(cache, prefix_len, result.path)
