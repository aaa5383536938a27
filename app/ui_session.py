"""One user's state on the chat page, and what the handlers make of it: the chat as the chat
box's messages, the chat list, the conversation sent to the model, and the turn saved before
and after its reply. No gradio and no model here; `app.ui_events` holds the handlers.

A `Session` lives in the page's `gr.State`, so every browser tab has its own.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

from app import store
from app.panels import depth_rates, stats_html
from app.render import reply_html, text_html
from core.decode.generate import StepEvent
from core.decode.tree import AUTO
from core.drafters.registry import KINDS
from models import on_disk


@dataclass
class Session:
    chat: store.Chat
    stop: threading.Event = field(default_factory=threading.Event)
    events: list[StepEvent] = field(default_factory=list)  # the last reply's steps
    max_depth: int = 0
    prompt: list[int] = field(default_factory=list)  # the last reply's prompt ids (for Compare)
    medusa_stats: dict = field(default_factory=dict)


def messages(chat: store.Chat, colors: bool) -> list[dict]:
    """The chat's turns as the chat box's messages (a turn with no reply yet shows only the user's)."""
    out = []
    for t in chat.turns:
        out.append({"role": "user", "content": text_html(t.user)})
        if t.steps or t.assistant:
            out.append({"role": "assistant", "content": reply_html(t.steps or [(t.assistant, 0)], colors)})
    return out


def chat_choices() -> tuple[list[tuple[str, str]], list[str]]:
    """The chat list's (title, id) choices, newest first, and a message per damaged file set aside."""
    chats, problems = store.list_entries()  # from the index: a page load reads no chat file
    return [(c.title, c.id) for c in chats], problems


def reply_stats(stats: dict, events: list[StepEvent], max_depth: int) -> str:
    """The stats panel of a reply whose steps are `events`."""
    accepted = [e.accepted for e in events]
    return stats_html(stats, accepted, depth_rates(accepted, max_depth))


def tree_setting(choice: str) -> str:
    """The tree dropdown's value as saved in the settings: "" for Auto."""
    return "" if choice == AUTO else choice


DRAFT_NONE, DRAFT_SELF = "none", "self"  # the draft-model control's values for no draft model and the target in 4 bits
DRAFT_FIXED = [(DRAFT_NONE, DRAFT_NONE), ("self — this model in 4 bits (for full precision)", DRAFT_SELF)]


def draft_choices(suggested: str | None, loaded: str | None) -> list[tuple[str, str]]:
    """The draft-model control's (label, value) choices: none, self, the catalog's suggestion for
    the model, and the loaded draft model where it is none of those (a typed id or folder)."""
    out = list(DRAFT_FIXED)
    for name in (suggested, loaded):
        if name and name not in (value for _, value in out):
            out.append((name if name != suggested else f"{name} (suggested for this model)", name))
    return out


def on_disk_choices() -> list[tuple[str, str]]:
    """The models already on this machine as the model picker's (label, value) choices: the label
    name · size · quantization (or why it cannot be opened) · where it is; the value is what
    --model takes (the file's path, or a hub snapshot's repo id), loaded like any other."""
    out = []
    for f in on_disk.find():
        last = f"cannot open: {f.problem}" if f.problem else (f.quantization or "unknown quantization")
        out.append((f"{f.name} · {on_disk.size_text(f.size)} · {last} · {f.source}", f.ref))
    return out


def on_disk_note(ref: str) -> str:
    """The line under the model picker for a model on this machine ("" for any other), as Markdown
    that shows its names as text."""
    f = next((f for f in on_disk.find() if f.ref == ref), None)
    if f is None:
        return ""
    if f.problem:
        return f"{literal(f.name)} ({literal(f.source)}) cannot be opened: {literal(f.problem)}"
    facts = [on_disk.size_text(f.size), f.quantization, f.architecture]
    facts += [f"{on_disk.params_text(f.parameters)} parameters"] if f.parameters else []
    where = f"opened in place from {f.path}" if f.ref != f.name else f"from the hub cache at {f.path}"
    return f"{literal(f.name)} ({literal(f.source)}): {literal(', '.join(x for x in facts if x))}; {literal(where)}."


def draft_note(loaded: str | None, suggested: str | None, own_drafter: bool | None) -> str:
    """The line under the draft-model control: the loaded draft model, or the catalog's suggestion
    where the model has no drafter of its own (`own_drafter` None: not known yet, still loading)."""
    if loaded:
        return f"Draft model loaded: {literal(loaded)}; the drafter *{literal(KINDS['draft'].label)}* drafts with it."
    if suggested and own_drafter is False:
        return f"This model has no trained Medusa heads or EAGLE layer: try the draft model {literal(suggested)}."
    return ""


def literal(text: str) -> str:
    """`text` as Markdown that shows it as it is: every ASCII punctuation mark backslash-escaped
    (a typed name or folder is not markup)."""
    return re.sub(r"([!-/:-@\[-`{-~])", r"\\\1", " ".join(str(text).split()))


def conversation(turns: list[store.Turn], message: str) -> list[dict]:
    """Earlier turns as messages, then the new user message."""
    pairs = [m for t in turns for m in _pair(t)]
    return [*pairs, {"role": "user", "content": message}]


def _pair(turn: store.Turn) -> list[dict]:
    return [{"role": "user", "content": turn.user}, {"role": "assistant", "content": turn.assistant}]


def begin_turn(s: Session, message: str, model_id: str) -> str | None:
    """Add the user's message as a new turn and save the chat before the reply starts, so that a
    kill during the reply loses none of it; the warning to show when the chat cannot be saved."""
    title = s.chat.title
    s.chat.turns.append(store.Turn(user=message))
    if title == "New chat":
        s.chat.title = message.strip().splitlines()[0][:60] or "Chat"
    s.chat.model = model_id
    try:
        store.save_chat(s.chat)
    except OSError as e:  # a full disk, a read-only folder: the message stays in its box
        s.chat.turns.pop()
        s.chat.title = title
        return f"The chat could not be saved ({e.strerror or e}), so the message was not sent."
    return None


def save_partial(s: Session) -> None:
    """Keep what a reply that failed midway had streamed (its steps' text) as the turn's reply."""
    if s.chat.turns and s.chat.turns[-1].steps:
        turn = s.chat.turns[-1]
        turn.assistant = "".join(step[0] for step in turn.steps)
        store.save_chat(s.chat)
