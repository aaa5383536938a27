"""Chats and settings on disk: one JSON file per chat, written atomically after every turn.

A write goes to a temporary file in the same folder, is flushed to disk, then renamed over
the old one (and the folder is flushed too), so a crash or a kill leaves either the previous
or the new version, never half a file; temporary files a kill leaves behind are removed later.

Chat ids become file names, so every function taking an id checks it against `ID` first. A
chat file is checked field by field when read (`chat_from_dict`): one that is not a chat this
app wrote is moved aside (`*.corrupt`, never overwriting or deleting anything) and reported,
not fatal. This module knows nothing of the UI; it only returns the messages to show.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import platformdirs

from core.errors import UserError
from core.tree import DRAFT_SOURCES

log = logging.getLogger("medusa-chat")

ID = re.compile(r"[0-9a-f]{12}")  # what Chat.new makes; nothing else may name a chat file
SOURCES = (*DRAFT_SOURCES, "")  # a step's source; "" when it accepted no draft
TITLE_CHARS = 80  # longest title kept by a rename
EXPORT_NAME_BYTES = 120  # file systems cap a name at 255 bytes (not characters); leave room
TEMP_GLOB = ".*.json.*.tmp"  # write_atomic's temporary files: f".{name}." + random + ".tmp"
STALE_TEMP_SECONDS = 30.0  # a save takes milliseconds: an older temporary file has no writer left


class ChatFileError(ValueError):
    """A chat file that is not a chat this app wrote; the message says what is wrong."""


class ChatIdError(UserError, ValueError):
    """An id that Chat.new cannot have made (it could name a file outside the chats folder)."""


def chats_dir() -> Path:
    return Path(platformdirs.user_data_dir("medusa-chat")) / "chats"


def settings_file() -> Path:
    return Path(platformdirs.user_config_dir("medusa-chat")) / "settings.json"


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


# -- names ----------------------------------------------------------------------------------


def check_id(chat_id: object) -> str:
    """chat_id unchanged if Chat.new could have made it; ChatIdError otherwise."""
    if not isinstance(chat_id, str) or not ID.fullmatch(chat_id):
        shown = repr(chat_id)[:40]
        raise ChatIdError(f"{shown} is not a chat id (a chat id is 12 lowercase hexadecimal digits).")
    return chat_id


def chat_path(chat_id: str) -> Path:
    return chats_dir() / f"{check_id(chat_id)}.json"


def clean_title(text: str | None) -> str:
    """A title on one line, at most TITLE_CHARS characters ("" when nothing is left)."""
    return " ".join((text or "").split())[:TITLE_CHARS].strip()


def export_name(title: str) -> str:
    """A file name for a chat's Markdown export: letters, digits, spaces, - and _ only, at most
    EXPORT_NAME_BYTES bytes of UTF-8 before ".md", cut on a character boundary."""
    name = "".join(ch if ch.isalnum() or ch in " -_" else "_" for ch in title).strip()
    name = name.encode("utf-8")[:EXPORT_NAME_BYTES].decode("utf-8", errors="ignore").strip()
    return f"{name or 'chat'}.md"


# -- checking what was read -------------------------------------------------------------------


def _want(ok: bool, message: str) -> None:
    if not ok:
        raise ChatFileError(message)


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_text(x: object) -> bool:
    return isinstance(x, str)


def _is_text_or_none(x: object) -> bool:
    return x is None or isinstance(x, str)


def _is_sources(x: object) -> bool:
    return isinstance(x, dict) and all(k in DRAFT_SOURCES and _is_count(n) for k, n in x.items())


_STATS: dict[str, Callable[[object], bool]] = {  # a finished reply's stats, all read by rendering
    "tokens": _is_count,
    "steps": _is_count,
    "seconds": _is_number,
    "tokens_per_step": _is_number,
    "tokens_per_second": _is_number,
    "first_token_seconds": _is_number,
    "finish_reason": _is_text,
}
_OPTIONAL_STATS: dict[str, Callable[[object], bool]] = {  # older chats lack drafter and sources
    "mode": _is_text_or_none,
    "acceptance": _is_text_or_none,
    "tree": _is_text_or_none,
    "drafter": _is_text_or_none,
    "sources": _is_sources,
}


def _keys(data: object, required: set[str], allowed: set[str], what: str) -> dict:
    """data if it is a JSON object with every required key and no key outside allowed.

    Unknown keys are refused rather than dropped: saving the chat again would lose them."""
    if not isinstance(data, dict):
        raise ChatFileError(f"{what} is not a JSON object.")
    missing, unknown = sorted(required - data.keys()), sorted(data.keys() - allowed)
    _want(not missing, f"{what} lacks {', '.join(missing)}.")
    _want(not unknown, f"{what} has unknown fields: {', '.join(unknown)[:200]}.")
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
        and isinstance(data[0], str)
        and _is_count(data[1])
        and (len(data) == 2 or (isinstance(data[2], str) and data[2] in SOURCES))
    )
    _want(ok, f"{what} is not [text, drafted tokens accepted, source] with a known source.")
    return tuple(data)  # type: ignore[arg-type]


def _turn(data: object, what: str) -> Turn:
    d = _dataclass_keys(data, Turn, what)
    user, assistant = d["user"], d.get("assistant", "")
    _want(isinstance(user, str) and isinstance(assistant, str), f"{what}'s messages are not text.")
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
        _want(isinstance(d.get(key, ""), str), f"The chat's {key} is not text.")
    _want(ID.fullmatch(d["id"]) is not None, "The chat's id is not 12 lowercase hexadecimal digits.")
    _want(_is_number(d["created"]), "The chat's creation time is not a finite number.")
    turns = d.get("turns", [])
    _want(isinstance(turns, list), "The chat's turns are not a list.")
    checked = [_turn(t, f"Turn {i + 1}") for i, t in enumerate(turns)]
    return Chat(d["id"], d["title"], float(d["created"]), d.get("system", ""), d.get("model", ""), checked)


def _read(file: Path) -> Chat:
    """The chat in file: OSError when it cannot be read, ChatFileError when it is not a chat."""
    raw = file.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, absurd nesting, huge integers
        raise ChatFileError(f"The file is not UTF-8 JSON ({type(e).__name__}).") from e
    chat = chat_from_dict(data)
    _want(file.name == f"{chat.id}.json", f"The file's name does not match the chat's id {chat.id}.")
    return chat


# -- files ------------------------------------------------------------------------------------


def _fsync_dir(folder: Path) -> None:
    """Make a rename in folder durable; skipped where a folder cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the rename itself has happened
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") if isinstance(text, bytes) else os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def remove_stale_temp_files() -> None:
    """Delete the temporary files of saves killed midway (chats and settings folders).

    Only those older than STALE_TEMP_SECONDS: a younger one may belong to another app process
    saving into the same folder right now. The chat or settings file it was meant to replace
    still holds the version before it."""
    now = time.time()
    for folder in (chats_dir(), settings_file().parent):
        for tmp in folder.glob(TEMP_GLOB):
            try:
                if now - tmp.stat().st_mtime > STALE_TEMP_SECONDS:
                    tmp.unlink()
            except OSError:  # removed meanwhile by another process, or not ours to remove
                continue


