"""Chats and settings on disk: one JSON file per chat, written atomically after every turn
(`app.atomic`: a crash or a kill leaves the previous or the new version, never half a file);
temporary files a kill leaves behind are removed later.

Chat ids become file names, so every function taking an id checks it against `ID` first. A
chat file is read only as a regular file in the chats folder (a symbolic link is not followed)
and checked field by field (`app.chat.chat_from_dict`): one that is not a chat this app wrote
is moved aside (`*.corrupt`, never overwriting or deleting anything) and reported, not fatal.

The chat list comes from an index beside the chats folder (id → title, creation time, and the
file's inode, size and time when indexed), rewritten with every save and delete. Listing checks
it against the folder's names and `stat`s: only a file it does not know as it is now is read,
so a page load reads no chat, and a missing, damaged or outdated index heals itself. This
module knows nothing of the UI; it only returns the messages to show.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import platformdirs

from app.atomic import write_atomic
from app.chat import ID, Chat, ChatFileError, chat_from_dict, clean_text, is_count, is_number, is_text, shown
from app.chat import Turn as Turn  # the UI and older callers name chats' parts through this module
from core.errors import UserError

log = logging.getLogger("medusa-chat")

TITLE_CHARS = 80  # longest title kept by a rename
EXPORT_NAME_BYTES = 120  # file systems cap a name at 255 bytes (not characters); leave room
TEMP_GLOB = ".*.json.*.tmp"  # write_atomic's temporary files: f".{name}." + random + ".tmp"
STALE_TEMP_SECONDS = 30.0  # a save takes milliseconds: an older temporary file has no writer left
INDEX_VERSION = 1
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)  # no link followed, no FIFO waited on
_LINK = "The file is a symbolic link; chats are read from files in the chats folder only."


class ChatIdError(UserError, ValueError):
    """An id that Chat.new cannot have made (it could name a file outside the chats folder)."""


@dataclass(frozen=True)
class ChatEntry:
    """A chat as the chat list shows it, without its turns."""

    id: str
    title: str
    created: float


def chats_dir() -> Path:
    return Path(platformdirs.user_data_dir("medusa-chat")) / "chats"


def index_file() -> Path:
    """Beside the chats folder, not in it: everything in there is a chat or a chat set aside."""
    return chats_dir().parent / "chat-index.json"


def settings_file() -> Path:
    return Path(platformdirs.user_config_dir("medusa-chat")) / "settings.json"


# -- names ----------------------------------------------------------------------------------


def check_id(chat_id: object) -> str:
    """chat_id unchanged if Chat.new could have made it; ChatIdError otherwise."""
    if not isinstance(chat_id, str) or not ID.fullmatch(chat_id):
        said = repr(chat_id)[:40]
        raise ChatIdError(f"{said} is not a chat id (a chat id is 12 lowercase hexadecimal digits).")
    return chat_id


def chat_path(chat_id: str) -> Path:
    return chats_dir() / f"{check_id(chat_id)}.json"


def clean_title(text: str | None) -> str:
    """A title on one line, at most TITLE_CHARS characters ("" when nothing is left), valid Unicode."""
    return clean_text(" ".join((text or "").split())[:TITLE_CHARS].strip())


def export_name(title: str) -> str:
    """A file name for a chat's Markdown export: letters, digits, spaces, - and _ only, at most
    EXPORT_NAME_BYTES bytes of UTF-8 before ".md", cut on a character boundary."""
    name = "".join(ch if ch.isalnum() or ch in " -_" else "_" for ch in title).strip()
    name = name.encode("utf-8")[:EXPORT_NAME_BYTES].decode("utf-8", errors="ignore").strip()
    return f"{name or 'chat'}.md"


# -- reading ----------------------------------------------------------------------------------


def _read_file(file: Path) -> tuple[bytes, os.stat_result]:
    """The bytes of a regular file and its stat; ChatFileError for a symbolic link (never
    followed, so the file cannot be one outside the folder) or anything else but a file."""
    if file.is_symlink():
        raise ChatFileError(_LINK)
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_BINARY", 0) | _NO_FOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:  # made a link since is_symlink looked
            raise ChatFileError(_LINK) from e
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ChatFileError("The file is not a regular file.")
        return f.read(), st


def _read(file: Path) -> tuple[Chat, os.stat_result]:
    """The chat in file and the file's stat: OSError when it cannot be read, ChatFileError when
    it is not a chat."""
    raw, st = _read_file(file)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, absurd nesting, huge integers
        raise ChatFileError(f"The file is not UTF-8 JSON ({type(e).__name__}).") from e
    chat = chat_from_dict(data)
    if file.name != f"{chat.id}.json":
        raise ChatFileError(f"The file's name does not match the chat's id {chat.id}.")
    return chat, st


def _read_or_set_aside(file: Path, problems: list[str]) -> tuple[Chat, os.stat_result] | None:
    """What `_read` gives; None when the file is gone, or damaged (then set aside, and said in problems)."""
    try:
        return _read(file)
    except FileNotFoundError:
        return None  # deleted or set aside by another tab meanwhile
    except (OSError, ChatFileError) as e:
        if message := _set_aside(file, e):
            problems.append(message)
        return None


def _chat_files(problems: list[str] | None) -> Iterator[tuple[Path, os.stat_result]]:
    """Each chat file in the folder with its stat (from the listing, nothing read), in name order.

    Whatever else ends in .json is set aside unread, with a message in problems (None: skipped
    and left in place): a name that is not a chat id, a symbolic link, anything not a file."""
    try:
        entries = sorted(os.scandir(chats_dir()), key=lambda e: e.name)
    except FileNotFoundError:
        return
    for entry in entries:
        if not entry.name.endswith(".json"):
            continue
        path = Path(entry.path)
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # deleted or set aside by another tab meanwhile
        if not ID.fullmatch(entry.name.removesuffix(".json")):
            problem = ChatFileError("The file's name is not a chat id.")
        elif stat.S_ISLNK(st.st_mode):
            problem = ChatFileError(_LINK)
        elif not stat.S_ISREG(st.st_mode):
            problem = ChatFileError("The file is not a regular file.")
        else:
            yield path, st
            continue
        if problems is not None and (message := _set_aside(path, problem)):
            problems.append(message)


# -- files ------------------------------------------------------------------------------------


def remove_stale_temp_files() -> None:
    """Delete the temporary files of saves killed midway (chats, index and settings folders).

    Only those older than STALE_TEMP_SECONDS: a younger one may belong to another app process
    saving into the same folder right now. The chat or settings file it was meant to replace
    still holds the version before it."""
    now = time.time()
    for folder in (chats_dir(), index_file().parent, settings_file().parent):
        for tmp in folder.glob(TEMP_GLOB):
            try:
                if now - tmp.stat().st_mtime > STALE_TEMP_SECONDS:
                    tmp.unlink()
            except OSError:  # removed meanwhile by another process, or not ours to remove
                continue


def _free_corrupt_name(file: Path) -> Path:
    """file's name with .corrupt (then .1.corrupt, .2.corrupt, …), the first that is free."""
    names = (f"{file.stem}.corrupt" if n == 0 else f"{file.stem}.{n}.corrupt" for n in itertools.count())
    return next(aside for aside in map(file.with_name, names) if not os.path.lexists(aside))


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
        return f"A damaged chat file, {shown(file.name)}, could not be set aside ({e.strerror or e})."
    log.warning("chat file %s unreadable (%s); moved to %s", file, reason, aside)
    return f"A damaged chat file was set aside as {shown(aside.name)}."


