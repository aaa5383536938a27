"""A reply never exceeds its token limit nor the model's context, whatever a step accepts;
a conversation is trimmed to the context, oldest turns first."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from app.history import fit_history
from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.decode.tree import build_tree
from core.drafters.base import Draft, Drafter
from core.errors import UserError
from tests.helpers import plain_tokens, tiny_backend

PROMPT = [1, 17, 33, 5, 60, 2, 41]
CHAINS = {d: build_tree([[0] * i for i in range(1, d + 1)]) for d in range(5)}


class ChainOracle(Drafter):
    """Drafts the true continuation as a chain of up to 4 tokens. With `stop_at` (an index into
    prompt + reply), the steps before it are shortened so that one step drafts a chain of 4
    ending exactly there: that step accepts a whole branch whose last drafted token is it."""

    def __init__(self, reference: list[int], stop_at: int | None = None) -> None:
        self.reference, self.stop_at = reference, stop_at

    def propose(self, hidden: Tensor, root: Tensor, history: Sequence[int]) -> Draft:
        pos = len(history)  # index in `reference` of the token after the root
        depth = 4
        if self.stop_at is not None and self.stop_at >= pos:
            reach = self.stop_at - pos + 1  # drafted tokens that would end at `stop_at`
            depth = reach if reach <= 4 else min(4, reach - 5)  # a step emits depth + 1 tokens
        truth = [self.reference[min(pos + d, len(self.reference) - 1)] for d in range(depth)]
        return Draft(torch.tensor([int(root), *truth]), CHAINS[depth])


def first_new_token_at(tokens: list[int], start: int) -> int:
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture(scope="module")
def setup():
    backend = tiny_backend("llama")
    reply = plain_tokens(backend, PROMPT, 40)
    eos_at = first_new_token_at(reply, 6)  # the first token not seen before: plain decoding stops there
    return backend, reply, eos_at


def decode(backend, drafter, limit: int, eos: int | None = None):
    settings = DecodeSettings(max_new_tokens=limit)
    events, done = collect(stream(backend, PROMPT, settings, drafter, eos_ids=() if eos is None else (eos,)))
    return events, done


@pytest.mark.parametrize("below", [1, 2, 3])
def test_a_branch_ending_in_eos_never_overshoots_the_limit(setup, below):
    backend, reply, eos_at = setup
    drafter = ChainOracle(PROMPT + reply, len(PROMPT) + eos_at)
    limit = eos_at + 1 - below  # the EOS would be the (limit + below)-th token
    events, done = decode(backend, drafter, limit, reply[eos_at])
    assert list(done.token_ids) == reply[:limit]
    assert done.finish_reason == "length"
    assert sum(len(e.token_ids) for e in events) == limit


def test_the_branch_is_really_accepted_whole(setup):
    backend, reply, eos_at = setup
    events, done = decode(backend, ChainOracle(PROMPT + reply, len(PROMPT) + eos_at), 100, reply[eos_at])
    assert list(done.token_ids) == reply[: eos_at + 1] and done.finish_reason == "eos"
    assert events[-1].token_ids[-1] == reply[eos_at] and events[-1].accepted == len(events[-1].token_ids)
    assert max(e.accepted for e in events) == 4


def test_steps_near_the_context_edge_stay_inside_it(setup):
    backend, reply, _ = setup
    model = backend.model
    context = len(PROMPT) + 13
    seen: list[int] = []

    def record(module, args, kwargs):
        if kwargs.get("position_ids") is not None:
            seen.append(int(kwargs["position_ids"].max()))

    model.config.max_position_embeddings = context
    hook = model.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        _, done = decode(backend, ChainOracle(PROMPT + reply), 100)
    finally:
        hook.remove()
        model.config.max_position_embeddings = 512
    assert list(done.token_ids) == reply[: context - len(PROMPT)] and done.finish_reason == "length"
    assert max(seen) < context


# -- the history fitted to the context --------------------------------------------------------


def encode(messages: list[dict], system: str | None) -> list[int]:
    """A fake template: each message's words are its tokens, plus one per message."""
    all_ = ([{"role": "system", "content": system}] if system else []) + messages
    return [w for m in all_ for w in [0] + [1] * len(m["content"].split())]


def chat(*sizes: int) -> list[dict]:
    roles = ["user", "assistant"]
    return [{"role": roles[i % 2], "content": "w " * n} for i, n in enumerate(sizes)]


def test_oldest_turns_go_first_and_the_system_prompt_stays():
    messages = chat(10, 20, 10, 20, 5)  # 11 + 21 + 11 + 21 + 6 = 70 tokens
    fitted = fit_history(encode, messages, "s " * 4, context=100, reply=40)  # the system prompt: 5 tokens
    assert fitted.dropped == 2 and fitted.ids == encode(messages[2:], "s " * 4)
    assert len(fitted.ids) + 40 <= 100 and "2 oldest messages" in fitted.note
    assert fit_history(encode, messages, None, context=200, reply=40).dropped == 0
    assert fit_history(encode, messages, None, context=200, reply=40).note == ""


def test_a_message_that_cannot_fit_is_refused():
    with pytest.raises(UserError, match="This message is 91 tokens"):
        fit_history(encode, chat(10, 10, 90), None, context=100, reply=40)
    fitted = fit_history(encode, chat(10, 10, 60), None, context=100, reply=400)  # a long reply limit
    assert fitted.dropped == 2 and len(fitted.ids) == 61
