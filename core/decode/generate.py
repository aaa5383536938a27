"""The generation loop as a stream of frozen step events.

`stream` yields one `StepEvent` per decoding step (the prefill counts as step 1, which makes
the backbone's first token) and a final `Finished`. Plain decoding is the same loop with a
drafter that proposes nothing, so the two always report comparable numbers. The UI, the CLI,
the benchmark and the tests all consume this stream; `collect` gathers it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from core.backends.base import Backend, Cache
from core.backends.cache import Kept
from core.decode import precision
from core.decode.acceptance import Acceptance
from core.decode.settings import DecodeSettings
from core.decode.step import accept, commit, first_token, prefill, verify
from core.decode.text import Decoder, Detokenizer
from core.decode.tree import SOURCES
from core.drafters.base import Draft, Drafter, NoDrafter
from core.errors import ContextExceeded, UserError
from core.measure.clock import now

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FINISH_REASONS = ("eos", "stop", "length", "cancelled")


@dataclass(frozen=True)
class StepEvent:
    step: int  # 1-based; step 1 is the prefill
    token_ids: tuple[int, ...]  # new tokens: accepted drafts, then the backbone's own token
    text: str  # decoded text delta (may be empty while a character is incomplete)
    accepted: int  # drafted tokens accepted in this step
    path: tuple[int, ...]  # accepted tree nodes, root first
    draft: tuple[int, ...]  # the tree's tokens as verified (empty for the prefill)
    tree_size: int  # nodes in this step's verify forward (0 for the prefill)
    seconds: float  # wall time of the step
    tokens_per_second: float  # running rate of the reply since the prompt was sent
    sources: tuple[str, ...] = ()  # per accepted drafted token: "heads", "context" or "both"
    parents: tuple[int, ...] = ()  # the tree's shape: parent of each node (the root its own)
    node_sources: tuple[str, ...] = ()  # per tree node: "root", "heads", "context" or "both"
    draft_seconds: float = 0.0  # of `seconds`, the time the drafter took to build this step's tree
    choice: str = ""  # why this tree (an adaptive drafter's reason; empty for fixed trees)
    expected_tokens: float = 0.0  # what the drafter expected this step to return (0: no estimate)
    expected_ms: float = 0.0  # and to cost


@dataclass(frozen=True)
class Finished:
    token_ids: tuple[int, ...]  # the whole reply (an EOS token included if one ended it)
    text: str
    steps: int  # decoding steps, prefill included
    seconds: float  # wall time from the prompt to the last token
    first_token_seconds: float  # time to first token (the prefill)
    finish_reason: str  # one of FINISH_REASONS
    exactness: str = precision.EXACT  # against plain decoding: "exact", "exact up to bfloat16 rounding"…
    prompt_read: int = 0  # prompt tokens the prefill read
    prompt_reused: int = 0  # prompt tokens whose keys and values came from the kept cache instead

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        return len(self.token_ids) / self.steps if self.steps else 0.0


LARGE_TREE = 64  # a large tree's nodes, verified past the reply's last position (the cache is made with room for them)


def stream(
    backend: Backend,
    prompt_ids: list[int],
    settings: DecodeSettings,
    drafter: Drafter | None = None,
    tokenizer: Decoder | None = None,
    eos_ids: Iterable[int] = (),
    generator: torch.Generator | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    kept: Kept | None = None,
) -> Iterator[StepEvent | Finished]:
    """Decode a reply to `prompt_ids` on `backend`, one event per step. Cancellation is checked
    between steps. `kept`: the conversation's cache from the last reply, of which the prefill
    reuses what the prompt shares with it; the reply's own cache is kept there when it ends."""
    device = backend.device
    plain = NoDrafter(device)
    drafter = drafter or plain
    context = _check_prompt(backend.model, prompt_ids)
    reply = _Reply(tokenizer, eos_ids, min(settings.max_new_tokens, context - len(prompt_ids)), settings.stop, device)

    with torch.inference_mode():
        # 1) prefill: the prompt (what the kept cache lacks of it) into the cache, the backbone's first token
        taps = drafter.taps  # layers whose streams the drafter reads too (EAGLE-3)
        cache, reused = resume(backend, prompt_ids, kept, drafter)
        if not reused:  # a new cache made at once for the prompt and the longest reply: none of it copied
            backend.reserve(cache, len(prompt_ids) + reply.limit + LARGE_TREE)  # as it grows, or mid-reply
        fwd = prefill(backend, cache, torch.tensor(prompt_ids[reused:], device=device), taps)
        root = first_token(fwd, settings, generator)
        hidden = fwd.hidden[-1]
        if drafter.reads_features:  # (EAGLE) fed every committed position's features
            ids = torch.tensor([*prompt_ids[reused + 1 :], int(root)], device=device)
            drafter.feed(fwd.backbone_features(), ids, reused)
        new, reason = reply.emit([int(root)])
        history = [*prompt_ids, *new]
        cached = list(prompt_ids)  # the tokens in the cache: the prompt, then each step's root and accepted drafts
        first_token_seconds = now(device) - reply.start
        yield (e := reply.event(1, new, reply.start))
        reason = reason or reply.stopped(e.text)

        # 2) decode: propose → verify → accept → commit, until EOS, a stop string or the limit
        step = 1
        while reason is None:
            if should_stop():
                reason = "cancelled"
                break
            t0 = now(device)
            step += 1
            prefix_len = backend.length(cache)
            with backend.kernels():  # the attention kernels measured fastest here (a GPU's choice)
                draft = drafter.propose(hidden, root, history)
                choice = drafter.last_choice
                if prefix_len + draft.tree.max_depth >= context:  # the tree would need positions the model lacks
                    draft = plain.propose(hidden, root)
                room = backend.tree_room(prefix_len)  # the most nodes that each get a one-token step's bits
                draft = draft if room is None else draft.first(room)
                drafting = now(device) - t0
                fwd = verify(backend, cache, draft, taps)
                result = accept(fwd, draft, settings, generator)
                commit(backend, cache, prefix_len, result)
                hidden, root = fwd.hidden[result.path[-1]], result.next_token
                emitted = torch.cat([draft.tokens[result.path[1:]], root.view(1)])
                if drafter.reads_features:
                    drafter.feed(fwd.backbone_features(result.path), emitted, prefix_len)
            tokens = emitted.tolist()
            cached += [history[-1], *tokens[:-1]]  # the root, the accepted drafts (the new root is not in yet)
            drafter.observe(draft, tokens, now(device) - t0)  # adaptive drafters learn from each step
            new, reason = reply.emit(tokens)
            history += new
            yield (e := reply.event(step, new, t0, draft, result, drafting, choice))
            reason = reason or reply.stopped(e.text)

    # 3) finish
    text, seconds = reply.finish()
    exactness = precision.exactness(backend, settings, tree=not isinstance(drafter, NoDrafter))
    if kept is not None:  # before the last event: a reader may stop at it
        kept.keep(backend, cache, cached)
    read = len(prompt_ids) - reused
    yield Finished(tuple(reply.out), text, step, seconds, first_token_seconds, reason, exactness, read, reused)


