"""What a chat is, and the check of one read back from JSON. No files here (see app.store).

A chat file is checked field by field (`chat_from_dict`): every value of the type the app
reads, and every string valid Unicode. JSON can spell a lone surrogate (`"\\ud800"`), which
Python reads into a str that no UTF-8 page or file can carry: such a chat would break every
page that lists it. `clean_text` replaces those in what users type before it is stored.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields

from core.decode.tree import DRAFT_SOURCES

ID = re.compile(r"[0-9a-f]{12}")  # what Chat.new makes; nothing else may name a chat file
SOURCES = (*DRAFT_SOURCES, "")  # a step's source; "" when it accepted no draft
SURROGATE = re.compile("[\ud800-\udfff]")  # in a Python str always lone: JSON's pairs are joined when read


class ChatFileError(ValueError):
    """A chat file that is not a chat this app wrote; the message says what is wrong."""


@dataclass
class Turn:
    user: str
    assistant: str = ""
    # (text, drafted tokens accepted[, source: one of SOURCES]) per step
    steps: list[tuple[str, int] | tuple[str, int, str]] = field(default_factory=list)
    stats: dict = field(default_factory=dict)  # tokens, steps, seconds, … of the reply
    finished: bool = False  # False while streaming or when stopped early


@dataclass
class Chat:
    id: str
    title: str
    created: float
    system: str = ""
    model: str = ""
    turns: list[Turn] = field(default_factory=list)

    @staticmethod
    def new(model: str = "", system: str = "") -> Chat:
        return Chat(uuid.uuid4().hex[:12], "New chat", time.time(), system, model)

    def to_markdown(self) -> str:
        lines = [f"# {self.title}", ""]
        if self.system:
            lines += [f"*System:* {self.system}", ""]
        for t in self.turns:
            lines += ["**You:**", "", t.user, "", "**Assistant:**", "", t.assistant, ""]
        return "\n".join(lines)


def clean_text(text: str) -> str:
    """text with every lone surrogate replaced by U+FFFD, so that it can be written as UTF-8."""
    return SURROGATE.sub("\ufffd", text)


def shown(text: str) -> str:
    """text safe to put in a message: a lone surrogate becomes its escape (\\ud800)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# -- checking what was read -------------------------------------------------------------------


def _want(ok: bool, message: str) -> None:
    if not ok:
        raise ChatFileError(message)


def is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_text(x: object) -> bool:
    """A str that UTF-8 can carry (no lone surrogate)."""
    return isinstance(x, str) and SURROGATE.search(x) is None


def _is_text_or_none(x: object) -> bool:
    return x is None or is_text(x)


def _is_sources(x: object) -> bool:
    return isinstance(x, dict) and all(k in DRAFT_SOURCES and is_count(n) for k, n in x.items())


_STATS: dict[str, Callable[[object], bool]] = {  # a finished reply's stats, all read by rendering
    "tokens": is_count,
    "steps": is_count,
    "seconds": is_number,
    "tokens_per_step": is_number,
    "tokens_per_second": is_number,
    "first_token_seconds": is_number,
    "finish_reason": is_text,
}
_OPTIONAL_STATS: dict[str, Callable[[object], bool]] = {  # older chats lack drafter and sources
    "mode": _is_text_or_none,
    "acceptance": _is_text_or_none,
    "tree": _is_text_or_none,
    "drafter": _is_text_or_none,
    "sources": _is_sources,
    "exactness": _is_text_or_none,  # against plain decoding (core.decode.precision); older chats lack it
    "prompt_read": is_count,  # prompt tokens the reply read; older chats lack it
    "prompt_reused": is_count,  # prompt tokens it took from the conversation's kept cache
}


def _keys(data: object, required: set[str], allowed: set[str], what: str) -> dict:
    """data if it is a JSON object with every required key and no key outside allowed.

    Unknown keys are refused rather than dropped: saving the chat again would lose them."""
    if not isinstance(data, dict):
        raise ChatFileError(f"{what} is not a JSON object.")
    missing, unknown = sorted(required - data.keys()), sorted(data.keys() - allowed)
    _want(not missing, f"{what} lacks {', '.join(missing)}.")
    _want(not unknown, f"{what} has unknown fields: {shown(', '.join(unknown))[:200]}.")
    return data


def _dataclass_keys(data: object, cls: type, what: str) -> dict:
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    return _keys(data, required, names, what)


def _stats(data: object, what: str) -> dict:
    """Stats are empty (no finished reply) or hold every number that rendering reads."""
    if data == {}:
        return {}
    d = _keys(data, set(_STATS), set(_STATS) | set(_OPTIONAL_STATS), f"{what}'s stats")
    wrong = [k for k, ok in (_STATS | _OPTIONAL_STATS).items() if k in d and not ok(d[k])]
    _want(not wrong, f"{what}'s stats have values of the wrong type: {', '.join(wrong)}.")
    return dict(d)


def _step(data: object, what: str) -> tuple:
    ok = (
        isinstance(data, list)
        and len(data) in (2, 3)
        and is_text(data[0])
        and is_count(data[1])
        and (len(data) == 2 or (isinstance(data[2], str) and data[2] in SOURCES))
    )
    _want(ok, f"{what} is not [text, drafted tokens accepted, source] with a known source.")
    return tuple(data)  # type: ignore[arg-type]


def _turn(data: object, what: str) -> Turn:
    d = _dataclass_keys(data, Turn, what)
    user, assistant = d["user"], d.get("assistant", "")
    _want(is_text(user) and is_text(assistant), f"{what}'s messages are not valid Unicode text.")
    finished = d.get("finished", False)
    _want(isinstance(finished, bool), f"{what}'s finished flag is not true or false.")
    steps = d.get("steps", [])
    _want(isinstance(steps, list), f"{what}'s steps are not a list.")
    checked = [_step(s, f"{what}, step {j + 1},") for j, s in enumerate(steps)]
    return Turn(user, assistant, checked, _stats(d.get("stats", {}), what), finished)


def chat_from_dict(data: object) -> Chat:
    """A Chat from parsed JSON with every field checked; ChatFileError says what is wrong."""
    d = _dataclass_keys(data, Chat, "The chat")
    for key in ("id", "title", "system", "model"):
        _want(is_text(d.get(key, "")), f"The chat's {key} is not valid Unicode text.")
    _want(ID.fullmatch(d["id"]) is not None, "The chat's id is not 12 lowercase hexadecimal digits.")
    _want(is_number(d["created"]), "The chat's creation time is not a finite number.")
    turns = d.get("turns", [])
    _want(isinstance(turns, list), "The chat's turns are not a list.")
    checked = [_turn(t, f"Turn {i + 1}") for i, t in enumerate(turns)]
    return Chat(d["id"], d["title"], float(d["created"]), d.get("system", ""), d.get("model", ""), checked)