def _free_corrupt_name(file: Path) -> Path:
    """file's name with .corrupt (then .1.corrupt, .2.corrupt, …), the first that is free."""
    names = (f"{file.stem}.corrupt" if n == 0 else f"{file.stem}.{n}.corrupt" for n in itertools.count())
    return next(aside for aside in map(file.with_name, names) if not aside.exists())


def _set_aside(file: Path, reason: Exception) -> str | None:
    """Move a damaged chat file to a free *.corrupt name; the message for the user.

    None when the file is gone already (another tab set it aside or deleted it)."""
    try:
        aside = _free_corrupt_name(file)
        file.rename(aside)  # aside is free (and Windows refuses to overwrite, should it not be)
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("chat file %s unreadable (%s) and not movable (%s)", file, reason, e)
        return f"A damaged chat file, {file.name}, could not be set aside ({e.strerror or e})."
    log.warning("chat file %s unreadable (%s); moved to %s", file, reason, aside)
    return f"A damaged chat file was set aside as {aside.name}."


def set_aside(chat_id: str, reason: Exception) -> str:
    """Move the damaged file of chat_id aside (never deleting it); the message for the user."""
    message = _set_aside(chat_path(chat_id), reason)
    return message or f"The chat {chat_id} no longer exists; another tab deleted or set it aside."


# -- chats and settings -----------------------------------------------------------------------


def save_chat(chat: Chat) -> None:
    text = json.dumps(asdict(chat), ensure_ascii=False, indent=1)
    write_atomic(chat_path(chat.id), text)


def load_chat(chat_id: str) -> Chat:
    """The chat: ChatIdError for a bad id, OSError if unreadable, ChatFileError if damaged."""
    return _read(chat_path(chat_id))


def list_chats() -> tuple[list[Chat], list[str]]:
    """All readable chats, newest first, and a message for each file set aside as damaged."""
    remove_stale_temp_files()
    chats, problems = [], []
    for file in sorted(chats_dir().glob("*.json")):
        try:
            chats.append(_read(file))
        except FileNotFoundError:
            continue  # deleted or set aside by another tab meanwhile
        except (OSError, ChatFileError) as e:
            if message := _set_aside(file, e):
                problems.append(message)
    chats.sort(key=lambda c: c.created, reverse=True)
    return chats, problems


def delete_chat(chat_id: str) -> None:
    chat_path(chat_id).unlink(missing_ok=True)


def saved_replies() -> list[str]:
    """The assistant's texts in every readable saved chat (for retrieval drafting; unreadable
    chats are skipped here and reported where the chat list is shown)."""
    return [turn.assistant for chat in list_chats()[0] for turn in chat.turns if turn.finished and turn.assistant]


def load_settings() -> dict:
    """Saved settings, or {} when there are none or they are unreadable (the file is kept)."""
    try:
        data = json.loads(settings_file().read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as e:
        log.warning("settings unreadable (%s); using defaults", e)
        return {}
    return data if isinstance(data, dict) else {}


def save_settings(settings: dict) -> None:
    write_atomic(settings_file(), json.dumps(settings, indent=1))