def set_aside(chat_id: str, reason: Exception) -> str:
    """Move the damaged file of chat_id aside (never deleting it); the message for the user."""
    message = _set_aside(chat_path(chat_id), reason)
    return message or f"The chat {chat_id} no longer exists; another tab deleted or set it aside."


# -- the index --------------------------------------------------------------------------------


def _fingerprint(st: os.stat_result) -> list[int]:
    """What changes whenever a chat file does: a save renames a new file (a new inode) over it."""
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def _entry_ok(entry: object) -> bool:
    if not isinstance(entry, dict) or entry.keys() != {"title", "created", "file"}:
        return False
    file = entry["file"]
    ok_file = isinstance(file, list) and len(file) == 3 and all(is_count(n) for n in file)
    return ok_file and is_text(entry["title"]) and is_number(entry["created"])


def _load_index() -> dict[str, dict] | None:
    """The index's entries by chat id, less those not of the right shape (their chats are read
    again); None when the index is missing or damaged."""
    try:
        data = json.loads(_read_file(index_file())[0].decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:  # ChatFileError (a link) is a ValueError
        log.warning("chat index unreadable (%s); rebuilding it", e)
        return None
    if not isinstance(data, dict) or data.get("version") != INDEX_VERSION or not isinstance(data.get("chats"), dict):
        return None
    return {k: v for k, v in data["chats"].items() if isinstance(k, str) and ID.fullmatch(k) and _entry_ok(v)}


def _save_index(entries: dict[str, dict]) -> None:
    """Best effort: an index not written costs reading the chats it lacks, once, next time."""
    text = json.dumps({"version": INDEX_VERSION, "chats": entries}, ensure_ascii=False)
    try:
        write_atomic(index_file(), text, durable=False)
    except OSError as e:
        log.warning("chat index not written (%s)", e)


def _index_entry(chat: Chat, st: os.stat_result) -> dict:
    return {"title": clean_text(chat.title), "created": chat.created, "file": _fingerprint(st)}


def _update_index(chat_id: str, entry: dict | None) -> None:
    """The index with chat_id's entry replaced (None: removed). Two saves at once may each
    miss the other's change: listing finds that entry out of date and reads that chat again."""
    entries = _load_index() or {}
    if entry is None:
        entries.pop(chat_id, None)
    else:
        entries[chat_id] = entry
    _save_index(entries)


# -- chats and settings -----------------------------------------------------------------------


def save_chat(chat: Chat) -> None:
    """Write the chat (a lone surrogate becomes U+FFFD, so the file is always valid UTF-8) and
    its index entry."""
    text = clean_text(json.dumps(asdict(chat), ensure_ascii=False, indent=1))  # surrogates only occur in strings
    path = chat_path(chat.id)
    write_atomic(path, text)
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return  # deleted meanwhile: listing drops its entry
    _update_index(chat.id, _index_entry(chat, st))


def load_chat(chat_id: str) -> Chat:
    """The chat: ChatIdError for a bad id, OSError if unreadable, ChatFileError if damaged."""
    return _read(chat_path(chat_id))[0]


def list_chats() -> tuple[list[Chat], list[str]]:
    """All readable chats, whole (every file is read), newest first, and a message for each
    file set aside as damaged. The chat list reads `list_entries` instead."""
    remove_stale_temp_files()
    chats, problems = [], []
    for file, _ in _chat_files(problems):
        if (read := _read_or_set_aside(file, problems)) is not None:
            chats.append(read[0])
    chats.sort(key=lambda c: c.created, reverse=True)
    return chats, problems


def list_entries() -> tuple[list[ChatEntry], list[str]]:
    """Every readable chat's id, title and creation time, newest first, and a message for each
    file set aside as damaged. Only chat files the index does not know as they are now are read."""
    remove_stale_temp_files()
    index, problems = _load_index(), []
    entries: dict[str, dict] = {}
    for file, st in _chat_files(problems):
        chat_id = file.stem
        known = (index or {}).get(chat_id)
        if known is not None and known["file"] == _fingerprint(st):
            entries[chat_id] = known
        elif (read := _read_or_set_aside(file, problems)) is not None:
            entries[chat_id] = _index_entry(*read)
    if entries != index:
        _save_index(entries)
    listed = [ChatEntry(chat_id, e["title"], float(e["created"])) for chat_id, e in entries.items()]
    listed.sort(key=lambda c: c.created, reverse=True)
    return listed, problems


def delete_chat(chat_id: str) -> None:
    chat_path(chat_id).unlink(missing_ok=True)
    _update_index(chat_id, None)


def saved_replies() -> list[str]:
    """The assistant's texts in every readable saved chat, for retrieval drafting: one chat in
    memory at a time; damaged files are skipped here, set aside and reported by the chat list."""
    texts = []
    for file, _ in _chat_files(None):
        try:
            chat = _read(file)[0]
        except (OSError, ChatFileError):
            continue
        texts += [turn.assistant for turn in chat.turns if turn.finished and turn.assistant]
    return texts


def load_settings() -> dict:
    """Saved settings, or {} when there are none or they are unreadable (the file is kept).
    Texts are made valid Unicode: the page shows them."""
    try:
        data = json.loads(settings_file().read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as e:
        log.warning("settings unreadable (%s); using defaults", e)
        return {}
    if not isinstance(data, dict):
        return {}
    return {clean_text(k): clean_text(v) if isinstance(v, str) else v for k, v in data.items()}


def save_settings(settings: dict) -> None:
    """A lone surrogate in a text becomes U+FFFD: the file is always valid UTF-8."""
    write_atomic(settings_file(), clean_text(json.dumps(settings, ensure_ascii=False, indent=1)))
