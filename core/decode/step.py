"""One decode step: propose → verify → accept → commit, each a named function.

`verify` runs one forward of every tree node through the backend (`core.backends.base.Backend`),
with position ids = prefix length + depth and a 4D float mask, and returns the backbone's logits
and last hidden states at every node. The step knows nothing of what runs the forward: it calls
the backend's methods, never asks which cache or logits it holds. The only state mutated is the
cache passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from core.backends.base import Backend, Cache, Logits, Taps
from core.decode.acceptance import Acceptance, accept_greedy, accept_greedy_walk, accept_sampling, accept_typical
from core.decode.sampling import probabilities
from core.decode.settings import DecodeSettings
from core.drafters.base import Draft, NoDrafter


@dataclass(frozen=True)
class Forward:
    logits: Logits  # the backbone's next-token logits at each input position ((T, V), or node by node)
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


def prefill(backend: Backend, cache: Cache, ids: Tensor, taps: Taps = ()) -> Forward:
    """Run the prompt (n,) into the cache; logits and hidden state of its last position (and
    with `taps`, the streams after that many layers at every position)."""
    every, tapped = backend.prefill(cache, ids, taps)  # (n, H)
    hidden = every[-1:]
    return Forward(backend.logits(hidden), hidden, every, tapped)


def verify(backend: Backend, cache: Cache, draft: Draft, taps: Taps = ()) -> Forward:
    """One forward over every tree node on top of the committed prefix in `cache`."""
    past = backend.length(cache)
    hidden, tapped = decoder_layers(backend, cache, draft, tree_mask(backend, draft, past), past, taps)
    return Forward(backend.logits(hidden, tree=draft.tree.size > 1), hidden, taps=tapped)


def tree_mask(backend: Backend, draft: Draft, past: int) -> Tensor | None:
    """The 4D tree mask after `past` cached positions; None for a lone root, where plain causal
    attention is the same and faster."""
    return None if draft.tree.size == 1 else draft.tree.attention_mask(past, backend.dtype)


def decoder_layers(
    backend: Backend, cache: Cache, draft: Draft, mask: Tensor | None, past: int, taps: Taps = ()
) -> tuple[Tensor, Tensor | None]:
    """(T, H) last hidden states of the tree nodes (embedding, decoder layers, final norm),
    at positions prefix length + depth, and (T, taps·H) the streams at `taps` (None without);
    the nodes are appended to `cache`."""
    return backend.run(draft.tokens, draft.tree.depth + past, mask, cache, taps)


def accept(forward: Forward, draft: Draft, settings: DecodeSettings, generator: torch.Generator | None) -> Acceptance:
    """Apply the configured acceptance rule to a verified draft."""
    logits = forward.logits
    if settings.acceptance == "typical":
        return accept_typical(
            logits.full(), draft.tokens, draft.tree, settings.temperature, settings.epsilon, settings.delta
        )
    rows = logits if logits.by_row else logits.full()  # logits computed node by node stay so for a walk
    if settings.temperature == 0:
        greedy = accept_greedy_walk if logits.by_row else accept_greedy
        return greedy(rows, draft.tokens, draft.tree)
    return accept_sampling(rows, draft.tokens, draft.tree, sampler(settings), generator)


def sampler(settings: DecodeSettings) -> Callable[[Tensor], Tensor]:
    return lambda logits: probabilities(logits, settings.temperature, settings.top_k, settings.top_p)


def first_token(forward: Forward, settings: DecodeSettings, generator: torch.Generator | None) -> Tensor:
    """The backbone's token after the prompt, chosen by the same rule as every later one."""
    root_only = NoDrafter(forward.hidden.device).propose(
        forward.hidden[-1], forward.hidden.new_zeros((), dtype=torch.long)
    )
    return accept(forward, root_only, settings, generator).next_token


def commit(backend: Backend, cache: Cache, prefix_len: int, result: Acceptance) -> None:
    """Keep only the accepted path's entries after the prefix (a plain step's one entry stays as
    it is: on a GPU, moving it would cost a few kernel launches a layer for nothing)."""
    if result.path.numel() == 1 and backend.length(cache) == prefix_len + 1:
        return
    backend.keep_path(cache, prefix_len, result.path)