class _Reply:
    """One reply as it grows: its tokens and text, since when it runs, and its step events."""

    def __init__(
        self, tokenizer: Decoder | None, eos_ids: Iterable[int], limit: int, stop: tuple[str, ...], device
    ) -> None:
        self.detok, self.eos, self.stop = Detokenizer(tokenizer), set(eos_ids), stop
        self.limit, self.device = limit, device  # at most `limit` tokens
        self.out: list[int] = []
        self.start = now(device)  # every clock read waits for the device: a GPU's work is timed, not its launch

    def emit(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """A step's tokens as the reply takes them (`_trim`), and why the reply ends (None: it goes on)."""
        new, reason = _trim(tokens, self.out, self.eos, self.limit)
        self.out += new
        return new, reason

    def event(
        self, step: int, new: list[int], t0: float, draft: Draft | None = None, result: Acceptance | None = None,
        drafting: float = 0.0, choice=None,
    ) -> StepEvent:  # fmt: skip
        """The event of a step that began at `t0` and emitted `new` (`draft` None: the prefill)."""
        end = now(self.device)
        rate = len(self.out) / (end - self.start)
        if draft is None:  # the prefill
            return StepEvent(step, tuple(new), self.detok.push(new), 0, (0,), (), 0, end - t0, rate)
        nodes = result.path.tolist()
        kinds = tuple(SOURCES[draft.source(i)] for i in range(draft.tree.size))
        return StepEvent(
            step, tuple(new), self.detok.push(new), result.accepted, tuple(nodes), tuple(draft.tokens.tolist()),
            draft.tree.size, end - t0, rate,
            sources=tuple(kinds[i] for i in nodes[1:]), parents=tuple(draft.tree.parents), node_sources=kinds,
            draft_seconds=drafting,
            choice=choice.reason if choice else "", expected_tokens=choice.expected_tokens if choice else 0.0,
            expected_ms=choice.expected_ms if choice else 0.0,
        )  # fmt: skip

    def stopped(self, delta: str) -> str | None:
        """Why the reply ends where a stop string ends within the text `delta` just added, else None."""
        return _stopped(self.detok.text, delta, self.stop)

    def finish(self) -> tuple[str, float]:
        """The whole text (cut at a stop string) and the seconds since the prompt was sent."""
        self.detok.flush()
        return _cut_at_stop(self.detok.text, self.stop), now(self.device) - self.start


def _check_prompt(model: PreTrainedModel, prompt_ids: list[int]) -> int:
    """The model's context length, once the prompt is known to leave room in it for a reply."""
    if not prompt_ids:
        raise UserError("The prompt is empty; type a message first.")
    context = context_length(model)
    if len(prompt_ids) >= context:
        raise ContextExceeded(
            f"The prompt is {len(prompt_ids)} tokens but the model reads at most {context}; "
            "shorten it or start a new chat."
        )
    return context


def resume(backend: Backend, prompt_ids: list[int], kept: Kept | None, drafter: Drafter) -> tuple[Cache, int]:
    """The cache to prefill `prompt_ids` on and how many of its tokens it holds already: the kept
    conversation's, cut back to what the prompt shares with it and, for a drafter that reads the
    backbone's features (EAGLE), to what its own state still holds of the prompt (`Drafter.rewind`);
    else a new cache."""
    cache, reused = kept.take(backend, prompt_ids) if kept is not None else (backend.new_cache(), 0)
    held = drafter.rewind(prompt_ids, reused)  # how many positions of the prompt its own state keeps
    if held < reused:
        backend.truncate(cache, held)
        reused = held
    return cache, reused


def context_length(model: PreTrainedModel) -> int:
    """How many positions the model reads (prompt and reply together)."""
    return getattr(model.config.get_text_config(), "max_position_embeddings", None) or 1 << 30


def _trim(tokens: list[int], out: list[int], eos: set[int], limit: int) -> tuple[list[int], str | None]:
    """Cut a step's tokens to the room left under `limit`, then at the first EOS (kept).

    The room is applied first: a step that accepted a whole branch ending in EOS must not
    overshoot the limit by emitting that EOS."""
    tokens = tokens[: max(limit - len(out), 0)]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], "eos"
    return tokens, "length" if len(out) + len(tokens) >= limit else None


def _stopped(text: str, delta: str, stop: tuple[str, ...]) -> str | None:
    """A stop string that ends within the new text (only the tail is searched, not the reply)."""
    if not stop or not delta:
        return None
    tail = text[-(len(delta) + max(map(len, stop))) :]
    return "stop" if any(s in tail for s in stop) else None


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


def collect(events: Iterable[StepEvent | Finished]) -> tuple[list[StepEvent], Finished]:
    """Run a stream to the end: its step events and the final summary."""
    steps: list[StepEvent] = []
    for e in events:
        if isinstance(e, Finished):
            return steps, e
        steps.append(e)
    raise RuntimeError("the stream ended without a Finished event")
